"""Throughput path of the nodal engine: the equations of :mod:`.laws`, in a batch-LAST layout.

Every quantity carries the batch as its last axis (Q: (3, n_free, B), string vectors (S, B), bar matrices
(nba, nba, B)) and every product with a constant matrix is written as a gather or an elementwise product and
sum. Under ``torch.compile`` (inductor, CPU) that becomes a handful of loops vectorised over the batch,
instead of many tiny matrix multiplies (the reference layout of :mod:`.nodal` vectorises over 3..12-long
axes).

What is shared with the reference (:mod:`.nodal`), and defined once in :mod:`.laws`: the structure's
constants (:class:`.laws.NodalConstants`), the per-params quantities (one :func:`.laws.prepare`, moved batch
last by :meth:`.laws.Derived.batch_last`), the string law (rest lengths from the actuators, cord/spring
stiffness, damping, the tension-only clamp), the generalised forces, the bar-constraint multipliers with
Baumgarte terms, the projection, the implicit step and the step loop (:func:`.laws.steps`). This module
adds only the layout (:class:`BatchLast`): the gather products, and SPD solvers unrolled into elementwise
updates over the batch (Gauss-Jordan for the bar matrix, one diagonal block at a time, the blocks of one size
as one batch; a left-looking Cholesky for the implicit step), because a LAPACK call per batch item does not
fuse into inductor's loops; plus the layout conversions and the chunked, compiled rollout driver, whose graph
writes the full-layout outputs itself (:func:`steps_full`).

Used by ``NodalEngine.rollout(..., compile=True)`` and ``NodalEngine.compiled_step``; tested equal to the
reference layout (float64: 1e-12).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from . import laws
from ._common import differentiated, torch_threads
from .laws import NodalConstants, Options
from .params import Params


def _gather(X: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """X (..., k_in, B) @ M in gather form -> (..., k_out, B)."""
    return (X[..., idx, :] * w.unsqueeze(-1)).sum(-2)


class _ConstantProduct(torch.autograd.Function):
    """X @ M for a constant M, as a gather (forward) whose derivative is the gather of M^T.

    Autograd's own derivative of the indexing is a scatter-add, which inductor compiles to atomic vector adds
    on CPU. Measured 2026-11-27 (manipulator, 20 steps at batch 1024): with both derivatives here the compiled
    backward took 98 ms, with only :class:`_Inverse` about 420 ms, eager 190-290 ms."""

    generate_vmap_rule = True

    @staticmethod
    def forward(X, idx, w, idx_t, w_t):
        return _gather(X, idx, w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[3:])

    @staticmethod
    def backward(ctx, g):
        idx_t, w_t = ctx.saved_tensors
        return _gather(g, idx_t, w_t), None, None, None, None


def _product(X: torch.Tensor, c: NodalConstants, name: str) -> torch.Tensor:
    """X (..., k_in, B) @ (the constant matrix ``name`` of c) in gather form, differentiated through its
    transpose's (:class:`_ConstantProduct`) when a backward pass needs it. Otherwise (no grad, or forward-mode AD)
    the plain gather: no custom ``jvp`` (dynamo cannot trace one)."""
    idx, w = getattr(c, name + "_i"), getattr(c, name + "_w")
    if not (torch.is_grad_enabled() and X.requires_grad):
        return _gather(X, idx, w)
    t = laws.GATHER_TRANSPOSE[name]
    return _ConstantProduct.apply(X, idx, w, getattr(c, t + "_i"), getattr(c, t + "_w"))


def _bmm(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Batch-last matrix product X (n, k, B) @ Y (k, m, B) -> (n, m, B), as a broadcast product and sum, which
    inductor fuses into one reduction loop over the batch (``torch.bmm`` on these strides ran one small product
    per batch item inside the compiled backward)."""
    return (X.unsqueeze(2) * Y.unsqueeze(0)).sum(1)


class _Inverse(torch.autograd.Function):
    """A^-1 by unrolled Gauss-Jordan, differentiated as d(A^-1) = -A^-1 dA A^-1.

    Why not let autograd go through the elimination: its backward replays the n elimination steps, each over the
    whole (n, 2n, B) working matrix, saved or recomputed (n x 2.6 MB per step for the manipulator's 18 bars at
    batch 1024, far beyond the cache; profiled 2026-11-27: 18 elimination passes in the compiled backward,
    which, with the gathers' scatter-adds, made the compiled manipulator with gradients slower than eager: 24-32 k
    against 36 k item-steps/s). The identity needs only A^-1 and two products."""

    generate_vmap_rule = True

    @staticmethod
    def forward(A: torch.Tensor) -> torch.Tensor:
        return _gauss_jordan(A).contiguous()     # saved for backward: not a view keeping (n, 2n, B) alive

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (Ainv,) = ctx.saved_tensors
        At = Ainv.transpose(0, 1)
        return -_bmm(_bmm(At, g), At)


def _inverse(A: torch.Tensor) -> torch.Tensor:
    """Inverse of SPD matrices A (n, n, B): Gauss-Jordan, with the analytic derivative (:class:`_Inverse`) when
    a backward pass needs one (no custom ``jvp``: dynamo cannot trace one; forward-mode AD goes through the
    elimination)."""
    if torch.is_grad_enabled() and A.requires_grad:
        return _Inverse.apply(A)
    return _gauss_jordan(A)


def _gauss_jordan(A: torch.Tensor) -> torch.Tensor:
    """Gauss-Jordan inverse of SPD matrices A (n, n, B) (no pivoting)."""
    n = A.shape[0]
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    M = torch.cat([A, eye.unsqueeze(-1).expand(n, n, A.shape[-1])], dim=1)     # (n, 2n, B)
    for k in range(n):
        piv = M[k:k + 1] / M[k:k + 1, k:k + 1]                                   # (1, 2n, B)
        col = M[:, k:k + 1] - eye[:, k:k + 1].unsqueeze(-1)                      # (n, 1, B)
        M = M - col * piv
    return M[:, n:]


def _cholesky(K: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor L (n, n, B) of SPD matrices K (n, n, B): left-looking, one fused column update
    per (j, k) pair, no growing concatenations (they defeat inductor's fusion)."""
    n = K.shape[0]
    rows = torch.arange(n, device=K.device).unsqueeze(-1)
    cols = []
    for j in range(n):
        v = K[:, j]                                                           # (n, B)
        for k in range(j):
            v = v - cols[k] * cols[k][j:j + 1]
        col = v / torch.sqrt(v[j:j + 1])
        cols.append(torch.where(rows >= j, col, torch.zeros_like(col)))
    return torch.stack(cols, 1)


def _chol_solve(L: torch.Tensor, r: torch.Tensor, n: Optional[int] = None) -> torch.Tensor:
    """Solve (L L^T) x = r with the leading n x n block of the Cholesky factor L (N, N, B); r: (n, B)."""
    n = L.shape[0] if n is None else n
    if n == 0:
        return r
    L = L[:n, :n]
    y = []
    for i in range(n):                                                         # L y = r
        acc = r[i]
        for k in range(i):
            acc = acc - L[i, k] * y[k]
        y.append(acc / L[i, i])
    x = [None] * n
    for i in reversed(range(n)):                                               # L^T x = y
        acc = y[i]
        for k in range(i + 1, n):
            acc = acc - L[k, i] * x[k]
        x[i] = acc / L[i, i]
    return torch.stack(x, 0)


class BatchLast(laws.Layout):
    """The batch-last layout: vectors (n, B), coordinate arrays (3, n, B), matrices (n, m, B); per-params
    tensors with their params batch last (Bp = 1 or B). Gathers and elementwise products only, and unrolled
    solvers (see the module docstring)."""

    ent = -2

    def mul(self, X, c, name):
        return _product(X, c, name)

    def dense(self, X, M):
        """X (..., k_in, B) times M (k_in, k_out, Bp) -> (..., k_out, B)."""
        return (X.unsqueeze(-2) * M).sum(-3)

    def motor(self, Y, x):
        return (Y * x.unsqueeze(0)).sum(1)

    def gram(self, a, b):
        return (a.unsqueeze(2) * b.unsqueeze(1)).sum(0)

    def matvec(self, M, x):
        return (M * x.unsqueeze(0)).sum(1)

    def inverse(self, A):
        return _inverse(A)

    def block_inverse(self, A, groups, assemble):
        B = A.shape[-1]
        parts = []
        for g in groups:                                                  # blocks of one size m, as one batch
            n_blocks, m = g.shape
            sub = A[g.unsqueeze(-1), g.unsqueeze(-2)]                     # (n_blocks, m, m, B)
            inv = _inverse(sub.permute(1, 2, 0, 3).reshape(m, m, n_blocks * B))
            parts.append(inv.reshape(m, m, n_blocks, B).permute(2, 0, 1, 3).reshape(n_blocks * m * m, B))
        parts.append(A.new_zeros(1, B))
        return torch.cat(parts)[assemble].reshape(A.shape)

    def cholesky(self, K):
        return _cholesky(K)

    def chol_solve(self, L, r, n=None):
        return _chol_solve(L, r, n)


LAYOUT = BatchLast()


def prepare_fast(c: NodalConstants, p: Params) -> laws.Derived:
    """:func:`.laws.prepare`, batch last."""
    return laws.prepare(c, p).batch_last()


def step(c: NodalConstants, der: laws.Derived, Q, V, u, udot, fext, dt: float, integrator: str, opts: Options):
    """One step, batch last: Q, V (3, n_free, B); u, udot (A, B); fext (3, n_free, B) or None."""
    return laws.step(LAYOUT, c, der, Q, V, u, udot, fext, dt, integrator, opts)


def steps(c: NodalConstants, der: laws.Derived, Q, V, u, udot, fext, dt: float, integrator: str, opts: Options,
          K: int):
    """K steps. u, udot: (K, A, B) or None; fext: (K, 3, n_free, B) or None. Returns Qs, Vs (K, 3, n_free, B)."""
    return laws.steps(LAYOUT, c, der, Q, V, u, udot, fext, dt, integrator, opts, K)


def steps_full(c: NodalConstants, der: laws.Derived, Q, V, u, udot, fext, dt: float, integrator: str,
               opts: Options, K: int):
    """K steps (the graph torch.compile sees, one per chunk length K): the last reduced state Q, V
    (3, n_free, B), for the next chunk, and every step's full positions and velocities (K, B, N, 3), contiguous.

    Why the full layout inside the graph: converted outside it (a gather, then a transposed copy per rollout
    or sub-batch), the conversion took longer than the steps themselves (manipulator, batch 128, 50 steps, one
    thread, 2026-12-02: 16.8 ms of 26.8; the compiled steps 10.0 ms). Inside, inductor writes the outputs in
    their final layout in the loops that compute them."""
    Qs, Vs = steps(c, der, Q, V, u, udot, fext, dt, integrator, opts, K)
    return Qs[-1], Vs[-1], from_fast_positions(c, Qs).contiguous(), from_fast_velocities(c, Vs).contiguous()


_COMPILED = {}


def compiled(name: str, device_type: str = "cpu", serial: bool = False):
    """The torch.compile'd version of :func:`steps_full` for tensors on ``device_type`` (memoised; dynamo guards
    on shapes, dtype and K). ``serial``: CPU code without OpenMP regions (``cpp.threads = 1``), for pieces of a
    batch run one per thread (:func:`rollout`).

    Guards on globals are left out (``skip_guard_on_globals_unsafe``): the graph reads no global data, only
    the engine's module-level functions, classes and :data:`LAYOUT`, which never change at run time, and
    checking their identity on every call cost ~5 % of a batch-1 step (measured on the icosahedron). Every
    guard on the arguments (tensor shapes, dtypes and aliasing, options, integrator, K) and on the global
    torch state (grad mode, default dtype, threads) stays.

    ``cpp_wrapper``: inductor's C++ wrapper calls the graph's kernels instead of generated Python, which cuts the
    per-call cost where it dominates (the manipulator's 1-s horizon at batch 1 in 8-step chunks, one thread,
    2026-12-02, alternated with the Python wrapper in separate processes: 48.5 / 46.4 ms against 75.2 / 59.0;
    the icosahedron's 23.1 / 21.5 against 29.0 / 29.0; batch 1024 within the machine's spread, the icosahedron's
    1.88-1.99 M against 1.54-1.58 M item-steps/s). It also releases the GIL while the kernels run. CPU only:
    on CUDA it has not been measured (no GPU lent since), so the Python wrapper of stop 28's GPU figures stays.
    """
    key = (name, device_type, serial)
    fn = _COMPILED.get(key)
    if fn is None:
        from ._common import compile_fn
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_globals_unsafe, "cpp_wrapper": device_type == "cpu"}
        if device_type == "cuda":
            # inductor's persistent reductions (a whole reduction in one block) were the compiled step's slowest
            # kernels at large batches: the manipulator at batch 65 536 on an H200 (2026-12-04, float32, 20
            # steps) ran 24.2 M item-steps/s with them, 50.9 M without (coordinate-descent tuning: 42.7 M, after
            # a 59-s compile)
            options["triton.persistent_reductions"] = False
        if serial:
            options["cpp.threads"] = 1
        fn = compile_fn({"steps_full": steps_full}[name], dynamic=False, options=options)
        _COMPILED[key] = fn
    return fn


#: least work in a piece of the batch that gets a thread of its own (:func:`rollout`), in items x free nodes per
#: compiled call: below it the pieces' per-call costs, serialised by the GIL, outweigh the second core. Measured
#: (2026-12-03, this 2-core AMD EPYC, 100 steps, pieces on two threads against whole batches or pieces in turn on
#: two OpenMP threads, 7 rounds interleaved, median): manipulator (18 free nodes) pieces of 32 items 327 k
#: against 355 k item-steps/s, of 128 578 k against 516 k; icosahedron (12) pieces of 32 210 k against 670 k, of
#: 128 1.27 M against 1.94 M, of 512 3.22 M against 2.15 M
THREAD_PIECE_WORK = 4096

_POOL: dict = {}        # {"workers": n, "pool": ThreadPoolExecutor}


def _pool(workers: int) -> ThreadPoolExecutor:
    """The engine's threads for pieces of a batch (``workers`` of them; the calling thread is one more). Idle
    between rollouts; a rollout waits for its pieces, so none is in flight after it returns."""
    if _POOL.get("workers") != workers:
        if _POOL:
            _POOL["pool"].shutdown(wait=False)
        _POOL.update(workers=workers, pool=ThreadPoolExecutor(workers, thread_name_prefix="engine-piece"))
    return _POOL["pool"]


#: the integrators whose compiled rollouts run their pieces on threads (:func:`piece_threads`). The implicit
#: step is left out: in ``bench/bench_engine.py --quick`` (2026-12-03, four runs, fresh clone and /work/main)
#: its pieces on threads ran at 16-25 k item-steps/s at batch 1024 when the icosahedron had been run before in
#: the same process, against 190-240 k in runs of it alone or after the manipulator's explicit step only, and
#: 166 k on OpenMP's threads; the cause was not found (not glibc's mmap and trim thresholds: the same with both
#: fixed). rk4 was not measured.
THREADED_INTEGRATORS = ("semi_implicit",)


def piece_threads(compile: bool, device_type: str, grad: bool, integrator: str) -> int:
    """How many threads :func:`rollout` runs its pieces on: ``torch.get_num_threads()`` for a compiled rollout on
    a CPU that no gradient (``grad``) is asked of, with an integrator of :data:`THREADED_INTEGRATORS`; else 1."""
    ok = compile and device_type == "cpu" and not grad and integrator in THREADED_INTEGRATORS
    return torch.get_num_threads() if ok else 1


def batch_pieces(B: int, sub_batch: Optional[int], threads: int = 1, min_piece: int = 1):
    """Slices of the batch for :func:`rollout`, of equal size but the last (one graph), and how many threads run
    them. At most ``sub_batch`` items each; with ``threads`` > 1, a multiple of ``threads`` in number, each of at
    least ``min_piece`` items (this wins over ``sub_batch``); a batch too small for two such pieces runs on one
    thread (``sub_batch`` alone)."""
    n = 1 if sub_batch is None else -(-B // sub_batch)
    if threads > 1 and B >= 2 * min_piece:
        n = min(-(-max(n, threads) // threads) * threads, B // min_piece)
    else:
        threads = 1
    size = -(-B // n)
    return [slice(b0, min(B, b0 + size)) for b0 in range(0, B, size)], threads


#: the kernels of a compiled rollout (``kernel=``): ``inductor`` (torch.compile of :func:`steps_full`, any
#: integrator, differentiable), ``native`` (:mod:`.native`: the semi-implicit step fused in C, CPU, no gradient)
#: and ``auto``, which takes ``native`` wherever it applies and builds, else ``inductor``
KERNELS = ("auto", "inductor", "native")


def choose_kernel(kernel: str, device_type: str, grad: bool, integrator: str, dtype: torch.dtype) -> str:
    """The kernel a compiled rollout runs: ``inductor`` or ``native`` (see :data:`KERNELS`). ValueError for an
    unknown name (listing the valid ones) or for ``native`` where it does not apply (saying why)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (valid: {', '.join(KERNELS)})")
    if kernel == "inductor":
        return kernel
    from . import native
    why = native.unsuitable(device_type, grad, integrator, dtype)
    if why is None:
        why = native.available(dtype)
    if why is None:
        return "native"
    if kernel == "native":
        raise ValueError(f"kernel='native' cannot run this rollout: {why}")
    return "inductor"


def rollout(c: NodalConstants, params: Params, X0: torch.Tensor, V0: torch.Tensor, u, udot, fext, n: int,
            dt: float, integrator: str, opts: Options, chunk: int = 1, compile: bool = True,
            sub_batch: Optional[int] = None, kernel: str = "auto", cuda_graph: bool = False):
    """n steps from full node positions/velocities (B, N, 3); inputs time-major (T, B, ...) or None.
    Returns positions, velocities (n, B, N, 3). ``compile``: ``kernel`` (:data:`KERNELS`) runs the steps, else
    the eager batch-last steps. Under inductor, ``chunk`` steps per compiled call; ``sub_batch`` splits a large
    batch into pieces of at most that size (keeps a piece's working set in cache), each written into its slice
    of the outputs. The native kernel takes neither (it runs every step of a tile of the batch in one call).

    Compiled on a CPU with ``torch.get_num_threads()`` > 1, no gradient asked for, and a batch large enough
    (:data:`THREAD_PIECE_WORK`), the pieces run on that many threads, each piece in code without OpenMP regions
    (:func:`compiled` ``serial``; :func:`batch_pieces`). Why: the OpenMP graph puts a barrier after each of its
    ~40 loops per step, and at these sizes the second core waited more than it computed. Measured on this 2-core
    AMD EPYC (float32, 7 rounds interleaved in one process, median; 2026-12-03): the manipulator at batch 1024
    in pieces of 256, 50 steps, two OpenMP threads with the pieces in turn 363 k item-steps/s, the serial code
    on one thread 380 k, on two threads 647 k; through this function, 20 steps (``bench/bench_engine.py``'s),
    909 k against 590 k, and the icosahedron (two pieces of 512 against the whole batch) 1.96 M against 1.67 M
    (3.22 M against 2.15 M over 100 steps). With a gradient the pieces stay in turn on OpenMP's threads: their
    backward passes would run on autograd's one CPU thread anyway.

    ``cuda_graph`` (CUDA, no gradient): each piece's chunk of ``chunk`` steps is recorded once as a CUDA graph
    (:class:`.graphs.CapturedCall`) and replayed."""
    B = max(X0.shape[0], params.mass.shape[0] if params.mass.dim() == 2 else 1)
    X0, V0 = X0.expand(B, *X0.shape[1:]), V0.expand(B, *V0.shape[1:])
    leaves = (X0, V0, u, udot, fext, *(getattr(params, k) for k in params.kinds()))
    grad = differentiated(*leaves)
    if cuda_graph:
        from . import graphs
        graphs.require(X0.device, grad, integrator)
        if compile and kernel == "native":
            raise ValueError("cuda_graph: the native kernel runs on a CPU; pass kernel='inductor' or 'auto'")
    if compile and choose_kernel(kernel, X0.device.type, grad, integrator, X0.dtype) == "native":
        from . import native
        return native.rollout(c, params, X0, V0, u, udot, fext, n, dt, opts)
    threads = piece_threads(compile, X0.device.type, grad, integrator)
    steps_per_call = max(1, min(chunk, n))
    min_piece = -(-THREAD_PIECE_WORK // (steps_per_call * max(1, c.free_idx.numel())))
    pieces, threads = batch_pieces(B, sub_batch, threads, min_piece)
    if len(pieces) == 1:
        return _rollout(c, params, X0, V0, u, udot, fext, n, dt, integrator, opts, chunk, compile,
                        cuda_graph=cuda_graph)
    serial = threads > 1

    def part(x, sl, dim):
        return x if x is None or x.dim() <= dim or x.shape[dim] != B else x[(slice(None),) * dim + (sl,)]

    X, V = X0.new_empty((n,) + X0.shape), V0.new_empty((n,) + V0.shape)

    def run(sl, first_call=None):
        p = params.map(lambda t: t[sl] if t.dim() >= 1 and params.mass.dim() == 2 and t.shape[0] == B else t)
        out = None if grad else (X[:, sl], V[:, sl])      # chunks copied in place (autograd needs the copies)
        x, v = _rollout(c, p, X0[sl], V0[sl], part(u, sl, 1), part(udot, sl, 1), part(fext, sl, 1), n, dt,
                        integrator, opts, chunk, compile, serial, first_call, out, cuda_graph)
        if out is None:
            X[:, sl], V[:, sl] = x, v

    if not serial:
        for sl in pieces:
            run(sl)
        return X, V
    # piece i runs on thread i % threads, the calling thread being thread 0; the others start once its first
    # compiled call has returned, so that a graph not yet compiled compiles once (dynamo serialises compiles,
    # but two threads that both missed its cache would each compile it)
    compiled_once = threading.Event()

    def worker(i):
        compiled_once.wait()
        for sl in pieces[i::threads]:
            run(sl)

    # torch's own operations (the pieces' preparation and copies) run on one OpenMP thread meanwhile: each thread
    # that opens a parallel region gets a team of its own, and teams that spin-wait beside the pieces slowed the
    # OpenMP path run after them in the same process (manipulator, batch 1024: ~590 k -> 169 k item-steps/s)
    with torch_threads(1):
        futures = [_pool(threads - 1).submit(worker, i) for i in range(1, threads)]
        try:
            run(pieces[0], compiled_once)
            for sl in pieces[threads::threads]:
                run(sl)
        finally:
            compiled_once.set()
            errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return X, V


def _rollout(c: NodalConstants, params: Params, X0, V0, u, udot, fext, n: int, dt: float, integrator: str,
             opts: Options, chunk: int, compile: bool, serial: bool = False,
             first_call: Optional[threading.Event] = None, out=None, cuda_graph: bool = False,
             capture: bool = True):
    """:func:`rollout` for one piece of the batch (``serial``: the graph without OpenMP regions; ``first_call``
    is set once the first compiled call has returned, or failed; ``out``: positions and velocities (n, B, N, 3)
    that each chunk's outputs are copied into, returned, instead of concatenated; ``cuda_graph``: the chunks
    replayed from one CUDA graph, ``capture=False`` the same data flow without it, for CPU tests)."""
    B = X0.shape[0]
    der = prepare_fast(c, params)
    Q, V = to_fast(c, X0), to_fast(c, V0)
    u, udot, fq = inputs_to_fast(c, u, udot, fext, B)
    K = max(1, min(chunk, n))
    pad = (-n) % K

    def padded(x):
        if x is None or pad == 0:
            return x
        return torch.cat((x, x[-1:].expand(pad, *x.shape[1:])))

    u, udot, fq = padded(u), padded(udot), padded(fq)
    fn = compiled("steps_full", X0.device.type, serial) if compile else steps_full

    Xs, Vs = [], []
    try:
        for k0 in range(0, n + pad, K):
            sl = slice(k0, k0 + K)
            args = (c, der, Q, V, None if u is None else u[sl], None if udot is None else udot[sl],
                    None if fq is None else fq[sl], dt, integrator, opts, K)
            if cuda_graph:
                from .graphs import replay
                Q, V, x, v = replay(f"fast.steps_full/{'compiled' if compile else 'eager'}", fn, args, capture)
                if out is None:              # the graph's outputs are overwritten by the next replay
                    x, v = x.clone(), v.clone()
            else:
                Q, V, x, v = fn(*args)
            if first_call is not None:
                first_call.set()
            if out is not None:
                m = min(K, n - k0)
                out[0][k0:k0 + m].copy_(x[:m])
                out[1][k0:k0 + m].copy_(v[:m])
                continue
            Xs.append(x)
            Vs.append(v)
    finally:
        if first_call is not None:
            first_call.set()
    if out is not None:
        return out
    if len(Xs) == 1 and pad == 0:
        return Xs[0], Vs[0]
    return torch.cat(Xs)[:n], torch.cat(Vs)[:n]


# ---- layout conversion -------------------------------------------------------------------------------
def to_fast(c: NodalConstants, X: torch.Tensor) -> torch.Tensor:
    """(B, N, 3) full node array -> (3, n_free, B) reduced, batch last."""
    return X.index_select(-2, c.free_idx).permute(2, 1, 0).contiguous()


def from_fast_positions(c: NodalConstants, Q: torch.Tensor) -> torch.Tensor:
    """(..., 3, n_free, B) -> full positions (..., B, N, 3)."""
    X = _product(Q, c, "Tt") + c.XcT.unsqueeze(-1)                      # (..., 3, N, B)
    return X.movedim(-1, -3).transpose(-1, -2)


def from_fast_velocities(c: NodalConstants, V: torch.Tensor) -> torch.Tensor:
    X = _product(V, c, "Tt")
    return X.movedim(-1, -3).transpose(-1, -2)


def inputs_to_fast(c: NodalConstants, u: Optional[torch.Tensor], ud: Optional[torch.Tensor],
                   fext: Optional[torch.Tensor], B: int):
    """Time-major inputs (T, B, A) / (T, B, N, 3) (batch dim optional) -> (T, A, B) / (T, 3, n_free, B)."""
    def t_ab(x):
        if x is None:
            return None
        if x.dim() == 2:
            x = x.unsqueeze(1)
        return x.expand(x.shape[0], B, x.shape[-1]).transpose(1, 2).contiguous()

    fq = None
    if fext is not None:
        if fext.dim() == 3:
            fext = fext.unsqueeze(1)
        fq = (fext.transpose(-1, -2) @ c.T)                                   # (T, B, 3, nf)
        fq = fq.expand(fq.shape[0], B, *fq.shape[2:]).permute(0, 2, 3, 1).contiguous()
    return t_ab(u), t_ab(ud), fq
