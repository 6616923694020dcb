"""The plate pose map (control/outputs.py) against frames.py on known configurations of the manipulator.

* At the structure file's pose, value(x) is frames.manipulator_relative_poses(...)['0C2'] of the full nodes.
* Moving C2's nodes so that 0C2 becomes a chosen pose (built with rotation_zyx, not with pose_xyz_zyx), the
  map returns that pose's position and ZYX angles.
* The Jacobian against analytic motions: translating C2's three nodes by delta along C0's x axis moves plate.x by
  delta and nothing else; a tracked node's rows likewise; velocity columns are zero.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros import frames as F
from tensegrity_ros.control import PlateOutputMap
from tensegrity_ros.engine.topology import build_topology
from tensegrity_ros.model import load_structure

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup():
    s = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
    top = build_topology(s)
    free = list(top.free_nodes)
    x = np.concatenate([top.X0[free].reshape(-1), np.zeros(3 * len(free))])
    return s, top, x


def full_positions(top, x):
    nf = len(top.free_nodes)
    return top.T @ x[:3 * nf].reshape(nf, 3) + top.Xc


def test_value_matches_frames_at_the_file_pose(setup):
    s, top, x = setup
    m = PlateOutputMap.from_structure(s, track_nodes=("n7",))
    want = F.manipulator_relative_poses(full_positions(top, x), top.node_names)["0C2"]
    y = m.value(x)
    np.testing.assert_allclose(y[:6], want, atol=1e-12)
    c0 = F.frame_from_nodes(full_positions(top, x), top.node_names, F.FRAME_NODES["C0"])
    p7 = full_positions(top, x)[top.node_names.index("n7")]
    np.testing.assert_allclose(y[6:], F.invert_transform(c0)[:3, :3] @ p7 + F.invert_transform(c0)[:3, 3],
                               atol=1e-12)
    assert m.names[:6] == ("plate.x", "plate.y", "plate.z", "plate.yaw", "plate.pitch", "plate.roll")
    np.testing.assert_allclose(m.value(np.stack([x, x]))[1], y)        # batched


def test_value_returns_a_pose_built_with_rotation_zyx(setup):
    s, top, x = setup
    m = PlateOutputMap.from_structure(s)
    X = full_positions(top, x)
    names = top.node_names
    c0 = F.frame_from_nodes(X, names, F.FRAME_NODES["C0"])
    c2 = F.frame_from_nodes(X, names, F.FRAME_NODES["C2"])
    angles = np.array([-2.9, 0.12, -0.07])                  # yaw near -pi: the wrap is exercised
    want = np.eye(4)
    want[:3, :3] = F.rotation_zyx(angles)
    want[:3, 3] = [0.03, -0.02, 1.40]
    W = c0 @ want @ F.invert_transform(c2)                  # world motion that makes 0C2 = want
    x2 = x.copy()
    nf = len(top.free_nodes)
    Q = x2[:3 * nf].reshape(nf, 3)
    for node in F.FRAME_NODES["C2"]:
        j = list(top.free_nodes).index(names.index(node))
        Q[j] = W[:3, :3] @ Q[j] + W[:3, 3]
    np.testing.assert_allclose(m.value(x2), np.r_[want[:3, 3], angles], atol=1e-12)


def test_jacobian_against_analytic_motions(setup):
    s, top, x = setup
    m = PlateOutputMap.from_structure(s, track_nodes=("n10",))
    J = m.jacobian(x[None])[0]
    assert J.shape == (9, x.size)
    nf = len(top.free_nodes)
    assert np.all(J[:, 3 * nf:] == 0.0)
    c0 = F.frame_from_nodes(full_positions(top, x), top.node_names, F.FRAME_NODES["C0"])
    ex = c0[:3, 0]                                          # C0's x axis in the world
    dx = np.zeros_like(x)
    for node in F.FRAME_NODES["C2"]:
        j = list(top.free_nodes).index(top.node_names.index(node))
        dx[3 * j:3 * j + 3] = ex
    np.testing.assert_allclose(J @ dx, [1, 0, 0, 0, 0, 0, 0, 0, 0], atol=1e-7)
    dx = np.zeros_like(x)
    j = list(top.free_nodes).index(top.node_names.index("n10"))
    dx[3 * j:3 * j + 3] = c0[:3, 2]                         # n10 along C0's z: only n10.z (n10 is C1's, not C2's)
    np.testing.assert_allclose(J @ dx, [0, 0, 0, 0, 0, 0, 0, 0, 1], atol=1e-7)
    # and a general direction against a central difference of value() itself
    d = np.random.default_rng(0).standard_normal(x.size) * 1e-7
    np.testing.assert_allclose(J @ d, (m.value(x + d) - m.value(x - d)) / 2, atol=1e-12)


def test_unknown_nodes_are_rejected(setup):
    s, _, _ = setup
    with pytest.raises(ValueError, match="unknown nodes.*n99"):
        PlateOutputMap.from_structure(s, track_nodes=("n99",))


def test_the_control_package_imports_without_rclpy():
    """DESIGN.md: everything outside nodes/ is importable without rclpy (a fresh interpreter: this one has it)."""
    import subprocess
    import sys

    code = ("import sys, tensegrity_ros.control, tensegrity_ros.control.targets; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('rclpy', 'rosidl_runtime_py')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
