"""The GPU path, measured (issue 20 item 4): the engine's throughput on CUDA up to batch 65 536, beside
``mujoco.rollout`` on the same machine's CPU cores; the identification's tangent step (time and kernel launches
per step, 1 to 64 windows); the online identifier's update (``fit_window``, what its worker runs) on CUDA and on
the CPU; and ``tensegrity identify`` on the README's 16-s manipulator bag with ``--device cuda`` and
``--device cpu`` on the same machine, with each run's error against the truth.

    python bench/bench_gpu.py                       # every part (on a machine with CUDA; else it says so)
    python bench/bench_gpu.py --only engine         # or profile (where the engine's time goes), tangent (the
                                                    # identification's inner step), online, identify
    python bench/bench_gpu.py --bag DIR             # identify this bag (its true_model.yaml beside it) instead of
                                                    # simulating the README's one (which needs MuJoCo)

Without CUDA, ``run()`` returns ``{"cuda": false, ...}`` and measures nothing: `make bench` then prints the GPU
headlines as not measured. Writes build/bench/gpu.json after every measurement, so a run cut short keeps what it
measured (``--out`` moves it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from tensegrity_ros.paths import CONFIG_DIR, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_engine import DT, _mujoco_rates, device_sync, engine_rate, peak_gflops, roofline  # noqa: E402
from benchlib import run_cli  # noqa: E402

from tensegrity_ros.engine import graphs, make_engine  # noqa: E402
from tensegrity_ros.model import load_structure  # noqa: E402
from tensegrity_ros.validation.scoring import DISPLAY_UNITS, score  # noqa: E402

OUT = REPO_ROOT / "build" / "bench" / "gpu.json"
#: the bench's parts, in the order they run
PARTS = ("engine", "profile", "tangent", "online", "identify")
IMG = REPO_ROOT / "docs" / "img"
MODEL = CONFIG_DIR / "models" / "stacked_manipulator.yaml"
#: structure -> integrators measured on CUDA (the engine bench's headline integrators, plus the manipulator's
#: implicit step, which `identify` uses)
STRUCTURES = {"icosahedron": ("semi_implicit",), "stacked_manipulator": ("semi_implicit", "implicit")}
BATCHES = (1, 1024, 8192, 65536)
#: the compiled path and the gradients are measured at these batches only (each batch size is one compile)
COMPILED_BATCHES = (65536,)
GRAD_BATCHES = (1024, 65536)
#: issue 20 item 4's goal for the engine at batch 65 536 on a GPU
GOAL_B65K = 50e6


def _log(*a):
    print(*a, flush=True)


def device_info() -> Dict[str, Any]:
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "multiprocessors": p.multi_processor_count, "memory_gib": p.total_memory / 2 ** 30,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cpu_count": os.cpu_count()}


def engine_part(res: Dict[str, Any], save, structures=tuple(STRUCTURES), batches=BATCHES,
                compiled_batches=COMPILED_BATCHES, grad_batches=GRAD_BATCHES, device: str = "cuda") -> None:
    """Item-steps per second on ``device``, float32, 20 steps per rollout (10 with gradients at 65 536, for
    memory). Eager first, then MuJoCo on the CPU cores, then the compiled path (its compiles take longest), so that
    a run cut short keeps the most; a case that fails is recorded with its error and the others go on. On CUDA each
    path also replayed from a CUDA graph (``*_graph_nograd_*``: engine/graphs.py; no gradients, not the implicit
    step), the first call capturing it."""
    from tensegrity_ros.engine import setup_compile
    setup_compile(recompile_limit=256)
    eng_res = res.setdefault("engine", {})
    errors = res.setdefault("engine_errors", {})

    def measure(comp: bool, graph: bool = False):
        for name in structures:
            for integ in STRUCTURES[name]:
                if comp and integ == "implicit":       # its compile takes minutes per shape: not here
                    continue
                if graph and graphs.unsuitable(torch.device(device), False, integ) is not None:
                    continue
                eng = make_engine(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), "nodal", integ,
                                  dtype=torch.float32, device=device)
                for grad in (False, True) if not graph else (False,):
                    for B in batches:
                        if (comp and B not in compiled_batches) or (grad and B not in grad_batches):
                            continue
                        key = f"{'compiled' if comp else 'eager'}{'_graph' if graph else ''}_" \
                              f"{'grad' if grad else 'nograd'}_b{B}"
                        tag = f"{name}/{integ}"
                        try:
                            rate, warm = engine_rate(eng, B, 10 if grad and B >= 65536 else 20, comp, grad,
                                                     cuda_graph=graph)
                        except Exception as err:  # noqa: BLE001 - record it, measure the rest
                            errors[f"{tag}/{key}"] = f"{type(err).__name__}: {err}"[:500]
                            _log(f"{device:5s} {tag:34s} {key:26s} FAILED: {errors[f'{tag}/{key}']}")
                        else:
                            eng_res.setdefault(tag, {})[key] = {"steps_per_s": rate, "warmup_s": warm}
                            _log(f"{device:5s} {tag:34s} {key:26s} {rate:14.0f} item-steps/s   "
                                 f"(first call {warm:.1f} s)")
                        save()
                graphs.clear()                          # their device memory

    def best(name: str, suffix: str = "") -> Optional[float]:
        rates = [v["steps_per_s"] for k, v in eng_res.get(f"{name}/{STRUCTURES[name][0]}", {}).items()
                 if "nograd" in k and k.endswith(suffix)]
        return max(rates) if rates else None

    measure(comp=False)
    if device == "cuda":
        measure(comp=False, graph=True)
    mujoco = {}
    for name in structures:
        _, mujoco[name], nthread = _mujoco_rates(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"))
        res.setdefault("mujoco_rollout", {})[name] = {"steps_per_s": mujoco[name], "nthread": nthread}
        _log(f"cpu   {name:34s} mujoco.rollout (nthread={nthread}) {mujoco[name]:12.0f} item-steps/s")
        save()
    measure(comp=True)
    if device == "cuda":
        measure(comp=True, graph=True)
    top = max(batches)
    res["peak_gflops"] = peak_gflops(device)
    for name in structures:
        b = best(name)
        if b is None:                                   # every case of it failed: engine_errors says why
            continue
        res.setdefault("ratio_vs_rollout", {})[name] = b / mujoco[name]
        eng = make_engine(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), "nodal", STRUCTURES[name][0],
                          dtype=torch.float32, device=device)
        rf = res.setdefault("roofline", {})[name] = roofline(eng, b, res["peak_gflops"])
        _log(f"{name}: best {device} engine {b:.3g} item-steps/s = {b / mujoco[name]:.0f}x mujoco.rollout "
             f"on this machine's {os.cpu_count()} CPU cores; {rf['flops_per_item_step'] / 1e3:.1f} kflop per "
             f"item-step, {rf['achieved_gflops']:.1f} Gflop/s = {100 * rf['fraction_of_peak']:.2f} % of the "
             f"measured float32 GEMM rate ({res['peak_gflops']:.0f} Gflop/s)")
    res["top_batch"] = top
    tops = [best(n, f"_b{top}") for n in structures]
    if None not in tops:
        res["engine_top_batch_min_steps_per_s"] = min(tops)
        _log(f"batch {top}, best path per structure, slowest structure: {min(tops):.3g} item-steps/s "
             f"(goal at 65536 on a GPU: >= {GOAL_B65K:.0e})")
    save()


def tangent_part(res: Dict[str, Any], save, device: str = "cuda", windows: Sequence[int] = (1, 8, 64),
                 steps: int = 48, rows: Sequence[Optional[int]] = (1, 16, 4096), graphs_off: bool = True) -> None:
    """The identification's inner loop on ``device``: manipulator tangent steps (``engine/tangent.py``, every
    parameter and start-state direction, float64, as stage 2 runs it) with 1, 8 and 64 windows in the batch and the
    steps' linearisations batched ``rows`` (window, step) rows at a time (1: one step at a time, as before stop 42;
    16 the CPU's default, 4096 CUDA's; None: the device's default): wall time per step, and the aten operations per
    step over the whole rollout, and how many of them are not views (on CUDA, about one kernel launch each). If the
    time per step stays flat from 1 to 64 windows, the step is bound by launches and Python, not by arithmetic.
    On CUDA the primal steps run from a CUDA graph (engine/graphs.py; a replay is not an aten operation, so the
    counts fall with it); ``graphs_off``: each case again with ``TENSEGRITY_CUDA_GRAPHS=0``, side by side."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tensegrity_ros.engine import from_unconstrained, tangent, to_unconstrained
    from tensegrity_ros.engine.nodal import prepare, reduce

    class _Count(TorchDispatchMode):
        """aten operations, and those of them that are not views (a view launches no kernel)."""
        def __init__(self):
            super().__init__()
            self.ops = self.compute = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.compute += not (func.is_view or func is torch.ops.aten._unsafe_view.default)
            return func(*args, **(kwargs or {}))

    eng = make_engine(load_structure(MODEL), "nodal", "semi_implicit", dtype=torch.float64, device=device)
    c, p = eng.constants, eng.default_params()
    z0 = to_unconstrained(p)
    dth = tangent.param_tangents(c, lambda z: from_unconstrained(z, p), z0)
    der = prepare(c, p)
    st = eng.project(p, eng.initial_state())
    Q0, V0 = reduce(c, st.positions), reduce(c, st.velocities)
    nf, A = Q0.shape[-1], eng.topology.n_actuators
    C = z0.numel() + 6 * nf
    sync = device_sync(Q0)
    out = res.setdefault("tangent_step", {"structure": "stacked_manipulator", "directions": C, "rows": []})["rows"]
    cases = [(R, True) for R in rows]
    if graphs_off and graphs.for_identification(Q0.device, False):
        cases += [(R, False) for R in rows]
    for W in windows:
        S0 = torch.zeros(W, C, 3, nf, dtype=torch.float64, device=Q0.device)
        for R, graphed in cases:
            R = tangent.linearise_rows(Q0.device) if R is None else int(R)
            graphed = graphed and graphs.for_identification(Q0.device, False)
            saved = os.environ.get(graphs.ENV)
            os.environ[graphs.ENV] = "1" if graphed else "0"

            def run(n):
                u = torch.zeros(n, W, A, dtype=torch.float64, device=Q0.device)
                o = tangent.rollout_tangents(c, der, dth, Q0.expand(W, -1, -1), V0.expand(W, -1, -1), S0, S0, u,
                                             torch.zeros_like(u), None, None, 7e-4, n, eng.options,
                                             torch.full((W, 1), float(n), dtype=torch.float64, device=Q0.device),
                                             rows=R)
                sync()
                return o

            try:
                run(steps)                                                # warm-up (captures)
                counts = []
                for n in (steps, 2 * steps):      # the difference leaves out the once-per-rollout work
                    with _Count() as counter:
                        run(n)
                    counts.append((counter.ops, counter.compute))
                t0 = time.perf_counter()
                run(steps)
                ms = (time.perf_counter() - t0) / steps * 1e3
            finally:
                if saved is None:
                    os.environ.pop(graphs.ENV)
                else:
                    os.environ[graphs.ENV] = saved
            out.append({"windows": W, "rows": R, "cuda_graphs": graphed, "steps_linearised_together": max(1, R // W),
                        "ms_per_step": ms, "aten_ops_per_step": (counts[1][0] - counts[0][0]) / steps,
                        "compute_ops_per_step": (counts[1][1] - counts[0][1]) / steps})
            _log(f"{device:5s} tangent step, {W:3d} windows x {C} directions, {max(1, R // W):4d} steps linearised "
                 f"together, CUDA graphs {'on ' if graphed else 'off'}: {ms:7.2f} ms per step, "
                 f"{out[-1]['aten_ops_per_step']:.0f} aten operations per step, "
                 f"{out[-1]['compute_ops_per_step']:.0f} of them not views")
            save()
    graphs.clear()


def profile_part(res: Dict[str, Any], save, device: str = "cuda", name: str = "stacked_manipulator",
                 batch: int = 65536, steps: int = 20) -> None:
    """Where the engine's time goes: one rollout of ``steps`` semi-implicit steps at ``batch``, float32, of each path
    (eager and compiled; on CUDA each also replayed from a CUDA graph), warmed up, then under torch.profiler: the
    wall time per step beside the device's busy time per step (kernels), the kernels per step, and the longest
    kernels. Busy time near the wall time: the kernels themselves are the bound; far below it: the launches."""
    from torch.profiler import ProfilerActivity, profile

    eng = make_engine(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), "nodal", "semi_implicit",
                      dtype=torch.float32, device=device)
    p = eng.default_params().map(lambda t: t.to(torch.float32))
    s0 = eng.initial_state(batch=batch).map(lambda t: t.to(torch.float32))
    sync = device_sync(s0.positions)
    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = res.setdefault("profile", {"structure": name, "batch": batch, "steps": steps, "cases": {}})["cases"]
    for comp, graph in ((False, False), (True, False)) + (((False, True), (True, True)) if cuda else ()):
        tag = f"{'compiled' if comp else 'eager'}{', CUDA graph' if graph else ''}"
        kw = dict(compile=comp, cuda_graph=graph, **({"kernel": "inductor"} if comp else {}))
        try:
            with torch.no_grad():
                for _ in range(2):                          # compiles, captures, warms the allocator
                    eng.rollout(p, s0, None, DT, steps=steps, **kw)
                sync()
                with profile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    eng.rollout(p, s0, None, DT, steps=steps, **kw)
                    sync()
                    wall = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - record it, profile the rest
            rows[tag] = {"error": f"{type(err).__name__}: {err}"[:500]}
            _log(f"profile {tag}: FAILED {rows[tag]['error']}")
            continue
        events = prof.key_averages()
        kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]

        def busy(e):
            return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

        row = rows[tag] = {"wall_ms_per_step": wall / steps * 1e3,
                           "device_busy_ms_per_step": sum(busy(e) for e in kernels) / 1e3 / steps,
                           "kernels_per_step": sum(e.count for e in kernels) / steps,
                           "longest": [(e.key[:90], busy(e) / 1e3 / steps, e.count / steps)
                                       for e in sorted(kernels, key=busy, reverse=True)[:6]]}
        _log(f"profile {name} b{batch} {tag}: {row['wall_ms_per_step']:.3f} ms per step wall, device busy "
             f"{row['device_busy_ms_per_step']:.3f} ms, {row['kernels_per_step']:.0f} kernels per step; longest: "
             + "; ".join(f"{k} {ms:.3f} ms x{n:g}" for k, ms, n in row["longest"][:4]))
        save()
    graphs.clear()


def online_update(device: str, seconds: float = 8.0):
    """One online-identifier update on ``device``: ``fit_window`` with the node's shipped parameters, its first
    update (from the nominal), over ``seconds`` of the simulated manipulator with its stiffnesses and dampings 20 %
    off (MuJoCo, 0.3 mm marker noise). No time budget: a fit cut by the clock would end at a different iteration
    on each device. Returns the FitResult and the update's wall time (the simulation left out).

    The parameters come from the node's shipped YAML alone (it sets every one the update reads), not from the
    node module's table: importing the node imports the ROS messages, which a GPU machine without ROS lacks (the
    H200 of 2026-12-04 failed the CUDA test of this update on that import)."""
    import yaml

    from tensegrity_ros.engine import params_from_structure
    from tensegrity_ros.ident.online import accept_config, fit_window, update_options
    from tensegrity_ros.ident.synthetic import perturbed_twin_recording

    p = dict(yaml.safe_load((CONFIG_DIR / "nodes" / "online_identifier.yaml").read_text())
             ["online_identifier"]["ros__parameters"])
    p.update(device=device, first_update_max_s=1e9, max_update_s=1e9)
    nominal = load_structure(MODEL)
    _, ds = perturbed_twin_recording(nominal, seconds)
    nominal_params = params_from_structure(nominal)
    stages, options = update_options(p, nominal_params, first=True)
    t0 = time.perf_counter()
    out = fit_window(nominal, ds.times, ds.positions, ds.valid, ds.motor_angles,
                     {n: float(v) for n, v in nominal_params.named().items()}, stages, options, p["holdout_s"],
                     p["holdout_window_s"], p["holdout_windows"], accept_config(p))
    return out, time.perf_counter() - t0


def online_part(res: Dict[str, Any], save, devices: Sequence[str] = ("cuda", "cpu")) -> None:
    """The online identifier's first update on each device: wall time, whether it produced a set (else its error),
    and the largest relative difference of its values from those of the first device that produced one."""
    rows = res.setdefault("online", {})
    first = None                        # (device, values) of the first update that produced a set
    for dev in devices:
        try:
            out, sec = online_update(dev)
        except Exception as err:  # noqa: BLE001 - record it, measure the rest
            import traceback
            rows[dev] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500],
                         "traceback": traceback.format_exc()[-3000:]}
            _log(f"online update on {dev}: FAILED {rows[dev]['error']}\n{rows[dev]['traceback']}")
            save()
            continue
        row = rows[dev] = {"ok": out.ok, "error": out.error, "wall_s": sec, "timings": out.timings}
        line = f"online update on {dev}: {'ok' if out.ok else 'FAILED ' + out.error}, {sec:.1f} s"
        if out.ok and first is None:
            first = (dev, out.values)
        elif out.ok:
            diff = max(abs(out.values[n] / v - 1) for n, v in first[1].items() if v)
            row[f"max_rel_diff_vs_{first[0]}"] = diff
            line += f", values within {diff:.1e} of {first[0]}'s"
        _log(line)
        save()


def plot(res: Dict[str, Any], path: Path = IMG / "gpu_engine.png") -> Path:
    """Item-steps per second against batch size, per case, eager lines and compiled points, with the same
    machine's ``mujoco.rollout`` as horizontal lines: the figure of docs/engine.md's GPU section."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(12, 5.5))
    batches = [int(k.rsplit("_b", 1)[1]) for rates in res.get("engine", {}).values() for k in rates]
    x_text = min(batches, default=1) * 1.1            # labels of the horizontal lines, at the left edge
    for i, (tag, rates) in enumerate(sorted(res.get("engine", {}).items())):
        color = f"C{i}"
        for kind, style in (("eager_nograd", "o-"), ("eager_grad", "s--"), ("eager_graph_nograd", "^:")):
            pts = sorted((int(k.rsplit("_b", 1)[1]), v["steps_per_s"]) for k, v in rates.items()
                         if k.startswith(kind + "_b"))
            if pts:
                ax.loglog(*zip(*pts), style, color=color, label=f"{tag}, {kind.replace('_', ', ')}")
        for kind, marker in (("compiled_nograd", "*"), ("compiled_grad", "P"), ("compiled_graph_nograd", "X")):
            pts = [(int(k.rsplit("_b", 1)[1]), v["steps_per_s"]) for k, v in rates.items()
                   if k.startswith(kind + "_b")]
            if pts:
                ax.loglog(*zip(*pts), marker, ms=11, color=color, ls="none",
                          label=f"{tag}, {kind.replace('_', ', ')}")
    for i, (name, m) in enumerate(sorted(res.get("mujoco_rollout", {}).items())):
        ax.axhline(m["steps_per_s"], color="gray", ls=":", lw=1)
        ax.text(x_text, m["steps_per_s"] * 1.15, f"mujoco.rollout, {name}, {m['nthread']} CPU threads", fontsize=7,
                color="gray")
    ax.axhline(GOAL_B65K, color="k", ls="-.", lw=0.8)
    ax.text(x_text, GOAL_B65K * 1.15, "issue 20 goal at batch 65 536", fontsize=7)
    dev = res.get("device", {})
    ax.set(xlabel="batch size (items)", ylabel="item-steps per second",
           title=f"engine throughput on {dev.get('name', '?')}, float32 ({res.get('date', '')})")
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def identify_part(res: Dict[str, Any], save, work: Path, bag: Optional[Path] = None,
                  devices: Sequence[str] = ("cuda", "cpu")) -> None:
    """`tensegrity identify BAG` with default flags, once per device, as a user runs it: wall time of the command,
    interpreter start and imports included."""
    work.mkdir(parents=True, exist_ok=True)
    if bag is None:
        sim = work / "sim16"
        rc, sec, _ = run_cli(["simulate", str(MODEL), "--duration", "16", "--out", str(sim), "--bag", str(sim / "bag"),
                              "--perturb", "0.1", "--force"], show_progress=False)
        if rc != 0:
            raise RuntimeError(f"simulate exited {rc}")
        bag = sim / "bag"
    from rosbags.rosbag2 import Reader
    with Reader(bag) as reader:
        length = reader.duration / 1e9
    truth = bag.parent / "true_model.yaml"
    rows = res.setdefault("identify", {"bag": str(bag), "recording_s": length})
    for dev in devices:
        # its own process, as a user runs it: this one holds a CUDA context, and `--device cpu` forks workers
        out = work / f"identified_{dev}.yaml"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tensegrity_ros.cli", "identify", str(bag), "--model", str(MODEL),
                               "--out", str(out), "--force", "--device", dev], capture_output=True, text=True)
        rc, sec = proc.returncode, time.perf_counter() - t0
        (work / f"identify_{dev}.log").write_text(proc.stdout + proc.stderr)
        row = {"rc": rc, "wall_s": sec, "real_time_factor": sec / rows["recording_s"]}
        if out.exists() and truth.exists():
            scored = score(load_structure(truth), load_structure(MODEL), load_structure(out))
            row["median_error"] = {f"{k}_{DISPLAY_UNITS[v['unit']][1]}": v["median"] * DISPLAY_UNITS[v["unit"]][0]
                                   for k, v in scored["kinds"].items()}
            row["inside_2sigma"] = scored["inside_2sigma"]
        rows[dev] = row
        _log(f"identify --device {dev}: exit {rc}, {sec:.1f} s ({sec / rows['recording_s']:.2f}x real time)"
             + (f"; median error {', '.join(f'{k} {v:.3g}' for k, v in row['median_error'].items())}"
                if "median_error" in row else ""))
        save()


def run(parts: Sequence[str] = PARTS, bag: Optional[Path] = None, out: Path = OUT,
        work: Optional[Path] = None, device: str = "cuda", engine_kw: Optional[Dict[str, Any]] = None,
        tangent_kw: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The parts on ``device`` (``cpu``: a dry run of the same code, for the tests; ``engine_kw``: smaller batches
    for the same reason). Without CUDA and ``device="cuda"``: measures nothing and says so."""
    res: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "cuda": torch.cuda.is_available(),
                           "measured_on": device}
    if device == "cuda" and not res["cuda"]:
        res["reason"] = "no CUDA device: nothing measured (run this on a machine with an NVIDIA GPU)"
        _log(res["reason"])
        return res
    res["device"] = device_info() if device == "cuda" else {"name": "cpu", "cpu_count": os.cpu_count(),
                                                              "torch": torch.__version__}
    _log(f"device: {res['device']}")
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(out)

    if "engine" in parts:
        engine_part(res, save, device=device, **(engine_kw or {}))
        if device == "cuda":
            _log(f"wrote {plot(res)}")
    if "profile" in parts:
        profile_part(res, save, device=device)
    if "tangent" in parts:
        tangent_part(res, save, device=device, **(tangent_kw or {}))
    if "online" in parts:
        online_part(res, save, devices=tuple(dict.fromkeys((device, "cpu"))))
    if "identify" in parts:
        identify_part(res, save, work or out.parent / "gpu_identify", bag, devices=tuple(dict.fromkeys((device, "cpu"))))
    save()
    _log(f"wrote {out}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=PARTS, help="one part (default: every part)")
    ap.add_argument("--bag", type=Path, help="identify this bag (default: simulate the README's 16-s bag)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results JSON (default {OUT})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the same code (default cuda)")
    ap.add_argument("--batches", type=int, nargs="+", help=f"engine batch sizes (default {' '.join(map(str, BATCHES))}; "
                    "given: the compiled path and the gradients at the largest)")
    ap.add_argument("--tangent-rows", type=int, nargs="+", metavar="R", help="the tangent part's linearisation "
                    "batches (default 1 16 4096)")
    ap.add_argument("--plot", type=Path, metavar="JSON", help="only redraw docs/img/gpu_engine.png from a results "
                    "file of an earlier run")
    a = ap.parse_args(argv)
    if a.plot:
        _log(f"wrote {plot(json.loads(a.plot.read_text()))}")
        return 0
    kw = None if not a.batches else {"batches": tuple(a.batches), "compiled_batches": (max(a.batches),),
                                     "grad_batches": (max(a.batches),)}
    run(parts=(a.only,) if a.only else PARTS, bag=a.bag, out=a.out, device=a.device, engine_kw=kw,
        tangent_kw={"rows": tuple(a.tangent_rows)} if a.tangent_rows else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
