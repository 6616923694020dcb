"""CUDA graphs for rollouts that no derivative flows through: a chunk of steps captured once, then replayed.

Why: on a GPU the engine's step is hundreds of small kernels, and launching them from Python costs more than
running them. Measured on an H200 (2026-12-04, ``bench/bench_gpu.py``'s tangent part): the identification's
tangent step took 1.4-1.7 ms whatever the number of windows (1 to 64), most of it the eager primal step's
~150-300 launches, each with the dispatcher's and Python's overhead; ``identify --device cuda`` was 4.1x slower
than the same machine's CPU. A CUDA graph records the kernels of a chunk of steps once and replays them with one
launch: the same kernels on the same addresses, so the same numbers.

What a graph needs, and how the callers meet it:
- fixed shapes and addresses: every tensor the steps read (state, inputs, the parameters' derived quantities, the
  structure's constants) is copied into static buffers before each replay (:class:`CapturedCall`), so one graph
  per shape serves every parameter set (:func:`replay` keeps them); the last chunk's inputs are padded to the
  chunk length (:func:`chunked_steps`);
- no host synchronisation inside: the reference layout's bar-matrix inverse runs unrolled (Gauss-Jordan, only
  elementwise kernels) instead of LAPACK, whose singularity check reads a flag back to the host
  (:data:`CAPTURE_SOLVER`; test_engine_graphs.py checks that a step issues no synchronising operation);
- no gradients: autograd's graph is not recorded, so only rollouts that no derivative flows through use it
  (the residuals of Levenberg-Marquardt, the tangent model's primal, throughput).

On a CPU (the tests) ``capture=False`` runs the same data flow (static buffers, padding, copies) without a graph.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

#: ``TENSEGRITY_CUDA_GRAPHS=0`` in the environment turns the identification's graphs off (:func:`for_identification`)
ENV = "TENSEGRITY_CUDA_GRAPHS"

#: the reference layout's bar-matrix inverse inside a captured step (see the module docstring)
CAPTURE_SOLVER = "unrolled"
#: steps per captured chunk: one replay launches this many steps' kernels; longer chunks capture more kernels
#: once (the capture itself runs nothing, the warm-up runs one chunk eagerly)
CHUNK_STEPS = 32


#: the integrators whose steps can be captured: the implicit step's Cholesky factorisation checks its pivots on
#: the host (``torch.linalg.cholesky``), which a capture refuses
INTEGRATORS = ("semi_implicit", "rk4")


def unsuitable(device: torch.device, grad: bool, integrator: str) -> Optional[str]:
    """None when a rollout on ``device`` with ``integrator`` can be captured, else why not and how to fix."""
    if torch.device(device).type != "cuda":
        return f"CUDA graphs need a CUDA device (the tensors are on {torch.device(device).type}): leave cuda_graph off"
    if grad:
        return "a CUDA graph does not record autograd: pass tensors that need no gradient, or leave cuda_graph off"
    if integrator not in INTEGRATORS:
        return (f"the {integrator} step cannot be captured (valid: {', '.join(INTEGRATORS)}): its factorisation "
                f"reads a flag back to the host; leave cuda_graph off")
    return None


def require(device: torch.device, grad: bool, integrator: str) -> None:
    """ValueError, saying why and how to fix, where :func:`unsuitable` finds that a graph cannot run."""
    why = unsuitable(device, grad, integrator)
    if why is not None:
        raise ValueError(f"cuda_graph: {why}")


def for_identification(device: torch.device, grad: bool, integrator: str = "semi_implicit") -> bool:
    """Whether identification's rollouts on ``device`` run from CUDA graphs: its residual rollouts and the tangent
    model's primal, where no derivative flows through them, on CUDA, unless ``TENSEGRITY_CUDA_GRAPHS=0``."""
    return os.environ.get(ENV, "1") != "0" and unsuitable(device, grad, integrator) is None


class CapturedCall:
    """``fn(*args)``, recorded once as a CUDA graph for arguments shaped like ``example``.

    ``args`` is any tree of tensors and other values (torch's pytrees: tuples, dataclasses, named tuples). Every
    tensor of it is an input: calling copies the tensors into the graph's static buffers, replays the graph and
    returns the static outputs, which the NEXT call overwrites (copy what must outlive it). The other values are
    recorded as they were at the capture (:func:`replay` keys its cache on them). ``capture=False``: no graph,
    ``fn`` runs on the static buffers each call (the same data flow, for CPU tests).

    A tensor that is the very one of the previous call and unchanged since (same object, same version counter) is
    not copied again: a rollout's constants and parameters stay put from chunk to chunk, and at one step per
    replay their ~60 small copies took longer than the step (the icosahedron at batch 65 536 on an H200,
    2026-12-04: 65.8 M item-steps/s replayed against 164.8 M launched). A replay writes its outputs without
    counting a version, so this graph's own outputs passed back in (the next chunk's start state) are always
    copied, and so must be any tensor that another graph's replay rewrote in place (none of this module's callers
    passes one)."""

    def __init__(self, fn: Callable, example: Sequence, capture: bool = True):
        leaves, self.spec = pytree.tree_flatten(tuple(example))
        self.fn = fn
        self.static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        # (a weak reference to the tensor, its version) last copied into each buffer: weak, so that a graph kept
        # in the cache does not keep a finished rollout's inputs alive
        self.last = [None] * len(leaves)
        self.graph = None
        self.out = None
        # this graph's output tensors: the same objects at every replay (without a graph each call makes new ones,
        # which no later call can pass back as "the very one of the previous call")
        self.out_ids = set()
        if not capture:
            return
        # warm-up on a side stream (cuBLAS handles, the allocator, lazy initialisation), as torch's docs ask
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()
        self.out_ids = {id(t) for t in pytree.tree_leaves(self.out) if isinstance(t, torch.Tensor)}

    def _run(self):
        return self.fn(*pytree.tree_unflatten(self.static, self.spec))

    def __call__(self, *args):
        leaves = pytree.tree_leaves(tuple(args))
        if len(leaves) != len(self.static):
            raise ValueError(f"CapturedCall: {len(leaves)} leaves, captured with {len(self.static)}")
        for i, (buf, x) in enumerate(zip(self.static, leaves)):
            if not isinstance(buf, torch.Tensor) or buf.data_ptr() == x.data_ptr():
                continue
            last = self.last[i]
            if last is not None and last[0]() is x and last[1] == x._version and id(x) not in self.out_ids:
                continue
            buf.copy_(x)
            self.last[i] = (weakref.ref(x), x._version)
        if self.graph is None:
            self.out = self._run()
        else:
            self.graph.replay()
        return self.out


def _signature(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device)
    return ("value", x)


#: graphs kept per process (each holds its intermediates' device memory); the least recently used goes first
MAX_GRAPHS = 16
_GRAPHS: "OrderedDict[tuple, CapturedCall]" = OrderedDict()
_LOCK = threading.Lock()


def replay(name: str, fn: Callable, args: Sequence, capture: bool = True):
    """``fn(*args)`` from the graph of ``name`` captured for these arguments' structure, tensor shapes, dtypes and
    devices and other values, capturing it on the first call (:class:`CapturedCall`; at most :data:`MAX_GRAPHS`
    kept). Because every tensor is copied in, one graph serves every parameter set of a shape: identification's
    many rollouts of the same windows capture once. Returns the static outputs (overwritten by the next replay)."""
    leaves, spec = pytree.tree_flatten(tuple(args))
    key = (name, capture, spec, tuple(_signature(x) for x in leaves))
    with _LOCK:
        call = _GRAPHS.get(key)
        if call is None:
            call = _GRAPHS[key] = CapturedCall(fn, args, capture)
            while len(_GRAPHS) > MAX_GRAPHS:
                _GRAPHS.popitem(last=False)
        _GRAPHS.move_to_end(key)
        return call(*args)


def clear() -> None:
    """Forget every captured graph (their device memory is freed with them)."""
    with _LOCK:
        _GRAPHS.clear()


def chunked_steps(name: str, run_chunk: Callable, Q: torch.Tensor, V: torch.Tensor, consts: Sequence,
                  inputs: Sequence[Optional[torch.Tensor]], n: int, chunk: int = CHUNK_STEPS, capture: bool = True):
    """``n`` steps as replays of one captured chunk of ``K = min(chunk, n)`` steps (:func:`replay` under ``name``).

    run_chunk(Q, V, consts, inputs_chunk, K) -> (Qs, Vs), each (K, ...): K steps from (Q, V); ``consts``: a tree
    of what the steps read besides (the structure's and the parameters' tensors, options), copied in with the rest;
    ``inputs``: time-major tensors (n, ...) or None, sliced K steps at a time (the last slice padded with its last
    step, whose extra steps are computed and dropped). Returns Qs, Vs (n, ...), new tensors."""
    K = max(1, min(chunk, n))
    pad = (-n) % K

    def padded(x):
        return x if x is None or pad == 0 else torch.cat((x, x[-1:].expand(pad, *x.shape[1:])))

    inputs = [padded(x) for x in inputs]
    Qs = Q.new_empty((n,) + tuple(Q.shape))
    Vs = V.new_empty((n,) + tuple(V.shape))
    for k0 in range(0, n + pad, K):
        part = tuple(None if x is None else x[k0:k0 + K] for x in inputs)
        qs, vs = replay(name, run_chunk, (Q, V, consts, part, K), capture)
        m = min(K, n - k0)
        Qs[k0:k0 + m].copy_(qs[:m])
        Vs[k0:k0 + m].copy_(vs[:m])
        Q, V = Qs[k0 + m - 1], Vs[k0 + m - 1]
    return Qs, Vs
