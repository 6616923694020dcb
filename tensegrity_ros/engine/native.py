"""The semi-implicit step fused in C (``native_step.c``): CPU rollouts that no gradient is asked of.

What it is for: the throughput of many rollouts at once (sampling-based control, the engine bench), where a step
of the compiled batch-last path (:mod:`.fast`) is ~60 to ~280 inductor loops, each a pass over the batch's buffers.
The kernel runs every step of a rollout on a tile of 16 batch items whose state, parameters and intermediates stay
in the core's first caches, one vectorised loop over the tile per operation. Same equations as :mod:`.laws`, held
equal to the reference layout by ``test/test_engine_native.py`` (float64: 1e-12).

Built on first use with the C compiler that torch.compile uses (``cc``/``gcc``, ``-O3 -march=native``) into
``build/native/`` (a file per source, precision and CPU; compiled to a temporary sibling and renamed). Where no
compiler works, :func:`available` says why and :func:`.fast.rollout` keeps to inductor.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ..paths import REPO_ROOT
from . import tangent
from .laws import NodalConstants, Options
from .params import Params

SOURCE = Path(__file__).with_name("native_step.c")
#: batch items per tile (one AVX-512 vector of float32; the kernel's inner loops run over a tile)
TILE = 16
#: the dtypes the kernel is built for, and their C type
DTYPES = {torch.float32: "float", torch.float64: "double"}
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-fopenmp-simd")

_LIBS: dict = {}
_LOCK = threading.Lock()


class NativeUnavailable(RuntimeError):
    """The kernel could not be built here (no C compiler, or it failed); the message says which and how to fix."""


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (a build is not reused on another CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [os.uname().machine]
    return "\n".join(lines)


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library(dtype: torch.dtype) -> ctypes.CDLL:
    """The kernel built for ``dtype`` (memoised; built into build/native on first use)."""
    if dtype not in DTYPES:
        raise NativeUnavailable(f"the native kernel is built for {', '.join(map(str, DTYPES))}, not {dtype}")
    with _LOCK:
        lib = _LIBS.get(dtype)
        if lib is None:
            lib = _LIBS[dtype] = _build(DTYPES[dtype])
    return lib


def _build(real: str) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler found (tried $CC, cc, gcc): install gcc, or pass kernel='inductor'")
    src = SOURCE.read_bytes()
    flags = FLAGS + (f"-DREAL={real}", f"-DTB={TILE}")
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_key().encode()).hexdigest()[:16]
    out_dir = REPO_ROOT / "build" / "native"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"native_step_{real}_{key}.so"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cc, *flags, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise NativeUnavailable(f"building the native kernel failed ({' '.join(cmd)}):\n{done.stderr.strip()}")
        os.replace(tmp, path)
    lib = ctypes.CDLL(str(path))
    lib.rollout.restype = ctypes.c_int
    lib.tangent_rollout.restype = ctypes.c_int
    return lib


def unsuitable(device_type: str, grad: bool, integrator: str, dtype: torch.dtype) -> Optional[str]:
    """None when the kernel can run such a rollout, else why not (it is a CPU, forward-only semi-implicit step)."""
    if device_type != "cpu":
        return f"it runs on the CPU, and the tensors are on {device_type}"
    if grad:
        return "a gradient is asked of the rollout, and the kernel has no backward pass"
    if integrator != "semi_implicit":
        return f"it is the semi_implicit step, and the engine's integrator is {integrator!r}"
    if dtype not in DTYPES:
        return f"it is built for {', '.join(map(str, DTYPES))}, not {dtype}"
    return None


def available(dtype: torch.dtype = torch.float32) -> Optional[str]:
    """None when the kernel for ``dtype`` builds and loads here, else why not (``TENSEGRITY_NATIVE=0`` in the
    environment turns it off: every rollout then runs as before it existed, for comparisons and bug reports)."""
    if os.environ.get("TENSEGRITY_NATIVE", "1") == "0":
        return "turned off by TENSEGRITY_NATIVE=0"
    try:
        library(dtype)
    except (NativeUnavailable, OSError) as exc:
        return str(exc)
    return None


_IDX = ctypes.POINTER(ctypes.c_int64)


def _model_type(real):
    P = ctypes.POINTER(real)
    fields = [(n, ctypes.c_int64) for n in ("nf", "N", "nseg", "S", "A", "nba", "nblk",
                                              "wCst", "wG", "wGt", "wCsq", "wCbt", "wTt")]
    fields += [(n, _IDX) for n in ("Cst_i", "G_i", "Gt_i", "Csq_i", "Cbt_i", "Tt_i")]
    fields += [(n, P) for n in ("Cst_w", "G_w", "Gt_w", "Csq_w", "Cbt_w", "Tt_w", "scT", "dcT", "l2", "XcT")]
    fields += [("blk_ptr", _IDX), ("blk_idx", _IDX), ("pB", ctypes.c_int64)]
    fields += [(n, P) for n in ("EA", "kc", "zeta", "xi00", "Y", "z", "Minv", "Pt", "Gc", "FgT")]
    fields += [("alpha", real), ("beta", real), ("dt", real), ("proj_iters", ctypes.c_int64)]
    return type(f"Model_{real.__name__}", (ctypes.Structure,), {"_fields_": fields})


_MODELS = {torch.float32: _model_type(ctypes.c_float), torch.float64: _model_type(ctypes.c_double)}
#: the constant matrices the kernel takes in gather form: the C field's name -> NodalConstants' name
_GATHERS = {"Cst": "Cst", "G": "G", "Gt": "Gt", "Csq": "Cs_q", "Cbt": "Cbt", "Tt": "Tt"}


def _model(c: NodalConstants, der, dt: float, opts: Options, dtype: torch.dtype):
    """The kernel's Model struct, and the tensors it points into (kept alive by the caller)."""
    keep = []

    def ptr(t, ctype):
        t = t.contiguous()
        keep.append(t)
        return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))

    real = ctypes.c_float if dtype == torch.float32 else ctypes.c_double
    m = _MODELS[dtype]()
    m.nf, m.N = c.free_idx.numel(), c.XcT.shape[1]
    m.nseg, m.S, m.A, m.nba = c.scT.shape[1], c.G.shape[1], c.Ydir.shape[1], c.dcT.shape[1]
    for f, name in _GATHERS.items():
        i, w = getattr(c, name + "_i"), getattr(c, name + "_w")
        setattr(m, "w" + f, i.shape[1])
        setattr(m, f + "_i", ptr(i, ctypes.c_int64))
        setattr(m, f + "_w", ptr(w, real))
    for name in ("scT", "dcT", "l2", "XcT"):
        setattr(m, name, ptr(getattr(c, name), real))
    blocks = [row for g in c.chord_groups for row in g.tolist()]
    sizes = torch.tensor([0] + [len(b) for b in blocks], dtype=torch.int64).cumsum(0)
    members = torch.tensor([i for b in blocks for i in b] or [0], dtype=torch.int64)
    m.nblk, m.blk_ptr, m.blk_idx = len(blocks), ptr(sizes, ctypes.c_int64), ptr(members, ctypes.c_int64)
    m.pB = der.EA.shape[-1]
    for name in ("EA", "kc", "zeta", "xi00", "Y", "z", "Minv", "Pt", "Gc", "FgT"):
        setattr(m, name, ptr(getattr(der, name), real))
    m.alpha, m.beta = opts.baumgarte
    m.dt, m.proj_iters = dt, opts.projection_iters
    return m, keep


def rollout(c: NodalConstants, params: Params, X0: torch.Tensor, V0: torch.Tensor, u, udot, fext, n: int,
            dt: float, opts: Options, threads: Optional[int] = None):
    """n semi-implicit steps from full node positions/velocities (B, N, 3); inputs time-major (T, B, ...) or None.
    Returns positions, velocities (n, B, N, 3). The batch is split into ``threads`` (default torch's thread count)
    ranges of whole tiles, each run by one thread (the C call releases the GIL)."""
    from . import fast
    lib = library(X0.dtype)
    B = max(X0.shape[0], params.mass.shape[0] if params.mass.dim() == 2 else 1)
    X0, V0 = X0.expand(B, *X0.shape[1:]), V0.expand(B, *V0.shape[1:])
    with torch.no_grad():
        der = fast.prepare_fast(c, params)
        Q, V = fast.to_fast(c, X0), fast.to_fast(c, V0)
        u, udot, fq = fast.inputs_to_fast(c, u, udot, fext, B)
    model, keep = _model(c, der, dt, opts, X0.dtype)
    X = X0.new_empty((n,) + X0.shape)
    Vout = V0.new_empty((n,) + V0.shape)
    N = X0.shape[1]

    def data(t):
        return None if t is None else ctypes.c_void_p(t.data_ptr())

    def run(b0, b1):
        rc = lib.rollout(ctypes.byref(model), ctypes.c_int64(B), ctypes.c_int64(b0), ctypes.c_int64(b1),
                         ctypes.c_int64(n), data(Q), data(V), data(u), data(udot), data(fq), data(X), data(Vout),
                         ctypes.c_int64(B * N * 3), ctypes.c_int64(N * 3))
        if rc != 0:
            raise MemoryError("the native kernel could not allocate its working arrays")

    threads = max(1, min(threads or torch.get_num_threads(), -(-B // TILE)))
    tiles = -(-B // TILE)
    bounds = [min(B, TILE * (tiles * i // threads)) for i in range(threads + 1)]
    _on_threads([lambda i=i: run(bounds[i], bounds[i + 1]) for i in range(threads)])
    del keep
    return X, Vout


def _on_threads(jobs) -> None:
    """Run the callables ``jobs``, the first on this thread and the others on the engine's threads
    (:func:`.fast._pool`); wait for all, then raise the first error."""
    from . import fast
    futures = [fast._pool(len(jobs) - 1).submit(job) for job in jobs[1:]] if len(jobs) > 1 else []
    try:
        jobs[0]()
    finally:
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


# ---------------------------------------------------------------------------------------------------------------------
# the step's tangent (native_step.c, tangent_rollout): identification's Jacobians
# ---------------------------------------------------------------------------------------------------------------------
def _tangents_type(real):
    P = ctypes.POINTER(real)
    fields = [("C", ctypes.c_int64), ("P", ctypes.c_int64)]
    fields += [(n, P) for n in ("dEA", "dkc", "dzeta", "dxi00", "dY", "dz", "dMinv", "dPt", "dGc", "dFgT")]
    return type(f"Tangents_{real.__name__}", (ctypes.Structure,), {"_fields_": fields})


_TANGENTS = _tangents_type(ctypes.c_double)


def tangent_unsuitable(device_type: str, dtype: torch.dtype, tangent_dtype: Optional[torch.dtype], opts: Options,
                       params_batched: bool = False) -> Optional[str]:
    """None when :func:`rollout_tangents` can run such a rollout's tangents, else why not: the kernel runs float64 on
    the CPU, one parameter set shared by the windows, the semi-implicit step without Baumgarte terms (what
    :func:`.tangent.supports` covers); ``TENSEGRITY_NATIVE=0`` turns it off with the primal kernel."""
    if device_type != "cpu":
        return f"it runs on the CPU, and the tensors are on {device_type}"
    if dtype != torch.float64 or (tangent_dtype is not None and tangent_dtype != torch.float64):
        return "it runs the tangents in float64 only"
    if params_batched:
        return "the parameters are batched (the kernel takes one set shared by the windows)"
    if any(opts.baumgarte):
        return "Baumgarte terms are on (the tangent model covers the step without them)"
    return available(torch.float64)


def _derived_tangents(c: NodalConstants, der, dth, P: int, C: int) -> dict:
    """The per-params quantities' derivatives along the P parameter directions, as the kernel reads them: (rows, C)
    each, zero past P. The mass-derived ones from :func:`.tangent._mass_tangents` (Pt, Gc, the weights; and
    dMinv = -Minv dM_q Minv, which the dense model folds into its products)."""
    S, A = der.Y.shape
    nf = der.Minv.shape[-1]
    nba = der.Pt.shape[0]
    n_rows = dict(dEA=S, dkc=S, dzeta=S, dxi00=S, dY=S * A, dz=A, dMinv=nf * nf, dPt=nba * nf, dGc=nba * nba,
                  dFgT=3 * nf)
    out = {k: torch.zeros(n, C, dtype=torch.float64) for k, n in n_rows.items()}
    if P:
        mt = tangent._mass_tangents(c, der, dth)                          # (P, ...) first, but Fg (3 nf, P)
        src = dict(dEA=dth.EA, dkc=dth.kc, dzeta=dth.zeta, dxi00=dth.xi00, dY=dth.Y, dz=dth.z,
                   dMinv=(-der.Minv @ mt.Mq @ der.Minv).permute(1, 2, 0), dPt=mt.Pt.permute(1, 2, 0),
                   dGc=mt.Gc.permute(1, 2, 0), dFgT=mt.Fg)
        for k, x in src.items():
            out[k][:, :P] = x.reshape(n_rows[k], P)
    return out


def rollout_tangents(c: NodalConstants, der, dth, Q0, V0, SQ0, SV0, u, ud, du, fq, dt: float, n_steps: int,
                     opts: Options, sample_steps: torch.Tensor, dud=None, threads: Optional[int] = None):
    """:func:`.tangent.rollout_tangents` by the kernel (same arguments and returns; float64, CPU, parameters shared,
    see :func:`tangent_unsuitable`): positions (B, H, 3, nf) and their tangents (B, H, C, 3, nf) at the samples.

    Each window is one call: its primal stepped in scalars and every tile of 16 directions pushed through the
    step's derivative (native_step.c, tangent_rollout), which also interpolates the samples between the steps that
    bracket them (:func:`.tangent.sample_brackets`). The tangents come back as a view of a directions-last buffer
    (B, H, 3, nf, C), the layout a Jacobian's rows read. The windows are split over ``threads`` (default torch's
    thread count) threads; the C call releases the GIL."""
    why = tangent_unsuitable(Q0.device.type, Q0.dtype, None, opts, der.EA.dim() != 1)
    if why is not None:
        raise ValueError(f"native.rollout_tangents cannot run these tangents: {why}")
    lib = library(torch.float64)
    B, _, nf = Q0.shape
    n = 3 * nf
    C = SQ0.shape[1]
    P = 0 if dth is None else dth.EA.shape[-1]
    Cp = max(TILE, -(-C // TILE) * TILE)
    f64 = torch.float64
    model, keep = _model(c, der.batch_last(), dt, opts, f64)
    dd = _derived_tangents(c, der, dth, P, Cp)
    tg = _TANGENTS()
    tg.C, tg.P = Cp, P
    for k, t in dd.items():
        t = t.contiguous()
        keep.append(t)
        setattr(tg, k, ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_double)))
    S0 = torch.zeros(B, 2, n, Cp, dtype=f64)
    S0[:, 0, :, :C] = SQ0.reshape(B, C, n).mT
    S0[:, 1, :, :C] = SV0.reshape(B, C, n).mT
    Q0c, V0c = Q0.reshape(B, n).contiguous(), V0.reshape(B, n).contiguous()
    # sample h reads the states after steps k0 and k0 + 1, linearly interpolated (in the kernel)
    k0, wgt = tangent.sample_brackets(sample_steps, n_steps)
    k0, wgt = k0.contiguous(), wgt.to(f64).contiguous()
    H = k0.shape[1]
    Qs = torch.empty(B, H, n, dtype=f64)
    Ss = torch.empty(B, H, n, C, dtype=f64)          # directions last: what the Jacobian's rows are read from
    A = 0 if u is None else u.shape[-1]
    u_ = None if u is None else u.to(f64).contiguous()            # (n_steps, B, A)
    ud_ = None if (u is None or ud is None) else ud.to(f64).contiguous()
    du_ = None if (u is None or du is None or not P) else du.to(f64).contiguous()    # (n_steps, B, A, P)
    dud_ = None if (u is None or dud is None or not P) else dud.to(f64).contiguous()
    fq_ = None if fq is None else fq.to(f64).reshape(fq.shape[0], B, n).contiguous()
    keep += [S0, Q0c, V0c, k0, wgt, u_, ud_, du_, dud_, fq_]

    def at(t, *index):
        """A pointer to t[index] (None for None)."""
        if t is None:
            return None
        off = sum(i * s for i, s in zip(index, t.stride()))
        return ctypes.c_void_p(t.data_ptr() + off * t.element_size())

    def run(b):
        rc = lib.tangent_rollout(
            ctypes.byref(model), ctypes.byref(tg), ctypes.c_int64(n_steps), at(Q0c, b), at(V0c, b),
            at(S0, b, 0), at(S0, b, 1), at(u_, 0, b), at(ud_, 0, b), ctypes.c_int64(B * A),
            at(du_, 0, b), at(dud_, 0, b), ctypes.c_int64(B * A * P), at(fq_, 0, b), ctypes.c_int64(B * n),
            ctypes.c_int64(H), at(k0, b), at(wgt, b), ctypes.c_int64(C), at(Qs, b), at(Ss, b))
        if rc != 0:
            raise MemoryError("the native tangent kernel could not allocate its working arrays")

    threads = max(1, min(threads or torch.get_num_threads(), B))
    _on_threads([lambda i=i: [run(b) for b in range(i, B, threads)] for i in range(threads)])
    del keep
    # (B, H, C, 3, nf) as tangent.rollout_tangents returns, a view of the directions-last buffer
    return Qs.reshape(B, H, 3, nf), Ss.reshape(B, H, 3, nf, C).permute(0, 1, 4, 2, 3)
