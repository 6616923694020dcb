"""Hardware-path benchmark against the emulated bus (real dynamixel_sdk, real pty).

1. Bus round trip: Sync Write goal + Sync Read (or Fast Sync Read) of present
   position/velocity/current for 6 motors, through DynamixelBus, for the X and PRO tables.
2. Driver loop: DriverCore at 80 Hz (RateScheduler, absolute deadlines) for ``--duration``
   seconds: loop rate, period median/p99, jitter, missed cycles, time spent in cycle().

The emulator runs in a separate process by default (``tensegrity emulate-bus``), like real
motors would: it does not share the driver's GIL. Results: a table on stdout and
``build/bench/hardware.json``.

    python bench/bench_hardware.py --duration 60
    python -c "import bench.bench_hardware as b; print(b.run(5))"
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import numpy as np

from tensegrity_ros.paths import REPO_ROOT  # noqa: E402

REPO = str(REPO_ROOT)

from tensegrity_ros.hardware.driver_core import DriverCore, MotorSpec, RateScheduler  # noqa: E402
from tensegrity_ros.hardware.dynamixel.bus import DynamixelBus  # noqa: E402
from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus  # noqa: E402

IDS = (1, 2, 3, 4, 5, 6)
PRO_MODELS = "1-3:l54-50-s290-r,4-6:m42-10-s260-r"
OUT_PATH = os.path.join(REPO, "build", "bench", "hardware.json")


def _models(spec: str) -> Dict[int, str]:
    if ":" not in spec:
        return {i: spec for i in IDS}
    out = {}
    for part in spec.split(","):
        sel, name = part.rsplit(":", 1)
        a, b = (sel.split("-") + [sel])[:2]
        for i in range(int(a), int(b) + 1):
            out[i] = name
    return out


@contextmanager
def emulated_port(model: str, baud: int, mode: str = "subprocess") -> Iterator[str]:
    """A pty path served by the emulator (a child process or a thread of this process)."""
    if mode == "inprocess":
        emu = EmulatedBus(IDS, _models(model), baud=baud)
        try:
            yield emu.port
        finally:
            emu.stop()
        return
    link = os.path.join(tempfile.mkdtemp(prefix="dxl-bench-"), "ttyDXL")
    code = ("import sys; from tensegrity_ros.hardware.dynamixel.emulator import emulate_bus_main; "
            "sys.exit(emulate_bus_main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", code, "--link", link, "--ids", "1-6", "--model", model,
                             "--baud", str(baud)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 30
        while not os.path.islink(link):
            if proc.poll() is not None:
                raise RuntimeError(f"emulator exited: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                raise RuntimeError("emulator did not start")
            time.sleep(0.02)
        yield link
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_roundtrip(model: str, baud: int, seconds: float, mode: str) -> Dict[str, float]:
    with emulated_port(model, baud, mode) as port:
        with DynamixelBus(port, baud, _models(model)) as bus:
            bus.enable_torque()
            fast = all(bus.uses_fast_sync_read.values())
            times: List[float] = []
            t_end = time.perf_counter() + seconds
            k = 0
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                bus.write_goals({i: 0.2 * np.sin(0.01 * k + i) for i in IDS})
                states = bus.read_states()
                times.append(time.perf_counter() - t0)
                assert len(states) == len(IDS)
                k += 1
            failures = sum(c.failures for c in bus.counters.values())
    t = np.array(times)
    return {"model": model, "baud": baud, "fast_sync_read": fast, "cycles": int(t.size),
            "cycles_per_s": float(t.size / t.sum()), "median_ms": float(np.median(t) * 1e3),
            "p99_ms": float(np.percentile(t, 99) * 1e3), "max_ms": float(t.max() * 1e3), "read_failures": failures}


def bench_loop(duration_s: float, rate_hz: float, mode: str, model: str = PRO_MODELS,
               baud: int = 4_000_000) -> Dict[str, float]:
    acts = [MotorSpec(f"m{i}", i, m, limits=(-1.0, 1.0)) for i, m in _models(model).items()]
    with emulated_port(model, baud, mode) as port:
        bus = DynamixelBus(port, baud, {a.motor_id: a.model for a in acts})
        core = DriverCore(bus, acts, rate_hz=rate_hz, max_rate_rad_s=2.0, command_source="reference",
                          reference=lambda t: 0.5 * np.sin(2 * np.pi * t / 7.0 + np.arange(6) * 2 * np.pi / 3))
        sched = RateScheduler(rate_hz, window=int(duration_s * rate_hz) + 16)
        cycle_times: List[float] = []
        orig_cycle = core.cycle

        def timed_cycle(now=None):
            t0 = time.perf_counter()
            out = orig_cycle(now)
            cycle_times.append(time.perf_counter() - t0)
            return out

        core.cycle = timed_cycle  # measure the work inside each period
        stats = core.run(duration_s=duration_s, scheduler=sched)
    s = sched.summary()
    c = np.array(cycle_times) if cycle_times else np.zeros(1)
    return {"rate_hz_target": rate_hz, "duration_s": duration_s, "model": model, "baud": baud,
            "cycles": stats.cycles, "missed_cycles": s["missed_cycles"], "loop_rate_hz": s["rate_hz"],
            "period_median_ms": s["period_median_s"] * 1e3, "period_p99_ms": s["period_p99_s"] * 1e3,
            "jitter_median_ms": s["jitter_median_s"] * 1e3, "jitter_p99_ms": s["jitter_p99_s"] * 1e3,
            "cycle_time_median_ms": float(np.median(c) * 1e3), "cycle_time_p99_ms": float(np.percentile(c, 99) * 1e3),
            "read_failures": int(sum(v["failures"] for v in stats.motor_counters.values()))}


def run(duration_s: float = 60.0, rate_hz: float = 80.0, emulator: str = "subprocess",
        roundtrip_s: Optional[float] = None, write: bool = True) -> Dict[str, object]:
    """Run both benchmarks; returns the result dict (also written to build/bench/hardware.json)."""
    rt_s = roundtrip_s if roundtrip_s is not None else min(5.0, max(1.0, duration_s / 12.0))
    roundtrip = [bench_roundtrip(m, b, rt_s, emulator)
                 for m, b in (("xm430", 1_000_000), ("xm430", 4_000_000), (PRO_MODELS, 1_000_000),
                              (PRO_MODELS, 4_000_000))]
    result = {
        "roundtrip": roundtrip,
        "loop": bench_loop(duration_s, rate_hz, emulator),
        "meta": {"emulator": emulator, "python": platform.python_version(), "machine": platform.machine(),
                 "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "note": "pty emulator: no UART wire time; a real bus adds ~10 bits/byte / baud and the "
                         "FTDI latency timer (set it to 1 ms)"},
    }
    if write:
        os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
        with open(OUT_PATH, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(result: Dict[str, object]) -> str:
    lines = ["bus round trip (Sync Write goal + read pos/vel/cur, 6 motors, DynamixelBus over dynamixel_sdk)",
             f"{'model':<38} {'baud':>8} {'fast':>5} {'cycles/s':>9} {'median ms':>10} {'p99 ms':>8}"]
    for r in result["roundtrip"]:
        lines.append(f"{r['model']:<38} {r['baud']:>8} {str(r['fast_sync_read']):>5} {r['cycles_per_s']:>9.0f} "
                     f"{r['median_ms']:>10.3f} {r['p99_ms']:>8.3f}")
    lp = result["loop"]
    lines += ["", f"driver loop at {lp['rate_hz_target']:.0f} Hz for {lp['duration_s']:.0f} s ({lp['model']}, "
                  f"{lp['baud']} baud)",
              f"  cycles {lp['cycles']}, missed {lp['missed_cycles']}, rate {lp['loop_rate_hz']:.2f} Hz",
              f"  period median {lp['period_median_ms']:.3f} ms, p99 {lp['period_p99_ms']:.3f} ms",
              f"  jitter median {lp['jitter_median_ms']:.3f} ms, p99 {lp['jitter_p99_ms']:.3f} ms",
              f"  cycle() time median {lp['cycle_time_median_ms']:.3f} ms, p99 {lp['cycle_time_p99_ms']:.3f} ms",
              f"  read failures {lp['read_failures']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=60.0, help="driver loop duration [s] (default 60)")
    p.add_argument("--rate", type=float, default=80.0, help="loop rate [Hz]")
    p.add_argument("--emulator", choices=("subprocess", "inprocess"), default="subprocess")
    p.add_argument("--roundtrip-seconds", type=float, default=None, help="seconds per round-trip config")
    args = p.parse_args(argv)
    result = run(args.duration, args.rate, args.emulator, args.roundtrip_seconds)
    print(format_table(result))
    print(f"\nwrote {os.path.relpath(OUT_PATH, os.getcwd())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
