"""plate_controller over real rclpy: targets validated with a reason, plans published within the limits with
diagnostics, and a hold that says ``stale`` when the node states stop. Plus the pure target check.

The robot does not move here (the node states are the settled twin's, re-stamped): the closed loop itself is
test_control_closed_loop.py; this is the ROS shell around the same core."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rclpy.parameter import Parameter

from conftest import spin_until, unique_name
from tensegrity_ros import frames as F
from tensegrity_ros.control.targets import target_from_pose
from tensegrity_ros.nodes import _common as C

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "config" / "models" / "stacked_manipulator.yaml"


def quaternion_of(angles):
    return C.quaternion_from_matrix(F.rotation_zyx(np.asarray(angles)))


def test_target_from_pose_accepts_and_rejects_with_reasons():
    present = np.array([0.0, 0.0, 1.44, -2.93, 0.0, 0.0])
    q = quaternion_of([-2.9, 0.02, -0.01])                  # (x, y, z, w)
    y, why = target_from_pose((0.01, -0.02, 1.43), q, "C0", present)
    assert why == "" and np.allclose(y, [0.01, -0.02, 1.43, -2.9, 0.02, -0.01], atol=1e-9)
    assert "non-finite" in target_from_pose((math.nan, 0, 1.4), q, "C0", present)[1]
    assert "frame 'world' is not 'C0'" in target_from_pose((0, 0, 1.4), q, "world", present)[1]
    assert "unit quaternion" in target_from_pose((0, 0, 1.4), (0, 0, 0, 0), "C0", present)[1]
    y, why = target_from_pose((0.3, 0, 1.4), q, "C0", present)
    assert y is None and "out of the workspace: 302.7 mm" in why   # |(0.3, 0, -0.04)|
    y, why = target_from_pose((0, 0, 1.44), quaternion_of([2.9, 0.0, 0.0]), "C0", present, max_angle_rad=0.5)
    assert y is not None                                      # -2.93 -> 2.9 rad is 0.45 rad across +-pi


@pytest.fixture(scope="module")
def settled():
    from tensegrity_ros.model import load_structure
    from tensegrity_ros.twin.sim import TwinSim

    s = load_structure(MODEL)
    sim = TwinSim(s)
    sim.settle(2.0)
    P = sim.node_positions()
    sim.step(np.array([0.3, -0.2, 0.1, 0.2, -0.1, 0.0]), 1)
    sim.settle(2.0)
    goal = F.manipulator_relative_poses(sim.node_positions(), s.node_names)["0C2"]
    return s, P, goal


def test_plate_controller_roundtrip(rclpy_context, ros_executor, make_node, settled):
    from diagnostic_msgs.msg import DiagnosticArray
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import JointState
    from tensegrity_ros.msg import NodeStates
    from tensegrity_ros.nodes.plate_controller import PlateControllerNode

    s, P, goal = settled
    # a long nominal: on a loaded machine a linearisation in the node's own thread takes up to ~1 s
    params = {"model_file": str(MODEL), "worker": "thread", "max_input_age_s": 0.3, "diagnostics_period_s": 0.2,
              "nominal_margin_s": 2.0}
    node = PlateControllerNode(unique_name("plate_controller"), context=rclpy_context,
                               parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe"))
        plans, diags = [], []
        # the plan as JointState fields (name, K x A positions row-major), whichever type the node publishes
        as_rows = (lambda m: SimpleNamespace(name=list(m.joint_names), position=[v for p in m.points
                                                                                 for v in p.positions])) \
            if node._plan_cls.__name__ == "JointTrajectory" else (lambda m: m)
        probe.create_subscription(node._plan_cls, C.TOPICS["motor_plan"], lambda m: plans.append(as_rows(m)), 10)
        probe.create_subscription(DiagnosticArray, C.TOPICS["diagnostics"], diags.append, C.DIAG_QOS)
        pub_n = probe.create_publisher(NodeStates, C.TOPICS["node_states"], C.STREAM_QOS)
        pub_m = probe.create_publisher(JointState, C.TOPICS["motor_states"], C.STREAM_QOS)
        pub_t = probe.create_publisher(PoseStamped, "/tensegrity/plate_target", 10)
        assert spin_until(ros_executor, lambda: probe.count_subscribers("/tensegrity/plate_target") >= 1, timeout=5)
        # as the ingest publishes them: physical nodes only (no virtual duplicates), in its own order
        phys = [i for i, n in enumerate(s.node_names) if "_v" not in n][::-1]
        names = [s.node_names[i] for i in phys]
        Pm = P[phys]
        motors = [a.name for a in s.actuators]

        def feed(seconds):
            t_end = node.now_s() + seconds
            while node.now_s() < t_end:
                t = node.now_s()
                pub_m.publish(C.joint_state_to_msg(t, motors, np.zeros(6)))
                pub_n.publish(C.node_states_to_msg(t, names, Pm, np.zeros_like(Pm), np.ones(len(names), bool)))
                spin_until(ros_executor, lambda: False, timeout=0.02)

        def feed_until(predicate, timeout=15.0):
            """Feed node states until predicate() (a loaded machine delays callbacks); returns predicate()."""
            t_end = node.now_s() + timeout
            while node.now_s() < t_end and not predicate():
                feed(0.1)
            return predicate()

        def target(pos, angles, frame="C0"):
            msg = PoseStamped()
            msg.header.frame_id = frame
            msg.pose.position.x, msg.pose.position.y, msg.pose.position.z = (float(v) for v in pos)
            qx, qy, qz, qw = quaternion_of(angles)
            msg.pose.orientation.x, msg.pose.orientation.y, msg.pose.orientation.z, msg.pose.orientation.w = \
                qx, qy, qz, qw
            pub_t.publish(msg)

        def last_diag():
            for arr in reversed(diags):
                for st in arr.status:
                    if st.name == node.get_name():
                        return C.diag_values(st)
            return {}

        assert feed_until(lambda: node._state is not None)
        target((math.nan, 0.0, 1.4), goal[3:])
        assert feed_until(lambda: node.rejected == 1)
        assert node.target is None and "rejected: target has non-finite numbers" in node.target_reason
        target(goal[:3], goal[3:], frame="world")
        assert feed_until(lambda: node.rejected == 2)
        assert node.target is None and "frame 'world'" in node.target_reason
        target(goal[:3], goal[3:])
        assert feed_until(lambda: node.target is not None) and node.target_reason == "accepted"
        # until a cycle solved (the worker warms up first)
        assert feed_until(lambda: node.last is not None and node.last.ok, timeout=30.0), node.last
        plans.clear()

        def solved_plans():       # plans that move (a hold repeats one row)
            return [m for m in plans if np.ptp(np.asarray(m.position).reshape(-1, 6), axis=0).max() > 0]

        assert feed_until(solved_plans, timeout=20.0), f"{len(plans)} plans, none solved"
        ok = solved_plans()
        msg = ok[-1]
        assert list(msg.name) == motors
        plan = np.asarray(msg.position).reshape(-1, 6)
        assert plan.shape == (50, 6) and np.all(np.isfinite(plan))
        assert np.all(np.abs(plan) <= math.pi)
        knots = plan[4::5]                                   # ramp: knot b at step 5 (b + 1) - 1
        assert np.abs(np.diff(knots, axis=0)).max() <= 1.0 * 0.05 + 1e-9
        assert np.abs(plan).max() > 1e-3                      # it does act towards the target
        assert spin_until(ros_executor, lambda: "solve_ms_p50" in last_diag(), timeout=3)
        d = last_diag()
        assert float(d["solve_ms_p50"]) > 0 and float(d["linearize_ms_p50"]) > 0, d
        assert float(d["plate_error_mm"]) > 5.0 and d["target"] == "accepted", d
        # the ages of what the solved cycles used: fresh states only (older than max_input_age_s holds), along a
        # linearisation that covered the horizon (nominal_margin_s + extension_s at most)
        assert 0.0 <= float(d["state_age_ms_max"]) <= 300.0, d
        assert 0.0 <= float(d["linearization_age_ms_p50"]) <= float(d["linearization_age_ms_max"]) <= 3000.0, d
        # node states stop: the next cycles hold and say stale
        assert spin_until(ros_executor, lambda: node.last is not None and node.last.status.value == "stale",
                          timeout=3)
        # the reason names the age: of the node states (max_input_age_s), or, on a machine loaded enough that the
        # linearisation fell behind first, of the linearisation
        assert " s old" in node.last.message, node.last.message

        def last_is_hold():       # (solved plans still in flight arrive first)
            held = np.asarray(plans[-1].position).reshape(-1, 6)
            return bool(np.all(held == held[0]))

        assert spin_until(ros_executor, last_is_hold, timeout=5)
        assert spin_until(ros_executor, lambda: last_diag().get("status") == "stale", timeout=3)
        # ... and the held cycles are counted by cause (the node states stopped; on a machine loaded enough, the
        # linearisation may have aged out first)
        d = last_diag()
        assert int(d.get("holds_node_states", 0)) + int(d.get("holds_linearization", 0)) >= 1, d
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
