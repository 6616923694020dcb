"""Differentiability and batching: gradcheck through multi-step rollouts w.r.t. every parameter kind,
batched == per item, float32, the string-force regression pieces, torch.compile == eager."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.autograd import gradcheck

from tensegrity_ros.engine import Inputs, make_engine, stack_params
from tensegrity_ros.engine.nodal import NodalConstants, expand, generalized_forces, prepare, reduce
from tensegrity_ros.model import load_structure, structure_from_dict

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_structure():
    """Two bars among four anchors, with a composite string through a midpoint node, one through a coincident
    node, two actuated strings (directions +1 and -1). All strings start stretched (rest = 0.8 x length)."""
    pos = {"f1": [0, 0, 0], "f2": [1, 0, 0], "f3": [0, 1, 0], "f4": [0.2, 0.2, 1.5],
           "a": [0.3, 0.3, 0.5], "b": [0.6, 0.5, 1.0], "c": [0.8, 0.2, 0.4], "d": [0.2, 0.7, 0.9]}
    pos["m"] = [(x + y) / 2 for x, y in zip(pos["c"], pos["d"])]
    pos["v"] = list(pos["b"])
    fixed = {"f1", "f2", "f3", "f4"}
    nodes = [{"name": n, "position": p, **({"fixed": True} if n in fixed else {})} for n, p in pos.items()]
    paths = {"s1": (["f1", "a"], None), "s2": (["f2", "m", "f3"], "m1"), "s3": (["f4", "v", "d"], None),
             "s4": (["a", "c"], None), "s5": (["c", "f2"], "m2"), "s6": (["d", "f3"], None), "s7": (["a", "f4"], None)}
    strings = []
    for k, (name, (path, act)) in enumerate(paths.items()):
        L = sum(math.dist(pos[x], pos[y]) for x, y in zip(path[:-1], path[1:]))
        strings.append({"name": name, "nodes": path, "stiffness": 80.0 + 10 * k, "damping": 2.0 + 0.5 * k,
                        "rest_length": round(0.8 * L, 6), **({"actuator": act} if act else {})})
    return structure_from_dict({
        "name": "small", "gravity": [0, 0, -9.81], "nodes": nodes,
        "bars": [{"name": "b1", "nodes": ["a", "b"], "mass": 1.0}, {"name": "b2", "nodes": ["c", "d"], "mass": 1.5}],
        "strings": strings,
        "constraints": [{"type": "midpoint", "node": "m", "between": ["c", "d"]},
                        {"type": "coincident", "nodes": ["b", "v"]}],
        "actuators": [{"name": "m1", "motor_id": 1, "spool_radius": 0.02, "direction": 1, "zero_offset": 0.1},
                      {"name": "m2", "motor_id": 2, "spool_radius": 0.015, "direction": -1, "zero_offset": -0.2}]})


def small_rod_structure():
    """The seed's spring-rod element with an actuated first spring (simple strings, stretched)."""
    return structure_from_dict({
        "name": "rod", "gravity": [0, 0, -9.81],
        "nodes": [{"name": "nail1", "position": [-1, 0, 1], "fixed": True},
                  {"name": "nail2", "position": [2, 0, 1], "fixed": True},
                  {"name": "n1", "position": [-1, 0, 0]}, {"name": "n2", "position": [1, 0, 0]}],
        "bars": [{"name": "rod", "nodes": ["n1", "n2"], "mass": 10.0, "radius": 0.02}],
        "strings": [{"name": "s1", "nodes": ["nail1", "n1"], "stiffness": 100.0, "damping": 10.0, "rest_length": 0.8,
                     "actuator": "m1"},
                    {"name": "s2", "nodes": ["nail2", "n2"], "stiffness": 100.0, "damping": 10.0, "rest_length": 1.2}],
        "actuators": [{"name": "m1", "motor_id": 1, "spool_radius": 0.02, "direction": 1, "zero_offset": 0.3}]})


def _motor_inputs(T, A, dt=0.01):
    t = dt * torch.arange(T, dtype=torch.float64)
    u = torch.stack([0.5 * torch.sin(3 * t + k) for k in range(A)], -1).unsqueeze(1)
    ud = torch.stack([1.5 * torch.cos(3 * t + k) for k in range(A)], -1).unsqueeze(1)
    return u, ud


KINDS = ["stiffness", "damping", "rest_length", "mass", "spool_radius", "zero_offset"]


@pytest.mark.parametrize("integrator", ["semi_implicit", "rk4", "implicit"])
def test_gradcheck_nodal_rollout(integrator):
    s = small_structure()
    eng = make_engine(s, "nodal", integrator)
    p0 = eng.default_params()
    torch.manual_seed(0)
    s0 = eng.project(p0, eng.initial_state(velocities=0.05 * torch.randn(len(s.nodes), 3, dtype=torch.float64)))
    u, ud = _motor_inputs(5, 2)
    f_ext = 0.3 * torch.randn(5, 1, len(s.nodes), 3, dtype=torch.float64)
    inputs = Inputs(motor_angles=u, motor_velocities=ud, external_forces=f_ext)
    # the gate must stay open along the trajectory (gradcheck needs a smooth function)
    st = eng.rollout(p0, s0, inputs, 0.01)
    assert bool((eng.string_state(p0, st[-1], inputs[-1]).D > 0).all())
    for kind in KINDS:
        x0 = getattr(p0, kind).clone().requires_grad_(True)

        def f(x, kind=kind):
            return eng.rollout(p0.replace(**{kind: x}), s0, inputs, 0.01).positions

        assert gradcheck(f, (x0,), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True), kind


def test_gradcheck_nodal_state_and_inputs():
    """Gradients w.r.t. the initial state and the motor angles (for model-based control)."""
    s = small_structure()
    eng = make_engine(s)
    p = eng.default_params()
    s0 = eng.initial_state()
    u, ud = _motor_inputs(4, 2)

    def f(x, uu):
        return eng.rollout(p, s0.replace(positions=x), Inputs(motor_angles=uu, motor_velocities=ud), 0.01).positions

    assert gradcheck(f, (s0.positions.clone().requires_grad_(True), u.clone().requires_grad_(True)),
                     eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


@pytest.mark.parametrize("integrator", ["semi_implicit", "rk4"])
def test_gradcheck_spring_rod_rollout(integrator):
    s = small_rod_structure()
    eng = make_engine(s, "spring_rod", integrator)
    p0 = eng.default_params()
    s0 = eng.initial_state(velocities=torch.tensor([[0, 0, 0], [0, 0, 0], [0.1, 0.2, -0.1], [-0.1, 0.3, 0.2]],
                                                   dtype=torch.float64))
    u, ud = _motor_inputs(5, 1)
    torch.manual_seed(1)
    inputs = Inputs(motor_angles=u, motor_velocities=ud,
                    control_forces=5.0 * torch.randn(5, 1, 1, 3, dtype=torch.float64),
                    control_arms=torch.tensor([0.0, 0.0, 0.4], dtype=torch.float64).expand(5, 1, 1, 3))
    for kind in KINDS + ["control_force_scalar"]:
        x0 = getattr(p0, kind).clone().requires_grad_(True)

        def f(x, kind=kind):
            st = eng.rollout(p0.replace(**{kind: x}), s0, inputs, 0.01)
            return torch.cat((st.positions.flatten(), st.rod_orientations.flatten()))

        assert gradcheck(f, (x0,), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True), kind


def test_gradient_through_unconstrained_params():
    from tensegrity_ros.engine import from_unconstrained, to_unconstrained
    s = small_structure()
    eng = make_engine(s)
    p0 = eng.default_params()
    z = to_unconstrained(p0).clone().requires_grad_(True)
    loss = eng.rollout(from_unconstrained(z, p0), eng.initial_state(), None, 0.01, steps=5).positions.square().sum()
    (g,) = torch.autograd.grad(loss, z)
    assert g.shape == z.shape and bool(torch.isfinite(g).all())
    assert float(g.abs().sum()) > 0


def test_forward_mode_jacobian_matches_reverse():
    """torch.func.jacfwd through a rollout (used for parameter uncertainty) == reverse mode."""
    from tensegrity_ros.engine import from_unconstrained, to_unconstrained
    s = small_structure()
    eng = make_engine(s, integrator="implicit")
    p0 = eng.default_params()
    u, ud = _motor_inputs(4, 2)
    inputs = Inputs(motor_angles=u, motor_velocities=ud)
    s0 = eng.initial_state()

    def f(z):
        return eng.rollout(from_unconstrained(z, p0), s0, inputs, 0.01).positions[-1].flatten()

    z0 = to_unconstrained(p0)
    torch.testing.assert_close(torch.func.jacfwd(f)(z0), torch.autograd.functional.jacobian(f, z0),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("backend", ["nodal", "spring_rod"])
def test_batched_params_equal_per_item(backend):
    """Three parameter hypotheses at once == three separate runs (params batch broadcast over state batch 1)."""
    s = small_structure() if backend == "nodal" else small_rod_structure()
    eng = make_engine(s, backend)
    p = eng.default_params()
    hyps = [p, p.replace(stiffness=1.3 * p.stiffness, mass=0.7 * p.mass),
            p.replace(damping=0.5 * p.damping, rest_length=0.97 * p.rest_length, spool_radius=1.2 * p.spool_radius)]
    u, ud = _motor_inputs(20, len(s.actuators))
    inputs = Inputs(motor_angles=u, motor_velocities=ud)
    s0 = eng.initial_state()
    batched = eng.rollout(stack_params(hyps), s0, inputs, 0.005)
    assert batched.positions.shape == (20, 3, len(s.nodes), 3)
    for i, h in enumerate(hyps):
        single = eng.rollout(h, s0, inputs, 0.005)
        torch.testing.assert_close(batched.positions[:, i:i + 1], single.positions, rtol=0, atol=1e-12)
    # and a state batch of 3 with per-item params
    s3 = eng.initial_state(batch=3)
    both = eng.rollout(stack_params(hyps), s3, inputs, 0.005)
    torch.testing.assert_close(both.positions, batched.positions, rtol=0, atol=1e-12)


def test_float32_and_device_follow_inputs():
    s = load_structure(MODELS / "icosahedron.yaml")
    eng = make_engine(s)
    p = eng.default_params()
    torch.manual_seed(2)
    s0 = eng.project(p, eng.initial_state(velocities=0.3 * torch.randn(12, 3, dtype=torch.float64)))
    ref = eng.rollout(p, s0, None, 1e-3, steps=300)
    # float64 engine constants, float32 state and params: computation follows the state
    s32 = s0.map(lambda t: t.float())
    out = eng.rollout(p.map(lambda t: t.float()), s32, None, 1e-3, steps=300)
    assert out.positions.dtype == torch.float32 and out.positions.device == s32.positions.device
    assert float((out.positions.double() - ref.positions).abs().max()) < 1e-4
    assert float(eng.bar_length_error(out).max()) < 1e-5
    # a float32 engine gives float32 defaults
    e32 = make_engine(s, dtype=torch.float32)
    assert e32.default_params().mass.dtype == torch.float32 and e32.initial_state().positions.dtype == torch.float32


def test_string_unit_forces_reconstruct_engine_forces():
    """F = sum_c k_c A_c + zeta_c B_c + sum_b m_b W_b reproduces the engine's nodal forces (reduced: T^T F)."""
    s = small_structure()
    eng = make_engine(s)
    p = eng.default_params()
    torch.manual_seed(3)
    st = eng.project(p, eng.initial_state(velocities=0.2 * torch.randn(len(s.nodes), 3, dtype=torch.float64)))
    u, ud = torch.tensor([[0.3, -0.1]], dtype=torch.float64), torch.tensor([[0.5, 0.2]], dtype=torch.float64)
    uf = eng.string_unit_forces(p, st, Inputs(motor_angles=u, motor_velocities=ud))
    F = (torch.einsum("c,bcnk->bnk", p.stiffness, uf.stiffness) + torch.einsum("c,bcnk->bnk", p.damping, uf.damping)
         + torch.einsum("b,nbk->nk", p.mass, uf.gravity))
    c = eng.constants
    der = prepare(c, p)
    Fq = generalized_forces(c, der, reduce(c, st.positions), reduce(c, st.velocities), u, ud, None)
    torch.testing.assert_close(F.mT @ c.T, Fq, rtol=1e-12, atol=1e-12)
    assert bool(uf.active.all())
    # and the reduced mass matrix pieces are linear in the masses
    Mq = eng.mass_matrix(p)
    torch.testing.assert_close(Mq, c.T.T @ eng.mass_matrix(p, reduced=False) @ c.T)


@pytest.mark.parametrize("integrator", ["semi_implicit", "rk4", "implicit"])
def test_fast_layout_matches_reference(integrator):
    """The batch-last throughput path (what torch.compile runs) == the reference, eagerly (float64)."""
    from tensegrity_ros.engine import fast
    s = small_structure()
    eng = make_engine(s, integrator=integrator, baumgarte=(5.0, 10.0))
    hyps = stack_params([eng.default_params(), eng.default_params().replace(mass=torch.tensor([1.3, 0.8],
                                                                                              dtype=torch.float64))])
    u, ud = _motor_inputs(6, 2)
    torch.manual_seed(5)
    fe = torch.randn(6, 2, len(s.nodes), 3, dtype=torch.float64)
    s0 = eng.initial_state(batch=2)
    ref = eng.rollout(hyps, s0, Inputs(motor_angles=u, motor_velocities=ud, external_forces=fe), 0.01)
    X, V = fast.rollout(eng.constants, hyps, s0.positions, s0.velocities, u, ud, fe, 6, 0.01, integrator,
                        eng.options, chunk=4, compile=False, sub_batch=1 if integrator == "rk4" else None)
    torch.testing.assert_close(X, ref.positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(V, ref.velocities, rtol=0, atol=1e-11)


@pytest.mark.parametrize("integrator", ["semi_implicit", "implicit"])
def test_fast_layout_gradients(integrator):
    """The batch-last path's own derivatives (the constant products through their transposes' gathers, the bar
    matrix's inverse as -A^-1 dA A^-1: fast._ConstantProduct, fast._Inverse), eagerly: gradcheck against finite
    differences w.r.t. masses, stiffnesses and initial positions, and equal to the reference layout's gradients
    for every parameter kind (float64)."""
    from tensegrity_ros.engine import fast
    s = small_structure()
    eng = make_engine(s, integrator=integrator, baumgarte=(5.0, 10.0))
    p = eng.default_params()
    u, ud = _motor_inputs(5, 2)
    s0 = eng.initial_state()
    torch.manual_seed(3)
    X0 = s0.positions + 1e-3 * torch.randn_like(s0.positions) * (eng.constants.T.sum(1) != 0)[:, None]

    def fast_final(mass, stiffness, X):
        q = p.replace(mass=mass, stiffness=stiffness)
        Xs, _ = fast.rollout(eng.constants, q, X, s0.velocities, u, ud, None, 5, 0.01, integrator, eng.options,
                             compile=False)
        return Xs[-1]

    assert gradcheck(fast_final, (p.mass.clone().requires_grad_(True), p.stiffness.clone().requires_grad_(True),
                                  X0.clone().requires_grad_(True)))
    leaves = {k: getattr(p, k).clone().requires_grad_(True) for k in KINDS}
    q = p.replace(**leaves)
    Xs, Vs = fast.rollout(eng.constants, q, X0, s0.velocities, u, ud, None, 5, 0.01, integrator, eng.options,
                          compile=False)
    g_fast = torch.autograd.grad((Xs[-1].square().sum() + Vs[-1].square().sum()), list(leaves.values()))
    leaves = {k: getattr(p, k).clone().requires_grad_(True) for k in KINDS}
    ref = eng.rollout(p.replace(**leaves), s0.replace(positions=X0), Inputs(motor_angles=u, motor_velocities=ud), 0.01)
    g_ref = torch.autograd.grad(ref.positions[-1].square().sum() + ref.velocities[-1].square().sum(),
                                list(leaves.values()))
    for kind, a, b in zip(KINDS, g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{kind}: {m}")


def test_compiled_paths_match_eager():
    """torch.compile path (batch-last fast path, ``kernel="inductor"``) == eager reference: float64 to 1e-12, and
    gradients flow; without a gradient too (the graph ``compiled_step`` runs where the native kernel does not
    apply; test_engine_native.py checks the native one)."""
    s = small_structure()
    eng = make_engine(s)
    p = eng.default_params()
    u, ud = _motor_inputs(4, 2)
    inputs = Inputs(motor_angles=u, motor_velocities=ud)
    s0 = eng.initial_state()
    ref = eng.rollout(p, s0, inputs, 0.01)
    k = p.stiffness.clone().requires_grad_(True)
    out = eng.rollout(p.replace(stiffness=k), s0, inputs, 0.01, compile=True)
    torch.testing.assert_close(out.positions, ref.positions, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.velocities, ref.velocities, rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(out.positions[-1].square().sum(), k)
    k2 = p.stiffness.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(eng.rollout(p.replace(stiffness=k2), s0, inputs, 0.01).positions[-1].square().sum(),
                                   k2)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
    st = s0                                   # inductor's graph without a gradient (one step per rollout)
    with torch.no_grad():
        for t in range(4):
            st = eng.rollout(p, st, inputs[t:t + 1], 0.01, compile=True, kernel="inductor")[0]
    torch.testing.assert_close(st.positions, ref.positions[-1], rtol=0, atol=1e-12)


def test_rollout_runs_pieces_on_threads(monkeypatch):
    """The batch-last rollout's pieces on threads (``fast.rollout``: what a compiled semi-implicit CPU rollout with
    more than one torch thread and no gradient does, each piece in code compiled without OpenMP regions): per-item
    parameters, inputs and external forces land in their items (== the reference, float64, 1e-12), the pieces ran
    on two threads, torch's thread count is restored, and an error in a piece reaches the caller. Who gets
    threads (``piece_threads``) and how the batch is split (``batch_pieces``) are checked as functions. Run on
    the eager steps, so that the suite compiles no further graph (inductor's code for ``cpp.threads = 1`` is what
    it writes for one torch thread, which ``test_compiled_paths_match_eager`` compiles and checks)."""
    import threading

    from tensegrity_ros.engine import fast
    s = small_structure()
    eng = make_engine(s)
    B, T = 70, 5
    torch.manual_seed(11)
    p = eng.default_params()
    hyps = p.map(lambda t: t.expand(B, *t.shape).clone())
    hyps = hyps.replace(mass=hyps.mass * (1 + 0.2 * torch.rand(B, 1, dtype=torch.float64)))
    u, ud = _motor_inputs(T, 2)
    u = u + 0.1 * torch.randn(T, B, 2, dtype=torch.float64)
    fe = torch.randn(T, B, len(s.nodes), 3, dtype=torch.float64)
    inputs = Inputs(motor_angles=u, motor_velocities=ud.expand(T, B, 2), external_forces=fe)
    s0 = eng.initial_state(batch=B)
    ref = eng.rollout(hyps, s0, inputs, 0.01)
    # the split: equal pieces, a multiple of the threads, none under the least work a thread gets
    assert [(sl.start, sl.stop) for sl in fast.batch_pieces(1024, 256, 2, 228)[0]] == \
        [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert fast.batch_pieces(1024, None, 2, 342)[1] == 2 and len(fast.batch_pieces(1024, None, 2, 342)[0]) == 2
    assert fast.batch_pieces(256, None, 2, 342) == ([slice(0, 256)], 1)       # too small to share: one thread
    assert fast.batch_pieces(1024, 256, 1, 228) == ([slice(0, 256), slice(256, 512), slice(512, 768),
                                                     slice(768, 1024)], 1)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fast.piece_threads(True, "cpu", False, "semi_implicit") == 2
        assert fast.piece_threads(True, "cpu", True, "semi_implicit") == 1     # a gradient: pieces in turn
        assert fast.piece_threads(True, "cpu", False, "implicit") == 1         # left on OpenMP's threads
        assert fast.piece_threads(True, "cuda", False, "semi_implicit") == 1
        assert fast.piece_threads(False, "cpu", False, "semi_implicit") == 1

        asked, calls = [], []
        real_threads, real_rollout = fast.piece_threads, fast._rollout

        def threads(compile, device_type, grad, integrator):   # as if compiled: the eager steps on threads
            asked.append(grad)
            return real_threads(True, device_type, grad, integrator)

        def spy(*a, **kw):
            calls.append((threading.get_ident(), a[13] if len(a) > 13 else False))     # ``serial``
            return real_rollout(*a, **kw)

        monkeypatch.setattr(fast, "piece_threads", threads)
        monkeypatch.setattr(fast, "_rollout", spy)
        monkeypatch.setattr(fast, "THREAD_PIECE_WORK", 35 * eng.constants.free_idx.numel())   # this batch: 2 x 35
        X, V = fast.rollout(eng.constants, hyps, s0.positions, s0.velocities, u, ud.expand(T, B, 2), fe, T, 0.01,
                            eng.integrator, eng.options, compile=False)
        torch.testing.assert_close(X, ref.positions, rtol=0, atol=1e-12)
        torch.testing.assert_close(V, ref.velocities, rtol=0, atol=1e-11)
        assert len(calls) == 2 and all(serial for _, serial in calls), calls
        assert len({tid for tid, _ in calls}) == 2, "both pieces ran on one thread"
        assert torch.get_num_threads() == 2 and asked == [False]

        calls.clear()                                  # a gradient asked of one parameter: in turn, here
        k = hyps.stiffness.clone().requires_grad_(True)
        X, _ = fast.rollout(eng.constants, hyps.replace(stiffness=k), s0.positions, s0.velocities, u,
                            ud.expand(T, B, 2), fe, T, 0.01, eng.integrator, eng.options, compile=False)
        torch.testing.assert_close(X.detach(), ref.positions, rtol=0, atol=1e-12)
        assert asked == [False, True] and len(calls) == 1 and calls[0][0] == threading.get_ident()

        started = []

        def failing(*a, **kw):                         # the second piece fails, whichever thread took it
            started.append(1)
            if len(started) == 2:
                raise RuntimeError("piece failed")
            return real_rollout(*a, **kw)

        monkeypatch.setattr(fast, "_rollout", failing)
        with torch.no_grad(), pytest.raises(RuntimeError, match="piece failed"):
            fast.rollout(eng.constants, hyps, s0.positions, s0.velocities, u, ud.expand(T, B, 2), fe, T, 0.01,
                         eng.integrator, eng.options, compile=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_large_tensors_in_huge_pages():
    """Importing the engine puts PyTorch's large CPU allocations (a rollout's outputs) in transparent huge pages
    (``THP_MEM_ALLOC_ENABLE``, set unless the user set it; docs/engine.md): a fresh 64-MB tensor is backed by
    huge pages, and a user's ``0`` is kept (and, where the kernel gives huge pages only to those who ask, is not).
    Fresh interpreters, because the allocator reads the setting once. Skipped where the kernel has them off."""
    import os
    import subprocess
    import sys
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off in this kernel")
    defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag")
    if not defrag.exists() or not any(m in defrag.read_text() for m in ("[always]", "[madvise]", "[defer+madvise]")):
        pytest.skip("this kernel does not fault huge pages in when asked (defrag setting), so none may be there")
    probe = ("import os, re, torch; import tensegrity_ros.engine; x = torch.ones(16 << 20); "
             "kb = sum(int(v) for v in re.findall(r'AnonHugePages:\\s+(\\d+)', open('/proc/self/smaps').read())); "
             "print(os.environ['THP_MEM_ALLOC_ENABLE'], kb)")

    def run(**env):
        e = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        out = subprocess.run([sys.executable, "-c", probe], env={**e, **env}, capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
        return out[0], int(out[1])

    setting, huge_kb = run()
    assert setting == "1" and huge_kb >= 32 << 10, (setting, huge_kb)
    setting, huge_kb = run(THP_MEM_ALLOC_ENABLE="0")
    assert setting == "0"
    if "[madvise]" in mode.read_text():     # with ``always`` the kernel backs large mappings with huge pages itself
        assert huge_kb < 32 << 10, huge_kb


def test_the_recompile_limit_holds_on_worker_threads():
    """torch's dynamo config is per thread: the engine's recompile limit, set in the thread that builds a compiled
    function, must still hold where the engine's worker threads call it (fast.rollout runs a batch's pieces there).
    Before compile_fn, the 9th shape seen on a worker thread ran uncompiled for the rest of the process (stop 52's
    make bench: the manipulator's compiled rows at 0.17x eager)."""
    import threading
    from tensegrity_ros.engine._common import RECOMPILE_LIMIT, compile_fn

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(tuple(example_inputs[0].shape))
        return gm.forward

    def f(x):
        return torch.sin(x) * 2.0

    fn = compile_fn(f, dynamic=False, backend=counting_backend)
    shapes = [(n,) for n in range(1, 13)]          # 12 graphs: more than torch's default limit of 8
    assert len(shapes) < RECOMPILE_LIMIT
    errors = []

    def worker():
        try:
            for s in shapes:
                x = torch.rand(s)
                torch.testing.assert_close(fn(x), torch.sin(x) * 2.0)
        except Exception as exc:   # surfaced below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert sorted(graphs) == shapes, f"compiled {len(graphs)} of {len(shapes)} shapes on the worker thread"
