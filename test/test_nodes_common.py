"""nodes/_common and the modules behind it: message <-> array conversions (through real serialisation), the CDR
codec (nodes/cdr.py) against rclpy's serialiser, parameter specs and their run-time validation, drop counting."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from rclpy.parameter import Parameter
from rclpy.serialization import deserialize_message, serialize_message

from conftest import unique_name
from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates
from tensegrity_ros.nodes import _common as C
from tensegrity_ros.nodes import cdr


def _ser(msg):
    return deserialize_message(serialize_message(msg), type(msg))


def test_node_states_roundtrip_keeps_nan_and_validity():
    rng = np.random.default_rng(1)
    P, V = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    valid = np.array([True, False, True, True, True])
    P[1] = np.nan
    V[3] = np.nan  # velocity not estimated yet
    msg = _ser(C.node_states_to_msg(12.25, [f"n{i}" for i in range(5)], P, V, valid, "structure", "note"))
    r = C.node_states_from_msg(msg)
    assert r.names == tuple(f"n{i}" for i in range(5)) and r.frame_id == "structure"
    assert r.stamp == pytest.approx(12.25, abs=1e-9)
    np.testing.assert_array_equal(r.valid, valid)
    np.testing.assert_array_equal(r.positions[valid], P[valid])
    assert np.isnan(r.positions[1]).all()
    np.testing.assert_array_equal(r.velocity_valid, [True, False, True, False, True])


def test_joint_state_markers_and_poses():
    js = _ser(C.joint_state_to_msg(3.5, ["m1", "m2"], [0.1, -0.2], [1.0, 2.0]))
    r = C.joint_state_from_msg(js)
    assert r.names == ("m1", "m2") and r.stamp == pytest.approx(3.5)
    np.testing.assert_array_equal(r.position, [0.1, -0.2])
    assert np.isnan(r.effort).all()   # absent -> NaN
    pts = np.arange(12.0).reshape(4, 3)
    t, m = C.markers_from_pose_array(_ser(C.markers_to_pose_array(7.0, pts, "mocap")))
    assert t == 7.0
    np.testing.assert_array_equal(m, pts)
    # pose <-> matrix through a quaternion
    a = 0.7
    T = np.eye(4)
    T[:3, :3] = [[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]]
    T[:3, 3] = [0.1, 0.2, 0.3]
    np.testing.assert_allclose(C.matrix_from_pose(C.pose_from_matrix(T)), T, atol=1e-12)
    for R in (np.diag([1.0, -1.0, -1.0]), np.diag([-1.0, 1.0, -1.0]), np.diag([-1.0, -1.0, 1.0])):
        np.testing.assert_allclose(C.matrix_from_quaternion(*C.quaternion_from_matrix(R)), R, atol=1e-12)


def test_prediction_cdr_equals_rclpy_serialisation():
    rng = np.random.default_rng(0)
    realized = np.r_[np.nan, np.abs(rng.normal(size=12)) * 1e-3]        # step 0 not scored yet: NaN
    pred = C.Prediction(1234.5678, 0.01, tuple(f"n{i}" for i in range(7)), rng.normal(size=(13, 7, 3)),
                        rng.normal(size=(13, 7, 3)), "set-3", "structure", realized)
    fast = cdr.prediction_to_cdr(pred)
    slow = serialize_message(C.prediction_to_msg(pred))
    assert len(fast) == len(slow)
    for data in (fast, slow):   # both decode the same, with rclpy and with the fast decoder
        for got in (C.prediction_from_msg(deserialize_message(data, PredictedStates)), cdr.prediction_from_cdr(data)):
            np.testing.assert_array_equal(got.positions, pred.positions)
            np.testing.assert_array_equal(got.velocities, pred.velocities)
            assert got.node_names == pred.node_names and got.parameter_set_id == "set-3"
            assert got.dt == 0.01 and got.stamp == pytest.approx(pred.stamp, abs=1e-9)
            assert got.frame_id == "structure" and got.horizon_steps == 13
            np.testing.assert_array_equal(got.realized_error, realized)
    empty = C.Prediction(0.0, 0.01, (), np.zeros((0, 0, 3)), np.zeros((0, 0, 3)))
    assert deserialize_message(cdr.prediction_to_cdr(empty), PredictedStates).horizon_steps == 0


def test_parameter_set_roundtrip():
    ps = C.ParameterSet("abc", ("s1.stiffness", "b2.mass", "control_force_scalar"), np.array([100.0, 0.3, 1.2]),
                        np.array([1.0, 0.01, 0.1]), np.array([0.99, 0.97, 0.0]), 0.0012, (10.0, 20.0), True,
                        "ok", 20.5)
    msg = _ser(C.parameter_set_to_msg(ps))
    assert list(msg.element_names) == ["s1", "b2", ""] and list(msg.kinds) == ["stiffness", "mass",
                                                                               "control_force_scalar"]
    back = C.parameter_set_from_msg(msg)
    assert back.names == ps.names and back.set_id == "abc" and back.converged
    np.testing.assert_array_equal(back.values, ps.values)
    np.testing.assert_array_equal(back.std_devs, ps.std_devs)
    assert back.window == pytest.approx((10.0, 20.0)) and back.fit_residual == pytest.approx(0.0012)
    bad = IdentifiedParameters(element_names=["s1"], kinds=["stiffness"], values=[1.0, 2.0], std_devs=[0.1])
    with pytest.raises(ValueError):
        C.parameter_set_from_msg(bad)


def test_param_spec_checks():
    s = C.ParamSpec("rate", 1.0, "", range=(0.1, 10.0))
    assert s.problem(2) is None and s.problem(0.0) is not None and s.problem("x") is not None
    assert s.problem(float("nan")) is not None
    c = C.ParamSpec("mode", "a", "", choices=("a", "b"))
    assert c.problem("b") is None and "one of" in c.problem("z")
    t = C.ParamSpec("tf", [], "", check=C.transform_list, type_="double_array")
    assert t.problem([]) is None and t.problem([1.0] * 12) is None and t.problem([1.0] * 5) is not None
    R, tr = C.transform_from_list(list(np.eye(4).reshape(-1)))
    np.testing.assert_array_equal(R, np.eye(3))
    assert C.transform_from_list([]) is None


class _Demo(C.GraphNode):
    PARAMS = (C.ParamSpec("rate_hz", 10.0, "a rate", range=(1.0, 100.0)),
              C.ParamSpec("mode", "fast", "a mode", choices=("fast", "slow")),
              C.ParamSpec("fixed", 3, "read only", read_only=True),
              C.ParamSpec("names", [], "names", type_="string_array"))

    def on_parameter_change(self, name, value):
        return "slow is vetoed by the node" if (name, value) == ("mode", "slow") else None


def test_graph_node_declares_validates_and_rejects_with_reason(rclpy_context):
    node = _Demo(unique_name("demo"), context=rclpy_context,
                 parameter_overrides=[Parameter("rate_hz", value=20.0)])
    try:
        assert node.p == {"rate_hz": 20.0, "mode": "fast", "fixed": 3, "names": []}
        desc = node.describe_parameter("rate_hz")
        assert desc.description == "a rate" and desc.floating_point_range[0].to_value == 100.0
        ok = node.set_parameters([Parameter("rate_hz", value=50.0)])[0]
        assert ok.successful and node.p["rate_hz"] == 50.0
        bad = node.set_parameters([Parameter("mode", value="warp")])[0]
        assert not bad.successful and "one of" in bad.reason
        veto = node.set_parameters([Parameter("mode", value="slow")])[0]
        assert not veto.successful and "vetoed" in veto.reason and node.p["mode"] == "fast"
        ro = node.set_parameters([Parameter("fixed", value=4)])[0]
        assert not ro.successful
    finally:
        node.destroy_node()
    with pytest.raises(C.ParameterError, match="mode = 'warp'"):
        _Demo(unique_name("demo"), context=rclpy_context, parameter_overrides=[Parameter("mode", value="warp")])


def test_lean_node_leaves_out_qos_event_handlers_only_when_asked(rclpy_context):
    """bringup's nodes (qos_events=False) give the executor no QoS-event waitables to poll; a node launched on
    its own keeps rclpy's default handlers, so an incompatible subscriber is still reported."""
    from std_msgs.msg import Empty

    counts = {}
    for events in (True, False):
        node = _Demo(unique_name("lean"), context=rclpy_context, qos_events=events)
        try:
            pub = node.create_publisher(Empty, "/lean_test", 10)
            sub = node.create_subscription(Empty, "/lean_test", lambda m: None, 10)
            counts[events] = (len(pub.event_handlers), len(sub.event_handlers), len(node._diag_pub.event_handlers))
        finally:
            node.destroy_node()
    assert counts[False] == (0, 0, 0), counts
    assert all(n > 0 for n in counts[True]), counts


def test_a_latest_reader_takes_the_newest_of_a_backlog(rclpy_context):
    """LATEST_QOS (the plate controller's node states): of a backlog published on the graph's deep reliable
    stream while the executor was busy, one wake takes the newest message, not the oldest of a queue."""
    import time

    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import Int32

    node = _Demo(unique_name("latest"), context=rclpy_context, qos_events=False)
    got = []
    topic = f"/{unique_name('latest_test')}"
    node.subscribe(Int32, topic, lambda m: got.append(m.data), C.LATEST_QOS, info=False)
    pub = node.create_publisher(Int32, topic, C.STREAM_QOS)
    ex = SingleThreadedExecutor(context=rclpy_context)
    ex.add_node(node)
    try:
        deadline = time.monotonic() + 5.0
        while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(20):
            pub.publish(Int32(data=i))
        time.sleep(0.2)
        while not got and time.monotonic() < deadline:
            ex.spin_once(timeout_sec=0.1)
        ex.spin_once(timeout_sec=0.1)                   # nothing else is queued
        assert got == [19], got
    finally:
        ex.shutdown()
        node.destroy_node()


def test_sequence_monitor_counts_gaps_and_restarts():
    m = C.SequenceMonitor()
    for s in (1, 2, 3, 6, 7):
        m.update("/a", s)
    assert m.dropped["/a"] == 2 and m.received["/a"] == 5
    m.update("/a", 1)          # a restarted publisher
    m.update("/a", 2)
    assert m.dropped["/a"] == 2 and m.restarts["/a"] == 1
    m.update_info("/b", {"publication_sequence_number": None})
    assert m.total_dropped == 2 and m.received["/b"] == 1


def test_rolling_stats():
    r = C.RollingStats(100)
    for v in range(1, 201):
        r.add(v)
    s = r.summary()
    assert s["n"] == 200 and s["p50"] == pytest.approx(150.5) and s["max"] == 200
    last = r.summary(1e3, "ms_", last=10)          # the newest 10 (a node's diagnostics), scaled and prefixed
    assert last["ms_n"] == 200 and last["ms_p50"] == pytest.approx(195.5e3) and last["ms_max"] == 200e3
    assert last["ms_p99"] == pytest.approx(float(np.percentile(np.arange(191, 201), 99)) * 1e3)


def test_the_facade_re_exports_the_codec():
    for name in ("prediction_to_cdr", "prediction_from_cdr", "pose_array_to_cdr", "markers_from_cdr",
                 "node_states_to_cdr", "sample_to_cdr", "node_states_from_cdr", "joint_state_from_cdr"):
        assert getattr(C, name) is getattr(cdr, name)


def test_fast_codecs_match_rclpy():
    from geometry_msgs.msg import PoseArray
    from sensor_msgs.msg import JointState

    rng = np.random.default_rng(2)
    m = rng.normal(size=(7, 3))
    for data in (cdr.pose_array_to_cdr(5.25, m, "mocap"), serialize_message(C.markers_to_pose_array(5.25, m, "mocap"))):
        t, got, frame = cdr.markers_from_cdr(data)
        assert t == pytest.approx(5.25) and frame == "mocap"
        np.testing.assert_array_equal(got, m)
    msg = deserialize_message(cdr.pose_array_to_cdr(5.25, m, "mocap"), PoseArray)
    assert msg.poses[3].orientation.w == 1.0 and msg.poses[3].position.y == m[3, 1]
    P, V = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    valid = np.array([1, 0, 1, 1, 0], bool)
    names = [f"n{i}" for i in range(5)]
    for data in (cdr.node_states_to_cdr(3.0, names, P, V, valid, "structure", "x"),
                 serialize_message(C.node_states_to_msg(3.0, names, P, V, valid, "structure", "x"))):
        for r in (cdr.node_states_from_cdr(data), C.node_states_from_msg(deserialize_message(data, NodeStates))):
            assert r.names == tuple(names) and r.frame_id == "structure" and r.stamp == 3.0
            np.testing.assert_array_equal(r.positions, P)
            np.testing.assert_array_equal(r.velocities, V)
            np.testing.assert_array_equal(r.valid, valid)
        assert deserialize_message(data, NodeStates).frame_note == "x"
    sample = SimpleNamespace(stamp=4.0, names=tuple(names), positions=P, velocities=V, valid=valid,
                             velocity_valid=np.array([1, 1, 0, 1, 1], bool), frame_id="structure")
    fast, slow = cdr.sample_to_cdr(sample, "y"), serialize_message(C.sample_to_node_states(sample, "y"))
    assert len(fast) == len(slow) and deserialize_message(fast, NodeStates).frame_note == "y"
    a, b = cdr.node_states_from_cdr(fast), C.node_states_from_msg(deserialize_message(slow, NodeStates))
    assert a.names == b.names and a.stamp == b.stamp == 4.0
    for x, y in zip(a[2:5], b[2:5]):
        np.testing.assert_array_equal(x, y)
    assert np.isnan(a.velocities[2]).all() and not np.isnan(a.velocities[3]).any()
    js = C.joint_state_to_msg(2.0, ["a", "bb", "c"], [1.0, 2.0, 3.0], [0.1, 0.2, 0.3])
    r = cdr.joint_state_from_cdr(serialize_message(js))
    assert r.names == ("a", "bb", "c") and r.stamp == 2.0
    np.testing.assert_array_equal(r.position, [1, 2, 3])
    np.testing.assert_array_equal(r.velocity, [0.1, 0.2, 0.3])
    assert np.isnan(r.effort).all()
    empty = serialize_message(JointState())
    assert cdr.joint_state_from_cdr(empty).names == ()


def _output_until(proc, text: str, timeout_s: float) -> str:
    """A node process's output, line by line, until ``text`` appears, it ends or ``timeout_s`` passes."""
    import time

    deadline = time.monotonic() + timeout_s
    out = ""
    while time.monotonic() < deadline and text not in out:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
    return out


def test_run_node_exits_cleanly_on_sigterm_and_refuses_bad_parameters(tmp_path):
    """`main` of a node (C.run_node): SIGTERM -> destroy_node and exit 0; a bad parameter -> one line, exit 1."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    model = Path(__file__).resolve().parents[1] / "config" / "models" / "icosahedron.yaml"
    code = "import sys; from tensegrity_ros.nodes.mocap_ingest import main; sys.exit(main())"
    env = {**os.environ, "ROS_DOMAIN_ID": os.environ.get("ROS_DOMAIN_ID", "0")}
    proc = subprocess.Popen([sys.executable, "-c", code, "--ros-args", "-r", "__node:=ingest_sig",
                             "-p", f"model_file:={model}"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = _output_until(proc, "waiting for markers", 30)
        assert "waiting for markers" in out, out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run([sys.executable, "-c", code, "--ros-args", "-p", f"model_file:={tmp_path / 'missing.yaml'}"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "model_file" in bad.stderr and "no such file" in bad.stderr


def test_run_node_puts_the_callbacks_thread_under_sched_fifo_when_rt_priority_is_set():
    """`rt_priority` of the state predictor run as its own executable (as ros2 launch runs it): the thread that
    spins its executor (the main thread) runs under SCHED_FIFO at that priority, the threads the node started
    before it (its linearizer, rclpy's) stay normal; refused (no root / CAP_SYS_NICE), the log says how to allow
    it and the node runs on."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = "import sys; from tensegrity_ros.nodes.state_predictor import main; sys.exit(main())"
    env = {**os.environ, "ROS_DOMAIN_ID": os.environ.get("ROS_DOMAIN_ID", "0")}
    proc = subprocess.Popen([sys.executable, "-c", code, "--ros-args", "-r", "__node:=predictor_rt",
                             "-p", f"model_file:={root / 'config' / 'models' / 'stacked_manipulator.yaml'}",
                             "-p", f"reference_file:={root / 'config' / 'references' / 'seed_sinusoids.yaml'}",
                             "-p", "rt_priority:=7"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out = _output_until(proc, "callbacks' thread", 60)
        assert "callbacks' thread" in out, out
        if "cannot set" in out:
            assert "needs root, CAP_SYS_NICE or a real-time limit (ulimit -r)" in out
        else:
            assert "callbacks' thread: SCHED_FIFO priority 7" in out, out
            assert os.sched_getscheduler(proc.pid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
            assert os.sched_getparam(proc.pid).sched_priority == 7
            others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
            assert others and all(os.sched_getscheduler(t) == os.SCHED_OTHER for t in others)
        assert proc.poll() is None, out          # runs on either way
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_graph_monitor_keeps_every_prediction_through_an_executor_stall(rclpy_context, make_node, spin_until):
    """The monitor (bringup.GraphMonitor) counts every message on every subscription, and `make bench` holds what
    it loses to 0. Its reader of predictions must then ride out an executor that runs late as long as the
    streams' readers do (STREAM_QOS): here 1.5 s of 120-Hz predictions arrive while its executor does not spin,
    as when the graph's one executor thread is held up. A reader of depth 32 (PREDICTION_QOS) kept 32 of the 180
    here (stop 35), and the test failed."""
    from rclpy.executors import SingleThreadedExecutor

    from tensegrity_ros.bringup import GraphMonitor

    topic = C.TOPICS["predicted_states"]
    private = f"/{unique_name('stall')}/predicted_states"      # no other test's predictor can reach it
    monitor = GraphMonitor(unique_name("monitor"), context=rclpy_context, topics=[topic], qos_events=False,
                           cli_args=["--ros-args", "-r", f"{topic}:={private}"])
    ex = SingleThreadedExecutor(context=rclpy_context)
    ex.add_node(monitor)
    try:
        pub = make_node().create_publisher(PredictedStates, private, C.PREDICTION_QOS)
        assert spin_until(ex, lambda: pub.get_subscription_count() > 0, timeout=5.0)
        n = 180
        for _ in range(n):                                   # the monitor's executor is not spinning
            pub.publish(PredictedStates())
            time.sleep(1.0 / 120.0)
        assert spin_until(ex, lambda: monitor.seq.received.get(topic, 0) >= n, timeout=10.0), monitor.seq.received
        assert monitor.seq.received[topic] == n and monitor.seq.dropped[topic] == 0, (monitor.seq.received,
                                                                                      monitor.seq.dropped)
    finally:
        ex.shutdown(timeout_sec=1.0)
        monitor.destroy_node()
