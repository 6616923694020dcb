"""The array form of the streamed messages: :class:`NodeStatesRecord`, :class:`JointRecord` and
:class:`Prediction`, produced by both the message conversions (:mod:`.convert`) and the CDR codec (:mod:`.cdr`).

rclpy-free (and free of any ROS package): numpy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Tuple

import numpy as np


class NodeStatesRecord(NamedTuple):
    """A NodeStates message as arrays: stamp s, names (N,), positions / velocities (N, 3) (m, m/s; NaN
    where unknown), valid (N,) bool, frame_id."""

    stamp: float
    names: Tuple[str, ...]
    positions: np.ndarray
    velocities: np.ndarray
    valid: np.ndarray
    frame_id: str = ""

    @property
    def velocity_valid(self) -> np.ndarray:
        return self.valid & np.all(np.isfinite(self.velocities), axis=1)


class JointRecord(NamedTuple):
    """A JointState as arrays: stamp s, names (A,), position / velocity / effort (A,) (NaN if absent)."""

    stamp: float
    names: Tuple[str, ...]
    position: np.ndarray
    velocity: np.ndarray
    effort: np.ndarray


@dataclass(frozen=True)
class Prediction:
    """A predicted horizon: step k (0..K-1) is at ``stamp + k * dt``.

    positions / velocities: (K, N, 3) m, m/s in ``frame_id``; node_names (N,); parameter_set_id: the
    IdentifiedParameters set used.
    """

    stamp: float
    dt: float
    node_names: Tuple[str, ...]
    positions: np.ndarray
    velocities: np.ndarray
    parameter_set_id: str = ""
    frame_id: str = "structure"
    #: (K,) RMS error (m) of the predictor's recent predictions at each step, measured afterwards (empty: none)
    realized_error: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def horizon_steps(self) -> int:
        return int(self.positions.shape[0])

    @property
    def times(self) -> np.ndarray:
        return self.stamp + self.dt * np.arange(self.horizon_steps)

    @property
    def last_time(self) -> float:
        """The last step's time (nan for an empty horizon), without building :attr:`times`."""
        K = self.horizon_steps
        return self.stamp + self.dt * (K - 1) if K else math.nan
