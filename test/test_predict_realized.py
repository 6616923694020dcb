"""The realized prediction error against exact answers: predictions with a known error at each step."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tensegrity_ros.predict import RealizedError

NAMES = ("a", "b", "c")


def truth(t):
    """(3, 3) node positions at time t: a smooth motion."""
    return np.array([[math.sin(t), 0.1 * i, math.cos(2 * t)] for i in range(3)])


def test_per_step_error_is_the_known_offset():
    K, dt = 20, 0.01
    r = RealizedError(K, dt, memory_s=1e9)
    for j in range(300):                    # a measurement every step, a prediction every 5 steps
        t = j * dt
        if j % 5 == 0:
            # step k is off by 1 mm * k along x on every node
            P = np.stack([truth(t + k * dt) + np.array([1e-3 * k, 0.0, 0.0]) for k in range(K)])
            r.add_prediction(t, NAMES, P)
        r.add_measurement(t, NAMES, truth(t), np.ones(3, bool))
    got = r.per_step()
    np.testing.assert_allclose(got, 1e-3 * np.arange(K), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.whole_run(), got, rtol=1e-9, atol=1e-12)
    assert r.at(0.1) == pytest.approx(1e-3 * 10)


def test_measurements_between_steps_see_the_prediction_interpolated():
    """Node states at 120 Hz against 10-ms steps: for a motion linear in time the interpolated prediction is
    exact, so an exact prediction scores zero wherever the measurements fall."""
    K, dt, v = 100, 0.01, np.array([0.3, -0.2, 0.1])
    r = RealizedError(K, dt, memory_s=1e9)
    line = lambda t: np.stack([v * t + i for i in range(3)])          # noqa: E731
    for j in range(600):
        t = j / 120.0
        if j % 12 == 0:
            r.add_prediction(t, NAMES, np.stack([line(t + k * dt) for k in range(K)]))
        r.add_measurement(t, NAMES, line(t), np.ones(3, bool))
    got = r.per_step()
    assert np.isfinite(got).sum() > 0.9 * K                            # nearly every step was scored
    assert np.nanmax(got) < 1e-12


def test_invalid_and_unknown_nodes_are_not_scored_and_memory_forgets():
    K, dt = 5, 0.01
    r = RealizedError(K, dt, memory_s=0.05)
    P = np.zeros((K, 3, 3))
    P[:, 0] = [0.01, 0, 0]                  # node a 10 mm off; b, c exact
    r.add_prediction(0.0, NAMES, P)
    valid = np.array([False, True, True])  # a not measured: only the exact nodes count
    r.add_measurement(0.0, NAMES + ("zz",), np.zeros((4, 3)), np.r_[valid, True])
    assert r.per_step()[0] == 0.0 and np.isnan(r.per_step()[1:]).all()
    r.add_measurement(0.01, NAMES, np.zeros((3, 3)), np.ones(3, bool))     # a counts: RMS over 3 nodes
    assert r.per_step()[1] == pytest.approx(0.01 / math.sqrt(3))
    # a much later, exact prediction: the old errors are forgotten (memory 0.05 s), the whole run keeps them
    r.add_prediction(10.0, NAMES, np.zeros((K, 3, 3)))
    r.add_measurement(10.01, NAMES, np.zeros((3, 3)), np.ones(3, bool))
    assert r.per_step()[1] == pytest.approx(0.0, abs=1e-12)
    assert r.whole_run()[1] == pytest.approx(0.01 / math.sqrt(6))


def test_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"expected \(4, N, 3\)"):
        RealizedError(4, 0.01).add_prediction(0.0, NAMES, np.zeros((3, 3, 3)))
