"""Window-parallel evaluation of a multiple-shooting problem in forked worker processes.

Stage 2's windows are independent: each has its own start state, and its residuals and Jacobian blocks depend
only on the shared parameters and its own start offsets. :func:`window_workers` forks ``n`` processes that
inherit the problem (copy-on-write: nothing is pickled but the arguments and the results), hands each a
contiguous share of the windows and concatenates what they return. That equals the one-process result exactly,
because every window is computed by the same code on the same numbers.

Processes, not threads: every engine step issues many small tensor operations whose dispatch holds the GIL.
On the manipulator's 8 x 1.0-s windows two threads took 9.12 s against 10.02 s for one; two processes took
5.67 s against 8.73 s (docs/identification.md, section 5).

Only on the CPU (a CUDA context does not survive a fork) and on Linux (macOS has ``fork`` but its system
libraries are not fork-safe, which is why Python spawns there); elsewhere, and for one window or ``n = 1``,
everything stays in this process (also inside a daemonic process, which may not start children).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterator, List, Optional

import numpy as np
import torch

#: the problem a forked worker inherited (set in the child by :func:`_adopt`)
_PROBLEM: Any = None
#: the worker's share of the windows, as one problem (made on the first call): the same object every call, so that
#: what it keeps between calls (the residual rollout's states that the next Jacobian reuses) stays with it
_SHARE: Any = None


def _adopt(problem) -> None:
    global _PROBLEM, _SHARE
    torch.set_num_threads(1)
    problem._workers = None                 # the child's copy evaluates in its own process
    _PROBLEM, _SHARE = problem, None


def _to_numpy(x):
    # numpy through the result pipe, not torch's shared-memory tensors: a container's /dev/shm is often 64 MB,
    # and one Jacobian of 8 x 1.0-s windows is ~70 MB
    if isinstance(x, tuple):
        return tuple(_to_numpy(v) for v in x)
    return None if x is None else x.detach().cpu().numpy()


def _to_torch(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _ready() -> bool:
    return True


def _evaluate(method: str, idx: List[int], args: tuple):
    global _SHARE
    if _SHARE is None or _SHARE.window_ids != [_PROBLEM.window_ids[i] for i in idx]:
        _SHARE = _PROBLEM.subset(idx)
    return _to_numpy(getattr(_SHARE, method)(*(_to_torch(a) for a in args)))


def _concat(parts: list):
    if isinstance(parts[0], tuple):
        return tuple(_concat([p[k] for p in parts]) for k in range(len(parts[0])))
    return None if parts[0] is None else torch.from_numpy(np.concatenate(parts, axis=0))


def usable_cores(cap: int = 8) -> int:
    """The cores this process may run on, at most ``cap`` (the ladder's longest rungs have 8 windows)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cap, n))


def can_fork(device) -> bool:
    """Whether windows can be spread over forked processes for a problem on ``device``."""
    return (torch.device(device).type == "cpu" and sys.platform.startswith("linux")
            and "fork" in multiprocessing.get_all_start_methods()
            and not multiprocessing.current_process().daemon)        # a daemonic process may not have children


class WindowWorkers:
    """``n`` forked processes, each evaluating a fixed contiguous share of ``problem``'s windows: one pool of one
    process per share, so that a share always goes to the same process (a shared pool hands a call to whichever
    process is free, and what a process kept from the share's last call would then sit in the other one).

    Each rung and check forks its own workers, so a module that the windows' code imports lazily on its first call
    is imported again in every worker: torch._dynamo and the forward-mode decompositions (1.4-2.1 s per worker)
    until the parameter tangents left forward mode, and torch.fx's symbolic shapes (0.4 s) through
    ``torch.autograd.grad`` with ``grad_outputs`` (stop 56; docs/identification.md, "Stop 56")."""

    def __init__(self, problem, n: int):
        self.problem = problem
        self.shares = [a.tolist() for a in np.array_split(np.arange(problem.B_win), n)]
        self.failure: Optional[str] = None
        self._pools = [ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_adopt,
                                           initargs=(problem,)) for _ in self.shares]
        # Each pool forks its process on its first call. Made to answer one after another here, each fork happens
        # while the pools before it are idle, never while one of their threads is feeding a call into a pipe (a
        # lock held at a fork stays held in the child). Why: 4 of ~40 runs of
        # test_engine_tangent.py hung in its window-worker test at the first call, a worker never answering (stop 53)
        for pool in self._pools:
            pool.submit(_ready).result()

    def map(self, method: str, w: torch.Tensor, x0: Optional[torch.Tensor], *rest):
        """``problem.<method>(w, x0, *rest)`` with the windows spread over the workers; results are
        concatenated along the window axis (a tuple's items each, ``None`` items kept)."""
        # numpy arrays through the pipes, not torch tensors: torch pickles a tensor into shared memory whose file
        # descriptor a thread of this process then serves to the child (multiprocessing's resource sharer)
        w, x0 = w.detach(), None if x0 is None else x0.detach()          # (on the CPU: see can_fork)
        wn, xn = _to_numpy(w), _to_numpy(x0)
        futures = [pool.submit(_evaluate, method, idx, (wn, None if xn is None else xn[idx], *rest))
                   for pool, idx in zip(self._pools, self.shares)]
        try:
            parts = [f.result() for f in futures]
        except BrokenProcessPool as exc:      # a worker was killed (out of memory?): finish in this process
            self.failure = f"window workers stopped ({exc}); continued in one process"
            self.problem._workers = None
            return getattr(self.problem, method)(w, x0, *rest)
        return _concat(parts)                  # numpy keeps the dtype: the problem's

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for pool in self._pools:
            pool.shutdown(wait=True)


@contextlib.contextmanager
def window_workers(problem, n: int) -> Iterator[Optional[WindowWorkers]]:
    """Within the block, ``problem.residuals`` and ``problem.jacobian_blocks`` (without autograd) run on ``n``
    forked processes; yields the :class:`WindowWorkers`, or None where they stay in this process."""
    n = min(int(n), problem.B_win)
    if n <= 1 or not can_fork(problem.device):
        yield None
        return
    workers = WindowWorkers(problem, n)
    problem._workers = workers
    try:
        yield workers
    finally:
        problem._workers = None
        workers.close()
