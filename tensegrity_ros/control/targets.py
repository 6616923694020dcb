"""Plate targets from poses: validation once, at the entry point, with a reason (pure; no rclpy).

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
    if present is not None:
        d = float(np.linalg.norm(y[:3] - present[:3]))
        a = float(np.abs(wrap_angle(y[3:] - present[3:])).max())
        if d > max_offset_m or a > max_angle_rad:
            return None, (f"target out of the workspace: {d * 1e3:.1f} mm / {np.degrees(a):.1f} deg from the plate "
                          f"(max {max_offset_m * 1e3:.0f} mm / {np.degrees(max_angle_rad):.1f} deg)")
    return y, ""
