"""Stage-2 numerics that decide whether multiple shooting converges on stiff, damped structures: the
integration step bound with damping, the initial-state block's truncated inverse, the trust region, the prior
centre, and the gate on a far-off stage-1 start."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import build_topology, params_from_structure
from tensegrity_ros.ident import RefineOptions, refine
from tensegrity_ros.ident.synthetic import (actuated_pendulum, pendulum_drive, random_initial_state,
                                             simulate_dataset)
from tensegrity_ros.model import load_structure

RF = importlib.import_module("tensegrity_ros.ident.refine")   # the module (the package exports the function)
PL = importlib.import_module("tensegrity_ros.ident.pipeline")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _spectral_radius(K, C, M, h):
    """Semi-implicit Euler on M x'' + C x' + K x = 0: v1 = v + h M^-1 (-K x - C v), x1 = x + h v1."""
    n = K.shape[0]
    Mi = np.linalg.inv(M)
    I = np.eye(n)
    A = np.block([[I - h * h * Mi @ K, h * (I - h * Mi @ C)], [-h * Mi @ K, I - h * Mi @ C]])
    return float(np.abs(np.linalg.eigvals(A)).max())


@pytest.mark.parametrize("model", ["stacked_manipulator", "icosahedron"])
def test_stable_step_is_the_damped_stability_limit(model):
    s = load_structure(ROOT / "config" / "models" / f"{model}.yaml")
    top, p = build_topology(s), params_from_structure(s)
    K, C, M = RF._axial_matrices(top, p)
    h = RF.stable_step(top, p, safety=1.0)
    # just below the limit every mode of the linearised strings-and-bars model is bounded, just above it is not
    assert _spectral_radius(K, C, M, 0.99 * h) <= 1.0 + 1e-6
    assert _spectral_radius(K, C, M, 1.05 * h) > 1.01
    # the undamped bound 2 / w_max (the earlier criterion) is far outside: damping halves the step or more
    w = RF.max_frequency(top, p)
    assert 2.0 / w > 1.5 * h
    assert _spectral_radius(K, C, M, 0.99 * 2.0 / w) > 2.0
    assert RF.stable_step(top, p) == pytest.approx(0.75 * h)


def test_truncated_inverse_drops_directions_the_data_do_not_see():
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    ev = np.array([1e-14, 1e-3, 0.1, 1.0, 10.0])
    A = torch.as_tensor((Q * ev) @ Q.T)[None].expand(3, 5, 5)
    P = RF.truncated_inverse(A, 1e-8).numpy()
    kept = (Q[:, 1:] / ev[1:]) @ Q[:, 1:].T
    for k in range(3):
        np.testing.assert_allclose(P[k], kept, rtol=1e-8, atol=1e-8)
    # a plain inverse would blow the unseen direction up by 1e14
    assert np.abs(np.linalg.inv(A[0].numpy())).max() > 1e12


@pytest.fixture(scope="module")
def pendulum():
    s = actuated_pendulum()
    true = params_from_structure(s)
    X0, V0 = random_initial_state(s, np.random.default_rng(1), params=true)
    ds = simulate_dataset(s, true, X0, V0, dt=2e-3, steps=300, every=5, motor_fn=pendulum_drive)
    return s, true, ds


def test_trust_region_clips_each_parameter_on_its_own():
    # one weakly determined parameter asks for 15 units: it is clipped to the bound, the others keep their
    # Gauss-Newton step (a uniformly scaled step would cut them to 2/15), and the trailing delay is untouched
    dw = torch.tensor([0.5, -15.0, 1.2, -0.3, 7.0], dtype=torch.float64)
    out = RF.limit_step(dw, 4, 2.0)
    assert out.tolist() == [0.5, -2.0, 1.2, -0.3, 7.0]
    assert RF.limit_step(dw[:1], 1, 2.0).tolist() == [0.5]
    assert RF.limit_step(dw, 0, 2.0).tolist() == dw.tolist()


def test_prior_center_holds_a_parameter_the_data_barely_see(pendulum):
    """With a tight prior the result sits at the prior's centre, which by default is the start and can be set
    elsewhere (online: the nominal model, while each update starts from the last accepted set)."""
    s, true, ds = pendulum
    start = true.with_values({"s3.rest_length": 1.082})
    centre = true.with_values({"s3.rest_length": 1.090})
    base = dict(free=("s3.rest_length",), optimize_initial_states=False, window_s=0.3, max_iter=8,
                prior_std={"rest_length": 1e-6})
    at_start = refine(s, ds, start, RefineOptions(**base))
    at_centre = refine(s, ds, start, RefineOptions(**base, prior_center=centre))
    assert float(at_start.params.named()["s3.rest_length"]) == pytest.approx(1.082, abs=2e-5)
    assert float(at_centre.params.named()["s3.rest_length"]) == pytest.approx(1.090, abs=2e-5)
    # without a prior the data decide: the true value
    free = refine(s, ds, start, RefineOptions(**{**base, "prior_std": {}}))
    assert float(free.params.named()["s3.rest_length"]) == pytest.approx(1.08, abs=2e-4)


def test_stage1_start_far_from_the_prior_is_refused():
    s = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
    prior = params_from_structure(s)
    near = prior.with_values({"sc8.stiffness": 2.5 * float(prior.named()["sc8.stiffness"])})
    far = prior.with_values({"sc8.stiffness": float(prior.named()["sc8.stiffness"]) / 50})
    assert PL._far_from(near, prior, 3.0) is None
    name, ratio = PL._far_from(far, prior, 3.0)
    assert name == "sc8.stiffness" and ratio == pytest.approx(0.02)
    # rest lengths are not scale parameters: never a reason
    moved = prior.with_values({"sc8.rest_length": 1.1 * float(prior.named()["sc8.rest_length"])})
    assert PL._far_from(moved, prior, 1.01) is None


def test_longer_windows_continue_stage2_from_the_last_result(pendulum, monkeypatch):
    """``longer_windows``: stage 2 runs again on longer windows from its own result, the prior still centred on
    the original start, and the final problem (covariance, residual) is the long-window one."""
    s, true, ds = pendulum
    start = true.with_values({"s1.stiffness": 1.15 * float(true.named()["s1.stiffness"])})
    calls = []
    real = PL.refine

    def spy(structure, data, start_params, opts, **kw):
        calls.append((opts.window_s, opts.max_windows, opts.max_iter, opts.prior_center,
                      float(start_params.named()["s1.stiffness"])))
        return real(structure, data, start_params, opts, **kw)

    monkeypatch.setattr(PL, "refine", spy)
    res = PL.identify(s, ds, prior=start, stages=("refine",), options=PL.IdentifyOptions.from_flat(
        refine_kinds=("stiffness",), known={"rod.mass": 1.0}, window_s=0.1, max_iter=6,
        longer_windows=((0.3, 4, 4),), prior_std={"stiffness": 0.5}, covariance=False))
    assert res.ok, res.error
    assert [c[:3] for c in calls] == [(0.1, None, 6), (0.3, 4, 4)]
    # the second run starts where the first ended, with the prior centred on the original start
    assert calls[1][4] != pytest.approx(calls[0][4])
    assert calls[1][3] is not None and float(calls[1][3].named()["s1.stiffness"]) == pytest.approx(calls[0][4])
    assert res.refinement.problem.opts.window_s == 0.3
    assert any("continued on 0.3-s windows" in n for n in res.notes)
    k = float(res.params.named()["s1.stiffness"]) / float(true.named()["s1.stiffness"])
    assert k == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("bad", [((0.3, 4),), ((0.0, 4, 4),), ((0.3, 0, 4),), ((0.3, 4, -1),), ((0.3, "many", 4),)])
def test_longer_windows_are_checked(bad):
    with pytest.raises(ValueError, match="longer_windows"):
        PL.IdentifyOptions(longer_windows=bad)


def test_auto_rung_windows_grow_with_the_recording():
    """``"auto"``: the ladder as it was (8 windows) up to 12 s of recording, then 2 per 3 recorded seconds."""
    assert [PL.rung_windows("auto", s) for s in (4.0, 12.0, 16.0, 24.0, 60.0)] == [8, 8, 11, 16, 40]
    assert PL.rung_windows(5, 60.0) == 5 and PL.rung_windows(None, 60.0) is None
    assert PL.LONGER_WINDOWS_LADDER[-1][1] == "auto"
    PL.IdentifyOptions(longer_windows=PL.LONGER_WINDOWS_LADDER)          # accepted as options
