"""Safety clamps for motor goal angles: pure functions plus a small state machine.

Every function here is pure (numpy in, numpy out, no I/O, no clock) so it can be tested on its
own. :class:`SafetyFilter` combines them in a fixed order each control cycle:

1. hardware-error policy (latched torque-off-all, or hold),
2. command source: no command / stale command (watchdog) -> hold the last safe goal,
3. non-finite entries (NaN/inf) -> the last safe goal for that motor,
4. clamp to the actuator limits,
5. smooth switch between command sources (blend over ``ramp_s``),
6. rate limit relative to the last goal sent,
7. clamp again (belt and braces) and remember the result as the last safe goal.

All angles are motor angles in rad, in actuator order.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

#: Hardware Error Status bits that make the motor itself shut down (torque off): motor hall
#: sensor (PRO), overheating, motor encoder, electrical shock, overload.
SHUTDOWN_BITS = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5)
#: Bits after which the motor keeps working but should not be driven further: input voltage.
HOLD_BITS = 1 << 0


class Action(str, enum.Enum):
    CONTINUE = "continue"
    HOLD = "hold"              # keep torque, freeze goals at the last safe goal
    TORQUE_OFF_ALL = "torque_off_all"  # latched until reset()


class State(str, enum.Enum):
    INIT = "init"
    RUNNING = "running"
    HOLD = "hold"
    STOPPED = "stopped"


# ---- pure functions ------------------------------------------------------------------------------
def _vec(x, n: Optional[int] = None, name: str = "value") -> np.ndarray:
    a = np.array(x, dtype=float, copy=True).reshape(-1) if np.ndim(x) else np.full(n or 1, float(x))
    if n is not None and a.shape != (n,):
        if a.size == 1:
            return np.full(n, a[0])
        raise ValueError(f"{name} has {a.size} entries, expected {n}")
    return a


def clamp_goals(goals_rad, lower, upper, last_safe) -> np.ndarray:
    """Clamp ``goals_rad`` into [lower, upper]; NaN/inf entries take the ``last_safe`` goal.

    ``last_safe`` is itself clamped; if it is non-finite too, the middle of the range is used.
    """
    last = _vec(last_safe, name="last_safe")
    n = last.size
    g = _vec(goals_rad, n, "goals")
    lo, hi = _vec(lower, n, "lower"), _vec(upper, n, "upper")
    if np.any(lo > hi):
        raise ValueError("lower limit above upper limit")
    mid = 0.5 * (lo + hi)
    last = np.clip(np.where(np.isfinite(last), last, mid), lo, hi)
    g = np.where(np.isfinite(g), g, last)
    return np.clip(g, lo, hi)


def rate_limit(prev_goal, new_goal, max_rate_rad_s, dt: float) -> np.ndarray:
    """Move from ``prev_goal`` towards ``new_goal`` by at most ``max_rate_rad_s * dt`` per entry.

    A non-positive or non-finite ``dt`` returns ``prev_goal`` (no motion). Non-finite entries of
    ``new_goal`` are treated as ``prev_goal``.
    """
    prev = _vec(prev_goal, name="prev_goal")
    n = prev.size
    new = _vec(new_goal, n, "new_goal")
    rate = np.abs(_vec(max_rate_rad_s, n, "max_rate_rad_s"))
    if not (isinstance(dt, (int, float, np.floating)) and math.isfinite(dt)) or dt <= 0:
        return prev.copy()
    new = np.where(np.isfinite(new), new, prev)
    step = np.where(np.isfinite(rate), rate * dt, np.inf)
    return np.clip(new, prev - step, prev + step)


def watchdog(last_cmd_stamp: Optional[float], now: float, timeout: float) -> bool:
    """True when the last command is stale (so the goal must be held).

    Stale = no command yet, a non-finite stamp, older than ``timeout``, or more than ``timeout``
    in the future (a clock jump / wrong clock).
    """
    if last_cmd_stamp is None:
        return True
    try:
        age = float(now) - float(last_cmd_stamp)
    except (TypeError, ValueError):
        return True
    if not math.isfinite(age):
        return True
    return age > timeout or age < -timeout


def hardware_error_policy(errors_by_id: Mapping[int, int]) -> Action:
    """What to do about the motors' Hardware Error Status values.

    Any shutdown-class bit (hall sensor, overheating, encoder, electrical shock, overload) on any
    motor -> torque off on *all* motors (a tensegrity with one limp actuator is not in a known
    state). Only an input-voltage error -> hold. Nothing -> continue.
    """
    bits = 0
    for v in errors_by_id.values():
        bits |= int(v or 0)
    if bits & SHUTDOWN_BITS or bits & ~(SHUTDOWN_BITS | HOLD_BITS) & 0xFF:
        return Action.TORQUE_OFF_ALL
    if bits & HOLD_BITS:
        return Action.HOLD
    return Action.CONTINUE


def blend_weight(elapsed_s: float, ramp_s: float) -> float:
    """Weight of the new source ``elapsed_s`` after a switch: smoothstep from 0 to 1 over ``ramp_s``."""
    if ramp_s <= 0 or not math.isfinite(elapsed_s):
        return 1.0
    x = min(max(elapsed_s / ramp_s, 0.0), 1.0)
    return x * x * (3.0 - 2.0 * x)


def blend(old, new, weight: float) -> np.ndarray:
    """(1 - w) * old + w * new, with non-finite ``new`` entries replaced by ``old``."""
    old = _vec(old, name="old")
    new = _vec(new, old.size, "new")
    new = np.where(np.isfinite(new), new, old)
    return (1.0 - weight) * old + weight * new


# ---- state machine -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SafetyConfig:
    """Frozen limits, usually from the structure file's actuator limits.

    ``lower``/``upper``: motor angle limits (rad); ``max_rate_rad_s``: goal speed limit;
    ``watchdog_s``: topic commands older than this are ignored (hold); ``ramp_s``: blend time when
    the command source changes; ``max_step_dt``: the rate limiter never integrates more than this
    much time at once (after a stall the goal does not jump).
    """

    names: Tuple[str, ...]
    lower: Tuple[float, ...]
    upper: Tuple[float, ...]
    max_rate_rad_s: float = 1.0
    watchdog_s: float = 0.25
    ramp_s: float = 1.0
    max_step_dt: float = 0.05

    def __post_init__(self):
        n = len(self.names)
        if len(self.lower) != n or len(self.upper) != n:
            raise ValueError("names, lower and upper must have the same length")
        for nm, lo, hi in zip(self.names, self.lower, self.upper):
            if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
                raise ValueError(f"bad limits for {nm}: ({lo}, {hi})")
        if not self.max_rate_rad_s > 0:
            raise ValueError("max_rate_rad_s must be > 0")
        if not self.watchdog_s > 0:
            raise ValueError("watchdog_s must be > 0")
        if self.ramp_s < 0 or self.max_step_dt <= 0:
            raise ValueError("ramp_s must be >= 0 and max_step_dt > 0")

    @classmethod
    def from_actuators(cls, actuators: Sequence, max_rate_rad_s: float = 1.0, watchdog_s: float = 0.25,
                       ramp_s: float = 1.0, bounds: Optional[Sequence[Tuple[float, float]]] = None,
                       max_step_dt: float = 0.05) -> "SafetyConfig":
        """From objects with ``.name`` and ``.limits=(lo, hi)``; ``bounds`` (one (lo, hi) per
        actuator, e.g. the control table's position-mode range) are intersected with the limits."""
        lower, upper = [], []
        for k, a in enumerate(actuators):
            lo, hi = (float(v) for v in a.limits)
            if bounds is not None:
                lo, hi = max(lo, bounds[k][0]), min(hi, bounds[k][1])
            lower.append(lo)
            upper.append(hi)
        return cls(tuple(a.name for a in actuators), tuple(lower), tuple(upper), float(max_rate_rad_s),
                   float(watchdog_s), float(ramp_s), float(max_step_dt))


@dataclass(frozen=True)
class SafetyOutput:
    goals: Optional[np.ndarray]   # None when torque must go off
    action: Action
    stale: bool = False
    nonfinite: int = 0
    clamped: int = 0
    rate_limited: int = 0


@dataclass
class SafetyCounters:
    steps: int = 0
    holds: int = 0
    stale: int = 0
    nonfinite: int = 0
    clamped: int = 0
    rate_limited: int = 0
    stops: int = 0


@dataclass
class SafetyFilter:
    """Combines the clamps; call :meth:`reset` with the present positions before the first step."""

    config: SafetyConfig
    state: State = State.INIT
    last_goal: Optional[np.ndarray] = None
    last_time: Optional[float] = None
    counters: SafetyCounters = field(default_factory=SafetyCounters)
    stop_reason: str = ""
    _blend_from: Optional[np.ndarray] = None
    _blend_t0: float = 0.0

    @property
    def lower(self) -> np.ndarray:
        return np.asarray(self.config.lower, dtype=float)

    @property
    def upper(self) -> np.ndarray:
        return np.asarray(self.config.upper, dtype=float)

    def reset(self, present_rad, now: float) -> None:
        """(Re)start from the present motor angles (clamped into the limits)."""
        n = len(self.config.names)
        present = _vec(present_rad, n, "present")
        self.last_goal = clamp_goals(present, self.lower, self.upper, present)
        self.last_time = float(now)
        self.state = State.RUNNING
        self.stop_reason = ""
        self._blend_from = None

    def begin_switch(self, now: float) -> None:
        """A new command source starts now: blend from the current goal over ``ramp_s``."""
        if self.last_goal is not None and self.config.ramp_s > 0:
            self._blend_from = self.last_goal.copy()
            self._blend_t0 = float(now)

    @property
    def switching(self) -> bool:
        return self._blend_from is not None

    def stop(self, reason: str) -> None:
        """Latch the torque-off state (until :meth:`reset`)."""
        self.state = State.STOPPED
        self.stop_reason = reason
        self.counters.stops += 1

    def step(self, now: float, target, command_stamp: Optional[float] = None,
             hardware_errors: Optional[Mapping[int, int]] = None, check_watchdog: bool = False) -> SafetyOutput:
        """Safe goals for this cycle.

        ``target``: desired goals (None = hold). ``command_stamp`` with ``check_watchdog``: the
        time the command was produced (topic commands). ``hardware_errors``: {id: bits}.
        """
        if self.state is State.INIT or self.last_goal is None:
            raise RuntimeError("SafetyFilter.reset(present, now) must be called before step()")
        self.counters.steps += 1
        if self.state is State.STOPPED:
            return SafetyOutput(None, Action.TORQUE_OFF_ALL)
        action = hardware_error_policy(hardware_errors or {})
        if action is Action.TORQUE_OFF_ALL:
            bad = {i: b for i, b in (hardware_errors or {}).items() if b}
            self.stop(f"hardware error {bad}")
            return SafetyOutput(None, action)
        dt = now - self.last_time if self.last_time is not None else 0.0
        self.last_time = float(now)
        if action is Action.HOLD:
            self.state = State.HOLD
            self.counters.holds += 1
            return SafetyOutput(self.last_goal.copy(), action)
        self.state = State.RUNNING

        stale = False
        if target is None:
            target = self.last_goal
            self.counters.holds += 1
        elif check_watchdog and watchdog(command_stamp, now, self.config.watchdog_s):
            stale = True
            target = self.last_goal
            self.counters.stale += 1
        n = self.last_goal.size
        try:
            raw = _vec(target, n, "target")
        except (ValueError, TypeError):
            raw = self.last_goal.copy()
            self.counters.nonfinite += n
        nonfinite = int(np.count_nonzero(~np.isfinite(raw)))
        goal = clamp_goals(raw, self.lower, self.upper, self.last_goal)
        finite_raw = np.where(np.isfinite(raw), raw, goal)
        clamped = int(np.count_nonzero(finite_raw != goal))
        if self._blend_from is not None:
            w = blend_weight(now - self._blend_t0, self.config.ramp_s)
            goal = blend(self._blend_from, goal, w)
            if w >= 1.0:
                self._blend_from = None
        dt_eff = min(max(dt, 0.0), self.config.max_step_dt)
        limited = rate_limit(self.last_goal, goal, self.config.max_rate_rad_s, dt_eff) if dt_eff > 0 \
            else self.last_goal.copy()
        rate_limited = int(np.count_nonzero(np.abs(limited - goal) > 1e-12))
        limited = np.clip(limited, self.lower, self.upper)
        self.last_goal = limited
        self.counters.nonfinite += nonfinite
        self.counters.clamped += clamped
        self.counters.rate_limited += rate_limited
        return SafetyOutput(limited.copy(), Action.CONTINUE, stale, nonfinite, clamped, rate_limited)
