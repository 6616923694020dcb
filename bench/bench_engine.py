"""Engine throughput and accuracy vs the MuJoCo twin, side by side.

    .venv/bin/python bench/bench_engine.py            # full run (compiles several graphs: ~10-20 min on 2 cores)
    .venv/bin/python bench/bench_engine.py --quick    # batch 1 and 1024 only, no gradients

``run() -> dict`` measures, for the icosahedron (explicit semi-implicit Euler) and the stacked manipulator
(``implicit``: its strings are damped too hard for explicit steps at 1 ms), at dt = 1 ms:

* engine steps/s (every batch item counts as a step) for batch 1, 64, 1024 (compiled at 1024 without gradients:
  rollouts of ``ROLLOUT_STEPS``, as long as MuJoCo's, and of 20 steps); eager, compiled by inductor
  (``rollout(compile=True, kernel="inductor")``, the batch-last path) and, for the semi-implicit step without
  gradients, the step fused in C (``kernel="native"``, engine/native.py, what ``kernel="auto"`` runs there);
  without and with gradients (forward + backward of a rollout loss, per step); float32 for throughput;
* the 1 s horizon at batch 1 (eager; compiled, 1 and 8 steps per call; native), ms;
* MuJoCo: a Python ``mj_step`` loop (one core) and ``mujoco.rollout`` with nthread = os.cpu_count();
* agreement with the twin (node positions, mm) on the scenarios of test/test_engine_vs_mujoco.py;
* the roofline: matrix-product flops per item-step (torch's flop counter, reference layout) times the best batch-1024
  rate, as a fraction of the float32 GEMM rate measured on the same threads;
* the compiled path's first call without gradients at each batch size (each a graph of its own) in this process,
  with the inductor cache as the run found it (a fresh clone's is empty: the compile), and again in a NEW process
  once this one has filled the cache (:func:`first_call_in_new_process`): what a later run pays, the "paid once and
  cached across runs" of issue 20.

Writes ``build/bench/engine.json`` (keys per structure: engine_b1024_steps_per_s, mujoco_rollout_steps_per_s,
ratio_b1024_vs_rollout, roofline_b1024, horizon_1s_b1_ms, max_abs_error_vs_mujoco_mm, and the details).
Timings are the best of a few repeats (the machine may be shared).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from tensegrity_ros.paths import REPO_ROOT  # noqa: E402

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / "build" / "torchinductor"))

from tensegrity_ros.engine import Inputs, make_engine, native  # noqa: E402
from tensegrity_ros.engine import setup_compile  # noqa: E402
from tensegrity_ros.metrics import rms_error  # noqa: E402
from tensegrity_ros.model import load_structure  # noqa: E402

DT = 1e-3
#: structure -> integrators measured; the first is the headline (top-level keys), the others nest under their name
STRUCTURES = {"icosahedron": ("semi_implicit",), "stacked_manipulator": ("semi_implicit", "implicit")}
#: compiled path without gradients: run big batches in pieces of this size (measured: the manipulator's working
#: set at 1024 spills the cache; 128 was ~1.8x faster per item until stop 48; with the chord matrix inverted by
#: blocks and the outputs written inside the compiled graph, 2026-12-02, 2 threads, interleaved in one process:
#: 64 / 128 / 256 / 512 / 1024 -> 300 / 427-434 / 491-550 / 473 / 459 k item-steps/s); None: whole batch (the
#: icosahedron: 256 / 512 / 1024 -> 0.96 / 0.88 / 1.28 M). Not with gradients: each
#: piece then keeps an autograd graph of its own, and whole batches were faster (2026-11-27, manipulator at 1024:
#: 85-106 k item-steps/s whole, 58 k in pieces of 128, eager 32-37 k)
SUB_BATCH = {"icosahedron": None, "stacked_manipulator": 256}
#: not measured unless asked for: the manipulator's implicit step compiled with its backward (first call 653 s at
#: batch 1 on this 2-core machine, 2026-11-26, and 234 item-steps/s against eager's 433), and its 8-step chunk.
#: The default of run() too, so that `make bench` (run_all) skips them as the command line does
DEFAULT_SKIP = ("stacked_manipulator/implicit/compiled_grad", "stacked_manipulator/implicit/horizon_compiled_chunk8")


#: steps per rollout of the headline comparison: the compiled engine at batch 1024 without gradients and
#: ``mujoco.rollout`` both run rollouts of this length (until stop 50 the engine's were 20 steps long against
#: MuJoCo's 500, which charged the engine's per-rollout costs 25 times as often; the 20-step figure is still
#: measured and printed, ``compiled_nograd_b1024_20steps``)
ROLLOUT_STEPS = 500


def _best(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def device_sync(t: torch.Tensor):
    """What waits for ``t``'s device: CUDA runs asynchronously, so a timing ends when the device is done, not when
    the Python call returns."""
    return torch.cuda.synchronize if t.is_cuda else (lambda: None)


def engine_rate(eng, B, steps, compile, grad, chunk=1, dtype=torch.float32, sub_batch=None, kernel="inductor",
                repeats=3, cuda_graph=False):
    """(item-steps per second of a rollout of ``steps`` steps at batch B (``compile``: by ``kernel``; ``cuda_graph``:
    replayed from a CUDA graph), the best of ``repeats``; the first call's seconds, which compiles and captures)."""
    p = eng.default_params().map(lambda t: t.to(dtype))
    s0 = eng.initial_state(batch=B).map(lambda t: t.to(dtype))
    torch.manual_seed(0)
    s0 = s0.replace(velocities=s0.velocities + 0.01 * torch.randn_like(s0.velocities))
    s0 = eng.project(p, s0)

    kw = dict(sub_batch=sub_batch, kernel=kernel) if compile else {}
    if cuda_graph:
        kw["cuda_graph"] = True
    sync = device_sync(s0.positions)

    def once():
        if grad:
            k = p.stiffness.clone().requires_grad_(True)
            out = eng.rollout(p.replace(stiffness=k), s0, None, DT, steps=steps, compile=compile, chunk=chunk, **kw)
            out.positions.square().sum().backward()
        else:
            with torch.no_grad():
                eng.rollout(p, s0, None, DT, steps=steps, compile=compile, chunk=chunk, **kw)
        sync()

    t0 = time.perf_counter()
    once()  # warm-up (compiles)
    warm = time.perf_counter() - t0
    if repeats < 1:                 # the first call's time alone
        return math.nan, warm
    sec = _best(once, repeats)
    return B * steps / sec, warm


def _nograd_steps(B: int) -> int:
    """Steps of the first compiled rollout without gradients at batch B in :func:`run` (the headline's length at
    1024 and above)."""
    return 100 if B <= 64 else ROLLOUT_STEPS


def _cache_files() -> int:
    """Files in the inductor cache folder now (0: an empty cache, as in a fresh clone)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    return sum(len(f) for _, _, f in os.walk(root)) if root and os.path.isdir(root) else 0


def first_call_in_new_process(name: str, integrator: str, batches: Sequence[int], timeout_s: float = 900.0) -> dict:
    """The compiled engine's first call without gradients at each batch size in ``batches`` (each shape is a graph
    of its own), timed in a new Python process that shares this one's inductor cache folder: {"seconds": {batch:
    s}, "cache_files"} (the cache's files when it started), or {"error"}. The child's imports are not counted;
    dynamo's tracing and the cache's loading are."""
    import subprocess
    cmd = [sys.executable, str(Path(__file__).resolve()), "--first-call", name, integrator,
           ",".join(str(int(b)) for b in batches)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)   # inherits the cache folder
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:g} s"}
    last = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode != 0 or not last:
        return {"error": f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"}
    out = json.loads(last[0])
    out["seconds"] = {int(b): v for b, v in out["seconds"].items()}
    return out


def _first_call_child(name: str, integrator: str, batches: str) -> None:
    """What :func:`first_call_in_new_process` runs: the compiled call at each batch, its first call timed (as
    :func:`run` makes it: threads, steps, pieces); the result as JSON on stdout."""
    setup_compile(recompile_limit=256)
    files = _cache_files()
    eng = make_engine(load_structure(REPO_ROOT / "config" / "models" / f"{name}.yaml"), "nodal", integrator,
                      dtype=torch.float32)
    seconds = {}
    for B in (int(b) for b in batches.split(",")):
        torch.set_num_threads(1 if B == 1 else (os.cpu_count() or 1))
        _, seconds[B] = engine_rate(eng, B, _nograd_steps(B), True, False, sub_batch=SUB_BATCH.get(name), repeats=0)
    print(json.dumps({"seconds": seconds, "cache_files": files}))


def reference_flops_per_item_step(eng, B: int = 64, steps: int = 10) -> float:
    """Matrix-product flops of one engine step per batch item, counted by torch's flop counter on the reference
    (batch-first, dense constant matrices) layout: the count at batch 2B minus the count at B, so that the work
    done once per rollout (the parameters' derived matrices) is left out. Elementwise work is not counted, and the
    batch-last fast path does the same products as gathers, so this measures the model's work, not what a path
    executes."""
    from torch.utils.flop_counter import FlopCounterMode
    p = eng.default_params()

    def count(b):
        s0 = eng.project(p, eng.initial_state(batch=b))
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            eng.rollout(p, s0, None, DT, steps=steps)
        return counter.get_total_flops()
    return (count(2 * B) - count(B)) / (steps * B)


def peak_gflops(device="cpu", n: int = 2048, repeats: int = 5) -> float:
    """The machine's float32 matrix-product rate, measured: the best of ``repeats`` n x n x n products on
    ``device`` (on the CPU with torch's current thread count). The roofline's ceiling, in Gflop/s."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device) for _ in range(2))
    sync = device_sync(a)

    def once():
        a @ b
        sync()
    once()
    return 2 * n ** 3 / _best(once, repeats) / 1e9


def roofline(eng, rate: float, peak: float) -> dict:
    """{flops per item-step, achieved Gflop/s at ``rate`` item-steps/s, the fraction of ``peak`` Gflop/s}."""
    flops = reference_flops_per_item_step(eng)
    return {"flops_per_item_step": flops, "achieved_gflops": rate * flops / 1e9, "peak_gflops": peak,
            "fraction_of_peak": rate * flops / 1e9 / peak}


def compiled_over_eager(engine: dict) -> dict:
    """{"grad_b1024": compiled / eager item-steps per second, ...} for every case measured both ways."""
    out = {}
    for key, v in engine.items():
        case = key[len("compiled_"):]
        if key.startswith("compiled_") and "eager_" + case in engine:
            out[case] = v["steps_per_s"] / engine["eager_" + case]["steps_per_s"]
    return out


def _mujoco_rates(structure, steps=2000, batch=64, rollout_steps=ROLLOUT_STEPS):
    import mujoco
    from mujoco import rollout as mjr

    from tensegrity_ros.twin import TwinSim
    sim = TwinSim(structure, timestep=DT)
    m, d = sim.model, sim.data

    def loop():
        for _ in range(steps):
            mujoco.mj_step(m, d)

    step_rate = steps / _best(loop)
    spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
    st = np.zeros((1, mujoco.mj_stateSize(m, spec)))
    mujoco.mj_getState(m, d, st[0], spec)
    st = np.repeat(st, batch, 0)
    ctrl = np.repeat(d.ctrl[None, None, :], batch, 0).repeat(rollout_steps, 1)
    nthread = os.cpu_count() or 1
    datas = [mujoco.MjData(m) for _ in range(nthread)]
    with mjr.Rollout(nthread=nthread) as r:
        r.rollout(m, datas, st, ctrl)
        sec = _best(lambda: r.rollout(m, datas, st, ctrl))
    return step_rate, batch * rollout_steps / sec, nthread


def _agreement(name, structure, integ):
    """Engine vs twin node positions (mm): the test scenarios."""
    from tensegrity_ros.twin import TwinSim
    out = {}
    if name == "icosahedron":
        s = dataclasses.replace(structure, gravity=(0.0, 0.0, 0.0))
        X0 = np.array([n.position for n in s.nodes])
        V0 = np.random.default_rng(0).normal(0.0, 0.5, X0.shape)
        n, u, ud, cases = 2000, None, None, [("implicitfast", 1)]
    else:
        from tensegrity_ros import references as R
        s = structure
        X0 = np.array([nd.position for nd in s.nodes])
        V0 = np.zeros_like(X0)
        n = 7000
        t = DT * np.arange(n)
        ref = R.seed_reference()
        u, ud = R.motor_angles(ref, s, t), R.motor_velocities(ref, s, t)
        cases = [("RK4", 1), ("RK4", 4), ("implicitfast", 1), ("implicitfast", 4)]
    eng = make_engine(s, "nodal", integ)
    p = eng.default_params()
    st = eng.project(p, eng.initial_state(torch.as_tensor(X0), torch.as_tensor(V0)))
    inp = None if u is None else Inputs(motor_angles=torch.as_tensor(u).unsqueeze(1),
                                        motor_velocities=torch.as_tensor(ud).unsqueeze(1))
    xe = eng.rollout(p, st, inp, DT, steps=None if inp else n).positions[:, 0].numpy()
    for integrator, sub in cases:
        sim = TwinSim(s, timestep=DT / sub, integrator=integrator)
        sim.set_node_state(st.positions[0].numpy(), st.velocities[0].numpy())
        xm = np.empty_like(xe)
        for k in range(n):
            sim.step(None if u is None else u[k], sub, motor_velocities=None if ud is None else ud[k])
            xm[k] = sim.node_positions()
        e = np.linalg.norm(xe - xm, axis=-1)
        out[f"mujoco_{integrator}_dt{DT / sub * 1e3:g}ms"] = {
            "rms_mm": rms_error(e) * 1e3, "max_mm": float(e.max() * 1e3),
            "duration_s": n * DT}
    return out


def run(structures=tuple(STRUCTURES), batches=(1, 64, 1024), grads=(False, True), compiled=(False, True),
        threads=None, agreement=True, skip=DEFAULT_SKIP, log=print) -> dict:
    """Measure everything; returns (and writes) the result dict.

    threads: torch intra-op threads for batches >= 64 (default: all cores, like MuJoCo's rollout); batch 1
    always runs on one thread (more threads only add overhead to tiny ops). ``skip``: measurement keys
    (e.g. ``stacked_manipulator/compiled_grad``) not to run.
    """
    setup_compile(recompile_limit=256)
    big_threads = threads or os.cpu_count() or 1
    results = {"date": time.strftime("%Y-%m-%d"), "dt_s": DT, "torch_threads_batch1": 1, "sub_batch": SUB_BATCH,
               "torch_threads_batched": big_threads, "cpu_count": os.cpu_count(), "dtype": "float32",
               "torch": torch.__version__, "skipped": list(skip), "inductor_cache_files_at_start": _cache_files()}
    todo = [(n, i) for n in structures for i in STRUCTURES[n]]
    for name, integ in todo:
        s = load_structure(REPO_ROOT / "config" / "models" / f"{name}.yaml")
        eng = make_engine(s, "nodal", integ, dtype=torch.float32)
        r = {"integrator": integ, "engine": {}}
        tag = f"{name}/{integ}"
        for comp in compiled:
            for grad in grads:
                if f"{tag}/{'compiled' if comp else 'eager'}_{'grad' if grad else 'nograd'}" in skip:
                    log(f"{tag:34s} {'compiled' if comp else 'eager'}_{'grad' if grad else 'nograd'}: skipped")
                    continue
                for B in batches:
                    torch.set_num_threads(1 if B == 1 else big_threads)
                    steps = 100 if B <= 64 else 20
                    if grad:
                        steps = 20
                    if not comp and B >= 1024:
                        steps = 10
                    key = f"{'compiled' if comp else 'eager'}_{'grad' if grad else 'nograd'}_b{B}"
                    runs = [(key, steps)]
                    if comp and not grad and B >= 1024:      # the headline: MuJoCo's rollout length, and 20 steps
                        runs = [(key, _nograd_steps(B)), (key + "_20steps", 20)]
                    for k, n_steps in runs:
                        rate, warm = engine_rate(eng, B, n_steps, comp, grad,
                                                 sub_batch=None if grad else SUB_BATCH.get(name))
                        r["engine"][k] = {"steps_per_s": rate, "warmup_s": warm, "steps": n_steps}
                        log(f"{tag:34s} {k:26s} {rate:12.0f} item-steps/s   ({n_steps} steps; first call "
                            f"{warm:.1f} s)")
        cold = {B: r["engine"][f"compiled_nograd_b{B}"]["warmup_s"] for B in batches
                if f"compiled_nograd_b{B}" in r["engine"]}
        if cold:
            again = first_call_in_new_process(name, integ, sorted(cold))
            warm = again.get("seconds", {})
            r["first_call"] = {"this_run_s": cold, "next_run_s": warm, "this_run_max_s": max(cold.values()),
                               # NaN when the new process failed: the headline then shows a miss, not "n/a"
                               "next_run_max_s": max(warm.values()) if warm else math.nan,
                               "cache_files_at_start": results["inductor_cache_files_at_start"],
                               "next_run_cache_files": again.get("cache_files"), "next_run_error": again.get("error")}
            log(f"{tag:34s} compiled first calls (no gradients; batch " + "/".join(map(str, cold)) + "): "
                + " / ".join(f"{v:.1f}" for v in cold.values()) + " s in this run (cache "
                + ("empty" if not results["inductor_cache_files_at_start"] else "as found") + " at its start), "
                + (" / ".join(f"{warm[B]:.1f}" for B in cold) + " s in a new process with the cache this run filled"
                   if warm else f"new process: {again['error']}"))
        # the semi-implicit step fused in C (engine/native.py): CPU, no gradient; the same batches and lengths
        why = native.unsuitable("cpu", False, integ, torch.float32) or native.available(torch.float32)
        if why is None and f"{tag}/native_nograd" not in skip:
            for B in batches:
                torch.set_num_threads(1 if B == 1 else big_threads)
                runs = [(f"native_nograd_b{B}", 100 if B <= 64 else 20)]
                if B >= 1024:
                    runs = [(f"native_nograd_b{B}", ROLLOUT_STEPS), (f"native_nograd_b{B}_20steps", 20)]
                for k, n_steps in runs:
                    rate, warm = engine_rate(eng, B, n_steps, True, False, kernel="native")
                    r["engine"][k] = {"steps_per_s": rate, "warmup_s": warm, "steps": n_steps}
                    log(f"{tag:34s} {k:26s} {rate:12.0f} item-steps/s   ({n_steps} steps; first call "
                        f"{warm:.1f} s)")
        elif why is not None:
            log(f"{tag:34s} native kernel: not measured ({why})")
        # 1 s horizon at batch 1
        horizon = {}
        torch.set_num_threads(1)
        paths = [("eager", False, 1, "inductor"), ("compiled_chunk1", True, 1, "inductor"),
                 ("compiled_chunk8", True, 8, "inductor")]
        if "native_nograd_b1" in r["engine"]:
            paths.append(("native", True, 1, "native"))
        for label, comp, chunk, kernel in paths:
            if comp and True not in compiled:
                continue
            if f"{tag}/horizon_{label}" in skip:
                log(f"{tag:34s} 1 s horizon, batch 1, {label}: skipped")
                continue
            p = eng.default_params()
            s0 = eng.initial_state()
            kw = dict(compile=comp, chunk=chunk, kernel=kernel)
            with torch.no_grad():
                eng.rollout(p, s0, None, DT, steps=16, **kw)
                sec = _best(lambda: eng.rollout(p, s0, None, DT, steps=1000, **kw), 2)
            horizon[label] = sec * 1e3
            log(f"{tag:34s} 1 s horizon, batch 1, {label:16s} {sec * 1e3:8.1f} ms")
        r["horizon_1s_b1_ms_by_path"] = horizon
        r["horizon_1s_b1_ms"] = min(horizon.values())
        mj_step, mj_roll, nthread = _mujoco_rates(s)
        r["mujoco_mj_step_steps_per_s"] = mj_step
        r["mujoco_rollout_steps_per_s"] = mj_roll
        r["mujoco_rollout_nthread"] = nthread
        log(f"{tag:34s} MuJoCo mj_step loop {mj_step:10.0f} steps/s, rollout (nthread={nthread}) {mj_roll:10.0f}")
        b1024 = {k[:-len("_nograd_b1024")]: v["steps_per_s"] for k, v in r["engine"].items()
                 if k.endswith("_nograd_b1024")}
        if b1024:
            best = max(b1024, key=b1024.get)
            r["engine_b1024_steps_per_s"], r["engine_b1024_path"] = b1024[best], best
            r["ratio_b1024_vs_rollout"] = b1024[best] / mj_roll
            r["ratio_b1024_vs_rollout_by_path"] = {k: v / mj_roll for k, v in b1024.items()}
            log(f"{tag:34s} batch 1024 / MuJoCo rollout = {r['ratio_b1024_vs_rollout']:.1f}x ({best}; both "
                f"{ROLLOUT_STEPS}-step rollouts; " + ", ".join(f"{k} {v / mj_roll:.1f}x" for k, v in b1024.items())
                + ")")
            torch.set_num_threads(big_threads)
            if "peak_gflops" not in results:
                results["peak_gflops"] = peak_gflops()
            r["roofline_b1024"] = roofline(eng, b1024[best], results["peak_gflops"])
            rf = r["roofline_b1024"]
            log(f"{tag:34s} roofline: {rf['flops_per_item_step'] / 1e3:.1f} kflop per item-step (matrix products), "
                f"{rf['achieved_gflops']:.2f} Gflop/s at batch 1024 = {100 * rf['fraction_of_peak']:.2f} % of the "
                f"measured float32 GEMM peak ({rf['peak_gflops']:.0f} Gflop/s on {big_threads} threads)")
        r["compiled_over_eager"] = compiled_over_eager(r["engine"])
        if r["compiled_over_eager"]:
            worst = min(r["compiled_over_eager"], key=r["compiled_over_eager"].get)
            r["compiled_over_eager_min"] = r["compiled_over_eager"][worst]
            log(f"{tag:34s} compiled / eager: slowest case {worst} {r['compiled_over_eager_min']:.2f}x "
                "(issue 20: never slower than eager)")
        if agreement:
            r["agreement"] = _agreement(name, s, integ)
            r["max_abs_error_vs_mujoco_mm"] = min(v["max_mm"] for v in r["agreement"].values())
            for k, v in r["agreement"].items():
                log(f"{tag:34s} vs {k}: RMS {v['rms_mm']:.3f} mm, max {v['max_mm']:.3f} mm")
        results.setdefault(name, {})
        if integ == STRUCTURES[name][0]:
            results[name].update(r)
        else:
            results[name][integ] = r
    out = REPO_ROOT / "build" / "bench" / "engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    log(f"wrote {out}")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 1 and 1024, no gradients")
    ap.add_argument("--structures", nargs="*", default=list(STRUCTURES))
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--skip", nargs="*", default=list(DEFAULT_SKIP),
                    help="keys to skip (default: the manipulator's implicit compiled backward, whose compile takes "
                         "~11 min per batch size and runs slower than eager, and its 8-step compiled chunk; "
                         "--skip with no keys measures everything)")
    ap.add_argument("--first-call", nargs=3, metavar=("STRUCTURE", "INTEGRATOR", "BATCHES"),
                    help="only time the compiled engine's first call without gradients at each batch (comma-"
                         "separated, e.g. 1,64,1024) in this process and print them as JSON (what the bench runs in a "
                         "new process to show the compile cache at work)")
    a = ap.parse_args(argv)
    if a.first_call:
        _first_call_child(*a.first_call)
        return
    kw = dict(structures=tuple(a.structures), threads=a.threads, agreement=not a.no_agreement, skip=tuple(a.skip))
    if a.quick:
        kw.update(batches=(1, 1024), grads=(False,))
    run(**kw)


if __name__ == "__main__":
    main()
