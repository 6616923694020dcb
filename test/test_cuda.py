"""The GPU path (issue 20 item 4): the engine, stage 2 of the identification and `tensegrity identify` on CUDA give
the CPU's numbers, and stage 2 keeps its windows in one process there (a CUDA context does not survive a fork:
windows are batched, not sharded over workers). The three CUDA tests skip cleanly without CUDA; the first test
and the last two (`bench/bench_gpu.py`, `make bench`'s GPU part, without CUDA and as a dry run on the CPU) run
everywhere."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import make_engine, params_from_structure
from tensegrity_ros.ident import RefineOptions, refine
from tensegrity_ros.ident.synthetic import actuated_pendulum, pendulum_drive, random_initial_state, simulate_dataset
from tensegrity_ros.ident.workers import can_fork, window_workers
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import CONFIG_DIR

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")


def test_windows_are_never_forked_for_a_cuda_problem():
    """Decided from the device alone, so it holds (and is checked) on a machine without CUDA too."""
    assert not can_fork(torch.device("cuda"))

    class _Problem:                     # the two attributes window_workers reads
        B_win = 8
        device = torch.device("cuda")
    with window_workers(_Problem(), 4) as workers:
        assert workers is None


def _bench_gpu(monkeypatch):
    """bench/bench_gpu.py as a module."""
    monkeypatch.syspath_prepend(str(CONFIG_DIR.parent / "bench"))
    import bench_gpu
    return bench_gpu


@needs_cuda
def test_engine_rollout_on_cuda_matches_cpu():
    s = load_structure(CONFIG_DIR / "models" / "icosahedron.yaml")
    out = {}
    for dev in ("cpu", "cuda"):
        eng = make_engine(s, "nodal", "semi_implicit", dtype=torch.float64, device=dev)
        p = eng.default_params()
        s0 = eng.initial_state(batch=64)
        # drawn on the CPU for both: CUDA's generator gives other numbers for the same seed
        kick = 0.05 * torch.randn(s0.velocities.shape, dtype=s0.velocities.dtype,
                                  generator=torch.Generator().manual_seed(0))
        s0 = eng.project(p, s0.replace(velocities=s0.velocities + kick.to(dev)))
        out[dev] = eng.rollout(p, s0, None, 1e-3, steps=500).positions.cpu().numpy()
    np.testing.assert_allclose(out["cuda"], out["cpu"], atol=1e-9)


@needs_cuda
def test_rollouts_replayed_from_cuda_graphs_equal_the_launched_ones():
    """engine/graphs.py on a GPU: the eager steps (70 in chunks of 32, every input, per-item parameters) and the
    compiled ones (inductor, chunks of 4) captured and replayed give the states of the same steps launched one by
    one (float64; the eager graph inverts the bar matrix unrolled instead of by LAPACK: round-off)."""
    import sys
    sys.path.insert(0, str(CONFIG_DIR.parent / "test"))
    from test_engine_native import _case
    for name, atol, kw in (("stacked_manipulator", 1e-11, {}),
                           ("icosahedron", 1e-12, {"compile": True, "kernel": "inductor", "chunk": 4})):
        eng, hyps, s0, inp = _case(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), B=5, T=70)
        hyps, s0, inp = (x.map(lambda t: t.cuda()) for x in (hyps, s0, inp))
        ref = eng.rollout(hyps, s0, inp, 1e-3, **kw)
        got = eng.rollout(hyps, s0, inp, 1e-3, cuda_graph=True, **kw)
        assert got.positions.device.type == "cuda"
        torch.testing.assert_close(got.positions, ref.positions, rtol=0, atol=atol)
        torch.testing.assert_close(got.velocities, ref.velocities, rtol=0, atol=100 * atol)


@needs_cuda
def test_stage_2_on_cuda_gives_the_cpu_fit():
    s = actuated_pendulum()
    nominal = params_from_structure(s)
    true = nominal.with_values({"s3.rest_length": 1.085, "m1.spool_radius": 0.012, "m2.spool_radius": 0.009})
    X0, V0 = random_initial_state(s, np.random.default_rng(1), params=true)
    ds = simulate_dataset(s, true, X0, V0, dt=2e-3, steps=1000, every=5, motor_fn=pendulum_drive)
    fits = {dev: refine(s, ds, nominal, RefineOptions(kinds=("rest_length", "spool_radius"), window_s=0.3,
                                                      max_iter=10, device=dev, workers=2))
            for dev in ("cpu", "cuda")}
    assert fits["cuda"].problem.device.type == "cuda"
    for (n, a), b in zip(fits["cuda"].params.named().items(), fits["cpu"].params.named().values()):
        assert float(a) == pytest.approx(float(b), rel=1e-8, abs=1e-12), n
    assert float(fits["cuda"].params.named()["s3.rest_length"]) == pytest.approx(1.085, abs=3e-4)


@needs_cuda
def test_identify_command_runs_on_cuda(tmp_path):
    """`tensegrity identify --device cuda` on a short simulated manipulator bag: exit 0 and the CPU's values.

    (Until 2026-11-27 this simulated the free-floating icosahedron: with no ground and no actuators it only falls,
    its strings slack, `identify` labelled 0.4 % of its node samples and refused the bag with exit 2, so the test
    failed on the first GPU it met, on the CPU side.)"""
    from tensegrity_ros.cli import main
    model = str(CONFIG_DIR / "models" / "stacked_manipulator.yaml")
    assert main(["simulate", model, "--duration", "2", "--out", str(tmp_path / "sim"), "--bag",
                 str(tmp_path / "sim" / "bag"), "--perturb", "0.1"]) == 0
    vals = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / f"{dev}.yaml"
        assert main(["identify", str(tmp_path / "sim" / "bag"), "--model", model, "--out", str(out), "--device", dev,
                     "--longer-windows", "none", "--holdout", "0", "--no-law-check", "--windows", "4",
                     "--max-iter", "3", "--workers", "1"]) in (0, 3)
        vals[dev] = params_from_structure(load_structure(out)).named()
    for n, v in vals["cpu"].items():
        assert float(vals["cuda"][n]) == pytest.approx(float(v), rel=1e-6, abs=1e-9), n


@needs_cuda
def test_online_identifier_update_on_cuda_gives_the_cpu_update(monkeypatch):
    """The online identifier's update (``fit_window``, what its worker runs) with ``device: cuda``: the CPU's
    values and held-out scores. (Its first run, on the H200 of 2026-12-04, failed before measuring anything: the
    update took its parameters from the node module, whose ROS message imports that machine lacks; see
    test_the_online_update_needs_no_ros.)"""
    pytest.importorskip("mujoco")
    bench_gpu = _bench_gpu(monkeypatch)
    out = {dev: bench_gpu.online_update(dev)[0] for dev in ("cpu", "cuda")}
    for dev, o in out.items():
        assert o.ok, f"{dev}: {o.error}"
    assert out["cuda"].values.keys() == out["cpu"].values.keys()
    for n, v in out["cpu"].values.items():
        assert out["cuda"].values[n] == pytest.approx(v, rel=1e-6, abs=1e-9), n
    np.testing.assert_allclose(out["cuda"].holdout_mse, out["cpu"].holdout_mse, rtol=1e-6)


def test_the_online_update_needs_no_ros():
    """The GPU bench's online update runs where no ROS is installed (a lent GPU machine has none): in a process
    where every ROS package refuses to import, it still produces a set."""
    pytest.importorskip("mujoco")
    import subprocess
    import sys
    from no_ros import HOOK
    code = HOOK + f"""
sys.path.insert(0, {str(CONFIG_DIR.parent / "bench")!r})
import bench_gpu
out, _ = bench_gpu.online_update("cpu", seconds=6.0)
assert out.ok, out.error
print("OK", len(out.values))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK 14" in proc.stdout, proc.stderr[-3000:]


def test_gpu_bench_says_when_it_measured_nothing(monkeypatch, tmp_path, capsys):
    """`make bench`'s GPU part, without CUDA: nothing measured, said so, no figures that look measured."""
    bench_gpu = _bench_gpu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = bench_gpu.run(out=tmp_path / "gpu.json")
    assert res["cuda"] is False and "engine" not in res and "identify" not in res
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "gpu.json").exists()


def test_gpu_bench_engine_part_dry_run_on_cpu(monkeypatch, tmp_path):
    """The same code on the CPU, small: every case measured, MuJoCo beside it, the ratio and the top-batch figure
    derived from those rates, and the results file holding them."""
    bench_gpu = _bench_gpu(monkeypatch)
    out = tmp_path / "gpu.json"
    res = bench_gpu.run(parts=("engine",), out=out, device="cpu",
                        engine_kw={"structures": ("icosahedron",), "batches": (1, 8), "compiled_batches": (),
                                   "grad_batches": (8,)})
    rates = res["engine"]["icosahedron/semi_implicit"]
    assert set(rates) == {"eager_nograd_b1", "eager_nograd_b8", "eager_grad_b8"}
    assert all(v["steps_per_s"] > 0 for v in rates.values()) and res["engine_errors"] == {}
    best = max(rates["eager_nograd_b1"]["steps_per_s"], rates["eager_nograd_b8"]["steps_per_s"])
    assert res["ratio_vs_rollout"]["icosahedron"] == pytest.approx(
        best / res["mujoco_rollout"]["icosahedron"]["steps_per_s"])
    rf = res["roofline"]["icosahedron"]
    assert rf["flops_per_item_step"] > 0 and res["peak_gflops"] > 0
    assert rf["fraction_of_peak"] == pytest.approx(best * rf["flops_per_item_step"] / 1e9 / res["peak_gflops"])
    assert res["top_batch"] == 8
    assert res["engine_top_batch_min_steps_per_s"] == rates["eager_nograd_b8"]["steps_per_s"]
    assert json.loads(out.read_text())["engine"] == res["engine"]


def test_gpu_bench_tangent_part_dry_run_on_cpu(monkeypatch, tmp_path):
    """The tangent-step measurement on the CPU, small: one row per window count and linearisation batch; stepped one
    at a time, the same operation count whatever the batch (the step's launches do not grow with the windows);
    with the steps linearised together, far fewer operations per step; a positive time."""
    bench_gpu = _bench_gpu(monkeypatch)
    res = {}
    bench_gpu.tangent_part(res, lambda: None, device="cpu", windows=(1, 2), steps=3, rows=(1, 4096))
    rows = res["tangent_step"]["rows"]
    assert [(r["windows"], r["rows"]) for r in rows] == [(1, 1), (1, 4096), (2, 1), (2, 4096)]
    one, batched = rows[0::2], rows[1::2]
    assert one[0]["aten_ops_per_step"] == one[1]["aten_ops_per_step"] > one[0]["compute_ops_per_step"] > 100
    assert all(b["aten_ops_per_step"] < 0.5 * o["aten_ops_per_step"] for b, o in zip(batched, one))
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_gpu_bench_online_part_dry_run_on_cpu(monkeypatch):
    """The online-update measurement, its code run on the CPU twice (the bench's pairing, CUDA then CPU, with the
    CPU in both places): both updates produce a set, equal to each other, with a wall time; a failing device is
    recorded with its traceback and the other still measured."""
    pytest.importorskip("mujoco")
    bench_gpu = _bench_gpu(monkeypatch)
    calls = []
    real = bench_gpu.online_update

    def update(dev, seconds=8.0):
        calls.append(dev)
        if dev == "broken":
            raise RuntimeError("no such device")
        return real("cpu", seconds=6.0)
    monkeypatch.setattr(bench_gpu, "online_update", update)
    res = {}
    bench_gpu.online_part(res, lambda: None, devices=("cpu", "broken", "cpu2"))
    assert calls == ["cpu", "broken", "cpu2"]
    assert res["online"]["cpu"]["ok"] and res["online"]["cpu"]["wall_s"] > 0
    assert res["online"]["broken"]["ok"] is False and "no such device" in res["online"]["broken"]["traceback"]
    assert res["online"]["cpu2"]["max_rel_diff_vs_cpu"] < 1e-9
