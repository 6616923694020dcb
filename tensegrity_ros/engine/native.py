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
    if threads == 1:
        run(0, B)
    else:
        futures = [fast._pool(threads - 1).submit(run, bounds[i], bounds[i + 1]) for i in range(1, threads)]
        try:
            run(bounds[0], bounds[1])
        finally:
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
    del keep
    return X, Vout


