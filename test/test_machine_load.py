"""tensegrity_ros.machine_load: the machine's CPU use and one thread's run-queue waits, against a contention the
test makes (a process spinning on the same CPU as the measured thread)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from tensegrity_ros.machine_load import LoadMeter, cpu_times, describe, thread_schedstat

linux_only = pytest.mark.skipif(cpu_times() is None or thread_schedstat(threading.get_native_id()) is None,
                                reason="no /proc/stat or per-thread schedstat here")


def _hash_for(seconds: float, meter_box: dict, cpu: int) -> None:
    """The measured thread: pinned to ``cpu``, hashing (C code, the GIL released) for ``seconds`` of wall time."""
    os.sched_setaffinity(0, {cpu})            # Linux: the calling thread only
    meter = LoadMeter().start(threading.get_native_id())
    data = b"x" * (1 << 20)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        hashlib.sha256(data).digest()
    meter_box["summary"] = meter.summary()


@linux_only
def test_a_thread_that_shares_its_cpu_with_a_spinning_process_is_measured_waiting():
    cpu = sorted(os.sched_getaffinity(0))[0]
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\n"
                                "while True: pass"])
    try:
        time.sleep(0.3)                       # the spinner is running before the measurement starts
        meter_box = {}
        t = threading.Thread(target=_hash_for, args=(1.5, meter_box, cpu))
        t.start()
        t.join(60)
    finally:
        spinner.kill()
        spinner.wait(10)
    load = meter_box["summary"]
    # one CPU, two runnable tasks of equal niceness: each runs about half the time and waits the other half;
    # the thread is never asleep, so on-CPU + waiting covers its wall time
    assert 0.15 < load["thread_cpu_fraction"] < 0.85, load
    assert 0.15 < load["thread_waiting_fraction"] < 0.85, load
    assert load["thread_cpu_fraction"] + load["thread_waiting_fraction"] == pytest.approx(1.0, abs=0.15), load
    assert load["cores"] == os.cpu_count() and 0.0 < load["busy_fraction"] <= 1.0
    line = describe(load)
    assert "% busy" in line and "ready but waiting for one" in line


@linux_only
def test_an_unloaded_thread_barely_waits_and_a_meter_without_a_thread_measures_only_the_machine():
    own = LoadMeter().start(threading.get_native_id())
    time.sleep(0.2)                            # asleep: neither on a CPU nor waiting for one
    s = own.summary()
    assert s["thread_cpu_fraction"] < 0.2 and s["thread_waiting_fraction"] < 0.2, s
    meter = LoadMeter().start()
    time.sleep(0.1)                            # /proc/stat counts in ticks (10 ms)
    machine = meter.summary()
    assert machine["thread_cpu_fraction"] is None and machine["busy_fraction"] is not None


def test_describe_says_when_nothing_was_measured():
    none = {"cores": 2, "wall_s": 1.0, "busy_fraction": None, "steal_fraction": None, "thread_cpu_fraction": None,
            "thread_waiting_fraction": None}
    assert describe(none) == "machine load not measured (no /proc)"
    assert thread_schedstat(2 ** 30) is None          # no such thread: None, not an exception


@linux_only
def test_a_stopped_meter_reports_the_run_up_to_its_stop_not_what_came_after():
    def spin(seconds):
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass

    meter = LoadMeter().start(threading.get_native_id())
    spin(0.15)
    meter.stop()
    first = meter.summary()
    spin(0.3)                                   # after the stop: not counted
    time.sleep(0.1)
    again = meter.summary()
    assert again == first
    assert first["thread_cpu_fraction"] * first["wall_s"] == pytest.approx(0.15, abs=0.03)
