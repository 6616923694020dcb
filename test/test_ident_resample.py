"""Motor angles resampled at the mocap stamps (``ident.data.resample_motor_angles``): a cubic spline through the
80-Hz samples, not a straight line between them (see its docstring for what the line cost on the generality
suite)."""
from __future__ import annotations

import numpy as np

from tensegrity_ros.ident.data import resample_motor_angles


def test_a_fast_drive_keeps_its_peaks():
    t = np.arange(0.0, 2.0, 1 / 80)                                    # motor states, 80 Hz
    tq = np.arange(0.1, 1.9, 1 / 120)                                  # mocap stamps, 120 Hz
    w = 2 * np.pi / 0.11                                               # the suite's fastest family, 9 Hz
    exact = lambda s: np.stack([0.08 * np.sin(w * s), np.cos(np.pi * s)], axis=1)
    cubic = resample_motor_angles(tq, t, exact(t))
    linear = np.stack([np.interp(tq, t, exact(t)[:, j]) for j in range(2)], axis=1)
    err_c, err_l = np.abs(cubic - exact(tq)).max(axis=0), np.abs(linear - exact(tq)).max(axis=0)
    assert err_l[0] > 0.05 * 0.08                                      # the line loses > 5 % of the peak
    assert err_c[0] < 0.02 * err_l[0] and err_c[1] < 1e-6
    # a cubic polynomial is reproduced to rounding (not-a-knot spline)
    p = lambda s: (1 + s - 2 * s ** 2 + 0.5 * s ** 3)[:, None]
    assert np.allclose(resample_motor_angles(tq, t, p(t)), p(tq), atol=1e-12)


def test_repeated_stamps_and_short_series():
    t = np.array([0.0, 0.0125, 0.0125, 0.025, 0.0375, 0.05])
    y = np.array([0.0, 1.0, 99.0, 2.0, 3.0, 4.0])[:, None]            # a repeated stamp keeps its first sample
    out = resample_motor_angles(np.array([0.0125, 0.03125]), t, y)
    assert out.shape == (2, 1) and out[0, 0] == 1.0 and abs(out[1, 0] - 2.5) < 1e-12
    few = resample_motor_angles(np.array([0.5]), np.array([0.0, 1.0]), np.array([[0.0], [2.0]]))
    assert few.shape == (1, 1) and few[0, 0] == 1.0                    # fewer than 4 samples: linear


def test_a_nan_reading_stays_nan_around_it():
    """A poisoned motor sample is not smoothed over by the spline: the samples next to it read NaN, so the window
    is refused downstream (the online identifier's and identify's screening), never repaired."""
    t = np.arange(12) / 80
    y = np.sin(t)[:, None]
    y[5] = np.nan
    out = resample_motor_angles(np.array([0.01, 0.06, 0.1]), t, y)
    assert np.isfinite(out[0, 0]) and np.isnan(out[1, 0]) and np.isfinite(out[2, 0])
