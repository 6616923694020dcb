"""Compute workers that always end: one job at a time, in a spawned process or a daemon thread (no rclpy).

Why not ``concurrent.futures.ProcessPoolExecutor``: its manager thread is joined, without a time limit, by an
``atexit`` hook. Terminating its worker while a caller waits on a future left that thread, the waiting thread
and the interpreter's exit blocked for good (seen: ``make test`` printed its summary and never exited; the
stack dump showed ``_python_exit`` joining the manager thread and the predictor's linearizer waiting in
``Future.result``). Here a job's future is settled by one daemon reader thread, from the worker's answer or
from the end of the pipe, so every future resolves: with the result, with the job's exception, or with
:class:`WorkerStopped` when the worker is stopped or dies. Nothing is registered with ``atexit``;
:meth:`WorkerProcess.stop` ends the process (SIGTERM, then SIGKILL) within ``timeout_s``.

    pool = make_worker("process", worker_init, (1, 5))
    pool.submit(fn, *args).result()        # fn and args must pickle (module-level functions)
    stop_worker(pool)                      # at most ~2 s, even with a job in flight
"""
from __future__ import annotations

import os
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Tuple

WORKER_KINDS = ("process", "thread")


class WorkerStopped(RuntimeError):
    """The worker was stopped, or died, before the job finished."""


def _serve(conn, initializer, initargs) -> None:
    """The worker process: run jobs from ``conn`` one at a time until the pipe closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent decides when the worker ends (Ctrl-C reaches both)
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        fn, args = job
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:   # noqa: BLE001 - the job's error goes back to its caller
            reply = ("error", (e, traceback.format_exc()))
        try:
            conn.send(reply)
        except (OSError, EOFError):
            return
        except Exception as e:     # an unpicklable result: say so instead of leaving the caller waiting
            conn.send(("error", (RuntimeError(f"result of {getattr(fn, '__name__', fn)} cannot be sent: {e}"), "")))


class WorkerProcess:
    """One spawned worker process; :meth:`submit` returns a Future settled by the worker's reply.

    Jobs queue up in submission order. ``pid`` is the worker's process id."""

    def __init__(self, initializer: Optional[Callable] = None, initargs: tuple = (), name: str = "tensegrity-worker"):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, initializer, initargs), name=name, daemon=True)
        self._proc.start()
        child.close()
        self.pid = self._proc.pid
        self._pending: List[Future] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    def submit(self, fn: Callable, *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._stopped:
                raise WorkerStopped("the worker is stopped")
            self._pending.append(fut)
            try:
                self._conn.send((fn, args))
            except (OSError, EOFError, ValueError) as e:
                self._pending.remove(fut)
                raise WorkerStopped(f"the worker is gone: {e}") from e
        return fut

    def _read(self) -> None:
        while True:
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError, TypeError, ValueError):
                break
            with self._lock:
                fut = self._pending.pop(0) if self._pending else None
            if fut is None:
                continue
            if kind == "ok":
                fut.set_result(value)
            else:
                err, tb = value
                if tb and isinstance(err, BaseException):
                    err.__notes__ = [*getattr(err, "__notes__", []), f"in the worker:\n{tb}"]
                fut.set_exception(err)
        self._fail_pending("the worker stopped" if self._stopped else
                           f"the worker process died (exit code {self._proc.exitcode})")

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            if not fut.done():
                fut.set_exception(WorkerStopped(why))

    def alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self, timeout_s: float = 1.5) -> None:
        """End the worker now, a running job included: SIGTERM, SIGKILL after ``timeout_s`` / 2; every pending
        future gets :class:`WorkerStopped`. Idempotent."""
        with self._lock:
            self._stopped = True
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout_s / 2)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout_s / 2)
        try:
            self._conn.close()
        except OSError:
            pass
        self._reader.join(timeout_s / 2)
        self._fail_pending("the worker stopped")


class WorkerThread:
    """The same interface on a daemon thread in this process (debugging, tests): a running job cannot be
    interrupted, but the thread never keeps the interpreter from exiting."""

    def __init__(self, initializer: Optional[Callable] = None, initargs: tuple = (), name: str = "tensegrity-worker"):
        import queue

        self.pid = os.getpid()
        self._jobs: "queue.Queue" = queue.Queue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, args=(initializer, initargs), name=name, daemon=True)
        self._thread.start()

    def _run(self, initializer, initargs) -> None:
        if initializer is not None:
            initializer(*initargs)
        while True:
            job = self._jobs.get()
            if job is None:
                break
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:   # noqa: BLE001
                fut.set_exception(e)
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None and not job[0].done():
                job[0].set_exception(WorkerStopped("the worker stopped"))

    def submit(self, fn: Callable, *args: Any) -> Future:
        if self._stopped:
            raise WorkerStopped("the worker is stopped")
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 1.5) -> None:
        self._stopped = True
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def make_worker(kind: str, initializer: Optional[Callable] = None, initargs: tuple = ()):
    """One worker for heavy compute (identification, relinearisation).

    ``process`` (default in the nodes): a spawned child process, so its Python work never holds the GIL of the
    process that runs the callbacks; ``thread``: a daemon thread in this process (debugging, tests).
    ``initializer(*initargs)`` runs once in the worker. An unknown kind lists the valid ones."""
    if kind not in WORKER_KINDS:
        raise ValueError(f"worker {kind!r} (valid: {', '.join(WORKER_KINDS)})")
    cls = WorkerProcess if kind == "process" else WorkerThread
    return cls(initializer, initargs)


def stop_worker(pool, timeout_s: float = 1.5) -> None:
    """Stop a :func:`make_worker` worker within ``timeout_s`` (a process worker's running job is killed)."""
    pool.stop(timeout_s)


def worker_pid() -> int:
    """A trivial job: starting a worker (and paying its imports) before the data flows."""
    return os.getpid()


def limit_blas_threads(n: int = 1) -> List[str]:
    """Set the thread count of every OpenBLAS loaded in this process (numpy's and scipy's bundled copies).

    The nodes' linear algebra is small (6x6 solves in the mocap filter, 108x108 matrix-vector products in the
    predictor); a BLAS thread pool only adds wake-ups, and on a busy machine a small solve then takes
    milliseconds instead of 12 us (measured: scipy solve_triangular 6x6, 83 us with 2 threads vs 12 us with 1
    on an idle machine, 16 ms under load). Also sets OPENBLAS_NUM_THREADS for processes started later.
    Returns the libraries changed."""
    import ctypes

    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(n))
    done = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return done
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads64_",
                    "scipy_openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(int(n)))
                done.append(path)
                break
    return done


def set_niceness(nice: int, pid: int = 0) -> Tuple[bool, int, str]:
    """Set the niceness of this process (``pid`` 0) or of process ``pid`` (its main thread: where a worker
    process computes) to ``nice`` (absolute, -20..19). Lowering the priority always works for one's own
    processes; raising it (below the current value, e.g. a negative niceness for the simulated robot and driver)
    needs root, CAP_SYS_NICE or an RLIMIT_NICE (``ulimit -e``, /etc/security/limits.conf). Returns (done, the
    niceness now, what happened, for logs and summaries); never raises."""
    nice = max(-20, min(19, int(nice)))
    try:
        before = os.getpriority(os.PRIO_PROCESS, pid)
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        return True, nice, f"niceness {before} -> {nice}"
    except (OSError, AttributeError) as e:
        now = os.getpriority(os.PRIO_PROCESS, pid) if hasattr(os, "getpriority") else 0
        return False, now, (f"cannot set niceness {nice} ({getattr(e, 'strerror', None) or e}); staying at {now}: "
                            "needs root, CAP_SYS_NICE or a nice limit (ulimit -e)")


def set_realtime(priority: int) -> Tuple[bool, str]:
    """Run the calling thread under SCHED_FIFO at ``priority`` (1..99), as ros2_control's controller manager
    does for its update thread (realtime_tools' configure_sched_fifo): the kernel then runs it the moment it
    wakes, ahead of every normal thread on the machine, instead of when the fair scheduler next gets round to
    it. With SCHED_RESET_ON_FORK the threads and processes it starts run at normal priority (a compute worker
    started from it must not take a real-time class). The kernel's real-time throttling (sched_rt_runtime_us,
    95 % by default) still bounds what a runaway thread could take. Needs root, CAP_SYS_NICE or ``ulimit -r``;
    returns (done, what happened, for logs and summaries) and never raises."""
    prio = max(1, min(99, int(priority)))
    policy = getattr(os, "SCHED_FIFO", None)
    if policy is None:   # pragma: no cover - not Linux
        return False, "no SCHED_FIFO on this platform; staying at normal priority"
    policy |= getattr(os, "SCHED_RESET_ON_FORK", 0)
    try:
        os.sched_setscheduler(0, policy, os.sched_param(prio))
        return True, f"SCHED_FIFO priority {prio}"
    except (OSError, AttributeError) as e:
        return False, (f"cannot set SCHED_FIFO priority {prio} ({getattr(e, 'strerror', None) or e}); staying at "
                       "normal priority: needs root, CAP_SYS_NICE or a real-time limit (ulimit -r)")


def worker_init(torch_threads: int = 1, nice: int = 0) -> None:
    """Initializer of compute workers: torch threads, and a lower priority for background work (``nice``: the
    worker's niceness, absolute, never above its parent's priority, so the real-time parts keep the cores
    when the machine is busy)."""
    if nice and nice > os.getpriority(os.PRIO_PROCESS, 0):
        set_niceness(nice)
    limit_blas_threads(1)
    try:
        import torch
        torch.set_num_threads(int(torch_threads))
    except ImportError:  # pragma: no cover
        pass
