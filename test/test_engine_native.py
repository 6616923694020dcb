"""The semi-implicit step fused in C (engine/native.py, engine/native_step.c) against the reference layout.

The kernel is a second writing of laws.py's equations, so it is held to the reference (engine/nodal.py, float64,
1e-12) on every nodal structure of config/models and on the test structures with what those lack: constraints
(midpoint, coincident), both string laws, motors with rates, external forces, per-item parameters, Baumgarte terms,
a batch that is not a multiple of the tile, one and two threads. Which kernel a rollout runs is checked as a function.
"""
from __future__ import annotations

import pytest
import torch

from tensegrity_ros.engine import Inputs, make_engine, native
from tensegrity_ros.engine import fast
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import REPO_ROOT

from test_engine_autodiff import small_structure
from test_string_laws import hoist

pytestmark = pytest.mark.skipif(native.available(torch.float64) is not None,
                                reason=f"native kernel unavailable: {native.available(torch.float64)}")

MODELS = ("icosahedron", "icosahedron_spread", "stacked_manipulator")


def _case(s, B=37, T=25, seed=0, **options):
    """A perturbed start, per-item masses and stiffnesses, motor angles and rates, external forces."""
    eng = make_engine(s, **options)
    g = torch.Generator().manual_seed(seed)
    p = eng.default_params()
    hyps = p.map(lambda t: t.expand(B, *t.shape).clone())
    hyps = hyps.replace(mass=hyps.mass * (1 + 0.2 * torch.rand(B, hyps.mass.shape[1], generator=g, dtype=torch.float64)),
                        stiffness=hyps.stiffness * (1 + 0.2 * torch.rand(B, hyps.stiffness.shape[1], generator=g,
                                                                          dtype=torch.float64)))
    A, N = eng.constants.Ydir.shape[1], len(s.nodes)
    u = 0.05 * torch.randn(T, B, A, generator=g, dtype=torch.float64)
    ud = torch.randn(T, B, A, generator=g, dtype=torch.float64)
    fe = torch.randn(T, B, N, 3, generator=g, dtype=torch.float64)
    s0 = eng.initial_state(batch=B)
    s0 = eng.project(p, s0.replace(velocities=s0.velocities + 0.05 * torch.randn(s0.velocities.shape, generator=g,
                                                                                dtype=torch.float64)))
    return eng, hyps, s0, Inputs(motor_angles=u, motor_velocities=ud, external_forces=fe)


def _structures():
    out = [(name, load_structure(REPO_ROOT / "config" / "models" / f"{name}.yaml")) for name in MODELS]
    return out + [("small (constraints)", small_structure()), ("hoist (spring and cord laws)", hoist("spring", "cord"))]


#: the engine's defaults, and Baumgarte terms without the projection (with it, d.d' and the bar gaps are zero to
#: round-off at the start of every step, and the Baumgarte terms with them)
OPTIONS = ({}, {"baumgarte": (20.0, 50.0), "projection_iters": 0})


@pytest.mark.parametrize("options", OPTIONS, ids=("defaults", "baumgarte"))
@pytest.mark.parametrize("name,s", _structures(), ids=lambda x: x if isinstance(x, str) else "")
def test_native_equals_the_reference(name, s, options):
    """float64 to 1e-12 (positions) and 1e-10 (velocities), with every input, per-item parameters, on one and two
    threads; then without inputs and with parameters shared by the batch (the kernel's other loading path)."""
    eng, hyps, s0, inputs = _case(s, **options)
    T = inputs.motor_angles.shape[0]
    ref = eng.rollout(hyps, s0, inputs, 1e-3)
    for threads in (1, 2):
        X, V = native.rollout(eng.constants, hyps, s0.positions, s0.velocities, inputs.motor_angles,
                              inputs.motor_velocities, inputs.external_forces, T, 1e-3, eng.options, threads=threads)
        torch.testing.assert_close(X, ref.positions, rtol=0, atol=1e-12)
        torch.testing.assert_close(V, ref.velocities, rtol=0, atol=1e-10)
    p = eng.default_params()
    ref = eng.rollout(p, s0, None, 1e-3, steps=T)
    X, V = native.rollout(eng.constants, p, s0.positions, s0.velocities, None, None, None, T, 1e-3, eng.options)
    torch.testing.assert_close(X, ref.positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(V, ref.velocities, rtol=0, atol=1e-10)
    assert torch.isfinite(X).all()


def test_native_float32_and_the_engine_api(monkeypatch):
    """The float32 build follows the float64 reference to float32 round-off; ``NodalEngine.rollout(compile=True)``
    without a gradient runs the native kernel (inductor is never asked for a graph) and ``compiled_step`` too."""
    s = load_structure(REPO_ROOT / "config" / "models" / "stacked_manipulator.yaml")
    eng, hyps, s0, inputs = _case(s, B=20, T=50)
    ref = eng.rollout(hyps, s0, inputs, 1e-3)

    def no_inductor(*a, **kw):
        raise AssertionError("inductor was asked for a graph")

    monkeypatch.setattr(fast, "compiled", no_inductor)
    f32 = lambda t: t.float()       # noqa: E731
    with torch.no_grad():
        out = eng.rollout(hyps.map(f32), s0.map(f32), inputs.map(f32), 1e-3, compile=True)
    assert out.positions.dtype == torch.float32
    torch.testing.assert_close(out.positions.double(), ref.positions, rtol=0, atol=2e-5)
    torch.testing.assert_close(out.velocities.double(), ref.velocities, rtol=0, atol=2e-3)
    p = eng.default_params()
    one = s0.map(lambda t: t[:1])
    st = eng.compiled_step(p, one, inputs[0].map(lambda t: t[:1]), 1e-3)
    torch.testing.assert_close(st.positions, eng.step(p, one, inputs[0].map(lambda t: t[:1]), 1e-3).positions,
                               rtol=0, atol=1e-12)


def test_which_kernel_runs(monkeypatch):
    """``auto`` takes the native kernel for CPU semi-implicit rollouts without a gradient and inductor otherwise;
    ``native`` where it cannot run, or an unknown name, is a ValueError that says why / lists the valid names; a
    machine where the kernel does not build keeps to inductor, and says why."""
    f64 = torch.float64
    assert fast.choose_kernel("auto", "cpu", False, "semi_implicit", f64) == "native"
    assert fast.choose_kernel("auto", "cpu", True, "semi_implicit", f64) == "inductor"
    assert fast.choose_kernel("auto", "cpu", False, "implicit", f64) == "inductor"
    assert fast.choose_kernel("auto", "cuda", False, "semi_implicit", f64) == "inductor"
    assert fast.choose_kernel("auto", "cpu", False, "semi_implicit", torch.float16) == "inductor"
    assert fast.choose_kernel("inductor", "cpu", False, "semi_implicit", f64) == "inductor"
    with pytest.raises(ValueError, match="gradient"):
        fast.choose_kernel("native", "cpu", True, "semi_implicit", f64)
    with pytest.raises(ValueError, match="valid: auto, inductor, native"):
        fast.choose_kernel("fused", "cpu", False, "semi_implicit", f64)
    monkeypatch.setattr(native, "_LIBS", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    why = native.available(f64)
    assert why is not None and "no C compiler" in why and "kernel='inductor'" in why
    assert fast.choose_kernel("auto", "cpu", False, "semi_implicit", f64) == "inductor"
    with pytest.raises(ValueError, match="no C compiler"):
        fast.choose_kernel("native", "cpu", False, "semi_implicit", f64)


def test_native_with_a_gradient_is_refused():
    """Asked explicitly of a rollout that needs a gradient, the engine says so instead of returning detached
    states."""
    eng, hyps, s0, inputs = _case(small_structure(), B=3, T=2)
    k = hyps.stiffness.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="no backward pass"):
        eng.rollout(hyps.replace(stiffness=k), s0, inputs, 1e-3, compile=True, kernel="native")

