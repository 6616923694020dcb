"""Which BLAS multiplies the tangent model's float64 matrices on the CPU: torch's or numpy's.

The torch wheel this project pins carries Intel MKL, linked in. On an AMD CPU, MKL takes a slower code path
for double precision. Measured on this project's 2-core AMD EPYC machine (2026-12-01, one thread, in one run):
batches of (108 x 54) @ (54 x 54) products, the tangent step's commonest shape, ran at 13.6 Gflop/s through torch
and at 37.3 Gflop/s through numpy's OpenBLAS; a 1000^3 product at 25 against 68 Gflop/s. The tangent step
(:mod:`.tangent`) is bound by such products, so on such a machine its products go through numpy. The numbers are
the same up to round-off: both are IEEE double GEMMs that sum in different orders.

Chosen once per process, from the environment variable ``TENSEGRITY_BLAS``: ``torch``, ``numpy`` or ``auto``
(the default: numpy's when torch's BLAS is MKL and the CPU is AMD's, else torch's). An unknown value is an error
that lists the valid ones. :func:`matmul` falls back to torch's ``@`` wherever numpy cannot serve: another dtype
or device, or a tensor that carries gradients.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD

CHOICES = ("auto", "torch", "numpy")
ENV = "TENSEGRITY_BLAS"


def cpu_field(key: str) -> str:
    """The first ``key`` line of /proc/cpuinfo (``vendor_id``, ``model name``, ...), or '' where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or '' if unknown."""
    return cpu_field("vendor_id")


def resolve(value: Optional[str] = None) -> str:
    """``torch`` or ``numpy``: ``value`` (default: ``$TENSEGRITY_BLAS``, else ``auto``) with ``auto`` decided."""
    value = (os.environ.get(ENV, "auto") if value is None else value).strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: valid values are {', '.join(CHOICES)}")
    if value != "auto":
        return value
    return "numpy" if torch.backends.mkl.is_available() and cpu_vendor() == "AuthenticAMD" else "torch"


@functools.lru_cache(maxsize=None)
def choice() -> str:
    """This process's choice (:func:`resolve` of the environment, once)."""
    return resolve()


_matched = None                  # (process, threads) that numpy's OpenBLAS was last given


def match_threads() -> None:
    """Give numpy's OpenBLAS as many threads as torch has (identification runs one per worker process: the
    workers would otherwise each start a thread per core and fight over the cores). Once per process and count."""
    global _matched
    if choice() != "numpy":
        return
    key = (os.getpid(), int(torch.get_num_threads()))
    if key != _matched:
        from ..workers import limit_blas_threads
        limit_blas_threads(key[1])
        _matched = key


def _plain(t: torch.Tensor) -> bool:
    """A CPU float64 tensor that carries no derivative: no autograd history, no forward-mode tangent (``.numpy()``
    would silently drop one), not wrapped by a torch.func transform."""
    return (t.dtype == torch.float64 and t.device.type == "cpu" and not t.requires_grad
            and not torch._C._functorch.is_functorch_wrapped_tensor(t) and fwAD.unpack_dual(t).tangent is None)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched, broadcast as torch does) through the chosen BLAS."""
    if choice() == "numpy" and _plain(a) and _plain(b):
        return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))
    return a @ b
