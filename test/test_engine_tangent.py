"""The nodal engine's tangent-linear model (engine/tangent.py) against forward-mode AD of the engine itself,
and stage 2's ``tangent`` Jacobian against the dual-number copies it replaces."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import from_unconstrained, make_engine, params_from_structure, to_unconstrained
from tensegrity_ros.engine import blas, native, tangent
from tensegrity_ros.engine import nodal
from tensegrity_ros.engine.nodal import prepare, reduce, step_reduced
from tensegrity_ros.ident import RefineOptions, add_marker_noise
from tensegrity_ros.ident.synthetic import actuated_pendulum, pendulum_drive, random_initial_state, simulate_dataset
from tensegrity_ros.model import load_structure

RF = importlib.import_module("tensegrity_ros.ident.refine")
ROOT = Path(__file__).resolve().parents[1]
MANIPULATOR = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("projection_iters, rows, matmuls", [(0, None, "torch"), (2, None, "torch"),
                                                              (2, 1, "torch"), (2, 4, "numpy")])
def test_rollout_tangents_are_the_engines_jacobian(projection_iters, rows, matmuls, monkeypatch):
    """Every direction at once: all 108 start-state coordinates and all 72 unconstrained parameters of the
    manipulator (stiffness, damping, rest length, mass, spool radius, zero offset), over 6 steps with the
    motors moving, equal to jacfwd through the engine's own step (the projection's chord terms included).
    rows: the steps linearised together (None: the default, all 6 steps in one pass; 1: one by one; 4: a
    chunk of 4, then one of 2); matmuls: the BLAS behind the products (engine/blas.py)."""
    monkeypatch.setattr(blas, "choice", lambda: matmuls)
    eng = make_engine(MANIPULATOR, projection_iters=projection_iters)
    c = eng.constants
    p = eng.default_params()
    X, V = random_initial_state(MANIPULATOR, np.random.default_rng(3), pos_std=0.01, vel_std=0.2, params=p)
    Q0, V0 = reduce(c, torch.as_tensor(X)[None]), reduce(c, torch.as_tensor(V)[None])
    n_steps, h, A = 6, 7e-4, eng.topology.n_actuators
    gen = torch.Generator().manual_seed(0)
    u = 0.5 * torch.randn(n_steps, 1, A, generator=gen, dtype=torch.float64)
    ud = 2.0 * torch.randn(n_steps, 1, A, generator=gen, dtype=torch.float64)
    z0 = to_unconstrained(p)

    def positions(x, z):
        der = prepare(c, from_unconstrained(z, p))
        q, v = x[:54].reshape(1, 3, 18), x[54:].reshape(1, 3, 18)
        for k in range(n_steps):
            q, v = step_reduced(c, der, q, v, u[k], ud[k], None, h, "semi_implicit", eng.options)
        return q.reshape(-1)

    x0 = torch.cat([Q0.reshape(-1), V0.reshape(-1)])
    Jx, Jz = torch.func.jacfwd(positions, argnums=(0, 1))(x0, z0)          # (54, 108), (54, 72)

    P = z0.numel()
    dth = tangent.param_tangents(c, lambda Z: from_unconstrained(Z, p), z0)
    eye = torch.eye(108, dtype=torch.float64)
    S0 = torch.cat([torch.zeros(P, 108, dtype=torch.float64), eye])       # parameter directions first
    Qs, S = tangent.rollout_tangents(c, prepare(c, p), dth, Q0, V0, S0[:, :54].reshape(1, -1, 3, 18),
                                     S0[:, 54:].reshape(1, -1, 3, 18), u, ud, None, None, h, n_steps, eng.options,
                                     torch.tensor([[float(n_steps)]], dtype=torch.float64),
                                     **({} if rows is None else {"rows": rows}))
    torch.testing.assert_close(Qs[0, 0].reshape(-1), positions(x0, z0), rtol=0, atol=1e-14)
    T = S[0, 0].reshape(P + 108, 54).T
    torch.testing.assert_close(T[:, P:], Jx, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(T[:, :P], Jz, rtol=1e-9, atol=1e-11)
    assert Jz.abs().max() > 1e-6 and Jx.abs().max() > 0.5                   # not trivially zero


def _noisy_pendulum_problem(window_s: float):
    """Stage 2's problem on the actuated pendulum with noisy starts (3 windows; every kind, the spool radii and the
    delay free), and a point (w, x0) off its start."""
    s = actuated_pendulum()
    p = params_from_structure(s)
    X0, V0 = random_initial_state(s, np.random.default_rng(0))
    ds = simulate_dataset(s, p, X0, V0, dt=1e-3, steps=600, every=8, motor_fn=pendulum_drive, motor_delay_s=0.02)
    ds = add_marker_noise(ds, 1e-3, np.random.default_rng(1))
    opts = RefineOptions(kinds=("stiffness", "damping", "rest_length", "mass", "spool_radius"), window_s=window_s,
                         max_windows=3, estimate_delay=True, delay_s=0.01, smooth_window_s=0.05)
    prob = RF.RefineProblem(s, [ds], p, opts)
    w = prob.initial_w(0.01) + 0.1 * torch.randn(prob.n_w, generator=torch.Generator().manual_seed(2),
                                                  dtype=torch.float64)
    x0 = 0.5 * torch.randn(prob.B_win, 2, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return prob, w, x0


@pytest.mark.parametrize("kernel", ("native", "torch"))
def test_stage2_tangent_jacobian_equals_dual_numbers(kernel, monkeypatch):
    """The refinement's Jacobian blocks (parameters, the motor delay, window starts) from the tangent model
    equal the exact dual-number copies, on the actuated pendulum with noisy starts (so the start projection
    and the delay's input tangent are exercised). kernel: the step's tangent fused in C (the default where it
    builds; engine/native.py) or the dense tangent model (TENSEGRITY_NATIVE=0). Every start column is pushed
    (START_BASIS_RTOL = 0): the basis of their span drops what the projection leaves of the noisy starts' bar-length
    violations (5e-8 of a column here), tested on its own below."""
    if kernel == "torch":
        monkeypatch.setenv("TENSEGRITY_NATIVE", "0")
    monkeypatch.setattr(RF, "START_BASIS_RTOL", 0.0)
    prob, w, x0 = _noisy_pendulum_problem(window_s=0.1)
    assert prob._native_tangents() == (kernel == "native" and native.available(torch.float64) is None)
    assert prob.jacobian_method() == "tangent"
    r1, Jw1, Je1 = prob.jacobian_blocks(w, x0, "tangent")
    r2, Jw2, Je2 = prob.jacobian_blocks(w, x0, "forward_ad")
    torch.testing.assert_close(r1, r2, rtol=0, atol=1e-13)
    for J1, J2 in ((Jw1, Jw2), (Je1, Je2)):
        assert J1.dtype == torch.float64
        rel = (J1 - J2).norm(dim=(0, 1)) / J2.norm(dim=(0, 1)).clamp_min(1e-30)
        assert float(rel.max()) < 1e-8, rel
    assert float(Jw2[..., -1].abs().max()) > 1e-4                           # the delay column is live


def test_start_columns_from_their_basis_equal_every_column_pushed(monkeypatch):
    """The window starts' 6 nf unit offsets, projected onto the bar lengths, span 6 nf - 2 x (bar constraints)
    directions; the tangent model pushes a basis of that span (refine.start_basis) and forms every start column
    from it. On the manipulator (18 free nodes: 108 columns, 72 pushed), 0.1-s windows of a recording with 1 mm
    noise, the Jacobian equals the one with every column pushed (START_BASIS_RTOL = 0) to 1e-4 of each start
    column's norm (measured 3e-6: what two projection iterations leave of the noisy starts' bar-length
    violations, singular values 1.5e-5 and below against 0.96 and above for the 72 kept)."""
    from tensegrity_ros.ident import RefineOptions as Opts
    s = MANIPULATOR
    p = params_from_structure(s)
    X0, V0 = random_initial_state(s, np.random.default_rng(0), pos_std=0.002, vel_std=0.05, params=p)
    ds = simulate_dataset(s, p, X0, V0, dt=1e-3, steps=400, every=8,
                          motor_fn=lambda t: 0.3 * np.sin(2 * np.pi * 1.5 * t[:, None] + np.arange(6)))
    prob = RF.RefineProblem(s, [add_marker_noise(ds, 1e-3, np.random.default_rng(1))], p,
                            Opts(kinds=("stiffness", "mass"), window_s=0.1, max_windows=2))
    w = prob.initial_w(0.0)
    nf = len(prob.top.free_nodes)
    x0 = 0.5 * torch.randn(prob.B_win, nf, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    c = prob.engine.constants
    n_w = w.numel()
    _, _, SQ, SV = prob._start_tangents(prepare(c, prob.params_of(w)), None, x0, n_w)
    SQb, SVb, coef = RF.start_basis(SQ, SV, n_w)
    k = 6 * nf - 2 * c.Cb_q.shape[0]
    assert (nf, k) == (18, 72) and SQb.shape[1] == n_w + k and coef.shape == (prob.B_win, 6 * nf, k)
    torch.testing.assert_close(SQb[:, :n_w], SQ[:, :n_w], rtol=0, atol=0)    # the parameters' columns untouched
    r1, Jw1, Je1 = prob.jacobian_blocks(w, x0, "tangent")
    monkeypatch.setattr(RF, "START_BASIS_RTOL", 0.0)
    assert RF.start_basis(SQ, SV, n_w)[2].shape[-1] == 6 * nf                 # nothing dropped: every column
    r2, Jw2, Je2 = prob.jacobian_blocks(w, x0, "tangent")
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    torch.testing.assert_close(Jw1, Jw2, rtol=1e-12, atol=1e-15)
    rel = (Je1 - Je2).norm(dim=(0, 1)) / Je2.norm(dim=(0, 1))
    print(f"start columns from the basis against every column pushed: largest relative difference {rel.max():.1e}")
    assert float(rel.max()) < 1e-4, rel


def test_jacobian_reuses_the_residual_rollouts_states_with_the_same_blocks(monkeypatch):
    """Levenberg-Marquardt evaluates the residuals at a point, then takes the Jacobian there: the tangent model
    takes that rollout's states instead of stepping the primal again (RefineProblem.residuals keeps the last
    PRIMAL_KEPT), with the same blocks to the bit. A point it did not keep, or another problem copy (other
    parameters around the same w), steps the primal itself. The dense tangent model's path (TENSEGRITY_NATIVE=0):
    the kernel's steps its own primal in C, and nothing is kept for it."""
    monkeypatch.setenv("TENSEGRITY_NATIVE", "0")
    prob, w, x0 = _noisy_pendulum_problem(window_s=0.1)
    fresh = prob.jacobian_blocks(w, x0, "tangent")                       # nothing kept yet: stepped itself
    calls = []
    orig = nodal.step_reduced

    def counted(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    monkeypatch.setattr(nodal, "step_reduced", counted)
    with torch.no_grad():
        for k in range(RF.PRIMAL_KEPT + 1):                              # the point of interest, then others
            prob.residuals(w if k == 0 else w + 0.01 * k, x0)
    calls.clear()
    prob.jacobian_blocks(w + 0.01, x0, "tangent")
    assert not calls                                                     # kept: the primal was not stepped
    last = w + 0.01 * RF.PRIMAL_KEPT
    kept = prob.jacobian_blocks(last, x0, "tangent")
    assert not calls
    other = prob.jacobian_blocks(w, x0, "tangent")                       # pushed out of the kept ones
    assert calls
    for a, b in zip(other, fresh):
        assert torch.equal(a, b)
    monkeypatch.setattr(RF, "PRIMAL_KEPT", 0)
    for a, b in zip(kept, prob.jacobian_blocks(last, x0, "tangent")):
        assert torch.equal(a, b)                                         # the same blocks to the bit
    copy = prob.with_params(RF.from_unconstrained(prob.z_start * 1.01, prob.template), 0.01)
    calls.clear()
    copy.jacobian_blocks(w + 0.01, x0, "tangent")
    assert calls                                                         # another problem: its own primal


def test_float32_tangents_and_starts_only_blocks():
    """What Levenberg-Marquardt and the window starts' fits take (RefineOptions.tangent_dtype, starts_only): the
    float32 tangent's blocks within 1e-4 of float64's, returned in the problem's dtype; the starts-only call gives
    the same J_e to round-off and no parameter columns."""
    prob, w, x0 = _noisy_pendulum_problem(window_s=0.2)
    r64, Jw64, Je64 = prob.jacobian_blocks(w, x0, "tangent")
    r32, Jw32, Je32 = prob.jacobian_blocks(w, x0, "tangent", torch.float32)
    torch.testing.assert_close(r32, r64, rtol=0, atol=1e-13)                 # the primal stays float64
    for J32, J64 in ((Jw32, Jw64), (Je32, Je64)):
        assert J32.dtype == torch.float64
        rel = (J32 - J64).norm(dim=(0, 1)) / J64.norm(dim=(0, 1)).clamp_min(1e-30)
        assert 0 < float(rel.max()) < 1e-4, rel                              # float32, and close
    rs, Jws, Jes = prob.jacobian_blocks(w, x0, "tangent", None, True)
    assert Jws.shape == (*Jw64.shape[:2], 0)
    torch.testing.assert_close(rs, r64, rtol=0, atol=0)
    torch.testing.assert_close(Jes, Je64, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="starts_only needs"):
        prob.jacobian_blocks(w, None, "tangent", None, True)


def test_start_fits_take_float32_columns_and_reach_float64s_errors(monkeypatch):
    """The held-out and string-law checks fit each window's start with float32 start columns
    (heldout.START_FIT_TANGENT_DTYPE; residuals in float64): the per-window errors they reach equal float64's to
    1e-6 (relative), and the fit lowers them well below the measured starts' (0 steps). Where the step's tangent
    fused in C runs (the default where it builds), the columns are its float64 ones: the same errors as the dense
    model's float64 to 1e-9."""
    from tensegrity_ros.ident import heldout
    prob, w, _ = _noisy_pendulum_problem(window_s=0.2)
    params = prob.finalize(w)[0]
    assert heldout.START_FIT_TANGENT_DTYPE == torch.float32
    by_native = heldout.fitted_start_mse(prob, params, 0.01, 3) if prob._native_tangents() else None
    monkeypatch.setenv("TENSEGRITY_NATIVE", "0")                # the dense tangent model
    assert not prob._native_tangents()
    mse32 = heldout.fitted_start_mse(prob, params, 0.01, 3)
    monkeypatch.setattr(heldout, "START_FIT_TANGENT_DTYPE", torch.float64)
    mse64 = heldout.fitted_start_mse(prob, params, 0.01, 3)
    measured = heldout.fitted_start_mse(prob, params, 0.01, 0)
    np.testing.assert_allclose(mse32, mse64, rtol=1e-6)
    assert np.all(mse64 < 0.5 * measured), (mse64, measured)
    if by_native is not None:
        np.testing.assert_allclose(by_native, mse64, rtol=1e-9)


def test_start_fits_under_window_workers_score_the_parameters_asked_for(monkeypatch):
    """Forked window workers evaluate the problem as it was built. ``fitted_start_mse`` on a problem whose workers
    run scores the parameters it is given: the build's on the workers, any others in this process (until stop 40
    the workers silently scored the build's parameters for every set)."""
    from tensegrity_ros.ident import heldout
    from tensegrity_ros.ident.workers import WindowWorkers, can_fork, window_workers
    if not can_fork(torch.device("cpu")):
        pytest.skip("no fork on this platform")
    s = actuated_pendulum()
    p = params_from_structure(s)
    X0, V0 = random_initial_state(s, np.random.default_rng(0))
    ds = add_marker_noise(simulate_dataset(s, p, X0, V0, dt=1e-3, steps=600, every=8, motor_fn=pendulum_drive),
                          1e-3, np.random.default_rng(1))
    other = p.map(lambda t: t * 1.1)
    prob = RF.RefineProblem.for_prediction(s, [ds], p, RefineOptions(window_s=0.2, smooth_window_s=0.05))
    serial = [heldout.fitted_start_mse(prob, q, 0.0, 2) for q in (p, other)]
    assert not np.allclose(serial[0], serial[1], rtol=1e-3)
    calls = []
    real_map = WindowWorkers.map
    monkeypatch.setattr(WindowWorkers, "map", lambda self, *a, **k: calls.append(a[0]) or real_map(self, *a, **k))
    with window_workers(prob, 2) as workers:
        assert workers is not None
        forked = [heldout.fitted_start_mse(prob, p, 0.0, 2)]
        on_workers = len(calls)
        forked.append(heldout.fitted_start_mse(prob, other, 0.0, 2))
    np.testing.assert_allclose(forked[0], serial[0], rtol=1e-9)
    np.testing.assert_allclose(forked[1], serial[1], rtol=1e-9)
    assert on_workers > 0 and len(calls) == on_workers      # the build's set ran on the workers, the other did not


def test_auto_jacobian_falls_back_where_there_is_no_tangent_model():
    assert tangent.supports(make_engine(MANIPULATOR))
    assert not tangent.supports(make_engine(MANIPULATOR, integrator="rk4"))
    assert not tangent.supports(make_engine(MANIPULATOR, baumgarte=(10.0, 10.0)))
    spring_rod = load_structure(ROOT / "config" / "models" / "spring_rod.yaml")
    assert not tangent.supports(make_engine(spring_rod, backend="spring_rod"))
    with pytest.raises(ValueError, match="jacobian = 'exact'.*valid: auto, tangent, central"):
        RefineOptions(jacobian="exact")


def test_linearisation_rows_default_per_device():
    """Few rows on the CPU (larger batches are no faster there and leave the caches), many on CUDA (launch-bound)."""
    assert tangent.linearise_rows(torch.device("cpu")) == tangent.LINEARISE_ROWS == 16
    assert tangent.linearise_rows("cuda:0") == tangent.LINEARISE_ROWS_CUDA > 100 * tangent.LINEARISE_ROWS


def test_blas_choice_is_validated_and_numpys_products_keep_derivatives(monkeypatch):
    """engine/blas.py: an unknown TENSEGRITY_BLAS lists the valid values; ``auto`` takes numpy's BLAS only where
    torch's is MKL on an AMD CPU; numpy's products equal torch's to round-off, and a product that carries a
    derivative (forward-mode dual, torch.func, autograd) is left to torch, derivative kept."""
    with pytest.raises(ValueError, match="auto, torch, numpy"):
        blas.resolve("mkl")
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "AuthenticAMD")
    assert blas.resolve("auto") == ("numpy" if torch.backends.mkl.is_available() else "torch")
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")
    assert blas.resolve("auto") == "torch" and blas.resolve("numpy") == "numpy"
    monkeypatch.setattr(blas, "choice", lambda: "numpy")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 108, 54, generator=gen, dtype=torch.float64)[:, :, :50]      # a strided view, as in _step
    b = torch.randn(5, 50, 54, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(blas.matmul(a, b), a @ b, rtol=1e-13, atol=1e-12)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        t = torch.randn_like(a)
        out = fwAD.unpack_dual(blas.matmul(fwAD.make_dual(a, t), b))
        torch.testing.assert_close(out.tangent, t @ b)
    J = torch.func.jacfwd(lambda x: blas.matmul(x, b[0]))(a[0, :3])
    assert J.shape == (3, 54, 3, 50) and float(J[1, 7, 1].sub(b[0, :, 7]).abs().max()) == 0.0
    x = a.clone().requires_grad_()
    blas.matmul(x, b).sum().backward()
    torch.testing.assert_close(x.grad, b.sum(-1).unsqueeze(-2).expand_as(x))

