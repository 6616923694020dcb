"""The markers' pure core (tensegrity_ros.viz.markers, no rclpy): node positions completed from the structure's
constraints, string tensions from the engine checked against the string law written out here and against the
MuJoCo twin's own tendon tensions, the tension colour scale, the cylinders' poses, the ghost, and an occluded
node leaving its elements out; the picture of the docs is rendered."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros.model import load_structure
from tensegrity_ros.viz.markers import SLACK_COLOR, MarkerScene, MarkerStyle, cylinder_pose, tension_color
from tensegrity_ros.viz.render import marker_nodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "config" / "models" / "stacked_manipulator.yaml"


@pytest.fixture(scope="module")
def manipulator():
    from tensegrity_ros.engine import params_from_structure

    s = load_structure(MODEL)
    scene = MarkerScene(s)
    names = marker_nodes(s)
    X0 = np.asarray(scene.topology.X0)
    return s, scene, names, X0, params_from_structure(s)


def test_full_positions_from_the_marker_nodes(manipulator):
    s, scene, names, X0, _ = manipulator
    idx = [s.node_names.index(n) for n in names]
    assert len(names) == 24 and len(s.node_names) == 36
    np.testing.assert_allclose(scene.full_positions(names, X0[idx]), X0, atol=1e-12)   # virtual + midpoint nodes
    # n10 unseen: it and what hangs on it (its virtual duplicates, the midpoints next to it) are unknown
    valid = np.array([n != "n10" for n in names])
    X = scene.full_positions(names, X0[idx], valid)
    unknown = {s.node_names[i] for i in np.flatnonzero(np.isnan(X).any(axis=1))}
    assert {"n10", "n10_v1", "n10_v2"} <= unknown and "n11" not in unknown and "n1" not in unknown
    # velocities: the same map without the constant part (a fixed node does not move)
    V = scene.full_velocities(names, np.ones((len(names), 3)))
    assert np.all(V[s.node_names.index("n10_v1")] == 1.0)


def test_tensions_follow_the_string_law(manipulator):
    """At rest and under a displacement: tension = kappa (L - xi0) with kappa = stiffness (cord: at the file's rest
    length), L the sum of the segment lengths, xi0 the rest length moved by the motor; 0 when slack."""
    s, scene, names, X0, params = manipulator
    T0 = scene.tensions(params, X0)
    # the model file's form-finding notes: 800 / 300.87 / 851.22 N (stage 1), 155 / 52.38 / 153.02 N (stage 2)
    np.testing.assert_allclose(T0[[0, 3, 6, 7, 10, 13]], [800.0, 300.87, 851.22, 155.0, 52.38, 153.02], atol=0.01)
    rng = np.random.default_rng(0)
    X = X0 + rng.normal(0.0, 0.01, X0.shape)
    u = np.array([0.5, -0.3, 0.0, 0.2, 0.0, -0.1])
    T = scene.tensions(params, X, motor_angles=u)
    acts = {a.name: a for a in s.actuators}
    ui = {a.name: i for i, a in enumerate(s.actuators)}
    for k, st in enumerate(s.strings):
        ring = [s.node_names.index(n) for n in st.nodes + (st.nodes[:1] if st.closed else ())]
        L = sum(np.linalg.norm(X[j] - X[i]) for i, j in zip(ring[:-1], ring[1:]))
        xi0 = st.rest_length
        if st.actuator:
            a = acts[st.actuator]
            xi0 += a.direction * a.spool_radius * (u[ui[st.actuator]] - a.zero_offset)
        kappa = st.stiffness * (st.rest_length / xi0 if st.stiffness_law == "cord" else 1.0)
        assert T[k] == pytest.approx(max(kappa * (L - xi0), 0.0), rel=1e-9, abs=1e-9), st.name
    # paying out m1 slackens its string sc1
    assert scene.tensions(params, X0, motor_angles=[1.0, 0, 0, 0, 0, 0])[0] < T0[0] - 100


def test_tensions_agree_with_the_twin(manipulator):
    """The engine's tensions at the MuJoCo twin's driven state = the twin's tendon tensions (its own code)."""
    from tensegrity_ros.references import load_reference, motor_angles, motor_velocities
    from tensegrity_ros.twin.sim import TwinSim

    s, scene, names, _, params = manipulator
    ref = load_reference(ROOT / "config" / "references" / "seed_sinusoids.yaml", s.actuators)
    sim = TwinSim(s)
    while sim.time < 3.0:
        sim.step(motor_angles(ref, s.actuators, sim.time)[0], n_steps=10,
                 motor_velocities=motor_velocities(ref, s.actuators, sim.time)[0])
    X, V = sim.node_positions(), sim.node_velocities()
    T = scene.tensions(params, X, V, sim.motor_angles, motor_velocities(ref, s.actuators, sim.time - 10 * sim.dt)[0])
    np.testing.assert_allclose(T, sim.string_tensions(), rtol=2e-3, atol=0.5)


def test_tension_colours_order_like_the_tensions():
    scale = 1000.0
    cols = [tension_color(t, scale) for t in np.linspace(1.0, 1500.0, 40)]
    red, blue = np.array([c[0] for c in cols]), np.array([c[2] for c in cols])
    assert np.all(np.diff(red) >= 0) and np.all(np.diff(blue) <= 0) and red[-1] > red[0] and blue[-1] < blue[0]
    assert cols[-1] == tension_color(scale, scale)                     # clipped at the top of the scale
    assert tension_color(0.0, scale) == SLACK_COLOR == tension_color(float("nan"), scale)


@pytest.mark.parametrize("d", [(0, 0, 1.0), (0, 0, -2.0), (0.3, -0.4, 0.1), (1.0, 0, 0)])
def test_cylinder_pose_turns_z_onto_the_bar(d):
    from tensegrity_ros.frames import matrix_from_quaternion

    a = np.array([0.1, 0.2, 0.3])
    b = a + np.asarray(d)
    centre, q, length = cylinder_pose(a, b)
    R = matrix_from_quaternion(*q)
    np.testing.assert_allclose(R @ [0, 0, length], b - a, atol=1e-12)
    np.testing.assert_allclose(centre, (a + b) / 2)
    assert np.linalg.norm(q) == pytest.approx(1.0)


def test_scene_markers_and_ghost(manipulator):
    s, scene, names, X0, params = manipulator
    T = scene.tensions(params, X0)
    scale = scene.rest_tension_scale(params)
    assert scale == pytest.approx(1.5 * T.max())
    K = 101
    drift = np.linspace(0.0, 0.05, K)[:, None, None] * np.array([1.0, 0.0, 0.0])
    idx = [s.node_names.index(n) for n in names]
    ghost = (names, X0[idx][None] + drift)
    specs = scene.markers(X0, T, scale, ghost)
    by_ns = {}
    for m in specs:
        by_ns.setdefault(m.ns, []).append(m)
    assert len(by_ns["bars"]) == len(s.bars) == 18 and all(m.type == "cylinder" for m in by_ns["bars"])
    assert len(by_ns["strings"]) == len(s.strings) == 14 and all(m.type == "line_strip" for m in by_ns["strings"])
    assert len({m.key for m in specs}) == len(specs)                      # unique (ns, id)
    for m in by_ns["bars"]:                                               # diameter 2 r (at least 8 mm), bar length
        b = s.bars[m.id]
        i, j = (s.node_names.index(n) for n in b.nodes)
        assert m.scale[0] == pytest.approx(max(2 * b.radius, 0.008))
        assert m.scale[2] == pytest.approx(np.linalg.norm(X0[j] - X0[i]))
    sc7 = next(m for m in by_ns["strings"] if m.name == "sc7")             # a closed loop returns to its start
    assert len(sc7.points) == 7 and np.allclose(sc7.points[0], sc7.points[-1])
    # colours order like the tensions
    order = np.argsort([m.value for m in by_ns["strings"]])
    reds = [by_ns["strings"][i].color[0] for i in order]
    assert reds == sorted(reds) and [m.value for m in by_ns["strings"]] == pytest.approx(list(T))
    # the ghost: 3 bar frames at steps 33, 67, 100, fading, in the predicted positions; and the nodes' paths
    g = sorted(by_ns["ghost"], key=lambda m: m.id)
    assert [m.name for m in g] == ["step 33", "step 67", "step 100"]
    alphas = [m.color[3] for m in g]
    assert alphas == sorted(alphas, reverse=True) and alphas[-1] == pytest.approx(alphas[0] / 4)
    last = g[-1].points.reshape(-1, 2, 3)
    assert len(last) == 18
    np.testing.assert_allclose(last[0], X0[[s.node_names.index(n) for n in s.bars[0].nodes]] + [0.05, 0, 0])
    (paths,) = by_ns["ghost_paths"]
    assert len(paths.points) == 24 * 9 * 2                                   # 24 nodes, 10 samples each
    assert all(m.ns != "ghost" for m in scene.markers(X0, T, scale))       # no prediction, no ghost
    style = MarkerStyle(ghost_steps=0)
    assert not MarkerScene(s, style).ghost_markers(*ghost)


def test_an_occluded_node_leaves_its_elements_out(manipulator):
    s, scene, names, X0, params = manipulator
    idx = [s.node_names.index(n) for n in names]
    valid = np.array([n != "n4" for n in names])
    X = scene.full_positions(names, X0[idx], valid)
    T = scene.tensions(params, X)
    specs = scene.markers(X, T, 1000.0)
    bars = {m.name for m in specs if m.ns == "bars"}
    strings = {m.name for m in specs if m.ns == "strings"}
    assert "b1" not in bars and len(bars) == 17                          # b1 = (n1, n4)
    assert {"sc6", "sc7"}.isdisjoint(strings) and len(strings) == 12      # both pass through n4
    assert np.isnan(T[[5, 6]]).all() and np.isfinite(np.delete(T, [5, 6])).all()
    (nodes,) = [m for m in specs if m.ns == "nodes"]
    assert len(nodes.points) == 35


def test_render_writes_the_picture(tmp_path, manipulator):
    from tensegrity_ros.viz.render import render

    s, scene, names, X0, params = manipulator
    T = scene.tensions(params, X0)
    out = render(scene.markers(X0, T, 1000.0), 1000.0, tmp_path / "m.png", "test")
    assert out.is_file() and out.stat().st_size > 10_000
