"""The engine's CUDA-graph rollouts (engine/graphs.py) without a GPU: their data flow, and what a capture needs.

A CUDA graph replays recorded kernels on fixed buffers, so what can go wrong is the plumbing around it (inputs
copied into static buffers, the last chunk padded, outputs copied out before the next replay overwrites them) and
an operation that reads a value back to the host, which a capture refuses. The first is checked here with
``capture=False`` (the same data flow, the step run eagerly on the static buffers) against the plain rollouts; the
second by recording every operation a step dispatches. test_cuda.py checks the captured graphs on a GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensegrity_ros.engine import fast, graphs, laws, make_engine, nodal
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import REPO_ROOT

from test_engine_native import _case

#: aten operations that make the host wait for the device (a capture fails on them): reading a scalar, sizes that
#: depend on values, LAPACK's error check
SYNCING = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "_unique2", "unique_dim",
           "unique_consecutive", "_linalg_check_errors", "equal"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _manipulator(**options):
    return _case(load_structure(REPO_ROOT / "config" / "models" / "stacked_manipulator.yaml"), B=5, T=70, **options)


def test_captured_steps_equal_the_eager_steps():
    """70 steps in chunks of 32 (the last padded), every input, per-item parameters: the reference rollout's states
    to round-off (the bar matrix inverted unrolled instead of by LAPACK). Then other parameters and start states of
    the same shapes: the same graph, the new values copied in, their own states."""
    graphs.clear()
    assert graphs.CHUNK_STEPS < 70 and 70 % graphs.CHUNK_STEPS != 0       # several chunks, the last one padded
    for seed in (0, 1):
        eng, hyps, s0, inp = _case(load_structure(REPO_ROOT / "config" / "models" / "stacked_manipulator.yaml"),
                                   B=5, T=70, seed=seed)
        c = eng.constants
        der = nodal.prepare(c, hyps)
        Q, V = nodal.reduce(c, s0.positions), nodal.reduce(c, s0.velocities)
        u, ud, fq = nodal._inputs_reduced(c, inp)
        ref = laws.steps(nodal.BatchFirst.of(eng.options), c, der, Q, V, u, ud, fq, 1e-3, "semi_implicit",
                         eng.options, 70)
        got = nodal.steps_captured(c, der, Q, V, u, ud, fq, 1e-3, "semi_implicit", eng.options, 70, capture=False)
        for r, g in zip(ref, got):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r, rtol=0, atol=1e-11)
    assert len(graphs._GRAPHS) == 1          # one chunk shape (the padded last chunk has it too), one graph
    der2 = nodal.prepare(c, eng.default_params())
    nodal.steps_captured(c, der2, Q[:2], V[:2], u[:, :2], ud[:, :2], fq[:, :2], 1e-3, "semi_implicit",
                         eng.options, 70, capture=False)
    assert len(graphs._GRAPHS) == 2          # other shapes: another graph


def test_the_compiled_path_through_a_graph_equals_it_without():
    """fast._rollout with the chunks passed through a CapturedCall (capture off): the same positions and velocities
    as without, into the caller's output buffers and concatenated."""
    eng, hyps, s0, inp = _manipulator()
    c = eng.constants
    args = (c, hyps, s0.positions, s0.velocities, inp.motor_angles, inp.motor_velocities, inp.external_forces, 70,
            1e-3, "semi_implicit", eng.options, 8, False)
    X, V = fast._rollout(*args)
    Xg, Vg = fast._rollout(*args, cuda_graph=True, capture=False)
    torch.testing.assert_close(Xg, X, rtol=0, atol=0)
    torch.testing.assert_close(Vg, V, rtol=0, atol=0)
    out = (torch.empty_like(X), torch.empty_like(V))
    fast._rollout(*args, out=out, cuda_graph=True, capture=False)
    torch.testing.assert_close(out[0], X, rtol=0, atol=0)


@pytest.mark.parametrize("integrator", ("semi_implicit", "rk4", "implicit"))
def test_a_captured_step_never_waits_for_the_host(integrator):
    """What graphs.INTEGRATORS claims: the captured step (bar matrix unrolled) issues no synchronising operation for
    the integrators it lists, and the implicit step, which it refuses, does (its Cholesky factorisation's check)."""
    eng, hyps, s0, inp = _manipulator()
    c = eng.constants
    der = nodal.prepare(c, hyps)
    Q, V = nodal.reduce(c, s0.positions), nodal.reduce(c, s0.velocities)
    u, ud, fq = nodal._inputs_reduced(c, inp)
    opts = eng.options._replace(solver=graphs.CAPTURE_SOLVER)
    with _Ops() as ops:
        laws.steps(nodal.BatchFirst.of(opts), c, der, Q, V, u[:2], ud[:2], fq[:2], 1e-3, integrator, opts, 2)
    assert ops.names, "nothing recorded"
    assert (not (ops.names & SYNCING)) == (integrator in graphs.INTEGRATORS), sorted(ops.names & SYNCING)
    # and LAPACK's inverse, which the graphs avoid, does synchronise
    with _Ops() as ops:
        nodal.BatchFirst.of(eng.options).inverse(2 * torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
    assert "_linalg_check_errors" in ops.names


def test_a_graph_where_it_cannot_run_says_why(monkeypatch):
    eng = make_engine(load_structure(REPO_ROOT / "config" / "models" / "icosahedron.yaml"))
    p, s0 = eng.default_params(), eng.initial_state(batch=2)
    for compile in (False, True):
        with pytest.raises(ValueError, match="CUDA device"):
            eng.rollout(p, s0, None, 1e-3, steps=3, compile=compile, cuda_graph=True)
    assert "autograd" in graphs.unsuitable(torch.device("cuda"), True, "semi_implicit")
    assert "implicit step cannot be captured" in graphs.unsuitable(torch.device("cuda"), False, "implicit")
    assert graphs.unsuitable(torch.device("cuda"), False, "rk4") is None
    # identification uses them on CUDA only, and not when the environment turns them off
    assert not graphs.for_identification(torch.device("cpu"), False)
    assert graphs.for_identification(torch.device("cuda"), False)
    monkeypatch.setenv(graphs.ENV, "0")
    assert not graphs.for_identification(torch.device("cuda"), False)
    assert fast.KERNELS == ("auto", "inductor", "native")       # a graph is not a kernel: it replays one


def test_a_replay_copies_what_changed_and_skips_what_did_not():
    """CapturedCall's inputs: an unchanged tensor of the previous call is not copied again, one changed in place
    (its version counter moved) or a new one is, and the outputs follow."""
    a, b = torch.arange(3.0), torch.ones(3)
    call = graphs.CapturedCall(lambda x, y: (x + y,), [a, b], capture=False)
    torch.testing.assert_close(call(a, b)[0], a + b)
    call.static[1].fill_(100.0)            # were b copied again, the sum would not show this
    torch.testing.assert_close(call(a, b)[0], a + 100.0)
    b.add_(1.0)                            # in place: copied
    torch.testing.assert_close(call(a, b)[0], a + b)
    c = b.clone()                          # another tensor, the same values: copied
    call.static[1].fill_(100.0)
    torch.testing.assert_close(call(a, c)[0], a + c)
