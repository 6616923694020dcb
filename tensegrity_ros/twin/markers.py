"""Synthetic motion-capture markers from twin node positions (pure numpy).

A real mocap system (the seed used eight OptiTrack Prime 41 at 120 Hz) reports UNLABELED marker positions in
its own frame: Y up, origin wherever the ground plane was calibrated, markers occasionally missing. The
functions here produce exactly that from node positions, so the mocap pipeline can be tested on the twin.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

#: World (Z up) -> OptiTrack (Y up): x_m = x_w, y_m = z_w, z_m = -y_w.
Z_UP_TO_Y_UP = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])


@dataclass(frozen=True)
class MocapFrame:
    """p_mocap = rotation @ p_world + offset (rotation proper, 3x3; offset in metres, mocap axes).

    The default is OptiTrack-like: Y up, and the structure's origin 0.4 m / -0.3 m from the mocap origin
    along the floor axes (x, z) and 0.005 m above it (marker radius), so no test can assume the identity.
    """

    rotation: np.ndarray = field(default_factory=lambda: Z_UP_TO_Y_UP.copy())
    offset: np.ndarray = field(default_factory=lambda: np.array([0.4, 0.005, -0.3]))

    def to_mocap(self, p_world) -> np.ndarray:
        """(..., 3) world -> mocap."""
        return np.asarray(p_world, dtype=float) @ np.asarray(self.rotation).T + np.asarray(self.offset)

    def to_world(self, p_mocap) -> np.ndarray:
        """(..., 3) mocap -> world."""
        return (np.asarray(p_mocap, dtype=float) - np.asarray(self.offset)) @ np.asarray(self.rotation)

    @property
    def matrix(self) -> np.ndarray:
        """4x4 homogeneous world -> mocap transform."""
        t = np.eye(4)
        t[:3, :3], t[:3, 3] = self.rotation, self.offset
        return t

    @staticmethod
    def identity() -> "MocapFrame":
        return MocapFrame(np.eye(3), np.zeros(3))

    @staticmethod
    def from_matrix(t) -> "MocapFrame":
        t = np.asarray(t, dtype=float)
        return MocapFrame(t[:3, :3].copy(), t[:3, 3].copy())


def physical_node_indices(node_names: Sequence[str], virtual: Sequence[str] = ()) -> np.ndarray:
    """Indices of nodes that carry a real marker: all but the given virtual ones (e.g. ``n10_v1``)."""
    skip = set(virtual)
    return np.array([i for i, n in enumerate(node_names) if n not in skip], dtype=int)


def markers(node_positions, frame_transform: Optional[MocapFrame] = None, noise_std: float = 0.0,
            occlusion_prob: float = 0.0, rng: Optional[np.random.Generator] = None,
            indices: Optional[Sequence[int]] = None, return_labels: bool = False):
    """Unlabeled, shuffled marker positions (M, 3) in the mocap frame; occluded markers are absent.

    ``node_positions``: (N, 3) world positions (one marker per node; pass ``indices`` to keep only the
    physical nodes). Each marker gets isotropic Gaussian noise ``noise_std`` (m) and is dropped with
    probability ``occlusion_prob``. ``return_labels=True`` also returns the node index of each row (for tests).
    """
    rng = rng if rng is not None else np.random.default_rng()
    frame = frame_transform if frame_transform is not None else MocapFrame()
    p = np.asarray(node_positions, dtype=float).reshape(-1, 3)
    idx = np.arange(len(p)) if indices is None else np.asarray(indices, dtype=int)
    p = frame.to_mocap(p[idx])
    if noise_std > 0:
        p = p + rng.normal(0.0, noise_std, p.shape)
    keep = rng.random(len(p)) >= occlusion_prob if occlusion_prob > 0 else np.ones(len(p), bool)
    order = rng.permutation(int(keep.sum()))
    out, labels = p[keep][order], idx[keep][order]
    return (out, labels) if return_labels else out
