"""The prediction stream (pure, no rclpy): the state predictor's decisions without ROS.

:class:`PredictionStream` decides when a new nominal is computed and how long it must be, and gives each
node-state message its prediction: along the current nominal, or, when the next one is late, along the current
nominal's frozen-Jacobian extension (flagged, for up to ``extend_s``; then nothing).
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional, Sequence, Tuple

import numpy as np

from .horizon import HorizonPredictor, Linearization


class PredictionStream:
    """The node's decisions without ROS: when to compute a new nominal and how long it must be, and the
    prediction for each node-state message (the node = this + message conversion + the worker). Stamps are
    message times (s); ``now`` (s, monotonic) only paces relinearisations.

    Schedule: a new nominal is started from the latest message when the current one will not cover the
    messages that arrive while the next is computed (``lookahead_s``: 1.5 x the 90th percentile of recent
    relinearisation wall times + 0.1 s), when the parameters or the motor plan change (``version``), and at
    most every ``period_s`` when it is ``max_age_s`` old or a message was ``deviation_m`` off it. Its length
    (automatic ``margin_s`` = 0) is the horizon + min(period, max age) + the lookahead + 0.2 s: enough to
    bridge to the next one, and no more, since the cost of a relinearisation is proportional to it (the
    former margin of max age + 1.5 x the relinearisation time fed back on itself on a loaded CPU: 6-s
    nominals that took 6 s to compute and so never covered the present).

    Messages the nominal does not cover get the prediction along its frozen-Jacobian extension
    (:meth:`Linearization.expand`, up to ``extend_s``) and count in ``extended``; only those beyond that
    (or before the nominal) are skipped (``skipped_uncovered``).
    """

    def __init__(self, core: HorizonPredictor, horizon_steps: int, period_s: float = 1.0, max_age_s: float = 3.0,
                 deviation_m: float = 0.005, margin_s: float = 0.0, extend_s: float = 0.25):
        self.core = core
        self.steps = int(horizon_steps)
        self.period_s, self.max_age_s, self.deviation_m, self.margin = period_s, max_age_s, deviation_m, margin_s
        self.extend_steps = max(0, int(round(extend_s / core.dt)))
        self.lin: Optional[Linearization] = None
        self.lin_times: deque = deque(maxlen=20)   # wall s of the recent relinearisations
        self.predictions = 0
        self.extended = 0
        self.skipped_uncovered = 0
        self.last_extended = False
        self._next_due = -math.inf
        self._version = None

    # ---- schedule --------------------------------------------------------------------------------------
    def lin_time_s(self) -> float:
        """90th percentile of the recent relinearisation wall times (0.6 s before the first)."""
        return float(np.percentile(self.lin_times, 90)) if self.lin_times else 0.6

    def lookahead_s(self) -> float:
        return 1.5 * self.lin_time_s() + 0.1

    def margin_s(self) -> float:
        if self.margin > 0:
            return self.margin
        return min(min(self.period_s, self.max_age_s) + self.lookahead_s() + 0.2, self.max_age_s + 2.0)

    def nominal_steps(self) -> int:
        """Prediction steps of the next nominal: the horizon + the margin."""
        return self.steps + max(2, int(math.ceil(self.margin_s() / self.core.dt)))

    def wants_relinearization(self, stamp: float, now: float, version=None) -> bool:
        lin = self.lin
        if lin is None or version != self._version:
            return True
        if not self.core.covers(lin, stamp + self.lookahead_s(), self.steps):
            return True
        return now >= self._next_due and (stamp - lin.t0 >= self.max_age_s or
                                          self.core.last_deviation > self.deviation_m)

    def started(self, now: float, version=None) -> None:
        """A relinearisation was started at ``now`` for inputs ``version``."""
        self._version = version
        self._next_due = now + self.period_s

    def nominal_start(self, t0: float, names: Sequence[str], positions: np.ndarray, velocities: np.ndarray,
                      valid: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Full-node positions and velocities (N, 3) to start the next nominal from, at ``t0``, from a node-state
        record (names (N',), positions / velocities (N', 3), valid (N',)): nodes it does not see are taken from
        the current nominal where that covers ``t0``, else the model's rest positions and zero velocities; the
        dependent nodes follow from the free ones."""
        core = self.core
        x = core.measured_state(names, positions, velocities, valid)
        lin = self.lin
        if lin is not None and core.covers(lin, t0, 0, extended=True):   # unseen nodes: from the current nominal
            i = min(int(round((t0 - lin.t0) / lin.dt)), lin.xe.shape[0] - 1)
            x = np.where(np.isfinite(x), x, lin.xe[i])
        q, v = core.split(x)
        q = np.where(np.isfinite(q), q, core.X0[core.free])
        v = np.where(np.isfinite(v), v, 0.0)
        return core.full_positions(q), core.full_velocities(v)   # dependent nodes from the free ones

    def install(self, lin: Linearization, wall_s: Optional[float] = None) -> Linearization:
        """Make ``lin`` current (interpolating and extending it first: call from the background thread)."""
        lin.expand(self.extend_steps)
        self.lin = lin
        self.lin_times.append(lin.compute_s if wall_s is None else wall_s)
        return lin

    # ---- per message ------------------------------------------------------------------------------------
    def predict(self, stamp: float, x: np.ndarray, u_future: Optional[np.ndarray]):
        """(q, v, i0, lin, extended) for the message at ``stamp`` with measured state x (n,), or None
        (no nominal yet, or not covered even by the extension)."""
        lin = self.lin
        if lin is None:
            return None
        core, K = self.core, self.steps
        ext = not core.covers(lin, stamp, K)
        if ext and not core.covers(lin, stamp, K, extended=True):
            self.skipped_uncovered += 1
            return None
        q, v, i0 = core.predict(lin, stamp, x, K, u_future, extended=ext)
        self.predictions += 1
        self.extended += ext
        self.last_extended = ext
        return q, v, i0, lin, ext
