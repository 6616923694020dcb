"""visualizer over real rclpy: node states, motor states, identified parameters and predictions in (as their
publishers send them), /tensegrity/markers (visualization_msgs/MarkerArray) out. Bars as cylinders and strings as
line strips, one each; a string's colour orders like its tension from the engine; the active identified
parameters and the motor angles change the tensions; the predicted horizon arrives as a fading ghost; an occluded
node's bar is deleted."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rclpy.parameter import Parameter

from conftest import spin_until, unique_name
from tensegrity_ros.nodes import _common as C

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "config" / "models" / "stacked_manipulator.yaml"


def _engine_tensions(structure, X, params=None, u=None) -> np.ndarray:
    """Tensions (S,) N from the engine's own API (NodalEngine.string_state) at full positions X (N, 3)."""
    import torch

    from tensegrity_ros.engine import Inputs, State, make_engine

    eng = make_engine(structure)
    Xt = torch.as_tensor(X, dtype=torch.float64)[None]
    inp = None if u is None else Inputs(motor_angles=torch.as_tensor(u, dtype=torch.float64)[None])
    st = eng.string_state(params if params is not None else eng.default_params(), State(Xt, torch.zeros_like(Xt)),
                          inp)
    return st.tension[0].numpy()


def test_visualizer_publishes_markers(rclpy_context, ros_executor, make_node):
    from sensor_msgs.msg import JointState
    from visualization_msgs.msg import Marker, MarkerArray

    from tensegrity_ros.model import load_structure
    from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates
    from tensegrity_ros.nodes.visualizer import MARKERS_TOPIC, VisualizerNode
    from tensegrity_ros.viz.render import marker_nodes

    s = load_structure(MODEL)
    node = VisualizerNode(unique_name("viz"), context=rclpy_context, parameter_overrides=[
        Parameter("model_file", value=str(MODEL)), Parameter("rate_hz", value=20.0),
        Parameter("tension_scale_n", value=3000.0)])   # fixed: colour = f(tension) whatever the parameters
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe"))
        got = []
        probe.create_subscription(MarkerArray, MARKERS_TOPIC, got.append, 10)
        pubs = {t: probe.create_publisher(m, C.TOPICS[t], q) for t, m, q in (
            ("node_states", NodeStates, C.STREAM_QOS), ("motor_states", JointState, C.STREAM_QOS),
            ("predicted_states", PredictedStates, C.PREDICTION_QOS),
            ("identified_parameters", IdentifiedParameters, C.LATCHED_QOS))}
        assert spin_until(ros_executor, lambda: all(p.get_subscription_count() >= 1 for p in pubs.values()) and
                          probe.count_publishers(MARKERS_TOPIC) >= 1, timeout=10)
        names = marker_nodes(s)
        X0 = np.array([n.position for n in s.nodes])
        idx = [s.node_names.index(n) for n in names]
        rng = np.random.default_rng(3)
        X = X0 + rng.normal(0.0, 0.004, X0.shape)
        X[[i for i, n in enumerate(s.nodes) if n.fixed]] = X0[[i for i, n in enumerate(s.nodes) if n.fixed]]
        stamp = [100.0]

        def send_states(valid=None):
            stamp[0] += 0.01
            v = np.ones(len(names), bool) if valid is None else valid
            pubs["node_states"].publish(C.node_states_to_msg(stamp[0], names, X[idx], np.zeros((len(names), 3)), v))

        def latest(pred=lambda arr: True):
            n = len(got)
            assert spin_until(ros_executor, lambda: len(got) > n and pred(got[-1]), timeout=5)
            return got[-1]

        def by_ns(arr, ns):
            return sorted((m for m in arr.markers if m.ns == ns and m.action == Marker.ADD), key=lambda m: m.id)

        # node states only: bars, strings, nodes; no ghost
        send_states()
        arr = latest()
        bars, strings = by_ns(arr, "bars"), by_ns(arr, "strings")
        assert len(bars) == 18 and all(m.type == Marker.CYLINDER for m in bars)
        assert len(strings) == 14 and all(m.type == Marker.LINE_STRIP for m in strings)
        assert len(by_ns(arr, "nodes")) == 1 and not by_ns(arr, "ghost")
        assert {m.header.frame_id for m in arr.markers} == {"structure"}
        assert C.stamp_to_sec(arr.markers[0].header.stamp) == pytest.approx(stamp[0])
        # a string's colour orders like its tension (the engine's, at the full positions)
        full = node.scene.full_positions(names, X[idx])
        np.testing.assert_allclose(full[idx], X[idx])
        tension = _engine_tensions(s, full)
        reds = np.array([m.color.r for m in strings])
        blues = np.array([m.color.b for m in strings])
        order = np.argsort(tension)
        assert np.all(np.diff(reds[order]) >= 0) and np.all(np.diff(blues[order]) <= 0)
        assert reds[order[-1]] > reds[order[0]] + 0.3
        sc1_red = reds[0]
        # the active identified parameters: sc1 twice as stiff -> twice the tension -> redder
        k = s.strings[0].stiffness
        ps = C.ParameterSet("set-2", ("sc1.stiffness",), np.array([2 * k]), np.array([1.0]), np.array([1.0]), 1e-3,
                            (0.0, 1.0), True, "", stamp[0])
        pubs["identified_parameters"].publish(C.parameter_set_to_msg(ps))
        assert spin_until(ros_executor, lambda: node.set_id == "set-2", timeout=5)
        arr = latest(lambda a: by_ns(a, "strings"))
        assert by_ns(arr, "strings")[0].color.r > sc1_red + 0.2
        # motor m1 pays out 1 rad (20 mm of string): sc1 slackens -> bluer
        pubs["motor_states"].publish(C.joint_state_to_msg(stamp[0], [a.name for a in s.actuators],
                                                          [1.0, 0, 0, 0, 0, 0], np.zeros(6)))
        arr = latest(lambda a: by_ns(a, "strings") and by_ns(a, "strings")[0].color.b > 0.5)
        params = C.params_with_set(node.nominal, ps)
        t_sc1 = _engine_tensions(s, full, params, [1.0, 0, 0, 0, 0, 0])[0]
        assert t_sc1 < _engine_tensions(s, full, params)[0]
        # a prediction: the ghost, fading, and the predicted paths
        K, dt = 100, 0.01
        P = X[idx][None] + np.linspace(0, 0.1, K)[:, None, None] * np.array([0.0, 0.0, 1.0])
        pred = C.Prediction(stamp[0] + dt, dt, names, P, np.zeros_like(P), "set-2")
        pubs["predicted_states"].publish(C.prediction_to_msg(pred))
        arr = latest(lambda a: by_ns(a, "ghost"))
        ghost = by_ns(arr, "ghost")
        assert len(ghost) == 3 and all(m.type == Marker.LINE_LIST for m in ghost)
        alphas = [m.color.a for m in ghost]
        assert alphas == sorted(alphas, reverse=True) and alphas[0] < 1.0
        top = np.array([(p.x, p.y, p.z) for p in ghost[-1].points])
        assert len(top) == 2 * 18 and top[:, 2].max() == pytest.approx(full[:, 2].max() + 0.1, abs=1e-6)
        assert len(by_ns(arr, "ghost_paths")) == 1 and node.last_ghost
        # n4 occluded: bar b1 (n1, n4) and the strings through n4 are deleted, the rest stays
        send_states(np.array([n != "n4" for n in names]))
        arr = latest(lambda a: any(m.action == Marker.DELETE for m in a.markers))
        deleted = {(m.ns, m.id) for m in arr.markers if m.action == Marker.DELETE}
        assert ("bars", 0) in deleted and {("strings", 5), ("strings", 6)} <= deleted
        assert len(by_ns(arr, "bars")) == 17
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
