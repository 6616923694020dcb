"""Compute workers always end: every future settles (result, error, or WorkerStopped), a worker stops within
2 s with a job in flight, and an interpreter holding a busy worker exits by itself."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tensegrity_ros.workers import WorkerStopped, make_worker, stop_worker, worker_pid


def _boom(x):
    raise ValueError(f"bad {x}")


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_results_and_errors_come_back(kind):
    w = make_worker(kind)
    try:
        assert w.submit(pow, 3, 4).result(timeout=30) == 81
        with pytest.raises(ValueError, match="bad 7"):
            w.submit(_boom, 7).result(timeout=30)
        pid = w.submit(worker_pid).result(timeout=30)
        assert (pid != os.getpid()) == (kind == "process")
    finally:
        stop_worker(w)


def test_stop_with_a_job_in_flight_settles_the_future_within_2_s():
    w = make_worker("process")
    w.submit(worker_pid).result(timeout=30)          # started
    fut = w.submit(time.sleep, 60)
    time.sleep(0.2)
    t0 = time.monotonic()
    stop_worker(w)
    with pytest.raises(WorkerStopped):
        fut.result(timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert not w.alive()
    with pytest.raises(WorkerStopped):
        w.submit(worker_pid)


def test_a_killed_worker_fails_its_pending_jobs():
    w = make_worker("process")
    try:
        pid = w.submit(worker_pid).result(timeout=30)
        futs = [w.submit(time.sleep, 60), w.submit(pow, 2, 2)]
        os.kill(pid, signal.SIGKILL)
        for f in futs:
            with pytest.raises(WorkerStopped, match="died"):
                f.result(timeout=10)
    finally:
        stop_worker(w)


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match="process, thread"):
        make_worker("fiber")


def test_interpreter_exits_with_a_busy_worker_and_a_waiting_thread():
    """The hang that kept `make test` alive: a thread waiting on a worker's future at interpreter exit."""
    code = textwrap.dedent("""
        import threading, time
        from tensegrity_ros.workers import make_worker
        w = make_worker("process")
        w.submit(time.sleep, 0).result()
        fut = w.submit(time.sleep, 120)
        threading.Thread(target=fut.result, daemon=True).start()
        print("ready", flush=True)
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ready" in proc.stdout
    assert time.monotonic() - t0 < 30.0    # the 120-s job did not hold the exit


def _policy_in_thread(fn):
    """Run fn in a fresh thread (the test's own thread keeps its scheduling class); return what it returned."""
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.update(value=fn()))
    t.start()
    t.join(30)
    return box["value"]


def test_set_realtime_makes_the_calling_thread_fifo_and_the_threads_it_starts_normal():
    from tensegrity_ros.workers import set_realtime

    def run():
        import threading

        done, text = set_realtime(10)
        if not done:
            return done, text, None, None
        child = {}
        t = threading.Thread(target=lambda: child.update(policy=os.sched_getscheduler(0)))
        t.start()
        t.join(30)
        return done, text, os.sched_getscheduler(0), child["policy"]

    done, text, own, child = _policy_in_thread(run)
    if not done:
        assert "needs root, CAP_SYS_NICE" in text
        pytest.skip(f"no real-time scheduling here: {text}")
    assert text == "SCHED_FIFO priority 10"
    assert own & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
    assert child == os.SCHED_OTHER             # a thread it starts: normal scheduling (SCHED_RESET_ON_FORK)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER          # the test's own thread is untouched


def test_set_realtime_refused_says_how_to_allow_it_and_never_raises(monkeypatch):
    from tensegrity_ros.workers import set_realtime

    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    done, text = set_realtime(500)
    assert not done
    assert text.startswith("cannot set SCHED_FIFO priority 99 (Operation not permitted)")   # clamped to 1..99
    assert "ulimit -r" in text
