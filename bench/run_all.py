"""`make bench`: every benchmark in one run, printed side by side, figures saved under build/bench/.

Each bench module exposes ``run(...) -> dict`` and writes its own JSON; this script runs them in turn,
prints a one-screen summary of the headline figures next to their targets, and writes
``build/bench/summary.json``. Speed lives here, never in timed test assertions.

Exit status, like ``tensegrity demo``'s: 0 when every headline target is met, 3 when one is missed (the last line
names them; every figure is still printed and written), 1 when a bench failed to run.

    python bench/run_all.py [--quick] [--only engine,hardware,identification,graph,generality,control,sysid,scaling,gpu]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

from tensegrity_ros.paths import REPO_ROOT  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "bench"))
OUT = REPO_ROOT / "build" / "bench"

#: name -> (module in bench/, kwargs for a full run, kwargs for --quick)
BENCHES = {
    "engine": ("bench_engine", {}, {"compiled": (False,), "grads": (False,)}),
    "hardware": ("bench_hardware", {"duration_s": 60.0}, {"duration_s": 10.0}),
    "identification": ("bench_identification", {"quick": False}, {"quick": True}),
    "graph": ("bench_graph", {"duration_s": 300.0}, {"duration_s": 30.0}),
    "generality": ("bench_generality", {}, {"structures": ("prism4_fixed",)}),
    "control": ("bench_control", {"ident_s": 60.0}, {"ident_s": 40.0}),
    "sysid": ("bench_sysid_baseline", {"quick": False}, {"quick": True}),
    "scaling": ("bench_scaling", {"quick": False}, {"quick": True}),
    "gpu": ("bench_gpu", {}, {"parts": ("engine",)}),     # measures nothing (and says so) without CUDA
}

#: (bench, json path, label, target text, check) — the headline figures.
HEADLINES = [
    ("engine", "stacked_manipulator.ratio_b1024_vs_rollout", "manipulator: engine b1024 / mujoco.rollout", ">= 20x", lambda v: v >= 20),
    ("engine", "icosahedron.ratio_b1024_vs_rollout", "icosahedron: engine b1024 / mujoco.rollout", ">= 20x", lambda v: v >= 20),
    ("engine", "stacked_manipulator.horizon_1s_b1_ms", "manipulator: 1-s horizon, batch 1 [ms]", "< 50", lambda v: v < 50),
    ("engine", "stacked_manipulator.compiled_over_eager_min", "manipulator: compiled / eager, slowest case",
     ">= 1", lambda v: v >= 1),
    ("engine", "icosahedron.compiled_over_eager_min", "icosahedron: compiled / eager, slowest case", ">= 1",
     lambda v: v >= 1),
    ("engine", "stacked_manipulator.roofline_b1024.fraction_of_peak", "manipulator: b1024 fraction of GEMM peak",
     "(report)", lambda v: True),
    ("engine", "icosahedron.roofline_b1024.fraction_of_peak", "icosahedron: b1024 fraction of GEMM peak", "(report)",
     lambda v: True),
    ("engine", "stacked_manipulator.implicit.first_call.this_run_max_s",
     "manip. implicit: first call, this run, slowest [s]", "(report)", lambda v: True),
    ("engine", "stacked_manipulator.implicit.first_call.next_run_max_s",
     "manip. implicit: first call, next run, slowest [s]", "< 30", lambda v: v < 30),
    ("engine", "stacked_manipulator.max_abs_error_vs_mujoco_mm", "manipulator: max |engine - MuJoCo| [mm]", "< 5", lambda v: v < 5),
    ("hardware", "loop.jitter_p99_ms", "driver loop jitter p99 at 80 Hz [ms]", "< 2", lambda v: v < 2),
    ("hardware", "loop.missed_cycles", "driver missed cycles", "0", lambda v: v == 0),
    ("identification", "spring_rod.ours.success_rate", "spring-rod success rate (ours)", "1.0", lambda v: v >= 1.0),
    ("identification", "speedup_vs_best_baseline", "speed-up vs best baseline", ">= 10x", lambda v: v >= 10),
    ("identification", "manipulator.worst_seed_median_error_pct", "manipulator median param error, worst seed [%]", "< 2", lambda v: v < 2),
    ("identification", "manipulator.worst_seed_wall_s", "manipulator identification wall time, worst seed [s]", "< 10", lambda v: v < 10),
    ("graph", "latency_p50_ms", "node state -> prediction latency p50 [ms]", "< 5", lambda v: v < 5),
    ("graph", "latency_p99_ms", "node state -> prediction latency p99 [ms]", "< 20", lambda v: v < 20),
    ("graph", "queue_drops_total", "messages lost on any subscription (gaps, published - received)", "0",
     lambda v: v == 0),
    ("graph", "not_produced_messages", "messages the sources did not produce (skipped frames, missed cycles)", "(report)",
     lambda v: True),
    ("graph", "delivery.mocap_frames.fraction", "graph: mocap frames delivered", ">= 0.99", lambda v: v >= 0.99),
    ("graph", "delivery.motor_states.fraction", "graph: motor states delivered", ">= 0.99", lambda v: v >= 0.99),
    ("graph", "health.figures.identifier_update_period_s_p50.value", "graph: identifier update period p50 [s]",
     "<= 10", lambda v: v <= 10),
    ("graph", "health.healthy", "graph run HEALTHY (config/health.yaml)", "True", lambda v: v is True),
    ("generality", "worst.stiffness_median_pct", "generality suite: stiffness median error, worst [%]", "< 5",
     lambda v: v < 5),
    ("generality", "worst.damping_median_pct", "generality suite: damping median error, worst [%]", "< 15",
     lambda v: v < 15),
    ("generality", "worst.mass_median_pct", "generality suite: mass median error, worst [%]", "< 3", lambda v: v < 3),
    ("generality", "worst.rest_length_median_mm", "generality suite: rest-length median error, worst [mm]", "< 1",
     lambda v: v < 1),
    ("generality", "worst.inside_2sigma", "generality suite: truth inside +-2 sigma, worst", ">= 0.9",
     lambda v: v >= 0.9),
    ("generality", "worst.z_rms_max", "generality suite: z-score RMS per kind, largest", "<= 2", lambda v: v <= 2),
    ("generality", "worst.z_rms_min", "generality suite: z-score RMS per kind, smallest", ">= 0.5",
     lambda v: v >= 0.5),
    ("generality", "targets_met", "generality suite: every item-3/6 target met", "True", lambda v: v is True),
    ("generality", "string_law.swapped_flagged", "generality: swapped string law flagged (structures)",
     "all", lambda v: v is not None and v[0] == v[1]),
    ("generality", "string_law.right_flagged", "generality: right string law flagged (structures)", "0",
     lambda v: v is not None and v[0] == 0),
    ("control", "identified_rmse_mm", "control: plate tracking RMSE, identified model [mm]", "< 2", lambda v: v < 2),
    ("control", "nominal_rmse_mm", "control: plate tracking RMSE, nominal model [mm]", "(paired)", lambda v: True),
    ("control", "ratio", "control: RMSE identified / nominal", "<= 0.5", lambda v: v <= 0.5),
    ("control", "rate_hz", "control: controller rate [Hz]", ">= 20", lambda v: v >= 19.5),
    ("control", "solve_p99_ms", "control: MPC solve p99 [ms]", "< 25", lambda v: v < 25),
    ("control", "violations", "control: limit violations", "0", lambda v: v == 0),
    ("sysid", "spring_rod.ours.success_rate", "spring rod, one fit per trial: success, ours", "1.0",
     lambda v: v >= 1.0),
    ("sysid", "spring_rod.sysid.success_rate", "spring rod: success, mujoco.sysid", "(baseline)", lambda v: True),
    ("sysid", "prism4_fixed.ours.error_pct.stiffness", "prism, same prior: stiffness error, ours [%]", "< 5",
     lambda v: v < 5),
    ("sysid", "prism4_fixed.sysid.error_pct.stiffness", "prism: stiffness error, mujoco.sysid [%]", "(baseline)",
     lambda v: True),
    ("sysid", "prism4_fixed.sysid_over_ours_seconds", "prism: wall time, mujoco.sysid / ours", "> 1",
     lambda v: v > 1),
    ("scaling", "identify.by_length.2.real_time_factor", "identify, 16-s manipulator bag: wall / recording", "<= 1",
     lambda v: v <= 1),
    ("scaling", "identify.fit_wall_s.per_recorded_s", "identify: extra wall seconds per recorded second", "(fit)",
     lambda v: True),
    ("scaling", "engine.stacked_manipulator.fit.saturation_batch", "engine (eager): batch where throughput saturates",
     "(fit)", lambda v: True),
    ("gpu", "engine_top_batch_min_steps_per_s", "GPU: engine b65536, slowest structure [steps/s]",
     ">= 5e7", lambda v: v >= 5e7),
    ("gpu", "identify.cuda.real_time_factor", "GPU: identify 16-s bag on cuda, wall / recording", "<= 1",
     lambda v: v <= 1),
    ("gpu", "identify.cpu.real_time_factor", "GPU machine: identify on its CPU, wall / recording", "(paired)", lambda v: True),
    ("gpu", "online.cuda.wall_s", "GPU: online identifier's first update on cuda [s]", "(paired)", lambda v: True),
    ("gpu", "online.cpu.max_rel_diff_vs_cuda", "GPU machine: that update on its CPU, largest relative difference",
     "(report)", lambda v: True),
]


def _lookup(tree, dotted: str):
    """tree["a"]["b"]... for "a.b..."; a numeric key indexes a list."""
    for key in dotted.split("."):
        if isinstance(tree, list) and key.isdigit() and int(key) < len(tree):
            tree = tree[int(key)]
        elif isinstance(tree, dict) and key in tree:
            tree = tree[key]
        else:
            return None
    return tree


def machine() -> dict:
    """What the figures were measured on: the CPU, its cores, the load when the run started (what else was running
    shows there), torch and the BLAS behind the tangent model's products (tensegrity_ros/engine/blas.py)."""
    import os
    import platform

    import torch

    from tensegrity_ros.engine import blas
    return {"cpu": blas.cpu_field("model name") or platform.processor(), "vendor": blas.cpu_vendor(), "cores": os.cpu_count(),
            "load_1_5_15": list(os.getloadavg()), "torch": torch.__version__, "tangent_blas": blas.choice(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (minutes; the full run is long: its "
                    "scaling part alone took 17 min, 2026-11-26)")
    ap.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of: " + ", ".join(BENCHES))
    args = ap.parse_args(argv)
    wanted = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in BENCHES]
    if unknown:
        ap.error(f"unknown bench {unknown} (valid: {', '.join(BENCHES)})")
    OUT.mkdir(parents=True, exist_ok=True)
    here = machine()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in here.items()), flush=True)
    results, failures = {}, {}
    for name in wanted:
        module, full, quick = BENCHES[name]
        print(f"\n=== bench: {name} ({module}) ===", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = importlib.import_module(module).run(**(quick if args.quick else full))
        except Exception as err:  # keep going: one broken bench must not hide the others' figures
            traceback.print_exc()
            failures[name] = f"{type(err).__name__}: {err}"
        print(f"=== {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    print("\n" + "=" * 96)
    print(f"{'headline':<52}{'measured':>14}  {'target':>8}  met")
    print("-" * 96)
    missed, judged = [], 0
    for bench, path, label, target, ok in HEADLINES:
        if bench not in results:
            continue
        v = _lookup(results[bench], path)
        shown = "n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else
                                         f"{v[0]} of {v[1]}" if isinstance(v, list) else str(v))
        met = "" if v is None else ("yes" if ok(v) else "NO")
        judged += v is not None
        if met == "NO":
            missed.append(f"{label} {shown} (target {target})")
        print(f"{label:<52}{shown:>14}  {target:>8}  {met}")
    for name, why in failures.items():
        print(f"{name:<52}{'FAILED':>14}  {why}")
    (OUT / "summary.json").write_text(json.dumps({"quick": args.quick, "machine": here, "results": results,
                                                  "failures": failures, "missed": missed}, indent=2, default=str))
    print(f"\nfigures: {OUT}/*.json")
    if failures:
        print(f"bench: FAILED to run: {', '.join(failures)} (exit 1)")
        return 1
    if missed:
        print(f"bench: {len(missed)} of {judged} headline targets missed: {'; '.join(missed)} (exit 3)")
        return 3
    print(f"bench: all {judged} headline targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
