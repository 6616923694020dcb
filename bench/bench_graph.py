"""The node graph against the simulated robot (tensegrity_ros.bringup): node-state -> prediction latency (p50 /
p99, DDS reception to publish), the identifier's update time, what was delivered against rate x duration over a
run (default 300 s), message rates, the driver's loop, CPU use and the machine's load (the figures depend on
it: the cores' busy and stolen time, the executor thread's waits for a CPU), and the run's health verdict against
config/health.yaml (section graph; exit 3 when degraded).

    python bench/bench_graph.py [--duration 300]
    python -c "import bench.bench_graph as b; print(b.run(30))"

Writes build/bench/graph.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from tensegrity_ros.machine_load import describe as describe_load
from tensegrity_ros.paths import REPO_ROOT

OUT = REPO_ROOT / "build" / "bench" / "graph.json"


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _pct(stats, q, scale=1e3):
    v = stats.values()
    return float(np.percentile(v, q) * scale) if v.size else float("nan")


def run(duration_s: float = 300.0, out: Path = OUT, robot_process: bool = True,
        predictor_process: bool = False) -> dict:
    """robot_process: the simulated robot (twin, emulated bus, driver) in a process of its own (default, as the
    demo runs it), else in the graph's; predictor_process: the state predictor in one of its own too."""
    from tensegrity_ros.bringup import (GraphConfig, build_graph, delivery, delivery_summary, drain, graph_health,
                                        stop_sources)

    # the demo's priorities (its default, without --realtime): the simulated robot and the graph's callbacks above
    # the compute workers
    from tensegrity_ros.commands.demo import priority_fields

    graph = build_graph(GraphConfig(keep_predictions_every=1000, robot_process=robot_process,
                                    predictor_process=predictor_process, **priority_fields()))
    try:
        nodes = graph.nodes
        idn, ing = nodes["online_identifier"], nodes["mocap_ingest"]
        pids = {"graph_process": os.getpid(), "identifier_worker": idn.worker_pid}
        for role, proc in (("robot_process", graph.robot), ("predictor_process", graph.predictor_proc)):
            if proc is not None:
                pids[role] = proc.proc.pid
        cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
        load0 = os.getloadavg()
        graph.spin_in_background()
        t0 = time.monotonic()
        while time.monotonic() - t0 < duration_s:
            time.sleep(min(5.0, duration_s - (time.monotonic() - t0)))
            for n in nodes.values():
                if getattr(n, "fault", None) is not None:
                    raise RuntimeError(f"{n.get_name()} stopped: {n.fault}")
            faults = graph.robot_stats()["faults"]
            if faults:
                raise RuntimeError(f"robot side stopped: {faults}")
        wall = time.monotonic() - t0
        cpu1 = {k: _cpu_s(p) for k, p in pids.items()}
        load1 = os.getloadavg()
        stop_sources(graph)            # also ends the load meter's measurement: the run's, not the drain's
        delivered = drain(graph, 30.0)
        drops = graph.drops()
        robot = graph.robot_stats()
        st = robot["driver"]
        pr = graph.predictor()     # latency statistics: the last 20,000 predictions (~170 s at 120 Hz)
        deliv = delivery(graph, wall)
        health = graph_health(graph, wall)
        result = {
            "health": health.as_dict(),
            "delivery": deliv,
            "priorities": graph.priorities,
            "robot_process": robot_process,
            "duration_s": round(wall, 2),
            "latency_p50_ms": _pct(pr.latency, 50), "latency_p99_ms": _pct(pr.latency, 99),
            "latency_max_ms": _pct(pr.latency, 100),
            "compute_p50_ms": _pct(pr.compute, 50), "compute_p99_ms": _pct(pr.compute, 99),
            "predictions": pr.published, "predictions_skipped_uncovered": pr.skipped_uncovered,
            "predictions_extended": pr.extended,
            "relinearize_ms_p50": _pct(pr.lin_time, 50), "relinearize_ms_p99": _pct(pr.lin_time, 99),
            "identifier_update_s_p50": _pct(idn.update_time, 50, 1.0),
            "identifier_update_s_p99": _pct(idn.update_time, 99, 1.0),
            "identifier": dict(idn.stats),
            # every message of a rate-driven stream not delivered (expected = rate x duration), lost between nodes or
            # never produced by its source, and whether every stream was complete
            **delivery_summary(deliv, delivered),
            "queue_drops": drops,
            # lost on ANY subscription (every topic, every subscriber: sequence gaps or published - received);
            # lost_messages above counts only the rate streams, at their least-served consumer
            "queue_drops_total": graph.total_dropped(drops),
            "messages": graph.received(), "published": graph.published_counts(),
            "rates_hz": {"mocap": ing.frames / wall, "driver_loop": st.get("loop_rate_hz"),
                         "motor_states": graph.received().get("/tensegrity/motor_states", 0) / wall},
            "driver": {"cycles": st.get("cycles"), "missed_cycles": st.get("missed_cycles"),
                       "jitter_p99_ms": st.get("jitter_p99_ms")},
            "sim": robot["sim"],
            "ingest_ms_p50": _pct(ing.proc_time, 50), "ingest_ms_p99": _pct(ing.proc_time, 99),
            "cpu_cores": {k: round((cpu1[k] - cpu0[k]) / wall, 3) for k in pids},
            "loadavg_start": load0, "loadavg_end": load1, "cpu_count": os.cpu_count(),
            # the cores' busy / stolen time and the executor thread's waits for a CPU (tensegrity_ros.machine_load)
            "machine": graph.load.summary() if graph.load is not None else {},
        }
    finally:
        graph.shutdown()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of motion (default 300)")
    ap.add_argument("--one-process", action="store_true", help="the simulated robot in the graph's process too")
    ap.add_argument("--predictor-process", action="store_true", help="the state predictor in a process of its own")
    args = ap.parse_args(argv)
    r = run(args.duration, robot_process=not args.one_process, predictor_process=args.predictor_process)
    print(f"latency p50 {r['latency_p50_ms']:.2f} ms, p99 {r['latency_p99_ms']:.2f} ms; identifier update "
          f"p50 {r['identifier_update_s_p50']:.2f} s; not delivered {r['dropped_messages']} ({r['lost_messages']} lost "
          f"between nodes, {r['not_produced_messages']} never produced); driver missed "
          f"{r['driver']['missed_cycles']} cycles; load {r['loadavg_end']}; wrote {OUT}")
    if r["machine"]:
        print(f"machine during the run: {describe_load(r['machine'])}")
    print(r["health"]["verdict"])
    return 0 if r["health"]["healthy"] else 3


if __name__ == "__main__":
    sys.exit(main())
