"""Velocity estimation: online Kalman filter and offline local polynomial fits, on a known sinusoid.

The signal is seed-like: a 7 s, 36.3 mm sinusoid plus a 2 mm, 1.5 Hz vibration, sampled at ~120 Hz with
jittered stamps, 0.3 mm noise, a 0.5 s gap and 10 % random dropouts.
"""
import numpy as np
import pytest

from tensegrity_ros.mocap import ConstantVelocityKF, KalmanConfig, kalman_velocities, smooth_derivatives

NOISE = 0.3e-3


def _signal(seed=0, T=1200):
    rng = np.random.default_rng(seed)
    t = np.cumsum(1 / 120 + rng.uniform(-1e-3, 1e-3, T))
    w1, w2 = 2 * np.pi / 7.0, 2 * np.pi * 1.5
    x = 0.0363 * np.sin(w1 * t) + 0.002 * np.sin(w2 * t + 1)
    v = 0.0363 * w1 * np.cos(w1 * t) + 0.002 * w2 * np.cos(w2 * t + 1)
    a = -0.0363 * w1 ** 2 * np.sin(w1 * t) - 0.002 * w2 ** 2 * np.sin(w2 * t + 1)
    dirs = np.array([[1.0, 0.5, -1.0], [0.0, 1.0, 0.3]])  # two nodes moving along different directions
    X0 = x[:, None, None] * dirs[None]
    X = X0 + rng.normal(0, NOISE, (T, 2, 3))
    V = v[:, None, None] * dirs[None]
    A = a[:, None, None] * dirs[None]
    valid = rng.random((T, 2)) > 0.1
    valid[400:460, 0] = False
    return t, X, V, A, valid, X0


def _rms(e):
    return float(np.sqrt(np.mean(np.sum(e ** 2, axis=-1))))


def test_kalman_velocity_error_bound():
    t, X, V, _, valid, _ = _signal()
    out = kalman_velocities(t, X, valid, KalmanConfig(measurement_std_m=NOISE))
    ok = out.velocity_ok
    assert not np.any(ok & ~valid)  # invalid samples never produce an estimate
    assert ok[valid].mean() > 0.9
    err = _rms(out.velocities[ok] - V[ok])
    raw = np.diff(X, axis=0) / np.diff(t)[:, None, None]
    both = valid[1:] & valid[:-1]
    raw_err = _rms(raw[both] - 0.5 * (V[1:] + V[:-1])[both])
    peak = np.abs(np.linalg.norm(V, axis=-1)).max()
    # measured: 10 mm/s RMS (3-D norm; ~6 mm/s per axis) vs peak speed 77 mm/s; raw differences 88 mm/s
    assert err < 13e-3, err
    assert err < raw_err / 4, (err, raw_err)
    assert np.all(np.isnan(out.velocities[~ok]))
    assert peak > 0.05


def test_class_and_function_forms_agree():
    t, X, _, _, valid, _ = _signal(seed=1, T=200)
    out = kalman_velocities(t, X, valid)
    kf = ConstantVelocityKF(2)
    for k in range(len(t)):
        o = kf.update(t[k], X[k], valid[k])
        np.testing.assert_allclose(o.velocities, out.velocities[k], atol=1e-12, equal_nan=True)
        np.testing.assert_array_equal(o.position_ok, out.position_ok[k])


def test_gaps_do_not_update_and_long_gaps_reset():
    kf = ConstantVelocityKF(1, KalmanConfig(reset_after_s=0.25))
    for k in range(50):
        kf.update(k / 100, [[0.01 * k, 0, 0]], [True])
    state = (kf.pos.copy(), kf.vel.copy(), kf.t_last.copy())
    out = kf.update(0.5, [[np.nan, np.nan, np.nan]], [True])  # NaN measurement = invalid
    assert not out.position_ok[0] and np.isnan(out.velocities).all()
    out = kf.update(0.51, [[5.0, 5.0, 5.0]], [False])
    assert np.array_equal(kf.pos, state[0]) and np.array_equal(kf.vel, state[1]) and kf.t_last[0] == state[2][0]
    pred, vel, std = kf.predict(0.6)  # extrapolation capped at max_extrapolation_s
    np.testing.assert_allclose(pred[0, 0], state[0][0, 0] + state[1][0, 0] * 0.1, atol=1e-9)
    out = kf.update(2.0, [[3.0, 0, 0]], [True])  # after a long gap: re-initialised, velocity not yet trusted
    assert out.position_ok[0] and not out.velocity_ok[0] and kf.vel[0, 0] == 0.0


@pytest.mark.parametrize("order", [2, 3])
def test_smooth_derivatives_error_bound(order):
    t, X, V, A, valid, X0 = _signal()
    d = smooth_derivatives(t, X, valid, window_s=0.2 if order == 2 else 0.4, order=order)
    assert not np.any(d.valid & ~valid)
    assert d.valid[valid].mean() > 0.95
    assert np.all(np.isnan(d.velocities[~d.valid]))
    err_v = _rms(d.velocities[d.valid] - V[d.valid])
    err_p = _rms(d.positions[d.valid] - X0[d.valid])
    # measured: 3.8 mm/s (order 2, 0.2 s) and 3.1 mm/s (order 3, 0.4 s) RMS velocity error (3-D norm);
    # positions better than the raw 0.3 mm/axis noise
    assert err_v < 5e-3, err_v
    assert err_p < NOISE * np.sqrt(3), err_p
    err_a = _rms(d.accelerations[d.valid] - A[d.valid])
    assert err_a < 0.25, err_a


def test_smooth_derivatives_the_same_in_chunks(monkeypatch):
    """Samples are fitted a chunk at a time (bounded memory on long recordings): chunks of 7 samples give the
    same result as one chunk, gaps included."""
    from tensegrity_ros.mocap import filtering
    t, X, _, _, valid, _ = _signal()
    whole = smooth_derivatives(t, X, valid)
    monkeypatch.setattr(filtering, "_CHUNK_ELEMENTS", 7 * 25 * X.shape[1] * 3)
    parts = smooth_derivatives(t, X, valid)
    assert np.array_equal(whole.valid, parts.valid) and whole.valid.any() and not whole.valid.all()
    for a, b in zip(whole[:3], parts[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def test_smooth_derivatives_exact_on_polynomials_and_shapes():
    t = np.sort(np.random.default_rng(2).uniform(0, 1, 300))
    x = 1 + 2 * t - 3 * t ** 2 + 0.5 * t ** 3
    d = smooth_derivatives(t, x[:, None], window_s=0.1, order=3)
    np.testing.assert_allclose(d.velocities[d.valid[:, 0] if d.valid.ndim > 1 else d.valid, 0],
                               (2 - 6 * t + 1.5 * t ** 2)[d.valid], atol=1e-8)
    np.testing.assert_allclose(d.accelerations[d.valid, 0], (-6 + 3 * t)[d.valid], atol=1e-6)
    assert d.valid.shape == (300,)
    with pytest.raises(ValueError, match="strictly increasing"):
        smooth_derivatives(t[::-1], x[:, None])


def test_smooth_derivatives_fill_gaps_between_measured_samples_only():
    """fill_gaps estimates an unmeasured sample from its measured neighbours on both sides (exact on a
    polynomial of the fit's order), leaves the measured samples' estimates as they were, and never
    extrapolates past the record's ends or across a gap wider than the window."""
    t = np.arange(240) / 120.0
    x = np.stack([1 + 2 * t - 3 * t ** 2 + 0.5 * t ** 3, np.sin(3 * t)], 1)[:, None, :]   # (T, 1, 2)
    valid = np.ones((240, 1), dtype=bool)
    valid[[50, 51, 120, 239], 0] = False             # two short gaps and the last sample
    valid[150:190, 0] = False                          # a gap wider than the 0.2-s window
    plain = smooth_derivatives(t, x, valid, window_s=0.2, order=3)
    filled = smooth_derivatives(t, x, valid, window_s=0.2, order=3, fill_gaps=True)
    assert not plain.valid[[50, 51, 120], 0].any() and np.isnan(plain.positions[50]).all()
    assert filled.valid[[50, 51, 120], 0].all()
    np.testing.assert_allclose(filled.positions[[50, 51, 120], 0, 0], x[[50, 51, 120], 0, 0], atol=1e-9)
    np.testing.assert_allclose(filled.velocities[[50, 51, 120], 0, 0], (2 - 6 * t + 1.5 * t ** 2)[[50, 51, 120]],
                               atol=1e-7)
    # the smooth one is estimated, not reproduced: within the fit's error of a sine over 0.2 s
    np.testing.assert_allclose(filled.positions[[50, 51, 120], 0, 1], x[[50, 51, 120], 0, 1], atol=1e-4)
    assert not filled.valid[239, 0] and not filled.valid[165:175, 0].any()
    assert np.array_equal(filled.valid & valid, plain.valid)
    np.testing.assert_array_equal(filled.positions[plain.valid], plain.positions[plain.valid])
    np.testing.assert_array_equal(filled.velocities[plain.valid], plain.velocities[plain.valid])
