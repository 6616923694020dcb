"""Shared pytest fixtures and helpers for tensegrity_ros tests.

ROS isolation: before anything can initialise rclpy, this module picks a
random ROS_DOMAIN_ID (1..100) for the whole test session and restricts
discovery to this host, so parallel test runs (CI jobs, developers) don't
cross-talk. Set TENSEGRITY_TEST_ROS_DOMAIN_ID to force a specific domain.

Fixtures:
    rclpy_context  session-wide rclpy Context (rclpy.init(context=...) once,
                   shut down at the end); never touches the global context.
    ros_executor   a SingleThreadedExecutor bound to that context (per test).
    make_node      factory: make_node("name") -> rclpy Node in the session
                   context, added to ros_executor, destroyed after the test.
    spin_until     the spin_until() helper below, as a fixture.

Helpers (also importable: ``from conftest import spin_until, unique_name``):
    spin_until(executor, predicate, timeout=10.0, step=0.05) -> bool
    unique_name(prefix) -> str
"""
from __future__ import annotations

import itertools
import os
import random
import time
from typing import Callable

import pytest

# --- ROS environment isolation (must happen before rclpy.init) ---------------
_DOMAIN_ID = os.environ.get("TENSEGRITY_TEST_ROS_DOMAIN_ID") or str(random.SystemRandom().randint(1, 100))
os.environ["ROS_DOMAIN_ID"] = _DOMAIN_ID
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

_counter = itertools.count()


def unique_name(prefix: str = "test") -> str:
    """Return a node/topic-safe name unique within this process."""
    return f"{prefix}_{os.getpid()}_{next(_counter)}"


def spin_until(executor, predicate: Callable[[], bool], timeout: float = 10.0, step: float = 0.05) -> bool:
    """Spin ``executor`` until ``predicate()`` is true or ``timeout`` seconds pass.

    Returns the final value of ``predicate()`` (so callers can ``assert`` it).
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bool(predicate())
        executor.spin_once(timeout_sec=min(step, remaining))


def pytest_report_header(config):  # noqa: ARG001 - pytest hook signature
    return f"ROS_DOMAIN_ID={_DOMAIN_ID} ROS_AUTOMATIC_DISCOVERY_RANGE={os.environ.get('ROS_AUTOMATIC_DISCOVERY_RANGE')}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: torch's intra-op threads only add overhead (and thrash on a loaded 2-core machine).
    Use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def rclpy_context():
    """A dedicated rclpy Context, initialised once per test session."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(args=[], context=context)
    try:
        yield context
    finally:
        rclpy.try_shutdown(context=context)


@pytest.fixture
def ros_executor(rclpy_context):
    """A SingleThreadedExecutor on the session context; shut down after the test."""
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=rclpy_context)
    try:
        yield executor
    finally:
        executor.shutdown(timeout_sec=1.0)


@pytest.fixture
def make_node(rclpy_context, ros_executor):
    """Factory creating nodes in the session context (added to ``ros_executor``)."""
    from rclpy.node import Node

    nodes = []

    def _make(name: str | None = None, **kwargs) -> Node:
        node = Node(name or unique_name("node"), context=rclpy_context, **kwargs)
        ros_executor.add_node(node)
        nodes.append(node)
        return node

    try:
        yield _make
    finally:
        for node in nodes:
            ros_executor.remove_node(node)
            node.destroy_node()


@pytest.fixture(name="spin_until")
def _spin_until_fixture():
    return spin_until


# --- the session must end: no hang after the summary, nothing left running ------------------------------------
#: seconds the interpreter may take to exit after the session; then every thread's stack is dumped and the run
#: fails (a hang in an atexit hook once kept `make test` alive after "318 passed")
EXIT_WATCHDOG_S = float(os.environ.get("TENSEGRITY_TEST_EXIT_WATCHDOG_S", "60"))


def _child_pids() -> list:
    """Live (non-zombie) child processes of this process, from /proc."""
    import glob

    pids = []
    for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            pids += [int(p) for p in open(f).read().split()]
        except OSError:
            pass
    live = []
    for pid in sorted(set(pids)):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z":
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if "multiprocessing.resource_tracker" in cmd or "multiprocessing.forkserver" in cmd:
            continue   # multiprocessing's own helper: it ends when this interpreter closes its pipe
        live.append(pid)
    return live


def _idle_pool_worker(thread) -> bool:
    """A ``concurrent.futures`` thread-pool worker waiting for work (e.g. the pool torch's inductor starts when it
    compiles): the interpreter's exit hook wakes and joins it at once, so it cannot hang the exit. A worker
    running a job is not idle (its innermost frame is the job's)."""
    import linecache
    import sys

    frame = sys._current_frames().get(thread.ident)
    return (frame is not None and frame.f_code.co_name == "_worker"
            and frame.f_code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py"))
            and "work_queue.get" in linecache.getline(frame.f_code.co_filename, frame.f_lineno))


def leftovers(grace_s: float = 2.0):
    """(non-daemon threads other than the main one, live child pids) still there after ``grace_s`` s; idle
    thread-pool workers are not counted (see :func:`_idle_pool_worker`)."""
    import threading

    deadline = time.monotonic() + grace_s
    while True:
        threads = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
                   and not t.daemon and not _idle_pool_worker(t)]
        children = _child_pids()
        if (not threads and not children) or time.monotonic() >= deadline:
            return threads, children
        time.sleep(0.05)


def pytest_configure(config):  # noqa: ARG001
    import faulthandler
    import signal

    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, chain=True)   # `timeout` in .ci/run: stacks before the kill


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    import faulthandler
    import sys

    if "torch._inductor.async_compile" in sys.modules:
        # torch's own pool of compile-worker processes, which inductor starts on a machine with many cores (the
        # 16-core GPU machine of 2026-12-04: test_cuda.py compiles there) and which torch's exit hook ends only
        # after this check
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
    threads, children = leftovers()
    if threads or children:
        lines = [f"thread {t.name!r} (non-daemon)" for t in threads] + \
            [f"child process {pid}: {open(f'/proc/{pid}/cmdline').read().replace(chr(0), ' ')[:120]!r}"
             for pid in children if os.path.exists(f"/proc/{pid}/cmdline")]
        sys.stderr.write("\nsession-end check FAILED: still running 2 s after the last test:\n  " +
                         "\n  ".join(lines) + "\n")
        faulthandler.dump_traceback(all_threads=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    # whatever hangs from here on (atexit hooks, interpreter teardown) ends in a stack dump and exit 1
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True)
