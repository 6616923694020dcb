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


def test_engine_steps_between_the_120_hz_samples_follow_a_curve():
    """Stage 2 interpolates the 120-Hz motor samples at its ~1.7-ms engine steps (``refine._hermite``): a cubic
    Hermite curve keeps a 9-Hz drive's peaks and rates, where a straight line cut the peaks by 2.8 % and its
    slope was up to 23 % of the peak rate off; values, rates and second derivatives are those of one curve."""
    import torch

    from tensegrity_ros.ident.refine import _hermite

    w, h = 2 * np.pi / 0.11, 1 / 120
    t = np.arange(-0.2, 1.2, h)
    tq = np.arange(0.0, 1.0, 1 / 600)                                  # engine steps, 1.67 ms
    U = torch.tensor(np.stack([np.sin(w * t), 3.0 + t - 2 * t ** 2], 1)[None])       # (1, M, 2)
    Ut, tau = torch.tensor(t[None]), torch.tensor(tq[None])
    u, ud, udd = (x[0].numpy() for x in _hermite(U, Ut, tau, tau))
    err = np.abs(u[:, 0] - np.sin(w * tq)).max()
    line = np.abs(np.interp(tq, t, np.sin(w * t)) - np.sin(w * tq)).max()
    assert line > 0.025 and err < 0.0025                                # peaks: 2.8 % -> under 0.25 %
    assert np.abs(ud[:, 0] - w * np.cos(w * tq)).max() < 0.04 * w       # rates within 4 % of the peak rate
    # a quadratic on a uniform grid is reproduced exactly (central differences are its exact slopes)
    q = 3.0 + tq - 2 * tq ** 2
    assert np.allclose(u[:, 1], q, atol=1e-12) and np.allclose(ud[:, 1], 1 - 4 * tq, atol=1e-10)
    assert np.allclose(udd[:, 1], -4.0, atol=1e-8)
    # through the samples, and the rate is the derivative of the value (one curve, not two approximations)
    k = np.searchsorted(t, 0.5)
    assert abs(_hermite(U, Ut, torch.tensor([[t[k]]]), torch.tensor([[t[k]]]))[0][0, 0, 0] - np.sin(w * t[k])) < 1e-12
    d = 1e-6
    up, um = (_hermite(U, Ut, tau + e, tau + e)[0][0, :, 0].numpy() for e in (d, -d))
    assert np.abs((up - um) / (2 * d) - ud[:, 0]).max() < 1e-4 * w        # (u'' jumps at the samples)
