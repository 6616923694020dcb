"""A controller's motor plan as the driver follows it (pure: no rclpy, no clock, no I/O).

A plan is the angles (rad) the motors should have over the next fraction of a second, at given times. The
driver (:class:`~.driver_core.DriverCore`) samples it every cycle (linear interpolation in time, the end
points held) and sends the sample through the same :class:`~.safety.SafetyFilter` as every other command:
actuator limits, NaN handling, the rate limit and the source-switch blend all apply, so a plan cannot move a
motor any way a reference or a topic command could not.

Two message layouts are read (duck-typed, so this module needs no ROS message package):

* ``trajectory_msgs/JointTrajectory``: ``joint_names`` (A,), ``points[k].positions`` (A,) and
  ``points[k].time_from_start``; ``header.stamp`` = the time ``time_from_start`` counts from.
* ``sensor_msgs/JointState`` (where trajectory_msgs is not installed; the state_predictor's and
  plate_controller's convention): ``name`` (A,), ``position`` = K x A angles row-major (step-major), one
  ``plan_dt`` apart, ``header.stamp`` = the time of the first.

Motors the plan does not name get NaN: the safety filter keeps their last safe goal. Names the driver does not
drive are ignored; a plan that names none of its motors is refused with a reason (:class:`PlanError`).

Staleness (:func:`plan_state`): a plan is followed while the newest one arrived at most ``timeout_s`` ago and
its last point is not in the past. Otherwise it is stale and the driver holds (see DriverCore).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np


class PlanError(ValueError):
    """A plan message that cannot be followed; the message says why."""


@dataclass(frozen=True)
class Plan:
    """times (K,) s on the driver's clock, strictly increasing; angles (K, A) rad in actuator order (NaN = not
    planned: hold that motor); received: the driver-clock time it arrived."""

    times: np.ndarray
    angles: np.ndarray
    received: float

    def at(self, t: float) -> np.ndarray:
        """(A,) angles at ``t``: linear in time between points, the first / last point held outside."""
        out = np.empty(self.angles.shape[1])
        for j in range(out.size):
            out[j] = np.interp(t, self.times, self.angles[:, j])
        return out

    @property
    def end(self) -> float:
        return float(self.times[-1])


def _stamp(header) -> float:
    st = header.stamp
    return float(st.sec) + 1e-9 * float(st.nanosec)


def plan_from_message(msg, motor_names: Sequence[str], plan_dt: float) -> Tuple[float, np.ndarray, np.ndarray]:
    """(t0 (s, the message's clock), offsets (K,) s from t0, angles (K, A) rad in ``motor_names`` order) from a
    JointTrajectory or a JointState plan (module docstring). Raises :class:`PlanError` with the reason."""
    motor_names = tuple(motor_names)
    if hasattr(msg, "joint_names"):      # trajectory_msgs/JointTrajectory
        names = tuple(msg.joint_names)
        pts = list(msg.points)
        if not pts:
            raise PlanError("trajectory has no points")
        rows = []
        for k, p in enumerate(pts):
            pos = np.asarray(p.positions, dtype=float)
            if pos.size != len(names):
                raise PlanError(f"point {k} has {pos.size} positions for {len(names)} joint names")
            rows.append(pos)
        raw = np.vstack(rows)
        offsets = np.array([p.time_from_start.sec + 1e-9 * p.time_from_start.nanosec for p in pts], dtype=float)
    else:                                # sensor_msgs/JointState, K x A row-major
        names = tuple(msg.name)
        pos = np.asarray(msg.position, dtype=float)
        if not names or pos.size == 0 or pos.size % len(names):
            raise PlanError(f"{pos.size} positions for {len(names)} names (a JointState plan holds K x A)")
        if not (math.isfinite(plan_dt) and plan_dt > 0):
            raise PlanError(f"plan_dt = {plan_dt}: must be > 0")
        raw = pos.reshape(-1, len(names))
        offsets = plan_dt * np.arange(raw.shape[0], dtype=float)
    if len(set(names)) != len(names):
        raise PlanError(f"duplicate joint names {list(names)}")
    cols = {n: i for i, n in enumerate(names)}
    if not any(n in cols for n in motor_names):
        raise PlanError(f"plan names {list(names)} match none of the driven motors {list(motor_names)}")
    if not np.all(np.isfinite(offsets)) or np.any(np.diff(offsets) <= 0):
        raise PlanError("plan times are not finite and strictly increasing")
    angles = np.full((raw.shape[0], len(motor_names)), np.nan)
    for j, n in enumerate(motor_names):
        if n in cols:
            angles[:, j] = raw[:, cols[n]]
    return _stamp(msg.header), offsets, angles


def plan_state(plan: Plan, now: float, timeout_s: float) -> Tuple[bool, str]:
    """(fresh, reason): fresh while the plan arrived at most ``timeout_s`` before ``now`` and its last point is
    not in the past; else the reason it is stale."""
    age = now - plan.received
    if not math.isfinite(age) or age > timeout_s:
        return False, f"no plan for {age:.2f} s (plan_timeout_s {timeout_s:g})"
    if now > plan.end:
        return False, f"the plan ended {now - plan.end:.2f} s ago"
    return True, ""
