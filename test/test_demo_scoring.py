"""The demo's scoring of predictions against the simulated robot's ground truth (commands/demo.py
``prediction_errors``): known answers, node names in another order, nodes the truth lacks, horizons outside it."""
from __future__ import annotations

import numpy as np
import pytest

from tensegrity_ros.commands.demo import prediction_errors
from tensegrity_ros.nodes.records import Prediction


def _truth(t):
    """(T, 3 nodes, 3) positions, smooth in time: each coordinate a different sine (interpolation is tested)."""
    t = np.asarray(t, dtype=float)[:, None, None]
    phase = np.arange(9.0).reshape(1, 3, 3)
    return 0.1 * np.sin(2.0 * t + phase)


GT_NAMES = ("a", "b", "c")
GT_T = np.arange(0.0, 5.0, 0.025)                       # 40 Hz, as the demo's /sim/ground_truth
GT_P = _truth(GT_T)


def _prediction(stamp, offset, names=("c", "a", "x", "b"), K=100, dt=0.01):
    t = stamp + dt * np.arange(K)
    exact = _truth(t)                                      # (K, 3, 3) in GT_NAMES order
    cols = {n: i for i, n in enumerate(GT_NAMES)}
    P = np.stack([exact[:, cols[n]] if n in cols else np.full((K, 3), 7.0) for n in names], axis=1)
    P[:, [k for k, n in enumerate(names) if n in cols]] += offset
    return Prediction(stamp, dt, tuple(names), P, np.zeros_like(P))


def test_an_offset_prediction_scores_its_offset_and_the_nodes_the_truth_lacks_are_left_out():
    preds = [_prediction(1.0, np.array([0.003, 0.0, 0.0])), _prediction(2.0037, np.array([0.0, -0.004, 0.0])),
             _prediction(4.5, 0.0),                        # its horizon runs past the truth: not scored
             _prediction(-0.5, 0.0)]                       # starts before it: not scored
    stamps, rms, end = prediction_errors(preds, GT_T, GT_P, GT_NAMES)
    assert stamps.tolist() == [1.0, 2.0037]
    # linear interpolation of a 40-Hz sine of amplitude 0.1 m at 2 rad/s: at most 0.1 * (2 * 0.0125)^2 / 2 = 31 um
    assert rms == pytest.approx([0.003, 0.004], abs=4e-5)
    assert end == pytest.approx([0.003, 0.004], abs=4e-5)


def test_an_exact_prediction_scores_only_the_interpolation_error():
    stamps, rms, end = prediction_errors([_prediction(1.5, 0.0, names=GT_NAMES)], GT_T, GT_P, GT_NAMES)
    assert 0.0 < rms[0] < 4e-5 and 0.0 <= end[0] < 4e-5
    # on the truth's own samples the interpolation is exact
    on_grid = Prediction(1.0, 0.025, GT_NAMES, _truth(1.0 + 0.025 * np.arange(40)), np.zeros((40, 3, 3)))
    assert prediction_errors([on_grid], GT_T, GT_P, GT_NAMES)[1][0] == pytest.approx(0.0, abs=1e-15)


def test_a_predictions_last_time_is_its_last_steps_and_nan_for_an_empty_horizon():
    p = _prediction(1.25, 0.0, K=100, dt=0.01)
    assert p.last_time == pytest.approx(p.times[-1], abs=1e-12) == pytest.approx(2.24)
    empty = Prediction(1.0, 0.01, GT_NAMES, np.zeros((0, 3, 3)), np.zeros((0, 3, 3)))
    assert np.isnan(empty.last_time) and not empty.last_time <= 1e9     # never "within" any ground truth
