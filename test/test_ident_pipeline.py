"""identify(): end to end, calibrated covariance, gauge reporting, poisoned windows."""
from __future__ import annotations

import numpy as np
import pytest

from tensegrity_ros.engine import params_from_structure
from tensegrity_ros.ident import (DataError, IdentifyOptions, NotEnoughDataError, add_marker_noise, drop_frames,
                                  identify, make_dataset)
from tensegrity_ros.ident.synthetic import (actuated_pendulum, pendulum_drive, random_initial_state,
                                             simulate_dataset)


@pytest.fixture(scope="module")
def noisy():
    s = actuated_pendulum()
    p = params_from_structure(s)
    rng = np.random.default_rng(3)
    X0, V0 = random_initial_state(s, rng, params=p, pos_std=0.08, vel_std=0.5)
    ds = simulate_dataset(s, p, X0, V0, dt=2e-3, steps=1500, every=5, motor_fn=pendulum_drive)
    return s, p, ds, add_marker_noise(ds, 1e-3, rng)


def test_identify_noisy_calibrated_covariance(noisy):
    """1 mm marker noise, prior 15-30 % off: the refined values lie within 3 sigma of the truth and the
    residual matches the noise (sqrt(3) mm in 3-D)."""
    s, p, _, ds = noisy
    prior = p.with_values({"s1.stiffness": 170.0, "s2.stiffness": 230.0, "s3.damping": 1.3, "s4.stiffness": 80.0})
    res = identify(s, ds, prior=prior, options=IdentifyOptions.from_flat(known={"rod.mass": 1.0}, window_s=0.3))
    assert res.ok and res.converged, res.notes
    true = {n: float(v) for n, v in p.named().items()}
    vals = res.values()
    z = {n: (vals[n] - true[n]) / res.std_devs[n] for n in res.std_devs}
    assert len(z) == 8
    assert max(abs(v) for v in z.values()) < 3.0, z
    assert 0.3 < float(np.sqrt(np.mean(np.square(list(z.values()))))) < 2.0, z   # neither over- nor under-confident
    assert res.residual_rms_m == pytest.approx(np.sqrt(3) * 1e-3, rel=0.15)
    assert res.identifiable["s1.stiffness"] and res.std_devs["s1.stiffness"] < 2.0
    # history for convergence plots: stage-1 entry then stage-2 evaluations
    assert res.history[0]["stage"] == "regression" and res.history[-1]["stage"] == "refine"
    assert "s1.stiffness" in res.summary()


def test_keep_fit_decides_whether_the_steps_after_the_fit_run(noisy):
    """keep_fit sees stage 2's parameters; False skips the covariance and the model check (the online
    identifier's rejected fits), True gives the same result as no keep_fit. Stage 2 alone, as online (stage 1
    has standard deviations of its own)."""
    s, p, _, ds = noisy
    prior = p.with_values({"s1.stiffness": 170.0, "s2.stiffness": 230.0})
    # without the engine-step check, which would refit the kept fit at a shorter step (the online identifier, which
    # passes keep_fit, runs without it: ident.online.update_options)
    opts = IdentifyOptions.from_flat(known={"rod.mass": 1.0}, window_s=0.3, max_iter=3, step_check=False)
    seen = []
    run = dict(prior=prior, options=opts, stages=("refine",))
    dropped = identify(s, ds, **run, keep_fit=lambda q: seen.append(q.named()) or False)
    kept = identify(s, ds, **run, keep_fit=lambda q: True)
    plain = identify(s, ds, **run)
    assert dropped.ok and kept.ok
    assert len(seen) == 1 and float(seen[0]["s1.stiffness"]) == dropped.values()["s1.stiffness"]
    assert dropped.std_devs == {} and dropped.model_mismatch is None and "covariance" not in dropped.timings
    assert any("skipped" in n for n in dropped.notes)
    assert kept.std_devs and kept.model_mismatch is not None
    assert kept.std_devs == pytest.approx(plain.std_devs) and kept.values() == pytest.approx(plain.values())
    assert dropped.values() == pytest.approx(plain.values())


def test_identify_reports_gauge_when_only_ratios_identifiable(noisy):
    s, p, clean, _ = noisy
    res = identify(s, clean.slice(0, 120), stages=("regression",),
                   options=IdentifyOptions.from_flat(derivative_method="semi_implicit", window_s=0.3))
    assert res.ok
    for n in ("rod.mass", "s1.stiffness", "s1.damping"):
        assert res.identifiability[n] == 0.0 and not res.identifiable[n]
    assert res.ratios["s1.stiffness/rod.mass"][0] == pytest.approx(200.0, rel=2e-2)
    assert any("ratios" in d for d in res.non_identifiable)


def test_poisoned_windows_never_give_nan(noisy):
    s, p, clean, ds = noisy
    prior = p.with_values({"s1.stiffness": 150.0})
    # 1. all NaN: refused with a typed error, the prior (last good set) returned
    bad = make_dataset(ds.times, np.full_like(ds.positions, np.nan), None, ds.motor_angles)
    res = identify(s, bad, prior=prior)
    assert not res.ok and isinstance(res.error, NotEnoughDataError)
    assert float(res.params.named()["s1.stiffness"]) == 150.0
    assert all(np.isfinite(float(v)) for v in res.params.named().values())
    with pytest.raises(NotEnoughDataError):
        identify(s, bad, prior=prior, options=IdentifyOptions(raise_errors=True))
    # 2. NaN motor angles: typed error as well
    with pytest.raises(DataError):
        make_dataset(ds.times, ds.positions, ds.valid, np.full_like(ds.motor_angles, np.nan))
    # 3. outliers (marker swaps / ghost markers) and missing frames: screened, the estimate stays good
    rng = np.random.default_rng(5)
    X = ds.positions.copy()
    hit = rng.random(X.shape[:2]) < 0.02
    hit[:, :4] = False                                           # anchors are fixed nodes
    X[hit] += rng.normal(0.0, 0.2, (int(hit.sum()), 3))
    spiky = drop_frames(make_dataset(ds.times, X, None, ds.motor_angles), 0.05, rng)
    res = identify(s, spiky, stages=("regression", "refine"),
                   options=IdentifyOptions.from_flat(known={"rod.mass": 1.0}, window_s=0.3, max_iter=20))
    assert res.ok, res.error
    assert any("screening rejected" in n for n in res.notes)
    vals = res.values()
    assert vals["s1.stiffness"] == pytest.approx(200.0, rel=0.03)
    assert vals["s2.stiffness"] == pytest.approx(200.0, rel=0.03)
    assert np.isfinite(res.residual_rms_m)


def test_a_rung_too_long_for_the_recording_is_skipped_with_a_note(noisy):
    """A 3-s recording and a ladder whose last rung wants 5-s windows: the fit of the rungs that fit stands, with a
    note, instead of the whole run failing after its work (`tensegrity identify` on a 4-s bag used to exit 2 after
    a minute: "no window with a measured start")."""
    s, p, clean, _ = noisy
    prior = p.with_values({"s1.stiffness": 170.0})
    opts = IdentifyOptions.from_flat(known={"rod.mass": 1.0}, window_s=0.3, max_iter=4,
                                     longer_windows=((0.6, 4, 2), (5.0, 4, 2)),
                                     step_check=False)     # noise-free: it would refit twice, for nothing asked here
    res = identify(s, clean, prior=prior, options=opts)
    assert res.ok, res.notes
    assert any("5-s rung (and any longer) skipped" in n for n in res.notes), res.notes
    assert any("continued on 0.6-s windows" in n for n in res.notes), res.notes
    assert float(res.values()["s1.stiffness"]) == pytest.approx(200.0, rel=0.02)


def test_a_window_the_model_cannot_follow_is_set_aside(noisy):
    """One window fitted far worse than the others (here a 6-mm, 10-Hz wobble of the free nodes for 0.3 s, which no
    parameter explains; on the generality icosahedron, a 1-s window starting one sample after the record's start:
    4.4 mm against 1.8 mm) is set aside and its rung refitted without it, with a note, so that it does not decide
    the model check and the covariance. A recording without one is left as it was (the suite, seed 0)."""
    from tensegrity_ros.ident.pipeline import outlying_windows
    s, p, _, ds = noisy
    X = ds.positions.copy()
    k = np.arange(120, 151)
    X[k, 4:, 0] += 6e-3 * np.sin(2 * np.pi * 10.0 * (ds.times[k] - ds.times[120]))[:, None]
    wobbly = make_dataset(ds.times, X, None, ds.motor_angles)
    opts = IdentifyOptions.from_flat(known={"rod.mass": 1.0}, window_s=0.3, max_windows=9, max_iter=6,
                                     longer_windows=(), noise_std_m=1e-3, heldout_check=False,
                                     set_aside_outlying=True, step_check=False)   # the set-aside alone
    res = identify(s, wobbly, stages=("refine",), options=opts)
    assert res.ok, res.error
    notes = [n for n in res.notes if "set aside" in n]
    assert len(notes) == 1 and notes[0].startswith("1 0.3-s window(s)"), res.notes
    assert all(not (s0 <= 135 <= s0 + res.refinement.problem.H) for _, s0 in res.refinement.problem.window_ids)
    assert outlying_windows(res.refinement)[0] == []
    clean = identify(s, ds, stages=("refine",), options=opts)
    assert not any("set aside" in n for n in clean.notes)
    assert res.values()["s1.stiffness"] == pytest.approx(clean.values()["s1.stiffness"], rel=0.02)
    kept = identify(s, wobbly, stages=("refine",), options=opts.with_flat(set_aside_outlying=False))
    assert not any("set aside" in n for n in kept.notes)          # the library's default: off (online updates)


def test_screening_median_equals_numpys():
    """The screening's sliding-window median (one sort instead of np.nanmedian's slow path for short rows) equals
    np.nanmedian exactly: odd and even counts of numbers per row, rows of NaN alone, one number alone."""
    import warnings

    from tensegrity_ros.ident.data import _nanmedian_last
    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 5, 3, 13))
    a[rng.random(a.shape) < 0.2] = np.nan
    a[0, 0, 0, :] = np.nan
    a[1, 1, 1, :-1] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # numpy's all-NaN rows
        ref = np.nanmedian(a, axis=-1)
    got = _nanmedian_last(a)
    assert np.isnan(got[0, 0, 0]) and got[1, 1, 1] == a[1, 1, 1, -1]
    assert np.array_equal(got, ref, equal_nan=True)
