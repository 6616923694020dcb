"""The controller demo's pure pieces (tensegrity_ros/commands/demo_control.py): the measured rest pose that
centres the target, the target itself, the scoring and the plan checker."""
import math

import numpy as np
import pytest

from tensegrity_ros.commands.demo_control import ControlTarget, mean_pose, plan_violations, tracking_errors


def test_mean_pose_averages_angles_across_the_wrap():
    # yaw samples on both sides of +-pi: the naive mean is ~0, the plate's yaw is pi
    yaw = np.array([math.pi - 0.01, -math.pi + 0.01, math.pi - 0.02, -math.pi + 0.02])
    poses = np.zeros((4, 6))
    poses[:, 0] = [1.0, 2.0, 3.0, 4.0]
    poses[:, 3] = yaw
    poses[:, 4] = [0.1, 0.2, 0.3, 0.4]
    m = mean_pose(poses)
    assert m[0] == pytest.approx(2.5)
    assert abs((m[3] - math.pi + math.pi) % (2 * math.pi) - math.pi) < 1e-12      # yaw = +-pi
    assert m[4] == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mean_pose(np.zeros((0, 6)))


def test_target_settles_then_circles_and_steps():
    c = np.array([0.0, 0.0, 1.4, -2.9, 0.0, 0.0])
    tg = ControlTarget(center=c, radius_m=0.01, period_s=10.0, settle_s=6.0, tilt_rad=0.01, tilt_at_s=15.0)
    y = tg.pose([0.0, 6.0, 8.5, 6.0 + 15.0])
    np.testing.assert_allclose(y[0, :3], c[:3] + [0.01, 0, 0])            # settling: on the circle's start
    np.testing.assert_allclose(y[1], y[0])
    np.testing.assert_allclose(y[2, :3], c[:3] + [0, 0.01, 0], atol=1e-12)   # a quarter lap later
    assert y[2, 4] == 0.0 and y[3, 4] == pytest.approx(0.01)                 # the pitch step


def test_tracking_errors_score_only_the_window_and_wrap_angles():
    c = np.array([0.0, 0.0, 1.4, math.pi - 0.001, 0.0, 0.0])
    tg = ControlTarget(center=c, settle_s=2.0)
    stamps = np.array([1.0, 2.5, 3.0])                # t0 = 0: the first is still settling
    poses = tg.pose(stamps)
    poses[:, 0] += 0.003                              # 3 mm off in x
    poses[:, 3] = -math.pi + 0.001                    # 0.002 rad across the wrap
    t, pos, ang = tracking_errors(stamps, poses, tg, 0.0)
    np.testing.assert_allclose(t, [0.5, 1.0])
    np.testing.assert_allclose(pos, 0.003)
    np.testing.assert_allclose(ang[:, 0], 0.002, atol=1e-12)


def test_plan_violations_counts_limits_and_rates():
    a = np.array([[0.0, 0.0], [0.005, 0.0], [0.5, 0.0], [0.5, 2.0]])
    # row 2: motor 0 jumps 0.495 rad in 0.01 s (rate); row 3: motor 1 jumps 2 rad (rate) and exceeds 1.5 (limit)
    assert plan_violations(a, 0.01, [-1.5, -1.5], [1.5, 1.5], max_rate=1.0) == 3
    assert plan_violations(a[:2], 0.01, [-1.5, -1.5], [1.5, 1.5], max_rate=1.0) == 0


class _StubNode:
    """What _quiet_background touches on a node: set_parameters and the yaml values ``p``."""

    def __init__(self, worker="thread"):
        self.p = {"worker": worker}
        self.set = {}

    def set_parameters(self, params):
        self.set.update({q.name: q.value for q in params})


@pytest.mark.parametrize("where", ["graph", "own_process"])
def test_quiet_background_says_what_it_did_to_the_predictor(where, capsys):
    """The control phases pause the identifier and slow the predictor's relinearisations; with the predictor in a
    process of its own (--predictor-process) it cannot reach it, and the line must say so instead of claiming it."""
    from types import SimpleNamespace

    from tensegrity_ros.commands import demo_control as D

    ident, pred = _StubNode(), _StubNode()
    nodes = {"online_identifier": ident}
    if where == "graph":
        nodes["state_predictor"] = pred
    graph = SimpleNamespace(nodes=nodes, predictor_proc=object() if where == "own_process" else None)
    D._quiet_background(graph)
    line = capsys.readouterr().err
    assert ident.set == {"max_duty": D.PAUSED_DUTY}
    if where == "graph":
        assert pred.set["relinearize_period_s"] == D.CONTROL_PREDICTOR_PERIOD_S
        assert f"relinearising every {D.CONTROL_PREDICTOR_PERIOD_S:g} s" in line
    else:
        assert pred.set == {}
        assert "relinearising" not in line and "in its own process) left as it is" in line
