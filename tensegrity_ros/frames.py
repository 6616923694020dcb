"""Plate frames, rigid transforms and quaternions from node positions (pure numpy, vectorised over leading axes).

The seed paper (Sec. IV) describes the manipulator's motion by three frames built from node triples:
C0 on the ground triangle (n1, n2, n3), C1 on Stage 1's plate (n10, n11, n12) and C2 on Stage 2's plate
(n22, n23, n24). Each frame has its origin at the triangle's centroid, x toward the triangle's first node
and z along the plane normal given by the node order (counter-clockwise seen from above -> z up):
z = (c - r) x (a - r) normalised, y = z x x. Relative poses ``iCj = Ci^-1 Cj`` are reported as a position
and ZYX Euler angles (the seed's Figure 6).

Every frame points x at the FIRST node of its triple; the triples below follow the seed: C0's x axis points
at n2 (so its triple starts at n2, keeping the counter-clockwise order), C1's at n10 and C2's at n22.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import numpy as np

#: Node triples of the manipulator's frames (structure node names).
FRAME_NODES = {"C0": ("n2", "n3", "n1"), "C1": ("n10", "n11", "n12"), "C2": ("n22", "n23", "n24")}


def cross3(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """u x v for (..., 3) arrays. ``np.cross`` moves axes and checks shapes on every call (~20 us): this
    runs per mocap frame in the ingest node, for three plates at 120 Hz."""
    out = np.empty(np.broadcast_shapes(u.shape, v.shape))
    out[..., 0] = u[..., 1] * v[..., 2] - u[..., 2] * v[..., 1]
    out[..., 1] = u[..., 2] * v[..., 0] - u[..., 0] * v[..., 2]
    out[..., 2] = u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0]
    return out


def triangle_frame(a, b, c) -> np.ndarray:
    """(..., 4, 4) homogeneous frame of the triangle (a, b, c), each (..., 3).

    Origin at the centroid, x toward ``a``, z = normalised (c - r) x (a - r), y = z x x.
    """
    a, b, c = (np.asarray(v, dtype=float) for v in (a, b, c))
    r = (a + b + c) / 3.0
    x = a - r
    x = x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    z = cross3(c - r, a - r)
    z = z / np.sqrt(np.sum(z * z, axis=-1, keepdims=True))
    y = cross3(z, x)
    shape = r.shape[:-1]
    out = np.zeros(shape + (4, 4))
    out[..., :3, 0], out[..., :3, 1], out[..., :3, 2], out[..., :3, 3] = x, y, z, r
    out[..., 3, 3] = 1.0
    return out


def frame_from_nodes(positions, node_names: Sequence[str], triple: Sequence[str]) -> np.ndarray:
    """(..., 4, 4) frame of the nodes ``triple`` from positions (..., N, 3) ordered as ``node_names``."""
    p = np.asarray(positions, dtype=float)
    idx = [list(node_names).index(n) for n in triple]
    return triangle_frame(p[..., idx[0], :], p[..., idx[1], :], p[..., idx[2], :])


def manipulator_frames(positions, node_names: Sequence[str]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """C0, C1, C2, each (..., 4, 4), from (..., N, 3) node positions of the stacked manipulator."""
    return tuple(frame_from_nodes(positions, node_names, FRAME_NODES[k]) for k in ("C0", "C1", "C2"))


def invert_transform(t) -> np.ndarray:
    """Inverse of (..., 4, 4) rigid transforms."""
    t = np.asarray(t, dtype=float)
    out = np.zeros_like(t)
    rt = np.swapaxes(t[..., :3, :3], -1, -2)
    out[..., :3, :3] = rt
    out[..., :3, 3] = -np.einsum("...ij,...j->...i", rt, t[..., :3, 3])
    out[..., 3, 3] = 1.0
    return out


def relative_pose(ci, cj) -> np.ndarray:
    """iCj = Ci^-1 Cj, (..., 4, 4)."""
    return invert_transform(ci) @ np.asarray(cj, dtype=float)


def euler_zyx(rot) -> np.ndarray:
    """(..., 3) ZYX Euler angles (yaw about z, pitch about y, roll about x), rad, with R = Rz Ry Rx."""
    r = np.asarray(rot, dtype=float)[..., :3, :3]
    yaw = np.arctan2(r[..., 1, 0], r[..., 0, 0])
    pitch = np.arcsin(np.clip(-r[..., 2, 0], -1.0, 1.0))
    roll = np.arctan2(r[..., 2, 1], r[..., 2, 2])
    return np.stack([yaw, pitch, roll], axis=-1)


def rotation_zyx(angles) -> np.ndarray:
    """(..., 3, 3) rotation from ZYX Euler angles (yaw, pitch, roll): Rz(yaw) Ry(pitch) Rx(roll)."""
    a = np.asarray(angles, dtype=float)
    cz, sz = np.cos(a[..., 0]), np.sin(a[..., 0])
    cy, sy = np.cos(a[..., 1]), np.sin(a[..., 1])
    cx, sx = np.cos(a[..., 2]), np.sin(a[..., 2])
    r = np.empty(a.shape[:-1] + (3, 3))
    r[..., 0, 0] = cz * cy
    r[..., 0, 1] = cz * sy * sx - sz * cx
    r[..., 0, 2] = cz * sy * cx + sz * sx
    r[..., 1, 0] = sz * cy
    r[..., 1, 1] = sz * sy * sx + cz * cx
    r[..., 1, 2] = sz * sy * cx - cz * sx
    r[..., 2, 0] = -sy
    r[..., 2, 1] = cy * sx
    r[..., 2, 2] = cy * cx
    return r


def pose_xyz_zyx(t) -> np.ndarray:
    """(..., 6): position (x, y, z) and ZYX Euler angles (yaw, pitch, roll) of (..., 4, 4) transforms."""
    t = np.asarray(t, dtype=float)
    return np.concatenate([t[..., :3, 3], euler_zyx(t)], axis=-1)


def manipulator_relative_poses(positions, node_names: Sequence[str]) -> dict:
    """The seed's Figure 6 quantities: {'0C1', '0C2', '1C2'} -> (..., 6) [x, y, z, yaw, pitch, roll]."""
    c0, c1, c2 = manipulator_frames(positions, node_names)
    return {"0C1": pose_xyz_zyx(relative_pose(c0, c1)), "0C2": pose_xyz_zyx(relative_pose(c0, c2)),
            "1C2": pose_xyz_zyx(relative_pose(c1, c2))}


def fit_rigid_transform(src, dst, weights=None) -> Tuple[np.ndarray, np.ndarray]:
    """Kabsch: R (..., 3, 3), t (..., 3) minimising sum_k w_k |R src_k + t - dst_k|^2 (a proper rotation).

    ``src``/``dst``: (..., K, 3) with K >= 3 non-collinear points (K = 2 fits a rotation that is arbitrary
    about the points' axis). ``weights`` (..., K) optional, e.g. 0 for occluded markers.
    """
    src, dst = np.asarray(src, dtype=float), np.asarray(dst, dtype=float)
    w = np.ones(src.shape[:-1]) if weights is None else np.broadcast_to(np.asarray(weights, dtype=float),
                                                                         src.shape[:-1])
    wsum = w.sum(-1, keepdims=True)[..., None]
    cs = (w[..., None] * src).sum(-2, keepdims=True) / wsum
    cd = (w[..., None] * dst).sum(-2, keepdims=True) / wsum
    h = np.einsum("...k,...ki,...kj->...ij", w, src - cs, dst - cd)
    u, _, vt = np.linalg.svd(h)
    v = np.swapaxes(vt, -1, -2)
    det = np.linalg.det(v @ np.swapaxes(u, -1, -2))
    d = np.ones(det.shape + (3,))
    d[..., 2] = np.where(det < 0, -1.0, 1.0)
    r = v @ (d[..., :, None] * np.swapaxes(u, -1, -2))
    t = cd[..., 0, :] - np.einsum("...ij,...j->...i", r, cs[..., 0, :])
    return r, t


def quaternion_from_matrix(R: np.ndarray) -> Tuple[float, float, float, float]:
    """(x, y, z, w) of a rotation matrix (Shepperd's method; plain floats: called per plate per frame)."""
    R = _M(np.asarray(R, dtype=float)[:3, :3].tolist())
    tr = R[0, 0] + R[1, 1] + R[2, 2]
    if tr > 0:
        s = 2.0 * math.sqrt(tr + 1.0)
        w, x, y, z = 0.25 * s, (R[2, 1] - R[1, 2]) / s, (R[0, 2] - R[2, 0]) / s, (R[1, 0] - R[0, 1]) / s
    elif R[0, 0] > R[1, 1] and R[0, 0] > R[2, 2]:
        s = 2.0 * math.sqrt(1.0 + R[0, 0] - R[1, 1] - R[2, 2])
        w, x, y, z = (R[2, 1] - R[1, 2]) / s, 0.25 * s, (R[0, 1] + R[1, 0]) / s, (R[0, 2] + R[2, 0]) / s
    elif R[1, 1] > R[2, 2]:
        s = 2.0 * math.sqrt(1.0 + R[1, 1] - R[0, 0] - R[2, 2])
        w, x, y, z = (R[0, 2] - R[2, 0]) / s, (R[0, 1] + R[1, 0]) / s, 0.25 * s, (R[1, 2] + R[2, 1]) / s
    else:
        s = 2.0 * math.sqrt(1.0 + R[2, 2] - R[0, 0] - R[1, 1])
        w, x, y, z = (R[1, 0] - R[0, 1]) / s, (R[0, 2] + R[2, 0]) / s, (R[1, 2] + R[2, 1]) / s, 0.25 * s
    n = math.sqrt(x * x + y * y + z * z + w * w)
    return x / n, y / n, z / n, w / n


class _M:
    """Nested lists indexed as m[i, j] (keeps the formula above readable without numpy scalars)."""

    __slots__ = ("m",)

    def __init__(self, m):
        self.m = m

    def __getitem__(self, ij):
        return self.m[ij[0]][ij[1]]


def matrix_from_quaternion(x: float, y: float, z: float, w: float) -> np.ndarray:
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])
