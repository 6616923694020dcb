"""Plate frames, ZYX Euler angles, Kabsch fit, and synthetic mocap markers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros import frames as F
from tensegrity_ros.model import load_structure
from tensegrity_ros.twin import MocapFrame, markers, physical_node_indices

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


def _triangle(r=0.26, z=0.0):
    ang = np.deg2rad([0.0, 120.0, 240.0])
    return np.stack([r * np.cos(ang), r * np.sin(ang), np.full(3, z)], axis=1)


def test_nominal_triangle_frame_is_identity():
    np.testing.assert_allclose(F.triangle_frame(*_triangle()), np.eye(4), atol=1e-12)


def test_frame_follows_a_known_rotation_vectorised():
    rng = np.random.default_rng(0)
    angles = rng.uniform(-1.0, 1.0, (5, 3))
    rot = F.rotation_zyx(angles)
    t = rng.normal(0, 1, (5, 3))
    tri = np.einsum("kij,nj->kni", rot, _triangle()) + t[:, None, :]
    c = F.triangle_frame(tri[:, 0], tri[:, 1], tri[:, 2])
    np.testing.assert_allclose(c[:, :3, :3], rot, atol=1e-12)
    np.testing.assert_allclose(c[:, :3, 3], t, atol=1e-12)
    np.testing.assert_allclose(F.euler_zyx(c), angles, atol=1e-12)
    # relative pose is invariant to moving everything together
    c0 = F.triangle_frame(*_triangle())
    rel = F.relative_pose(c0, c)
    np.testing.assert_allclose(rel, c, atol=1e-12)
    np.testing.assert_allclose(F.relative_pose(c, c), np.broadcast_to(np.eye(4), c.shape), atol=1e-12)


def test_cross3_matches_numpy_cross_with_broadcasting():
    rng = np.random.default_rng(1)
    u, v = rng.normal(size=(4, 5, 3)), rng.normal(size=(5, 3))
    np.testing.assert_allclose(F.cross3(u, v), np.cross(u, v), rtol=0, atol=1e-14)


def test_euler_zyx_convention():
    yaw = 0.3
    r = F.rotation_zyx([yaw, 0.0, 0.0])
    np.testing.assert_allclose(r, [[np.cos(yaw), -np.sin(yaw), 0], [np.sin(yaw), np.cos(yaw), 0], [0, 0, 1]])
    np.testing.assert_allclose(F.euler_zyx(F.rotation_zyx([0.1, -0.2, 0.3])), [0.1, -0.2, 0.3])


def test_fit_rigid_transform_recovers_pose_with_noise_and_weights():
    rng = np.random.default_rng(1)
    src = rng.normal(0, 0.3, (7, 4, 3))
    rot = F.rotation_zyx(rng.uniform(-2, 2, (7, 3)))
    t = rng.normal(0, 1, (7, 3))
    dst = np.einsum("kij,knj->kni", rot, src) + t[:, None]
    r_fit, t_fit = F.fit_rigid_transform(src, dst)
    np.testing.assert_allclose(r_fit, rot, atol=1e-10)
    np.testing.assert_allclose(t_fit, t, atol=1e-10)
    assert np.allclose(np.linalg.det(r_fit), 1.0)
    bad = dst.copy()
    bad[:, 3] += 5.0  # an outlier that weight 0 removes
    r_w, t_w = F.fit_rigid_transform(src, bad, weights=np.array([1.0, 1.0, 1.0, 0.0]))
    np.testing.assert_allclose(r_w, rot, atol=1e-9)


def test_manipulator_nominal_frames():
    s = load_structure(MODELS / "stacked_manipulator.yaml")
    p = np.array([n.position for n in s.nodes])
    c0, c1, c2 = F.manipulator_frames(p, s.node_names)
    # the seed's C0: origin at the ground triangle's centre, x toward n2 (n1 sits on +x, n2 at +120 deg), z up
    expected = np.eye(4)
    expected[:3, :3] = F.rotation_zyx([2 * np.pi / 3, 0.0, 0.0])
    np.testing.assert_allclose(c0, expected, atol=1e-9)
    poses = F.manipulator_relative_poses(p[None].repeat(3, 0), s.node_names)
    assert poses["0C1"].shape == (3, 6)
    # symmetric design: plates level and centred above the base, twisted about z
    np.testing.assert_allclose(poses["0C1"][0, [0, 1, 4, 5]], 0.0, atol=1e-8)
    np.testing.assert_allclose(poses["1C2"][0, [0, 1, 4, 5]], 0.0, atol=1e-8)
    assert 0.5 < poses["0C1"][0, 2] < 1.5 and poses["0C2"][0, 2] > poses["0C1"][0, 2]


def test_markers_are_unlabeled_shuffled_in_mocap_frame():
    s = load_structure(MODELS / "stacked_manipulator.yaml")
    p = np.array([n.position for n in s.nodes])
    idx = physical_node_indices(s.node_names, [n for n in s.node_names if "_v" in n])
    assert len(idx) == 24
    frame = MocapFrame()
    m, labels = markers(p, frame, rng=np.random.default_rng(0), indices=idx, return_labels=True)
    assert m.shape == (24, 3) and sorted(labels) == list(idx) and list(labels) != list(idx)
    np.testing.assert_allclose(m, frame.to_mocap(p[labels]))
    np.testing.assert_allclose(frame.to_world(m), p[labels], atol=1e-12)
    # OptiTrack-like: Y up
    assert np.allclose(frame.to_mocap([0, 0, 1.0]) - frame.to_mocap([0, 0, 0]), [0, 1, 0])
    # noise and occlusion
    rng = np.random.default_rng(5)
    counts = [len(markers(p, frame, noise_std=0.001, occlusion_prob=0.2, rng=rng, indices=idx)) for _ in range(200)]
    assert 0.75 * 24 < np.mean(counts) < 0.85 * 24
    m2, lab2 = markers(p, frame, noise_std=0.002, rng=rng, indices=idx, return_labels=True)
    err = m2 - frame.to_mocap(p[lab2])
    assert 0.001 < err.std() < 0.003
    assert np.allclose(MocapFrame.from_matrix(frame.matrix).offset, frame.offset)
    assert markers(p, MocapFrame.identity(), occlusion_prob=1.0, rng=rng).shape == (0, 3)
