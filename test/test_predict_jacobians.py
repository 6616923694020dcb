"""The predictor's step Jacobians (what the state predictor and the plate controller linearise about): the
engine's tangent-linear model against forward-mode AD through the engine's own step, and the autograd fallback
(integrators the tangent model does not cover) against central finite differences."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import tangent
from tensegrity_ros.model import load_structure
from tensegrity_ros.predict.horizon import HorizonPredictor

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _points(core: HorizonPredictor, k: int, seed: int):
    """k states (k, n) off the file's pose (positions projected onto the bar lengths), with motor angles and
    rates (k, A) off the zero offsets (None without actuators)."""
    rng = np.random.default_rng(seed)
    p = core.engine.default_params()
    X = np.stack([core.initial_state(p, core.X0 + 0.004 * rng.standard_normal(core.X0.shape),
                                     0.1 * rng.standard_normal(core.X0.shape)) for _ in range(k)])
    Us = Uds = None
    if core.n_u:
        z = np.array([a.zero_offset for a in core.structure.actuators])
        Us = torch.as_tensor(z + 0.3 * rng.standard_normal((k, core.n_u)))
        Uds = torch.as_tensor(0.8 * rng.standard_normal((k, core.n_u)))
    return p, torch.as_tensor(X), Us, Uds


def test_tangent_step_jacobians_equal_autograd_on_the_manipulator():
    """All 108 state columns and the 6 motor columns, at 5 points with the motors moving, the substep as the
    controller takes it (10 ms / 16): the tangent model equals vmap(jacfwd) through the engine's step."""
    core = HorizonPredictor(load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml"), dt=0.01,
                            jac_chunk=3)      # two chunks: the chunking is exercised too
    assert tangent.supports(core.engine)
    p, X, Us, Uds = _points(core, 5, 0)
    ks = np.arange(5)
    J = core._substep_jacobians(p, 16, X, Us, Uds, ks)
    J_ad = core._substep_jacobians_ad(p, 16, X, Us, Uds, ks)
    n = core.n
    assert J.shape == (5, n, n + 6)
    np.testing.assert_allclose(J, J_ad, rtol=0, atol=1e-10 * np.abs(J_ad).max())
    # not trivially equal: the state block is not the identity, and the motors move the nodes
    assert np.abs(J[:, :, :n] - np.eye(n)).max() > 1e-3
    assert np.abs(J[:, :, n:]).max() > 1e-3
    # the points differ, so must their Jacobians (no point's matrix written into another's rows)
    assert np.abs(J[0] - J[1]).max() > 1e-6


@pytest.mark.parametrize("integrator", ["semi_implicit", "rk4"])
def test_unactuated_structure_jacobians_equal_finite_differences(integrator):
    """The icosahedron (no actuators): the tangent model (semi-implicit) and the autograd fallback (rk4, which the
    tangent model does not cover) against central differences of the predictor's own substep."""
    core = HorizonPredictor(load_structure(ROOT / "config" / "models" / "icosahedron.yaml"), dt=0.01,
                            integrator=integrator)
    assert tangent.supports(core.engine) == (integrator == "semi_implicit")
    p, X, _, _ = _points(core, 2, 1)
    n_sub = 8
    J = core._substep_jacobians(p, n_sub, X, None, None, np.arange(2))
    f = core._step_fn(p, n_sub)
    eps = 1e-6
    for b in range(2):
        E = eps * torch.eye(core.n, dtype=torch.float64)
        with torch.no_grad():
            fd = (f(X[b] + E, None, None, 1) - f(X[b] - E, None, None, 1)).T / (2 * eps)
        np.testing.assert_allclose(J[b], fd.numpy(), rtol=0, atol=1e-6 * max(1.0, float(fd.abs().max())))
        assert np.abs(J[b] - np.eye(core.n)).max() > 1e-4
