"""Plate targets from poses: validation once, at the entry point, with a reason (pure; no rclpy). A single pose
(:func:`target_from_pose`) or a trajectory of poses at a fixed step (:func:`trajectory_from_poses`).

A target is the pose of C2 relative to C0 (docs/control.md), given as a position (m) and a unit quaternion
(x, y, z, w) in the frame named ``expected_frame`` (default "C0"). Rejected, with a reason: non-finite numbers, a
quaternion that is not unit length (|q| off by more than 1e-3: not a rotation, probably a zero-initialised
message), another frame, and a target farther from the plate's present pose than the controller is allowed to
jump (``max_offset_m``, ``max_angle_rad``: the reachable neighbourhood; out of it the linearisation is not
valid either).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from .. import frames as F
from .outputs import wrap_angle


def _out_of_workspace(y: np.ndarray, present: Optional[np.ndarray], max_offset_m: float, max_angle_rad: float,
                      what: str) -> str:
    """Why the pose ``y`` is farther from the plate's ``present`` pose than the reachable neighbourhood allows
    ("" when it is not, or when the present pose is unknown)."""
    if present is None:
        return ""
    d = float(np.linalg.norm(y[:3] - present[:3]))
    a = float(np.abs(wrap_angle(y[3:] - present[3:])).max())
    if d > max_offset_m or a > max_angle_rad:
        return (f"{what}: {d * 1e3:.1f} mm / {np.degrees(a):.1f} deg from the plate "
                f"(max {max_offset_m * 1e3:.0f} mm / {np.degrees(max_angle_rad):.1f} deg)")
    return ""


def target_from_pose(position: Sequence[float], quaternion: Sequence[float], frame_id: str,
                     present: Optional[np.ndarray] = None, expected_frame: str = "C0", max_offset_m: float = 0.1,
                     max_angle_rad: float = 0.5) -> Tuple[Optional[np.ndarray], str]:
    """(target (6,) [x, y, z, yaw, pitch, roll], "") or (None, reason). ``present``: the plate's pose now (6,)
    (None: no workspace check)."""
    p = np.asarray(position, dtype=float).reshape(3)
    q = np.asarray(quaternion, dtype=float).reshape(4)
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(q))):
        return None, "target has non-finite numbers"
    if frame_id != expected_frame:
        return None, f"target frame {frame_id!r} is not {expected_frame!r} (plate targets are C2 relative to C0)"
    nq = float(np.linalg.norm(q))
    if abs(nq - 1.0) > 1e-3:
        return None, f"target orientation is not a unit quaternion (|q| = {nq:.4f})"
    y = np.concatenate([p, F.euler_zyx(F.matrix_from_quaternion(*(q / nq)))])
    why = _out_of_workspace(y, present, max_offset_m, max_angle_rad, "target out of the workspace")
    return (None, why) if why else (y, "")


class TargetTrajectory:
    """A plate target over time: poses (T, 6) [x, y, z (m), yaw, pitch, roll (rad)] at ``times`` (T,) s,
    strictly increasing. :meth:`sample` gives the (K, 6) targets at the horizon's step times: linear in time
    between poses (angles unwrapped along the trajectory first, so a yaw near +-pi does not swing through 0),
    the first / last pose held outside."""

    def __init__(self, times, poses):
        self.times = np.asarray(times, dtype=float).reshape(-1)
        poses = np.asarray(poses, dtype=float).reshape(self.times.size, 6).copy()
        if self.times.size == 0 or np.any(np.diff(self.times) <= 0):
            raise ValueError("trajectory times must be strictly increasing")
        poses[:, 3:] = np.unwrap(poses[:, 3:], axis=0)
        self.poses = poses

    @property
    def end(self) -> float:
        return float(self.times[-1])

    def sample(self, times) -> np.ndarray:
        t = np.asarray(times, dtype=float).reshape(-1)
        return np.stack([np.interp(t, self.times, self.poses[:, j]) for j in range(6)], axis=-1)


def trajectory_from_poses(t0: float, dt: float, positions: Sequence[Sequence[float]],
                          quaternions: Sequence[Sequence[float]], frame_id: str, now: float,
                          present: Optional[np.ndarray] = None, expected_frame: str = "C0",
                          max_offset_m: float = 0.1, max_angle_rad: float = 0.5
                          ) -> Tuple[Optional[TargetTrajectory], str]:
    """(TargetTrajectory, "") or (None, reason) from poses ``dt`` apart from ``t0`` (s): every pose is checked
    as :func:`target_from_pose` checks one; the workspace check (against ``present``) applies to the pose at
    ``now`` (later poses move with the plate, the controller's reach between cycles is what matters). Rejected
    as well: no poses, a trajectory that ended before ``now``."""
    if not positions or len(positions) != len(quaternions):
        return None, "trajectory has no poses (or positions and orientations differ in number)"
    if not (np.isfinite(t0) and np.isfinite(dt) and dt > 0):
        return None, f"trajectory time step {dt} (from the parameter) must be > 0"
    poses = []
    for k, (p, q) in enumerate(zip(positions, quaternions)):
        y, why = target_from_pose(p, q, frame_id, None, expected_frame)
        if y is None:
            return None, f"pose {k}: {why}"
        poses.append(y)
    times = t0 + dt * np.arange(len(poses))
    if times[-1] < now:
        return None, f"trajectory ended {now - times[-1]:.2f} s ago"
    traj = TargetTrajectory(times, np.array(poses))
    why = None if present is None else _out_of_workspace(traj.sample([now])[0], present, max_offset_m,
                                                          max_angle_rad, "trajectory out of the workspace now")
    return (None, why) if why else (traj, "")
