"""mocap_ingest over real rclpy: unlabelled, shuffled markers of the MuJoCo twin of the stacked manipulator in a
Y-up mocap frame in; labelled node states in the structure frame, plate frames C1 / C2 and diagnostics out;
an occluded marker gives an invalid node (NaN), never an invented one; the transform refresh on request
(std_srvs/Trigger). The TF tree: mocap -> structure on /tf_static (latched: the registration), structure -> c0,
c1, c2 on /tf, its numbers against the registration and the twin's true mocap frame. The markers subscription's
QoS: sensor data by default (a best-effort driver is heard), reliable on request."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rclpy.parameter import Parameter

from conftest import spin_until, unique_name
from tensegrity_ros.nodes import _common as C
from tensegrity_ros.nodes.mocap_ingest import MocapIngestNode

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "config" / "models" / "stacked_manipulator.yaml"
#: the rough mocap -> structure guess of config/nodes/mocap_ingest.yaml (OptiTrack's Y up)
Y_UP = [1.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def twin_frames():
    """Node positions of the manipulator swaying in the twin, every 1/120 s for 1 s."""
    from tensegrity_ros.model import load_structure
    from tensegrity_ros.twin.sim import TwinSim

    s = load_structure(MODEL)
    sim = TwinSim(s)
    sim.settle(0.2)
    out = []
    for k in range(120):
        t = k / 120.0
        sim.step(0.6 * np.sin(2 * np.pi * t / 1.0 + np.arange(6)), n_steps=8)
        out.append((t, sim.node_positions()))
    return s, out


def test_ingest_node_labels_markers_and_publishes_plates(rclpy_context, ros_executor, make_node, twin_frames):
    from geometry_msgs.msg import PoseArray, PoseStamped
    from std_srvs.srv import Trigger
    from tensegrity_ros.frames import manipulator_frames
    from tensegrity_ros.msg import NodeStates
    from tensegrity_ros.bringup import yaml_parameters
    from tensegrity_ros.nodes.sim_robot import marker_node_indices
    from tensegrity_ros.twin.markers import MocapFrame, markers

    s, frames = twin_frames
    # reliable: this test publishes 10 frames between two spins and counts every one
    params = {**yaml_parameters("mocap_ingest"), "model_file": str(MODEL), "diagnostics_period_s": 0.2,
              "mocap_qos_reliability": "reliable"}
    node = MocapIngestNode(unique_name("ingest"), context=rclpy_context,
                           parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe"))
        states, c1, c2 = [], [], []
        probe.create_subscription(NodeStates, C.TOPICS["node_states"], states.append, C.STREAM_QOS)
        probe.create_subscription(PoseStamped, C.TOPICS["plate_c1"], c1.append, C.STREAM_QOS)
        probe.create_subscription(PoseStamped, C.TOPICS["plate_c2"], c2.append, C.STREAM_QOS)
        pub = probe.create_publisher(PoseArray, C.TOPICS["markers"], C.STREAM_QOS)
        assert spin_until(ros_executor, lambda: probe.count_subscribers(C.TOPICS["markers"]) >= 1, timeout=5)
        frame, rng = MocapFrame(), np.random.default_rng(0)
        idx = marker_node_indices(s)
        occluded = s.node_names.index("n15")
        T0 = 1000.0
        for k, (t, P) in enumerate(frames):
            keep = idx if k != 60 else idx[idx != occluded]          # one marker hidden in frame 60
            m = markers(P, frame, noise_std=3e-4, rng=rng, indices=keep)
            pub.publish(C.markers_to_pose_array(T0 + t, m, "mocap"))
            if k % 10 == 9:
                spin_until(ros_executor, lambda: len(states) > k - 3, timeout=5)
        assert spin_until(ros_executor, lambda: len(states) == len(frames), timeout=10)
        marker_names = tuple(s.node_names[i] for i in idx)
        errs = []
        for k, msg in enumerate(states):
            r = C.node_states_from_msg(msg)
            assert r.names == marker_names and r.frame_id == "structure"
            assert r.stamp == pytest.approx(T0 + frames[k][0], abs=1e-6)
            truth = frames[k][1][idx]
            if k == 60:
                j = marker_names.index("n15")
                assert not r.valid[j] and np.isnan(r.positions[j]).all()
                assert r.valid.sum() == len(idx) - 1
            else:
                assert r.valid.all(), k
            ok = r.valid
            errs.append(np.linalg.norm(r.positions[ok] - truth[ok], axis=1).max())
        # 0.3 mm marker noise + the single-frame registration (~1 mm over the 1.4 m robot before the refresh)
        assert max(errs) < 4e-3, f"labelled positions off by {max(errs) * 1e3:.2f} mm"
        last = C.node_states_from_msg(states[-1])
        assert last.velocity_valid.all()
        # plates: the seed's frames of the true positions
        assert spin_until(ros_executor, lambda: len(c1) >= len(frames) - 5 and len(c2) >= len(frames) - 5, timeout=5)
        _, F1, F2 = manipulator_frames(frames[-1][1], s.node_names)
        for got, want in ((c1[-1], F1), (c2[-1], F2)):
            assert got.header.frame_id == "structure"
            T = C.matrix_from_pose(got.pose)
            np.testing.assert_allclose(T[:3, 3], want[:3, 3], atol=4e-3)
            np.testing.assert_allclose(T[:3, :3], want[:3, :3], atol=1e-2)
        # refresh on request: the std_srvs/Trigger service
        client = probe.create_client(Trigger, f"/{node.get_name()}/refresh_transform")
        assert spin_until(ros_executor, client.service_is_ready, timeout=5)
        future = client.call_async(Trigger.Request())
        assert spin_until(ros_executor, future.done, timeout=5)
        reply = future.result()
        assert reply.success and reply.message.startswith("transform refreshed"), reply.message
        assert node.refreshes == 1
        diags = []
        from diagnostic_msgs.msg import DiagnosticArray
        probe.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        assert spin_until(ros_executor, lambda: any(st.name.startswith(node.get_name()) for d in diags
                                                    for st in d.status), timeout=5)
        st = [st for d in diags for st in d.status if st.name.startswith(node.get_name())][-1]
        vals = C.diag_values(st)
        assert vals["registered"] == "true" and int(vals["frames"]) == len(frames)
        assert vals["input_dropped"] == "0" and "processing_ms_p99" in vals
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()


def _matrix(tf) -> np.ndarray:
    """4x4 of a geometry_msgs/TransformStamped."""
    from geometry_msgs.msg import Point, Pose

    t = tf.transform.translation
    return C.matrix_from_pose(Pose(position=Point(x=t.x, y=t.y, z=t.z), orientation=tf.transform.rotation))


def test_ingest_publishes_the_tf_tree(rclpy_context, ros_executor, make_node, twin_frames):
    """mocap -> structure (/tf_static, latched: a subscriber that comes late still gets it) -> c0, c1, c2 (/tf):
    the registration's numbers as the node holds them, and the chain against the twin's true mocap frame."""
    from geometry_msgs.msg import PoseArray
    from tf2_msgs.msg import TFMessage
    from tensegrity_ros.frames import manipulator_frames
    from tensegrity_ros.nodes.mocap_ingest import TF_STATIC_QOS, TF_STATIC_TOPIC
    from tensegrity_ros.nodes.sim_robot import marker_node_indices
    from tensegrity_ros.twin.markers import MocapFrame, markers

    s, frames = twin_frames
    frames = frames[:30]
    node = MocapIngestNode(unique_name("ingest_tf"), context=rclpy_context, parameter_overrides=[
        Parameter("model_file", value=str(MODEL)), Parameter("mocap_qos_reliability", value="reliable"),
        Parameter("initial_transform", value=Y_UP), Parameter("tf_every", value=1)])   # every frame here
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe_tf"))
        tf = []
        probe.create_subscription(TFMessage, C.TOPICS["tf"], tf.append, C.STREAM_QOS)
        pub = probe.create_publisher(PoseArray, C.TOPICS["markers"], C.STREAM_QOS)
        assert spin_until(ros_executor, lambda: probe.count_subscribers(C.TOPICS["markers"]) >= 1, timeout=5)
        frame, rng, idx = MocapFrame(), np.random.default_rng(1), marker_node_indices(s)
        for t, P in frames:
            pub.publish(C.markers_to_pose_array(1000.0 + t, markers(P, frame, noise_std=3e-4, rng=rng, indices=idx),
                                                "optitrack"))
            spin_until(ros_executor, lambda: False, timeout=0.01)
        assert spin_until(ros_executor, lambda: node.frames == len(frames) and len(tf) >= len(frames) - 2, timeout=10)
        # /tf: structure -> c0, c1, c2 each frame, the plates of the labelled nodes
        last = {x.child_frame_id: x for x in tf[-1].transforms}
        assert set(last) == {"c0", "c1", "c2"}
        assert all(x.header.frame_id == "structure" for x in last.values())
        truth = dict(zip(("c0", "c1", "c2"), manipulator_frames(frames[-1][1], s.node_names)))
        for name, x in last.items():
            np.testing.assert_allclose(_matrix(x), truth[name], atol=1e-2)
        # /tf_static, subscribed only now: the latched registration mocap -> structure
        static = []
        probe.create_subscription(TFMessage, TF_STATIC_TOPIC, static.append, TF_STATIC_QOS)
        assert spin_until(ros_executor, lambda: len(static) >= 1, timeout=5)
        (reg,) = static[-1].transforms
        assert (reg.header.frame_id, reg.child_frame_id) == ("optitrack", "structure")
        T_ms = _matrix(reg)
        R, t = node.ingest.transform                       # x_structure = R x_mocap + t
        np.testing.assert_allclose(T_ms[:3, :3], R.T, atol=1e-9)
        np.testing.assert_allclose(T_ms[:3, 3], -R.T @ t, atol=1e-9)
        # ... which is the twin's true mocap frame (structure pose in mocap), to the registration's accuracy
        np.testing.assert_allclose(T_ms[:3, 3], frame.offset, atol=3e-3)
        np.testing.assert_allclose(T_ms[:3, :3], frame.rotation, atol=3e-3)
        # the chain mocap -> structure -> c1 puts the plate where the mocap saw it
        np.testing.assert_allclose((T_ms @ _matrix(last["c1"]))[:3, 3], frame.to_mocap(truth["c1"][:3, 3]), atol=5e-3)
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()


def test_mocap_qos_is_sensor_data_by_default(rclpy_context, ros_executor, make_node, twin_frames):
    """Sensor-data QoS (a best-effort reader with a deep queue): a best-effort mocap driver is heard (a reliable
    reader would hear nothing); ``reliable`` on request."""
    from geometry_msgs.msg import PoseArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from tensegrity_ros.nodes.sim_robot import marker_node_indices
    from tensegrity_ros.twin.markers import MocapFrame, markers

    s, frames = twin_frames
    node = MocapIngestNode(unique_name("ingest_qos"), context=rclpy_context, parameter_overrides=[
        Parameter("model_file", value=str(MODEL)), Parameter("initial_transform", value=Y_UP)])
    reliable = MocapIngestNode(unique_name("ingest_rel"), context=rclpy_context, parameter_overrides=[
        Parameter("model_file", value=str(MODEL)), Parameter("mocap_qos_reliability", value="reliable")])
    ros_executor.add_node(node)
    try:
        assert node.p["mocap_qos_reliability"] == "best_effort"
        q = node.sub.qos_profile
        assert q.reliability == ReliabilityPolicy.BEST_EFFORT and q.depth == C.STREAM_DEPTH   # C.SENSOR_READER_QOS
        q = reliable.sub.qos_profile
        assert q.reliability == ReliabilityPolicy.RELIABLE and q.depth == C.STREAM_DEPTH
        probe = make_node(unique_name("probe_qos"))
        pub = probe.create_publisher(PoseArray, C.TOPICS["markers"],
                                     QoSProfile(depth=5, reliability=ReliabilityPolicy.BEST_EFFORT))
        assert spin_until(ros_executor, lambda: pub.get_subscription_count() >= 1, timeout=5)
        idx = marker_node_indices(s)
        for t, P in frames[:5]:
            pub.publish(C.markers_to_pose_array(t, markers(P, MocapFrame(), indices=idx), "mocap"))
            spin_until(ros_executor, lambda: False, timeout=0.05)
        assert spin_until(ros_executor, lambda: node.frames >= 3, timeout=5), node.frames
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
        reliable.destroy_node()
