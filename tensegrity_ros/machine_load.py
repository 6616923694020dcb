"""What the machine did during a run (no rclpy): how busy its CPUs were, how much of their time the hypervisor
took (steal), and how long one thread -- the graph's executor, which runs every callback of the 120-Hz path --
waited for a CPU while it was ready to run.

Why: the demo's prediction latency p99 judges the software and the machine together. Traced in stop 47 (120-s
demos with every callback timed), the slowest 1 % of predictions did as much work as the others (2-3 ms of
CPU); their time went in waiting: for the executor to reach the message (most of it in no callback at all)
and, inside the callback, mostly in the run queue (74 % of the callbacks' waits over 5 ms: ready, not running;
the GIL can be no more than the rest), not in the garbage collector. These figures let a user tell a saturated machine from a slow
program: context printed with the health verdict; they change no threshold.

Linux only (``/proc/stat``, ``/proc/self/task/<tid>/schedstat``); elsewhere every figure is None.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple


def cpu_times() -> Optional[Tuple[float, float, float]]:
    """(busy, idle, steal) seconds summed over the machine's CPUs since boot (``/proc/stat``), None if
    unreadable. Busy counts user, nice, system, irq and softirq; idle counts idle and iowait."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, (idle + iowait) / tick, steal / tick


def thread_schedstat(tid: int) -> Optional[Tuple[float, float]]:
    """(seconds on a CPU, seconds waiting in a run queue) of thread ``tid`` of this process since it started
    (``/proc/self/task/<tid>/schedstat``; the kernel's schedstats), None if unreadable."""
    try:
        with open(f"/proc/self/task/{int(tid)}/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) * 1e-9, int(waiting) * 1e-9


class LoadMeter:
    """The machine's CPU use and one thread's run-queue waits from :meth:`start` to :meth:`stop` (or, until
    then, to each :meth:`summary`)."""

    def __init__(self):
        self._tid: Optional[int] = None
        self._begin: Optional[tuple] = None   # _sample() at start()
        self._end: Optional[tuple] = None     # _sample() at stop()

    def _sample(self) -> tuple:
        """(monotonic time, cpu_times(), thread_schedstat(tid) or None)."""
        return (time.monotonic(), cpu_times(), thread_schedstat(self._tid) if self._tid is not None else None)

    def start(self, tid: Optional[int] = None) -> "LoadMeter":
        """Start measuring now; ``tid``: the native id of the thread whose waits to measure (None: none)."""
        self._tid = tid
        self._begin, self._end = self._sample(), None
        return self

    def stop(self) -> None:
        """End the measurement now (a run's end, before its drain and reports); later summaries read it."""
        if self._end is None:
            self._end = self._sample()

    def summary(self) -> Dict[str, Optional[float]]:
        """From :meth:`start` to :meth:`stop` (or now): ``cores``; ``wall_s``; ``busy_fraction`` and
        ``steal_fraction`` of all cores' time; ``thread_cpu_fraction`` (of one core) and
        ``thread_waiting_fraction`` (of the wall time: ready but not running) of the measured thread. None where
        not measured."""
        t0, cpu0, thread0 = self._begin
        t1, cpu1, thread1 = self._end if self._end is not None else self._sample()
        wall = t1 - t0
        out: Dict[str, Optional[float]] = {"cores": os.cpu_count(), "wall_s": round(wall, 3), "busy_fraction": None,
                                           "steal_fraction": None, "thread_cpu_fraction": None,
                                           "thread_waiting_fraction": None}
        if cpu0 is not None and cpu1 is not None:
            busy, idle, steal = (b - a for a, b in zip(cpu0, cpu1))
            total = busy + idle + steal
            if total > 0:
                out["busy_fraction"], out["steal_fraction"] = busy / total, steal / total
        if thread0 is not None and thread1 is not None and wall > 0:
            out["thread_cpu_fraction"] = (thread1[0] - thread0[0]) / wall
            out["thread_waiting_fraction"] = (thread1[1] - thread0[1]) / wall
        return out


def describe(load: Dict[str, Optional[float]], thread: str = "the graph's executor thread") -> str:
    """One line for logs and reports: the machine's load and the measured thread's waits."""
    parts = []
    if load.get("busy_fraction") is not None:
        parts.append(f"{load['cores']} cores {100 * load['busy_fraction']:.0f} % busy "
                     f"(steal {100 * load['steal_fraction']:.1f} %)")
    if load.get("thread_cpu_fraction") is not None:
        parts.append(f"{thread} on a CPU {100 * load['thread_cpu_fraction']:.0f} % of the run, ready but waiting "
                     f"for one {100 * load['thread_waiting_fraction']:.1f} %")
    return "; ".join(parts) if parts else "machine load not measured (no /proc)"
