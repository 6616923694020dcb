"""Stage 2 (refinement through engine rollouts): actuator mapping, rest lengths, motor delay, optimisers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tensegrity_ros.engine import params_from_structure
from tensegrity_ros.ident import RefineOptions, refine
from tensegrity_ros.ident.synthetic import (actuated_pendulum, pendulum_drive, random_initial_state,
                                             simulate_dataset)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pendulum_data():
    s = actuated_pendulum()
    nominal = params_from_structure(s)
    true = nominal.with_values({"s3.rest_length": 1.085, "m1.spool_radius": 0.012, "m2.spool_radius": 0.009})
    rng = np.random.default_rng(1)
    X0, V0 = random_initial_state(s, rng, params=true)
    ds = simulate_dataset(s, true, X0, V0, dt=2e-3, steps=1000, every=5, motor_fn=pendulum_drive, motor_delay_s=0.02)
    return s, nominal, true, ds


def test_refine_recovers_rest_length_spool_radii_and_delay(pendulum_data):
    s, nominal, true, ds = pendulum_data
    history = []
    r = refine(s, ds, nominal, RefineOptions(kinds=("rest_length", "spool_radius"), estimate_delay=True,
                                             window_s=0.3, max_iter=30), callback=history.append)
    v = {n: float(x) for n, x in r.params.named().items()}
    assert v["s3.rest_length"] == pytest.approx(1.085, abs=3e-4)
    assert v["s4.rest_length"] == pytest.approx(1.08, abs=3e-4)
    assert v["m1.spool_radius"] == pytest.approx(0.012, rel=1e-2)
    assert v["m2.spool_radius"] == pytest.approx(0.009, rel=1e-2)
    assert r.delay_s == pytest.approx(0.02, abs=1e-3)
    assert r.converged and r.residual_rms_m < 1e-4
    # progress reported per evaluation, loss decreasing overall
    assert len(history) >= 3 and history[-1]["loss"] < 1e-3 * history[0]["loss"]
    assert {"iteration", "loss", "params", "delay_s", "time_s"} <= set(history[0])


def test_lbfgs_and_adam_decrease_the_loss(pendulum_data):
    s, nominal, true, ds = pendulum_data
    start = true.with_values({"s3.rest_length": 1.075})
    for opt, it in (("lbfgs", 6), ("adam", 6)):
        r = refine(s, ds.slice(0, 101), start, RefineOptions(kinds=("rest_length",), free=("s3.rest_length",),
                                                             optimizer=opt, max_iter=it, window_s=0.3,
                                                             optimize_initial_states=False, delay_s=0.02,
                                                             lr=0.5 if opt == "adam" else None))
        losses = [h["loss"] for h in r.history]
        assert min(losses) < 0.5 * losses[0], opt
        assert abs(float(r.params.named()["s3.rest_length"]) - 1.085) < abs(1.075 - 1.085), opt


def test_chord_steps_reach_the_same_fit_with_no_more_jacobians(pendulum_data):
    """Levenberg-Marquardt's chord steps (fresh residuals, the same normal equations: one rollout instead of a
    Jacobian) only keep steps that lower the loss, so the fit is the one plain LM finds, for no more Jacobians."""
    s, nominal, true, ds = pendulum_data
    fits = {}
    for chord in (0, 4):
        fits[chord] = refine(s, ds, nominal, RefineOptions(kinds=("rest_length", "spool_radius"), estimate_delay=True,
                                                           window_s=0.3, max_iter=30, lm_chord_steps=chord))
    plain, chord = fits[0], fits[4]
    for n in ("s3.rest_length", "m1.spool_radius", "m2.spool_radius"):
        assert float(chord.params.named()[n]) == pytest.approx(float(true.named()[n]), rel=1e-2)
    assert chord.delay_s == pytest.approx(0.02, abs=1e-3)
    assert chord.residual_rms_m < 1e-4 and plain.residual_rms_m < 1e-4
    assert chord.iterations <= plain.iterations                  # Jacobians
    assert chord.evaluations > chord.iterations + 1              # chord steps were taken and kept


def test_nothing_free_fits_the_window_starts_only(pendulum_data):
    """kinds=() (e.g. to score a parameter set with its window starts fitted): LM runs on the starts alone and
    leaves every parameter where it was."""
    s, nominal, true, ds = pendulum_data
    r = refine(s, ds, true, RefineOptions(kinds=(), estimate_delay=False, delay_s=0.02, window_s=0.3, max_iter=3))
    for (n, a), b in zip(r.params.named().items(), true.named().values()):
        assert float(a) == pytest.approx(float(b), rel=1e-9, abs=1e-12), n          # (round trip of the transforms)
    assert np.isfinite(r.loss) and r.history[-1]["loss"] <= r.history[0]["loss"]


def test_window_workers_give_the_one_process_fit(pendulum_data):
    """Levenberg-Marquardt's residuals and Jacobians spread over two forked processes (a share of the windows
    each) are the one-process numbers, so the fit is the same; the workers are gone afterwards."""
    s, nominal, true, ds = pendulum_data
    fits = {n: refine(s, ds, nominal, RefineOptions(kinds=("rest_length", "spool_radius"), estimate_delay=True,
                                                    window_s=0.3, max_iter=4, workers=n))
            for n in (1, 2)}
    one, two = fits[1], fits[2]
    assert two.problem.B_win >= 2 and two.problem._workers is None
    assert two.iterations == one.iterations and two.evaluations == one.evaluations
    for (n, a), b in zip(two.params.named().items(), one.params.named().values()):
        assert float(a) == pytest.approx(float(b), rel=1e-12, abs=1e-15), n
    assert two.loss == pytest.approx(one.loss, rel=1e-12)


@pytest.mark.parametrize("kernel", ("native", "torch"))
def test_window_workers_match_in_process_blocks_and_survive_a_killed_worker(pendulum_data, kernel, monkeypatch):
    """kernel: the Jacobians' tangents from the step's tangent fused in C (the default where it builds), or from the
    dense tangent model (TENSEGRITY_NATIVE=0), which reuses the residual rollout's kept states."""
    import os
    import signal

    import torch

    from tensegrity_ros.ident.refine import RefineProblem
    from tensegrity_ros.ident.workers import window_workers
    if kernel == "torch":
        monkeypatch.setenv("TENSEGRITY_NATIVE", "0")
    s, nominal, true, ds = pendulum_data
    prob = RefineProblem(s, [ds], nominal, RefineOptions(kinds=("rest_length",), window_s=0.2))
    native = prob._native_tangents()
    w = prob.initial_w(0.0)
    x0 = 1e-3 * torch.randn(prob.B_win, len(prob.top.free_nodes), 6, dtype=prob.dtype,
                            generator=torch.Generator().manual_seed(0))
    r1, Jw1, Je1 = prob.jacobian_blocks(w, x0)
    res1 = prob.residuals(w, x0)
    with window_workers(prob, 2) as workers:
        assert workers is not None and prob.subset([0, 1])._workers is None
        r2, Jw2, Je2 = prob.jacobian_blocks(w, x0)
        for a, b in ((r1, r2), (Jw1, Jw2), (Je1, Je2), (res1, prob.residuals(w, x0))):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)
        # each share goes to the same process every call, which keeps the residual rollout's states for the
        # Jacobian at the same point (RefineProblem.residuals): the same blocks from them. The C tangent steps its
        # own primal, and nothing is kept for it
        assert len({len(share) for share in workers.shares}) == 1          # np.concatenate: shares of one size
        assert (workers.map("_kept_primal", w, x0) is None) == native
        assert workers.map("_kept_primal", w + 0.1, x0) is None
        for a, b in zip((r1, Jw1, Je1), prob.jacobian_blocks(w, x0)):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)
        # Levenberg-Marquardt's normal equations, formed in the workers where the Jacobian stays: the products of
        # the one-process blocks; and the chord steps' J^T r at another point, with that same Jacobian
        normal = (r1, Jw1.mT @ Jw1, Jw1.mT @ Je1, Je1.mT @ Je1, _mv(Jw1, r1), _mv(Je1, r1))
        for a, b in zip(normal, prob.normal_blocks(w, x0)):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)
        r_new = prob.residuals(w + 0.01, x0).reshape(r1.shape)
        assert not torch.allclose(r_new, r1)
        for a, b in zip((r_new, _mv(Jw1, r_new), _mv(Je1, r_new)), prob.residual_gradients(w + 0.01, x0)):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)
        # J^T v for any per-window v (the covariance's prediction change), with that same Jacobian
        v = torch.randn(r1.shape, dtype=r1.dtype, generator=torch.Generator().manual_seed(1))
        for a, b in zip((_mv(Jw1, v), _mv(Je1, v)), prob.transposed_times(w + 0.01, v)):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)
        # the workers killed (as by the out-of-memory killer): the call finishes in this process, and says so
        for pool in workers._pools:
            for pid in list(pool._processes):
                os.kill(pid, signal.SIGKILL)
        r3, _, _ = prob.jacobian_blocks(w, x0)
        torch.testing.assert_close(r3, r1, rtol=1e-12, atol=1e-15)
        assert workers.failure and "one process" in workers.failure and prob._workers is None
    assert prob._workers is None
    # this process kept no Jacobian (the workers did): J^T v takes it again where the last normal equations were
    # formed (w, x0), and the gradients take one at the point asked
    for a, b in zip((_mv(Jw1, v), _mv(Je1, v)), prob.transposed_times(w, v)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)
    for a, b in zip((r1, _mv(Jw1, r1), _mv(Je1, r1)), prob.residual_gradients(w, x0)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-15)


def _mv(J, r):
    """Per window J^T r: (B, R, n), (B, R) -> (B, n)."""
    return (J.mT @ r.unsqueeze(-1)).squeeze(-1)


def test_window_workers_stay_in_process_inside_a_daemon():
    """A daemonic process (a multiprocessing worker, as the online identifier may run in) cannot start children:
    there the workers option falls back to one process instead of failing."""
    import multiprocessing

    from tensegrity_ros.ident.workers import can_fork
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(can_fork("cpu")), daemon=True)
    p.start()
    inside = q.get(timeout=60)
    p.join(timeout=60)
    assert can_fork("cpu") is True and inside is False


def test_quieter_data_get_shorter_engine_steps(pendulum_data):
    """The engine step follows the stated marker noise (``max_step_for_noise``): semi-implicit Euler's stiffness
    bias goes as h^2 and a parameter's sigma as the noise, so h ~ sqrt(noise) below 1 mm keeps the bias the same
    fraction of sigma; at 1 mm and above, and with the noise unknown, the step is what it was."""
    from tensegrity_ros.ident.refine import RefineProblem, max_step_for_noise
    s, nominal, _, ds = pendulum_data
    assert max_step_for_noise(2e-3, None) == max_step_for_noise(2e-3, 5e-3) == 2e-3
    assert max_step_for_noise(2e-3, 0.25e-3) == pytest.approx(1e-3)
    h = {noise: RefineProblem(s, [ds], nominal, RefineOptions(kinds=("stiffness",), window_s=0.2, noise_std_m=noise,
                                                              max_sim_dt=ds.dt)).sim_dt
         for noise in (None, 1e-3, 0.04e-3)}
    assert h[None] == h[1e-3]
    assert h[0.04e-3] <= max_step_for_noise(ds.dt, 0.04e-3) + 1e-12 < h[None]        # 1/5 of the step at most


def test_levenberg_marquardt_stops_once_within_chi2_of_the_minimum(pendulum_data):
    """Levenberg-Marquardt stops once an iteration lowers chi^2 by less than converged_chi2 and the geometric tail
    of its decreases is below it too (RefineOptions.converged_chi2): in fewer iterations than the strict stop, at a
    loss within converged_chi2 of the strict one."""
    from tensegrity_ros.ident import add_marker_noise
    from tensegrity_ros.ident.refine import _within_chi2_of_minimum
    assert not _within_chi2_of_minimum([100.0], 0.25)            # one iteration: no rate yet
    assert _within_chi2_of_minimum([4.0, 0.2], 0.25)             # rate 0.05: the tail is 0.01
    assert not _within_chi2_of_minimum([0.22, 0.2], 0.25)        # rate 0.91: a slow crawl, tail 2.0, goes on
    assert not _within_chi2_of_minimum([0.1, 0.2], 0.25)         # decreases growing
    assert not _within_chi2_of_minimum([4.0, 0.3], 0.25)         # the last decrease itself too large
    assert not _within_chi2_of_minimum([4.0, 0.2], 0.0)          # off
    s, nominal, true, ds = pendulum_data
    noisy = add_marker_noise(ds, 1e-3, np.random.default_rng(7))
    opts = RefineOptions(kinds=("rest_length", "spool_radius", "stiffness"), window_s=0.3, max_iter=30,
                         noise_std_m=1e-3, delay_s=0.02, lm_chord_steps=0)
    runs = {tol: refine(s, noisy, nominal, dataclasses.replace(opts, converged_chi2=tol)) for tol in (0.0, 0.25)}
    iters = {tol: max(h["iteration"] for h in r.history) for tol, r in runs.items()}
    chi2 = {tol: r.loss * r.problem.n_obs for tol, r in runs.items()}          # loss: chi^2 / n_obs
    assert runs[0.25].converged and iters[0.25] < iters[0.0], iters
    assert 0.0 <= chi2[0.25] - chi2[0.0] < 0.25, chi2
    # a noise stated 10x too large does not loosen the stop: chi^2 is counted in the residuals' own mean square
    loose = refine(s, noisy, nominal, dataclasses.replace(opts, noise_std_m=1e-2))
    assert max(h["iteration"] for h in loose.history) == iters[0.25]


def test_a_window_starts_where_a_marker_is_missing(pendulum_data):
    """Under occlusion most grid starts lack SOME node's marker. With ``bridge_start_gaps`` such a start is
    estimated by the smoothing fit from the node's neighbours on both sides, so the window is kept (by default it
    is dropped, with its data), and that start lies where the measured one would: within the smoothing's own
    error."""
    from tensegrity_ros.ident.refine import RefineProblem
    s, nominal, true, ds = pendulum_data
    ds = dataclasses.replace(ds, velocities=None)       # as recorded: positions only
    opts = RefineOptions(kinds=(), window_s=0.3, smooth_window_s=0.1, bridge_start_gaps=True)
    full = RefineProblem(s, [ds], true, opts)
    free = np.asarray(full.top.free_nodes)
    valid = ds.valid.copy()
    valid[5, :] = False                                 # one gap that every derivative method must step over
    gappy = RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true, opts)
    starts = [st for _, st in gappy.window_ids]
    assert len(starts) > 3
    assert starts[0] == 0
    for k, st in enumerate(starts[1:]):                 # a different free node missing at every later start
        valid[st, free[k % len(free)]] = False
    occluded = RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true, opts)
    assert occluded.window_ids == gappy.window_ids
    off = RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true,
                        dataclasses.replace(opts, bridge_start_gaps=False))
    assert off.window_ids == gappy.window_ids[:1]        # the default: such windows are dropped
    # the filled starts against the same problem's measured ones (the same smoothing, the sample itself kept)
    np.testing.assert_allclose(occluded.X0m.numpy(), gappy.X0m.numpy(), atol=2e-4)
    np.testing.assert_allclose(occluded.V0m.numpy(), gappy.V0m.numpy(), atol=5e-3)
    assert float((occluded.X0m - gappy.X0m).abs().max()) > 0          # they were estimated, not copied
    # without neighbours on both sides (the record's first sample) nothing is filled: the window starts later
    valid[0, free[0]] = False
    edge = RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true, opts)
    assert edge.window_ids[1:] == gappy.window_ids[1:] and edge.window_ids[0][1] > 0


def test_derivatives_are_kept_by_content_not_by_identity(pendulum_data):
    """Stage 2 builds a problem from the same recording for every rung and check: the smoothed derivatives are
    computed once per content (a copy hits), again when an array changed in place, and handed out read-only."""
    from tensegrity_ros.ident.data import derivatives
    _, _, _, ds = pendulum_data
    ds = dataclasses.replace(ds, velocities=None, valid=ds.valid.copy())
    first = derivatives(ds, "smooth", window_s=0.1)
    copy = dataclasses.replace(ds, positions=ds.positions.copy(), valid=ds.valid.copy())
    assert derivatives(copy, "smooth", window_s=0.1) is first
    assert derivatives(ds, "smooth", window_s=0.2) is not first          # another argument: another result
    assert not first.velocities.flags.writeable
    with pytest.raises(ValueError):
        first.velocities[0] = 0.0
    ds.valid[5, :] = False                                              # changed in place
    again = derivatives(ds, "smooth", window_s=0.1)
    assert again is not first and not again.ok[5].any() and first.ok[5].any()


def test_only_windows_fits_exactly_the_windows_named(pendulum_data):
    """``only_windows`` cuts exactly the windows it names (the window jackknife refits a fit's windows less one),
    whatever ``max_windows`` would have spread, and refuses a window these recordings do not have."""
    from tensegrity_ros.ident.errors import NotEnoughDataError
    from tensegrity_ros.ident.refine import RefineProblem
    s, nominal, true, ds = pendulum_data
    opts = RefineOptions(kinds=(), window_s=0.1)
    ids = RefineProblem(s, [ds], true, opts).window_ids
    assert len(ids) > 6
    chosen = tuple(ids[1:4] + ids[5:6])
    sub = RefineProblem(s, [ds], true, dataclasses.replace(opts, only_windows=chosen, max_windows=2))
    assert sub.window_ids == list(chosen)
    full = RefineProblem(s, [ds], true, opts)
    np.testing.assert_array_equal(sub.targets.numpy(), full.targets.numpy()[[1, 2, 3, 5]])
    with pytest.raises(NotEnoughDataError, match="only_windows"):
        RefineProblem(s, [ds], true, dataclasses.replace(opts, only_windows=chosen + ((0, ids[1][1] + 1),)))


def test_a_window_start_moves_past_a_long_dropout(pendulum_data):
    """A marker hidden longer than the smoothing can bridge (behind a bar for a while) leaves no state estimate at
    the grid's start: the window starts at the first sample after it that has one, at most half a window later,
    and keeps the grid's end, so that it never reaches into the next window's samples."""
    from tensegrity_ros.ident.refine import RefineProblem, without_windows
    s, nominal, true, ds = pendulum_data
    ds = dataclasses.replace(ds, velocities=None)
    opts = RefineOptions(kinds=(), window_s=0.3, smooth_window_s=0.1,         # 30 samples; smoothing +-5 samples
                         bridge_start_gaps=True)
    full = RefineProblem(s, [ds], true, opts)
    H, free = full.H, np.asarray(full.top.free_nodes)
    starts = [st for _, st in full.window_ids]
    # (central differences need both neighbours: no window starts at the record's first sample, as before)
    assert starts == list(range(H, H * (len(starts) + 1), H)) and full.window_lengths == [H] * len(starts)
    st = starts[1]
    valid = ds.valid.copy()
    valid[st - 3:st + 8, free[0]] = False               # 11 samples: no sample in it has neighbours within +-5
    moved = RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true, opts)
    moved_starts = [w for _, w in moved.window_ids]
    assert st not in moved_starts and st + 9 in moved_starts and set(starts) - {st} <= set(moved_starts)
    b, bf = moved_starts.index(st + 9), starts.index(st)
    assert moved.window_lengths[b] == H - 9
    assert not moved.mask[b, H - 9:].any() and moved.mask[b, :H - 9].all()   # stops where the grid's window ends
    np.testing.assert_allclose(moved.targets[b, :H - 9].numpy(), full.targets[bf, 9:].numpy())
    # setting it aside masks its own samples only, not the next window's
    kept = without_windows([dataclasses.replace(ds, valid=valid)], moved, [b])[0].valid
    assert not kept[st + 9:st + H + 1].any() and kept[st + H + 1:st + 2 * H].all()
    # a dropout longer than half a window loses the window, as before
    valid[st - 3:st + H // 2 + 8, free[0]] = False
    assert st // H not in [w // H for _, w in RefineProblem(s, [dataclasses.replace(ds, valid=valid)], true,
                                                            opts).window_ids]


def test_window_mse_of_several_sets_in_one_batch_equals_one_at_a_time(pendulum_data):
    """The online identifier scores the fit and the active set on its held-out windows in one engine batch; each
    set's per-window errors are those of its own rollout (the pendulum is actuated, so the motor inputs repeat per
    set too), and the set nearer the truth scores lower."""
    from tensegrity_ros.ident.refine import RefineProblem
    s, nominal, true, ds = pendulum_data
    prob = RefineProblem.for_prediction(s, [ds], nominal, RefineOptions(kinds=()), window_s=0.2, max_windows=6)
    sets = [true, nominal, true.with_values({"s3.rest_length": 1.11})]
    one_at_a_time = np.stack([prob.window_mse(p, delay_s=0.02) for p in sets])
    batched = prob.window_mse(sets, delay_s=0.02)
    assert batched.shape == (3, prob.B_win)
    np.testing.assert_allclose(batched, one_at_a_time, rtol=1e-10, atol=0.0)
    np.testing.assert_array_equal(prob.window_mse(sets[:1], delay_s=0.02), one_at_a_time[:1])   # a list of one
    assert np.all(batched[0] < 1e-8) and np.all(batched[1] > 1e-6)      # each copy ran with its own parameters
    assert np.all(batched[2] >= batched[0]) and np.any(batched[2] > 1e-6)   # (s3 is slack in some windows)


def test_primal_rollouts_run_the_native_kernel_where_no_derivative_flows(pendulum_data, monkeypatch):
    """The residual rollouts (no derivative) run the engine's native kernel, the differentiated ones the eager
    engine, and both give the eager residuals (float64, 1e-12): with the kernel off (``TENSEGRITY_NATIVE=0``)
    the same residuals come from the eager engine."""
    import torch
    import torch.autograd.forward_ad as fwAD

    from tensegrity_ros.engine import native
    from tensegrity_ros.ident.refine import RefineProblem
    if native.available(torch.float64) is not None:
        pytest.skip(native.available(torch.float64))
    s, nominal, true, ds = pendulum_data
    prob = RefineProblem(s, [ds], nominal, RefineOptions(kinds=("rest_length",), window_s=0.2))
    w = prob.initial_w(0.0)
    x0 = 1e-3 * torch.randn(prob.B_win, len(prob.top.free_nodes), 6, dtype=prob.dtype,
                            generator=torch.Generator().manual_seed(0))
    p = prob.params_of(w)
    st = prob.engine.initial_state(*prob._offset_starts(x0))
    inp = prob._inputs(prob.delay_of(w))
    assert prob._primal_kernel(p, st, inp) == {"compile": True, "kernel": "native"}
    wg = w.clone().requires_grad_(True)
    assert prob._primal_kernel(prob.params_of(wg), st, inp) == {}
    with fwAD.dual_level():
        xd = fwAD.make_dual(x0, torch.ones_like(x0))
        assert prob._primal_kernel(p, prob.engine.initial_state(*prob._offset_starts(xd)), inp) == {}
    fast = prob.residuals(w, x0)
    monkeypatch.setenv("TENSEGRITY_NATIVE", "0")
    assert prob._primal_kernel(p, st, inp) == {}
    torch.testing.assert_close(prob.residuals(w, x0), fast, rtol=0, atol=1e-12)
