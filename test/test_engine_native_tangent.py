"""The step's tangent fused in C (engine/native.py ``rollout_tangents``, native_step.c ``tangent_rollout``) against
the tangent-linear model it stands in for (engine/tangent.py, itself held to forward-mode AD through the engine by
test_engine_tangent.py): every direction at once, float64.

On the icosahedron and the manipulator of config/models and the test structures with what those lack (constraints,
both string laws), with motors, their rates and external forces, with the motor-angle tangents of a delay, several
windows, fractional sample steps, one and two threads. Stage 2's Jacobian blocks with the kernel on and off:
test_engine_tangent.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import from_unconstrained, make_engine, native, tangent, to_unconstrained
from tensegrity_ros.engine.nodal import prepare, reduce
from tensegrity_ros.ident.synthetic import random_initial_state
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import REPO_ROOT

from test_engine_autodiff import small_structure
from test_string_laws import hoist

pytestmark = [pytest.mark.skipif(native.available(torch.float64) is not None,
                                 reason=f"native kernel unavailable: {native.available(torch.float64)}"),
              pytest.mark.usefixtures("one_torch_thread")]

MODELS = ("icosahedron", "stacked_manipulator")


def _structures():
    out = [(name, load_structure(REPO_ROOT / "config" / "models" / f"{name}.yaml")) for name in MODELS]
    return out + [("small (constraints)", small_structure()), ("hoist (spring and cord laws)", hoist("spring", "cord"))]


def _case(s, B=3, n_steps=40, seed=0, forces=True, start_tangents=False):
    """B windows from perturbed starts, motors moving, every unconstrained parameter and every start coordinate as
    directions (parameters first), a delay-like motor-angle tangent on the last parameter direction."""
    eng = make_engine(s)
    c = eng.constants
    p = eng.default_params()
    rng = np.random.default_rng(seed)
    starts = [random_initial_state(s, rng, pos_std=0.005, vel_std=0.2, params=p) for _ in range(B)]
    Q0 = reduce(c, torch.as_tensor(np.stack([x for x, _ in starts])))
    V0 = reduce(c, torch.as_tensor(np.stack([v for _, v in starts])))
    nf = Q0.shape[-1]
    n = 3 * nf
    g = torch.Generator().manual_seed(seed)
    A, N = c.Ydir.shape[1], len(s.nodes)
    u = 0.05 * torch.randn(n_steps, B, A, generator=g, dtype=torch.float64)
    ud = torch.randn(n_steps, B, A, generator=g, dtype=torch.float64)
    fq = None
    if forces:
        fq = (0.3 * torch.randn(n_steps, B, N, 3, generator=g, dtype=torch.float64)).mT @ c.T
    z0 = to_unconstrained(p)
    P = z0.numel()
    dth = tangent.param_tangents(c, lambda Z: from_unconstrained(Z, p), z0)
    du = dud = None
    if A:
        du = torch.zeros(n_steps, B, A, P, dtype=torch.float64)
        dud = torch.zeros_like(du)
        du[..., -1] = -0.01 * ud
        dud[..., -1] = 0.1 * torch.randn(n_steps, B, A, generator=g, dtype=torch.float64)
    C = P + 2 * n
    SQ = torch.zeros(B, C, n, dtype=torch.float64)
    SV = torch.zeros(B, C, n, dtype=torch.float64)
    SQ[:, P:P + n] = torch.eye(n, dtype=torch.float64)
    SV[:, P + n:] = torch.eye(n, dtype=torch.float64)
    if start_tangents:                             # the start projection makes them non-zero in identification
        SQ[:, :P] = 1e-3 * torch.randn(B, P, n, generator=g, dtype=torch.float64)
    samples = torch.sort(n_steps * torch.rand(B, 7, generator=g, dtype=torch.float64), 1).values
    samples[:, 0], samples[:, -1] = 0.0, float(n_steps)
    args = (c, prepare(c, p), dth, Q0, V0, SQ.reshape(B, C, 3, nf), SV.reshape(B, C, 3, nf), u, ud, du, fq,
            1e-3, n_steps, eng.options, samples)
    return args, dud


@pytest.mark.parametrize("name,s", _structures(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("start_tangents", (False, True), ids=("params-from-rest", "params-moving-the-start"))
def test_native_tangents_equal_the_tangent_model(name, s, start_tangents):
    """start_tangents False: the parameter directions start at zero, so what they carry at the samples is the
    step's own parameter derivatives (the string law, the masses' inverse, the chord matrix's), not a start
    tangent pushed through; True: as in identification, where the start projection depends on them."""
    args, dud = _case(s, start_tangents=start_tangents)
    Qr, Sr = tangent.rollout_tangents(*args, dud=dud)
    for threads in (1, 2):
        Qn, Sn = native.rollout_tangents(*args, dud=dud, threads=threads)
        torch.testing.assert_close(Qn, Qr, rtol=0, atol=1e-12)
        scale = Sr.abs().amax(dim=(0, 1, 3, 4), keepdim=True).clamp_min(1e-12)       # per direction
        err = ((Sn - Sr).abs() / scale).max()
        assert float(err) < 1e-9, f"{name}: tangents differ by {float(err):.2e} of each direction's size"
    assert float(Sr.abs().max()) > 1e-3
