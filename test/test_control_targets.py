"""Target trajectories for the plate controller (control/targets.py, pure): sampled at the horizon's steps with
the angles unwrapped along the trajectory, every pose validated, the workspace checked at the present time."""
import numpy as np

from tensegrity_ros import frames as F
from tensegrity_ros.control.targets import TargetTrajectory, trajectory_from_poses


def _q(angles):
    return F.quaternion_from_matrix(F.rotation_zyx(np.asarray(angles, dtype=float)))


def test_trajectory_samples_linearly_and_unwraps_yaw_across_pi():
    t = np.array([10.0, 10.5, 11.0])
    poses = np.array([[0.0, 0, 1.44, 3.10, 0, 0], [0.01, 0, 1.44, -3.10, 0, 0], [0.02, 0, 1.44, -3.0, 0.01, 0]])
    tr = TargetTrajectory(t, poses)
    s = tr.sample([9.0, 10.25, 10.75, 12.0])
    np.testing.assert_allclose(s[:, 0], [0.0, 0.005, 0.015, 0.02])
    # +3.10 -> -3.10 is a 0.083-rad turn through pi, not 6.2 rad back through 0
    assert abs(s[1, 3] - (3.10 + (2 * np.pi - 6.2) / 2)) < 1e-9
    assert tr.end == 11.0


def test_trajectory_from_poses_validates_every_pose():
    present = np.array([0.0, 0.0, 1.44, -2.93, 0.0, 0.0])
    pos = [(0.001 * k, 0.0, 1.44) for k in range(5)]
    qs = [_q([-2.93, 0.0, 0.0])] * 5
    tr, why = trajectory_from_poses(100.0, 0.05, pos, qs, "C0", now=100.1, present=present)
    assert why == "" and np.allclose(tr.times, 100.0 + 0.05 * np.arange(5))
    np.testing.assert_allclose(tr.sample([100.1])[0, :3], [0.002, 0.0, 1.44], atol=1e-12)
    bad = list(pos)
    bad[3] = (np.nan, 0.0, 1.44)
    tr, why = trajectory_from_poses(100.0, 0.05, bad, qs, "C0", now=100.1, present=present)
    assert tr is None and why.startswith("pose 3: target has non-finite")
    tr, why = trajectory_from_poses(100.0, 0.05, pos, qs, "world", now=100.1)
    assert tr is None and "frame 'world'" in why
    tr, why = trajectory_from_poses(100.0, 0.05, pos, qs, "C0", now=101.0)
    assert tr is None and "ended" in why
    far = [(0.2, 0.0, 1.44)] * 5
    tr, why = trajectory_from_poses(100.0, 0.05, far, qs, "C0", now=100.1, present=present)
    assert tr is None and "out of the workspace" in why
    tr, why = trajectory_from_poses(100.0, 0.05, [], [], "C0", now=100.1)
    assert tr is None and "no poses" in why
