"""`tensegrity demo` end to end, as a user runs it (issue 16): the exit code agrees with the summary's health,
and the verdict is the last line printed -- no node logs after it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_short_demo_ends_with_its_verdict_and_matching_exit_code(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "ROS_DOMAIN_ID": "77", "PYTHONUNBUFFERED": "1"}
    # 12 s: too short for the identifier's first set, so the run is DEGRADED (no update period): exit 3
    r = subprocess.run([sys.executable, "-m", "tensegrity_ros.cli", "demo", "--duration", "12", "--no-bag",
                        "--realtime", "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=280)
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    summary = json.loads((out / "summary.json").read_text())
    health = summary["health"]
    assert lines[-1].startswith(health["verdict"]), lines[-5:]
    assert r.returncode == (0 if health["healthy"] else 3), (r.returncode, lines[-12:])
    failed = [k for k, f in health["figures"].items() if not f["pass"]]
    assert health["healthy"] == (not failed)
    for k in failed:                       # every failed figure is named in the verdict
        assert k in lines[-1]
    # every figure is printed with its threshold before the verdict
    printed = {m.group(2): m.group(1) for m in (re.match(r"(ok|FAIL)\s+(\S+) = ", x.strip()) for x in lines[:-1]) if m}
    assert printed == {k: "ok" if f["pass"] else "FAIL" for k, f in health["figures"].items()}
    # a message short of rate x duration is accounted for: lost between nodes, or never produced by its source
    lost, never = summary["lost_messages"], summary["not_produced_messages"]
    assert isinstance(lost, int) and isinstance(never, int) and lost + never >= summary["dropped_messages"] >= 0
    assert any(f"({lost} lost between nodes, {never} never produced by the sources)" in x for x in lines), lines[-12:]
    # the machine's load during the run, printed before the health lines: context for the latency figure
    machine = summary["machine"]
    assert machine["cores"] == os.cpu_count() and 10.0 < machine["wall_s"] < 200.0
    if machine["busy_fraction"] is not None:            # Linux: /proc/stat
        assert 0.0 < machine["busy_fraction"] <= 1.0 and 0.0 <= machine["steal_fraction"] < 1.0
        assert any(x.startswith("machine during the run: ") and "% busy" in x for x in lines), lines[-14:]
    # the priorities --realtime asked for, each done or refused with how to allow it: the state predictor on a
    # SCHED_FIFO executor thread of its own, the simulated robot's simulation thread SCHED_FIFO above it
    rt, sim = summary["priorities"]["realtime_executor"], summary["priorities"]["simulation_thread"]
    assert rt["nodes"] == ["state_predictor"]
    for got, prio in ((rt, 10), (sim, 20)):
        assert got["message"] == f"SCHED_FIFO priority {prio}" if got["done"] else "ulimit -r" in got["message"], got
