"""What the controller tracks, as pure functions of the predictor's state vector.

The state x (n,) is the predictor's (``nodes/state_predictor.py`` ``Linearization``): the free nodes' positions
(nf, 3) flattened node-major, then their velocities, m and m/s. Every node position follows from the free ones
linearly, ``X = T Q + X_c`` (``engine/topology.py``), so an output that is a function of node positions is a
function of x.

:class:`PlateOutputMap`: the top plate's pose, C2 relative to C0 as position (m) and ZYX angles (yaw, pitch,
roll, rad) -- the seed's Figure 6 quantities, computed with ``frames.py`` exactly as the reports compute them --
followed by the positions of chosen nodes expressed in C0 (m). :class:`LinearOutputMap`: y = C x (for tests, and
for a controller of the full state).

An output map has ``names`` (ny,), ``angular`` (ny,) bool (outputs that wrap at +-pi), ``value(x)`` (..., n) ->
(..., ny) and ``jacobian(x)`` (K, n) -> (K, ny, n).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from .. import frames as F

POSE_NAMES = ("x", "y", "z", "yaw", "pitch", "roll")


def wrap_angle(a):
    """Angles (rad) wrapped into [-pi, pi)."""
    return (np.asarray(a, dtype=float) + np.pi) % (2.0 * np.pi) - np.pi


class LinearOutputMap:
    """y = C x with C (ny, n); no output is an angle unless ``angular`` says so."""

    def __init__(self, C, names: Sequence[str] = (), angular: Sequence[bool] = ()):
        self.C = np.atleast_2d(np.asarray(C, dtype=float))
        ny = self.C.shape[0]
        self.names = tuple(names) or tuple(f"y{i}" for i in range(ny))
        self.angular = np.asarray(angular if len(angular) else np.zeros(ny, bool), dtype=bool)
        if len(self.names) != ny or self.angular.shape != (ny,):
            raise ValueError(f"names/angular must have {ny} entries (rows of C)")

    def value(self, x) -> np.ndarray:
        return np.asarray(x, dtype=float) @ self.C.T

    def jacobian(self, x) -> np.ndarray:
        x = np.atleast_2d(np.asarray(x, dtype=float))
        return np.broadcast_to(self.C, (x.shape[0],) + self.C.shape).copy()


class PlateOutputMap:
    """Plate pose 0C2 (6,) [x, y, z (m), yaw, pitch, roll (rad)], then chosen node positions in C0 (3 each, m).

    node_names: (N,) all structure nodes; free_nodes: (nf,) indices of the free nodes (the state's order);
    T: (N, nf), Xc: (N, 3) the topology's ``X = T Q + X_c``; track_nodes: names of extra nodes to track;
    frame_nodes: the C0 and C2 node triples (default ``frames.FRAME_NODES``).
    """

    def __init__(self, node_names: Sequence[str], T, Xc, track_nodes: Sequence[str] = (),
                 frame_nodes: Tuple[Sequence[str], Sequence[str]] = (F.FRAME_NODES["C0"], F.FRAME_NODES["C2"]),
                 fd_step_m: float = 1e-6):
        self.node_names = tuple(node_names)
        self.T = np.asarray(T, dtype=float)
        self.Xc = np.asarray(Xc, dtype=float)
        if self.T.shape[0] != len(self.node_names) or self.Xc.shape != (len(self.node_names), 3):
            raise ValueError(f"T {self.T.shape} / Xc {self.Xc.shape} do not match {len(self.node_names)} nodes")
        missing = [n for n in (*frame_nodes[0], *frame_nodes[1], *track_nodes) if n not in self.node_names]
        if missing:
            raise ValueError(f"unknown nodes {missing} (the structure has {', '.join(self.node_names)})")
        self.nf = self.T.shape[1]
        self.n = 6 * self.nf
        self.track_nodes = tuple(track_nodes)
        # the nodes any output depends on: C0's triple, C2's triple, the tracked nodes (in this order)
        used = [*frame_nodes[0], *frame_nodes[1], *self.track_nodes]
        self._used = np.array([self.node_names.index(n) for n in used], dtype=int)
        self._Tu = self.T[self._used]                   # (U, nf)
        self._Xcu = self.Xc[self._used]                 # (U, 3)
        self.names = tuple(f"plate.{k}" for k in POSE_NAMES) + \
            tuple(f"{n}.{a}" for n in self.track_nodes for a in "xyz")
        self.angular = np.array([False] * 3 + [True] * 3 + [False] * (3 * len(self.track_nodes)))
        self.fd_step_m = float(fd_step_m)
        # nodes of the outputs that move with the state (fixed nodes have a zero row of T: nothing to perturb)
        self._moving = np.flatnonzero(np.abs(self._Tu).sum(1) > 0)

    @classmethod
    def from_structure(cls, structure, track_nodes: Sequence[str] = ()) -> "PlateOutputMap":
        """For a structure with the manipulator's frame nodes (n1-n3 and n22-n24)."""
        from ..engine.topology import build_topology

        top = build_topology(structure)
        return cls(top.node_names, top.T, top.Xc, track_nodes)

    def _used_positions(self, x) -> np.ndarray:
        """(..., U, 3) positions of the used nodes from states (..., n)."""
        x = np.asarray(x, dtype=float)
        Q = x[..., :3 * self.nf].reshape(*x.shape[:-1], self.nf, 3)
        return np.matmul(self._Tu, Q) + self._Xcu

    def _from_used(self, P) -> np.ndarray:
        """(..., ny) outputs from used-node positions (..., U, 3)."""
        c0 = F.triangle_frame(P[..., 0, :], P[..., 1, :], P[..., 2, :])
        c2 = F.triangle_frame(P[..., 3, :], P[..., 4, :], P[..., 5, :])
        c0inv = F.invert_transform(c0)
        pose = F.pose_xyz_zyx(c0inv @ c2)
        if not self.track_nodes:
            return pose
        p = P[..., 6:, :]
        local = np.einsum("...ij,...kj->...ki", c0inv[..., :3, :3], p) + c0inv[..., None, :3, 3]
        return np.concatenate([pose, local.reshape(*local.shape[:-2], -1)], axis=-1)

    def value(self, x) -> np.ndarray:
        """(..., ny) outputs of states x (..., n)."""
        return self._from_used(self._used_positions(x))

    def jacobian(self, x) -> np.ndarray:
        """(K, ny, n) dy/dx at states x (K, n): central differences in the used nodes' positions (step
        ``fd_step_m``: truncation ~h^2, round-off ~1e-16/h, both < 1e-9 here), chained through T. The outputs
        are exact geometry (no model error), so a numerical derivative of them is all the controller needs;
        the velocity columns are zero."""
        x = np.atleast_2d(np.asarray(x, dtype=float))
        P = self._used_positions(x)                                   # (K, U, 3)
        K, ny, h = x.shape[0], len(self.names), self.fd_step_m
        G = np.zeros((K, ny, P.shape[1], 3))                          # dy / dX_used
        pert = [(u, a) for u in self._moving for a in range(3)]
        if pert:                        # all +-h perturbations in one batched evaluation (call overhead dominates)
            Pb = np.repeat(P[:, None], 2 * len(pert), axis=1)         # (K, 2m, U, 3)
            for i, (u, a) in enumerate(pert):
                Pb[:, 2 * i, u, a] += h
                Pb[:, 2 * i + 1, u, a] -= h
            Yb = self._from_used(Pb)                                  # (K, 2m, ny)
            d = Yb[:, 0::2] - Yb[:, 1::2]                             # (K, m, ny)
            d[..., self.angular] = wrap_angle(d[..., self.angular])   # yaw/roll can straddle +-pi
            for i, (u, a) in enumerate(pert):
                G[:, :, u, a] = d[:, i] / (2.0 * h)
        Jq = np.einsum("kyua,uj->kyja", G, self._Tu).reshape(K, ny, 3 * self.nf)
        return np.concatenate([Jq, np.zeros_like(Jq)], axis=-1)
