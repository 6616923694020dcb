"""How good the predictions turned out, from the measurements that arrive later: no ground truth needed.

A prediction made at t0 says where each node will be at t0 + k dt. When a node-state message with stamp t
arrives, every kept prediction whose horizon holds t is evaluated at t (linear between its steps: node states
come at 120 Hz, steps every 10 ms) and the error, the RMS over the nodes both have (valid measurements only)
of |predicted - measured|, is booked to the step nearest t. Per
horizon step, squared errors are averaged with exponential forgetting (time constant ``memory_s`` of message
time), so the figure follows the current model and parameter set. On the real robot the measurement noise
is part of it (a floor of about the mocap noise); on a controller's side it says how far to trust step k.

Pure numpy, no rclpy: the predictor node calls :meth:`RealizedError.add_prediction` for every
``every``-th prediction it publishes and :meth:`RealizedError.add_measurement` for every node-state message.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, Optional, Sequence, Tuple

import numpy as np


class RealizedError:
    """Per-horizon-step RMS error of past predictions against later measurements.

    horizon_steps: K, steps of a prediction (step k at t0 + k dt, k = 0..K-1); dt: its step, s;
    memory_s: forgetting time constant, s (message time); max_pending: predictions kept for scoring (the
    oldest are dropped first; 1 s of horizon at 10 scored predictions per second needs ~10)."""

    def __init__(self, horizon_steps: int, dt: float, memory_s: float = 10.0, max_pending: int = 16):
        self.K = int(horizon_steps)
        self.dt = float(dt)
        self.memory_s = float(memory_s)
        self._pending: Deque[Tuple[float, Tuple[str, ...], np.ndarray]] = deque(maxlen=int(max_pending))
        self._maps: Dict[Tuple[Tuple[str, ...], Tuple[str, ...]], Tuple[np.ndarray, np.ndarray]] = {}
        self._sq = np.zeros(self.K)        # forgotten sums of squared errors per step, m^2
        self._w = np.zeros(self.K)         # forgotten counts per step
        self._t_last: Optional[float] = None
        self.scored = 0                    # (prediction, step) pairs scored since the start
        self._total_sq = np.zeros(self.K)  # whole-run sums (no forgetting), for a run's summary
        self._total_n = np.zeros(self.K, dtype=np.int64)

    def add_prediction(self, t0: float, node_names: Sequence[str], positions: np.ndarray) -> None:
        """A published prediction: positions (K, N, 3) m for ``node_names`` at t0 + k dt."""
        P = np.asarray(positions, dtype=float)
        if P.ndim != 3 or P.shape[0] != self.K:
            raise ValueError(f"prediction positions {P.shape}: expected ({self.K}, N, 3)")
        self._pending.append((float(t0), tuple(node_names), P))

    def _map(self, pred_names: Tuple[str, ...], meas_names: Tuple[str, ...]) -> Tuple[np.ndarray, np.ndarray]:
        """(rows of the prediction, rows of the measurement) of the nodes both name; once per pair of lists."""
        m = self._maps.get((pred_names, meas_names))
        if m is None:
            index = {n: i for i, n in enumerate(pred_names)}
            pairs = [(index[n], j) for j, n in enumerate(meas_names) if n in index]
            src = np.array([a for a, _ in pairs], dtype=int)
            dst = np.array([b for _, b in pairs], dtype=int)
            m = self._maps[(pred_names, meas_names)] = (src, dst)
        return m

    def add_measurement(self, t: float, node_names: Sequence[str], positions: np.ndarray, valid: np.ndarray) -> int:
        """Score the kept predictions that cover stamp t; returns how many were scored."""
        t = float(t)
        if self._t_last is not None and t > self._t_last:
            decay = math.exp(-(t - self._t_last) / self.memory_s)
            self._sq *= decay
            self._w *= decay
        self._t_last = t if self._t_last is None else max(t, self._t_last)
        while self._pending and self._pending[0][0] + (self.K - 0.5) * self.dt < t:
            self._pending.popleft()        # its horizon has passed
        n = 0
        pos = np.asarray(positions, dtype=float)
        ok = np.asarray(valid, dtype=bool)
        meas_names = tuple(node_names)
        for t0, pred_names, P in self._pending:
            x = (t - t0) / self.dt
            if x < -0.5 or x > self.K - 0.5:
                continue                   # nearest to no step of this prediction (half a step either side)
            # linear between its steps; within half a step past either end, linear from the end segment
            k0 = min(max(int(math.floor(x)), 0), self.K - 2) if self.K > 1 else 0
            w = x - k0 if self.K > 1 else 0.0
            k = int(round(x))              # the step the error is booked to
            src, dst = self._map(pred_names, meas_names)
            use = ok[dst]
            if not use.any():
                continue
            rows = src[use]                # the prediction at t itself: linear between its steps
            pred_t = P[k0, rows] if w == 0.0 else (1.0 - w) * P[k0, rows] + w * P[k0 + 1, rows]
            err = pred_t - pos[dst[use]]
            if not np.all(np.isfinite(err)):
                continue
            e2 = float(np.mean(np.sum(err * err, axis=-1)))
            self._sq[k] += e2
            self._w[k] += 1.0
            self._total_sq[k] += e2
            self._total_n[k] += 1
            n += 1
        self.scored += n
        return n

    def per_step(self) -> np.ndarray:
        """(K,) RMS error per horizon step over the recent past (``memory_s``), m; NaN where nothing was scored
        within about the memory (less than half a sample's weight left: an old figure is not passed off as
        a recent one)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._w >= 0.5, np.sqrt(self._sq / np.maximum(self._w, 1e-300)), np.nan)

    def whole_run(self) -> np.ndarray:
        """(K,) RMS error per horizon step over every scored pair since the start, m; NaN where none."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self._total_n > 0, np.sqrt(self._total_sq / np.maximum(self._total_n, 1)), np.nan)

    def at(self, seconds: float, whole_run: bool = False) -> float:
        """RMS error (m) of the step nearest ``seconds`` ahead (NaN when not scored yet)."""
        k = min(max(int(round(seconds / self.dt)), 0), self.K - 1)
        return float((self.whole_run() if whole_run else self.per_step())[k])
