"""Small shared helpers (tensor conversion, constant pytrees, batched SPD inverse)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..paths import REPO_ROOT



def register_tensor_dataclass(cls):
    """Register a (frozen) dataclass whose fields are all tensors as a pytree node."""
    names = [f.name for f in fields(cls)]

    def flatten(obj):
        return [getattr(obj, n) for n in names], None

    def unflatten(children, _ctx):
        return cls(*children)

    def flatten_with_keys(obj):
        return [(pytree.GetAttrKey(n), getattr(obj, n)) for n in names], None

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"tensegrity_ros.engine.{cls.__name__}",
                                flatten_with_keys_fn=flatten_with_keys)
    cls.map = lambda self, fn: pytree.tree_map(lambda t: None if t is None else fn(t), self)
    return cls


@contextmanager
def torch_threads(n: Optional[int]):
    """torch's intra-op threads set to ``n`` inside the block (None: left as they are), restored after."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def is_dual(t: Optional[torch.Tensor]) -> bool:
    """Whether ``t`` carries a forward-mode tangent (``torch.autograd.forward_ad``)."""
    import torch.autograd.forward_ad as fwAD
    if t is None:
        return False
    try:
        return fwAD.unpack_dual(t).tangent is not None
    except RuntimeError:  # pragma: no cover - outside a dual level
        return False


def differentiated(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a result computed from ``tensors`` must carry a derivative: reverse mode (grad enabled and one of
    them requires grad) or forward mode (one of them is a dual tensor)."""
    live = [t for t in tensors if t is not None]
    return (torch.is_grad_enabled() and any(t.requires_grad for t in live)) or any(is_dual(t) for t in live)


def as_tensor(x: np.ndarray, dtype, device) -> torch.Tensor:
    x = np.asarray(x)
    if x.dtype.kind in "iub":
        return torch.as_tensor(x.astype(np.int64), device=device)
    return torch.as_tensor(x, dtype=dtype, device=device)


def convert_like(tree, ref: torch.Tensor):
    """Move the floating tensors of ``tree`` to ``ref``'s dtype and device (no-op when they match)."""

    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point():
            if t.dtype == ref.dtype and t.device == ref.device:
                return t
            return t.to(dtype=ref.dtype, device=ref.device)
        return t if t.device == ref.device else t.to(ref.device)

    return pytree.tree_map(f, tree)


def spd_inverse(A: torch.Tensor, method: str = "lapack") -> torch.Tensor:
    """Inverse of a batch of symmetric positive-definite matrices ``A`` (..., n, n).

    ``lapack``: torch.linalg.inv. ``unrolled``: Gauss-Jordan elimination without pivoting (safe for SPD),
    written as n vectorised tensor updates; fuses well under torch.compile and beats per-matrix LAPACK calls
    for large batches of small matrices.
    """
    n = A.shape[-1]
    if n == 0:
        return A
    if method == "lapack":
        return torch.linalg.inv(A)
    if method != "unrolled":
        raise ValueError(f"unknown solver {method!r} (valid: lapack, unrolled)")
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    M = torch.cat([A, eye.expand(A.shape)], dim=-1)
    for k in range(n):
        piv = M[..., k:k + 1, :] / M[..., k:k + 1, k:k + 1]
        col = M[..., :, k:k + 1] - eye[:, k:k + 1]
        M = M - col * piv
    return M[..., n:]


def inductor_cache_dir() -> str:
    """Point the inductor cache at ``<repo>/build/torchinductor`` (unless the caller set one) and return it."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        path = str(REPO_ROOT / "build" / "torchinductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    Path(path).mkdir(parents=True, exist_ok=True)
    return path


#: recompiles allowed per compiled function (distinct batch sizes, structures, chunk lengths and grad modes each
#: compile once; torch's default is 8)
RECOMPILE_LIMIT = 64


def setup_compile(recompile_limit: int = RECOMPILE_LIMIT) -> None:
    """Prepare torch.compile: inductor cache under build/, generous recompile limit (several batch sizes)."""
    inductor_cache_dir()
    import torch._dynamo as dynamo
    cfg = dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, recompile_limit)
    else:  # older torch
        cfg.cache_size_limit = max(cfg.cache_size_limit, recompile_limit)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * recompile_limit)


def compile_fn(fn, **kwargs):
    """``torch.compile(fn, **kwargs)`` with this engine's recompile limit on the function itself.

    Why not only the global setting (:func:`setup_compile`): torch's dynamo config is per thread, and a compiled
    rollout's pieces run on the engine's worker threads (:func:`.fast.rollout`), where the limit stayed torch's 8.
    In a long process (``make bench``, stop 52) the 9th graph of the compiled step then ran uncompiled, with a
    warning, for the rest of the process: the manipulator's compiled rows fell to 0.17x eager. The per-function
    limit travels with the function to whichever thread calls it (test_engine_autodiff.py::
    test_the_recompile_limit_holds_on_worker_threads)."""
    setup_compile()
    import inspect
    import torch._dynamo as dynamo
    if "recompile_limit" in inspect.signature(torch.compile).parameters:   # torch >= 2.10
        # this thread's setting where a caller raised it further (bench_engine.py: setup_compile(256))
        kwargs.setdefault("recompile_limit", max(RECOMPILE_LIMIT, dynamo.config.recompile_limit))
    return torch.compile(fn, **kwargs)


def unsqueeze_batch(t: Optional[torch.Tensor], ndim: int) -> Optional[torch.Tensor]:
    """Give ``t`` a leading batch dim if it has only ``ndim`` dims (unbatched)."""
    if t is None:
        return None
    return t.unsqueeze(0) if t.dim() == ndim else t
