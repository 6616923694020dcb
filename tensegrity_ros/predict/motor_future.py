"""Motor futures (pure, no rclpy): the commanded motor trajectory over a prediction horizon, as a function of time.

Sources (:class:`MotorFuture`, the state predictor's ``motor_source``): ``plan`` = the last plan from the
controller (:class:`MotorPlan`; on ``/tensegrity/motor_plan``: trajectory_msgs/JointTrajectory when installed,
else sensor_msgs/JointState with ``position`` = K x A angles row-major, step ``plan_dt``, header.stamp = time of
the first step); ``reference`` = the reference generator of the driver (``reference_file``), phase-locked to the
measured motor angles (:class:`ReferenceTracker`: the driver's reference clock is not published, and locking to
the measured angles also absorbs the motors' lag); ``hold`` = the last measured angles; ``auto`` (default) = a
fresh plan, else the locked reference, else hold.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import numpy as np


class ReferenceTracker:
    """Phase-locks a reference generator to measured motor angles.

    The driver evaluates its reference at t - t_ref (t_ref = when the reference became active, on the
    driver's clock, not published). Given measured angles u_i at times t_i, this finds the offset c with
    u_i ~ r(t_i - c) (least squares, a global grid search first, then local tracking) and predicts the
    future angles as r(t - c). ``locked`` is False while the robot is at rest at the reference's rest
    angles (before the start or after the end: the future is then "hold") or when the angles do not follow
    the reference (residual above tolerance: another command source is active).

    reference: times (T,) s -> angles (T, A) rad in the motor order of :meth:`observe`; start_s / end_s:
    where the reference moves (end None = never stops); period_s: its period.
    """

    def __init__(self, reference: Callable[[np.ndarray], np.ndarray], start_s: float, end_s: Optional[float],
                 period_s: float, ramp_in_s: float = 0.0, history_s: float = 3.0, samples: int = 40,
                 tolerance_rad: float = 0.03, relative_tolerance: float = 0.15):
        self.reference = reference
        self.start_s, self.end_s, self.period_s, self.ramp_in_s = start_s, end_s, period_s, ramp_in_s
        self.history_s, self.samples = history_s, samples
        self.tolerance_rad, self.relative_tolerance = tolerance_rad, relative_tolerance
        self.rest = np.asarray(reference(np.array([start_s - 1.0])))[0]
        self._hist: deque = deque()
        self.offset: Optional[float] = None
        self.locked = False
        self.moving = False
        self.residual_rad = math.nan

    @classmethod
    def from_reference(cls, ref, actuators, motor_names: Sequence[str], **kw) -> "ReferenceTracker":
        """From a :class:`tensegrity_ros.references.SinusoidReference` and the actuators (angles in
        ``motor_names`` order; motors the reference does not drive stay at their rest angle)."""
        from .. import references as R

        acts = tuple(getattr(actuators, "actuators", actuators))
        names = list(ref.actuator_names) if ref.actuator_names else [a.name for a in acts]
        cols = [names.index(n) if n in names else -1 for n in motor_names]
        by_name = {a.name: a for a in acts}
        rest = np.array([by_name[n].zero_offset if n in by_name else 0.0 for n in motor_names])

        def reference(t):
            u = R.motor_angles(ref, acts, np.asarray(t, dtype=float).reshape(-1), check_limits=False)
            out = np.repeat(rest[None, :], u.shape[0], axis=0)
            for j, c in enumerate(cols):
                if c >= 0:
                    out[:, j] = u[:, c]
            return out

        return cls(reference, ref.start_s, ref.end_s, ref.period_s, ref.ramp_in_s, **kw)

    def observe(self, t: float, angles) -> None:
        self._hist.append((float(t), np.asarray(angles, dtype=float).copy()))
        while self._hist and t - self._hist[0][0] > self.history_s:
            self._hist.popleft()

    def _cost(self, cands: np.ndarray, t: np.ndarray, u: np.ndarray) -> np.ndarray:
        tau = (t[None, :] - cands[:, None]).reshape(-1)
        r = self.reference(tau).reshape(cands.size, t.size, -1)
        return np.sqrt(np.mean((r - u[None]) ** 2, axis=(1, 2)))

    def update(self) -> bool:
        """Re-estimate the offset from the history; returns ``locked``."""
        if len(self._hist) < 5:
            self.locked = False
            return False
        idx = np.linspace(0, len(self._hist) - 1, min(self.samples, len(self._hist))).round().astype(int)
        t = np.array([self._hist[i][0] for i in idx])
        u = np.stack([self._hist[i][1] for i in idx])
        ok = np.all(np.isfinite(u), axis=1)
        t, u = t[ok], u[ok]
        if t.size < 5:
            self.locked = False
            return False
        dev = np.abs(u - self.rest[None, :])
        self.moving = bool(dev.max() > 0.5 * self.tolerance_rad)
        if not self.moving:
            self.locked, self.residual_rad = False, float(np.sqrt(np.mean(dev ** 2)))
            return False
        t_last = t[-1]
        best_c, best = None, math.inf
        if self.offset is not None:   # local tracking keeps the branch (period) found at the ramp in
            cands = self.offset + np.arange(-0.2, 0.2 + 1e-9, 0.005)
            cost = self._cost(cands, t, u)
            k = int(np.argmin(cost))
            best_c, best = cands[k], cost[k]
        tol = max(self.tolerance_rad, self.relative_tolerance * float(np.sqrt(np.mean(dev ** 2))))
        if best > tol:                # global search over where the reference can be
            span_end = self.end_s if self.end_s is not None else self.start_s + self.ramp_in_s + self.period_s
            cands = np.arange(t_last - span_end, t_last - self.start_s + 1e-9, 0.02)
            cost = np.concatenate([self._cost(ch, t, u) for ch in np.array_split(cands, max(1, cands.size // 400))])
            k = int(np.argmin(cost))
            fine = cands[k] + np.arange(-0.03, 0.03 + 1e-9, 0.002)
            fc = self._cost(fine, t, u)
            j = int(np.argmin(fc))
            if fc[j] < best:
                best_c, best = fine[j], fc[j]
        self.residual_rad = float(best)
        self.locked = bool(best <= tol)
        self.offset = float(best_c) if self.locked else None
        return self.locked

    def angles(self, times) -> Optional[np.ndarray]:
        """(T, A) rad at ``times`` (s), or None when not locked."""
        if not self.locked or self.offset is None:
            return None
        return np.asarray(self.reference(np.asarray(times, dtype=float).reshape(-1) - self.offset))


@dataclass(frozen=True)
class MotorPlan:
    """A controller's motor plan: angles (K, A) rad at ``times`` (K,) s, for motors ``names``."""

    times: np.ndarray
    names: Tuple[str, ...]
    angles: np.ndarray
    received: float = 0.0
    #: the times relative to times[0], exactly ``dt`` apart when the plan was built on a grid (:meth:`on_grid`);
    #: None: times - times[0]
    offsets: Optional[np.ndarray] = None

    @classmethod
    def on_grid(cls, t0: float, dt: float, names: Sequence[str], angles, received: float = 0.0) -> "MotorPlan":
        """Angles (K, A) at t0, t0 + dt, ...: :meth:`at_grid` samples it without the rounding of absolute times."""
        a = np.asarray(angles, dtype=float)
        off = dt * np.arange(a.shape[0])
        return cls(t0 + off, tuple(names), a, received, off)

    @classmethod
    def from_flat(cls, t0: float, dt: float, names: Sequence[str], flat, received: float = 0.0) -> "MotorPlan":
        """A plan in the JointState layout: ``flat`` = K x A angles row-major (step-major) for the A ``names``,
        one ``dt`` apart from ``t0``. ValueError when the count is not a (non-zero) multiple of A."""
        A = len(names)
        pos = np.asarray(flat, dtype=float)
        if A == 0 or pos.size == 0 or pos.size % A:
            raise ValueError(f"{pos.size} positions for {A} names (need K x A)")
        return cls.on_grid(t0, dt, names, pos.reshape(pos.size // A, A), received)

    def at_grid(self, t_start: float, dt: float, count: int, motor_names: Sequence[str],
                fallback: np.ndarray) -> np.ndarray:
        """:meth:`at` at t_start + dt * arange(count), computed relative to the plan's first time. Why: clock
        seconds (~1.8e9) are rounded to 2.4e-7 s each, 2e-5 of a 10-ms step, so a plan on its rate limit
        sampled at rounded absolute times came out up to 2e-5 faster than the limit (counted as violations by
        ``tensegrity demo --controller``); the offset between the two grids is one exact subtraction."""
        rel = (float(t_start) - float(self.times[0])) + dt * np.arange(int(count))
        knots = self.offsets if self.offsets is not None else self.times - self.times[0]
        return self._sample(rel, knots, motor_names, fallback)

    def at(self, times, motor_names: Sequence[str], fallback: np.ndarray) -> np.ndarray:
        """(T, A) angles in ``motor_names`` order; linear interpolation, held before/after the plan;
        motors not in the plan take ``fallback`` (A,)."""
        return self._sample(np.asarray(times, dtype=float).reshape(-1), self.times, motor_names, fallback)

    def _sample(self, x: np.ndarray, knots: np.ndarray, motor_names: Sequence[str], fallback) -> np.ndarray:
        """(len(x), A): each named motor's angles interpolated at ``x`` on ``knots`` (the plan's times or offsets),
        the others ``fallback``."""
        out = np.repeat(np.asarray(fallback, dtype=float)[None, :], x.size, axis=0)
        for j, n in enumerate(motor_names):
            if n in self.names:
                out[:, j] = np.interp(x, knots, self.angles[:, self.names.index(n)])
        return out


class MotorFuture:
    """The commanded motor trajectory as a function of time: plan | reference | hold (see the module doc).

    ``source``: "auto" | "plan" | "reference" | "hold". Thread-safe.
    """

    def __init__(self, motor_names: Sequence[str], source: str = "auto",
                 tracker: Optional[ReferenceTracker] = None, plan_timeout_s: float = 1.0):
        if source not in ("auto", "plan", "reference", "hold"):
            raise ValueError(f"motor source {source!r} (valid: auto, plan, reference, hold)")
        if source == "reference" and tracker is None:
            raise ValueError("motor source 'reference' needs a reference (reference_file)")
        self.names = tuple(motor_names)
        self.source = source
        self.tracker = tracker
        self.plan: Optional[MotorPlan] = None
        self.plan_timeout_s = plan_timeout_s
        self.last: Optional[np.ndarray] = None
        self.last_t = -math.inf
        self.active = "hold"
        self._lock = threading.Lock()

    def observe(self, t: float, names: Sequence[str], angles) -> None:
        """Measured motor angles (any order/subset of names)."""
        a = np.asarray(angles, dtype=float)
        with self._lock:
            if self.last is None:
                self.last = np.full(len(self.names), np.nan)
            for n, v in zip(names, a):
                if n in self.names and math.isfinite(v):
                    self.last[self.names.index(n)] = v
            self.last_t = t
            if self.tracker is not None and not np.any(np.isnan(self.last)):
                self.tracker.observe(t, self.last)

    def set_plan(self, plan: MotorPlan) -> None:
        with self._lock:
            self.plan = plan

    @property
    def relinearize_key(self) -> str:
        """What makes the current nominal's motor inputs obsolete at once: the active source (plan, reference,
        hold), not each new plan. Every prediction takes the motor future of the latest plan and the nominal's
        B_k carry the difference to first order (HorizonPredictor.predict), so a controller's new plan every
        50 ms waits for the usual period / age / deviation rule; keyed on each plan, the predictor relinearised
        back to back under the plate controller and took 0.4 of a core on 2 (2026-11-26)."""
        return self.active

    def update(self) -> str:
        """Re-lock the reference; returns the active source name."""
        if self.tracker is not None:
            with self._lock:
                self.tracker.update()
        return self._active(time_now=self.last_t)

    def _active(self, time_now: float) -> str:
        plan_ok = self.plan is not None and (self.plan.times[-1] >= time_now or
                                             time_now - self.plan.received <= self.plan_timeout_s)
        if self.source == "plan" or (self.source == "auto" and plan_ok):
            src = "plan" if self.plan is not None else "hold"
        elif self.source in ("reference", "auto") and self.tracker is not None and self.tracker.locked:
            src = "reference"
        else:
            src = "hold"
        self.active = src
        return src

    def angles(self, times) -> Optional[np.ndarray]:
        """(T, A) rad, or None before any motor state (no inputs known)."""
        with self._lock:
            if self.last is None or np.any(np.isnan(self.last)):
                return None
            src = self._active(self.last_t)
            if src == "plan":
                return self.plan.at(times, self.names, self.last)
            if src == "reference":
                u = self.tracker.angles(times)
                if u is not None:
                    return u
            return np.repeat(self.last[None, :], np.size(times), axis=0)
