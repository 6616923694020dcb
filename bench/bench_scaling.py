"""Scaling, by measurement (issue 20 item 5): how identification's wall time grows with the recording's length and
with the number of windows, and how the engine's throughput grows with the batch size.

1. ``tensegrity identify`` as a user runs it (the README's manipulator bag: ``tensegrity simulate
   config/models/stacked_manipulator.yaml --perturb 0.1 --bag``), default flags, on recordings of 4, 8, 16 and 32 s;
   and on the 16-s one with ``--windows`` 8, 16 and 32 (the short-window stage's count; the longer-window ladder
   keeps its default). Wall time of the whole command (bag reading, labelling, both stages, the checks).
2. The engine (eager, float32, no gradient, one thread) at batch 1 to 65 536 on the icosahedron (semi-implicit) and
   the manipulator (implicit): item-steps per second, and the fit time-per-step = a + b B (a: the per-step fixed
   cost, Python and dispatch; b: the cost per batch item), which says where throughput saturates (B ~ a / b).

Writes build/bench/scaling.json and docs/img/scaling_identify.png, docs/img/scaling_engine.png.

    python bench/bench_scaling.py [--quick]   # --quick: 4/8/16 s only, no window sweep, batches up to 4096
    python bench/bench_scaling.py --only identify --lengths 4,8 --merge   # re-measure two points, keep the rest
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Sequence

import numpy as np
import torch

from tensegrity_ros.paths import CONFIG_DIR, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_engine import engine_rate  # noqa: E402  (one measurement of the engine's rate, shared)
from benchlib import run_cli  # noqa: E402

from tensegrity_ros.engine import make_engine  # noqa: E402
from tensegrity_ros.model import load_structure  # noqa: E402

OUT = REPO_ROOT / "build" / "bench"
IMG = REPO_ROOT / "docs" / "img"
MODEL = CONFIG_DIR / "models" / "stacked_manipulator.yaml"


def _log(*a):
    print(*a, flush=True)


def identify_scaling(lengths_s: Sequence[float], windows: Sequence[int], work: Path) -> Dict[str, Any]:
    rows, wrows = [], []
    for L in lengths_s:
        sim = work / f"sim{L:g}"
        rc, sec, _ = run_cli(["simulate", str(MODEL), "--duration", f"{L:g}", "--out", str(sim), "--bag",
                              str(sim / "bag"), "--perturb", "0.1", "--force"], show_progress=False)
        if rc != 0:
            raise RuntimeError(f"simulate {L:g} s exited {rc}")
        rc, sec, text = run_cli(["identify", str(sim / "bag"), "--model", str(MODEL), "--out",
                                 str(sim / "identified.yaml"), "--force", "--truth", "none"], show_progress=False)
        (sim / "identify.log").write_text(text)
        rows.append({"recording_s": L, "wall_s": sec, "rc": rc, "real_time_factor": sec / L,
                     "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
        _log(f"  identify, {L:4g}-s recording: {sec:7.1f} s wall (x{sec / L:.2f} real time), exit {rc}")
    for w in windows:
        sim = work / "sim16"
        if not (sim / "bag").exists():
            break
        rc, sec, _ = run_cli(["identify", str(sim / "bag"), "--model", str(MODEL), "--out",
                              str(sim / f"identified_w{w}.yaml"), "--force", "--truth", "none", "--windows", str(w)],
                              show_progress=False)
        wrows.append({"windows": w, "wall_s": sec, "rc": rc, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})
        _log(f"  identify, 16-s recording, --windows {w:3d}: {sec:7.1f} s wall, exit {rc}")
    return {"by_length": rows, "by_windows": wrows}


def _merge_identify(old: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """Rows of ``new`` replace ``old``'s of the same recording length / window count (a re-measured point, e.g. on a
    quieter machine), the others are kept; the linear fit is redone over the merged rows."""
    out = {}
    for part, key in (("by_length", "recording_s"), ("by_windows", "windows")):
        rows = {r[key]: r for r in old.get(part, [])}
        rows.update({r[key]: r for r in new.get(part, [])})
        out[part] = [rows[k] for k in sorted(rows)]
    rows = out["by_length"]
    if len(rows) >= 2:
        x, y = np.array([r["recording_s"] for r in rows]), np.array([r["wall_s"] for r in rows])
        b, a = np.polyfit(x, y, 1)
        out["fit_wall_s"] = {"fixed_s": float(a), "per_recorded_s": float(b)}
    return out


def engine_scaling(batches: Sequence[int]) -> Dict[str, Any]:
    out = {}
    for name, integ in (("icosahedron", "semi_implicit"), ("stacked_manipulator", "implicit")):
        eng = make_engine(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), "nodal", integ,
                          dtype=torch.float32)
        rows = []
        for B in batches:
            steps = int(np.clip(2e5 / B, 2, 200))
            sec = B / engine_rate(eng, B, steps, compile=False, grad=False)[0]
            rows.append({"batch": B, "seconds_per_step": sec, "item_steps_per_s": B / sec})
            _log(f"  {name:20s} {integ:14s} batch {B:6d}: {B / sec:12.4g} item-steps/s ({sec * 1e3:.3g} ms/step)")
        Bs = np.array([r["batch"] for r in rows], float)
        T = np.array([r["seconds_per_step"] for r in rows])
        # time per step = a + b B, fitted with relative weights (every batch size counts alike)
        A = np.stack([np.ones_like(Bs), Bs], 1) / T[:, None]
        a, b = np.linalg.lstsq(A, np.ones_like(T), rcond=None)[0]
        out[name] = {"integrator": integ, "rows": rows, "fit": {"fixed_ms_per_step": a * 1e3,
                                                                 "us_per_item_step": b * 1e6,
                                                                 "saturation_batch": a / b if b > 0 else None}}
        _log(f"  {name}: time per step = {a * 1e3:.3g} ms + {b * 1e6:.3g} us x batch (saturates near batch "
             f"{a / b:.0f})" if b > 0 else f"  {name}: fit failed")
    return out


def plots(res: Dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    IMG.mkdir(parents=True, exist_ok=True)
    ident = res.get("identify")
    if ident and ident["by_length"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        x = [r["recording_s"] for r in ident["by_length"]]
        y = [r["wall_s"] for r in ident["by_length"]]
        axes[0].plot(x, y, "o-", label="tensegrity identify, default flags")
        axes[0].plot(x, x, "k--", lw=0.8, label="real time (wall = recording)")
        if "fit_wall_s" in ident:
            f = ident["fit_wall_s"]
            xx = np.linspace(0, max(x), 50)
            axes[0].plot(xx, f["fixed_s"] + f["per_recorded_s"] * xx, ":", label=f"fit {f['fixed_s']:.0f} s + "
                         f"{f['per_recorded_s']:.2f} x recording")
        axes[0].set(xlabel="recording length [s]", ylabel="wall time [s]",
                    title="identify: wall time vs recording length (manipulator)")
        axes[0].legend(fontsize=8)
        if ident["by_windows"]:
            axes[1].plot([r["windows"] for r in ident["by_windows"]], [r["wall_s"] for r in ident["by_windows"]],
                         "o-")
        axes[1].set(xlabel="--windows (short-window stage)", ylabel="wall time [s]",
                    title="identify: wall time vs window count (16-s recording)")
        fig.tight_layout()
        fig.savefig(IMG / "scaling_identify.png", dpi=110)
        plt.close(fig)
    eng = res.get("engine")
    if eng:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, e in eng.items():
            Bs = [r["batch"] for r in e["rows"]]
            ax.loglog(Bs, [r["item_steps_per_s"] for r in e["rows"]], "o-", label=f"{name} ({e['integrator']})")
            f = e["fit"]
            bb = np.logspace(0, np.log10(max(Bs)), 60)
            ax.loglog(bb, bb / (f["fixed_ms_per_step"] * 1e-3 + f["us_per_item_step"] * 1e-6 * bb), ":", color="gray")
        ax.set(xlabel="batch size", ylabel="item-steps per second",
               title="engine throughput vs batch (eager, float32, 1 thread; dotted: a + b B fit)")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", lw=0.3)
        fig.tight_layout()
        fig.savefig(IMG / "scaling_engine.png", dpi=110)
        plt.close(fig)


def run(quick: bool = False, parts: Sequence[str] = ("engine", "identify"), lengths: Sequence[float] = (),
        windows: Sequence[int] = (), merge: bool = False) -> Dict[str, Any]:
    """``lengths`` / ``windows``: measure these instead of the defaults; ``merge``: keep the other parts and rows of
    the last build/bench/scaling.json (each row carries the time it was measured)."""
    torch.set_num_threads(1)
    prev = OUT / "scaling.json"
    res: Dict[str, Any] = json.loads(prev.read_text()) if merge and prev.exists() else {}
    res["quick"] = quick
    if "engine" in parts:
        _log("engine throughput vs batch size")
        res["engine"] = engine_scaling((1, 4, 16, 64, 256, 1024, 4096) if quick else
                                       (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536))
    if "identify" in parts:
        _log("identify wall time vs recording length and window count")
        new = identify_scaling(lengths or ((4, 8, 16) if quick else (4, 8, 16, 32)),
                               windows if (lengths or windows) else (() if quick else (8, 16, 32)), OUT / "scaling")
        res["identify"] = _merge_identify(res.get("identify", {}) if merge else {}, new)
    plots(res)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scaling.json").write_text(json.dumps(res, indent=2, default=float))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="engine,identify", help="comma-separated subset of: engine, identify")
    ap.add_argument("--lengths", default="", help="recording lengths to identify, s (default 4,8,16,32)")
    ap.add_argument("--windows", default="", help="--windows values on the 16-s recording (default 8,16,32)")
    ap.add_argument("--merge", action="store_true", help="keep the other rows and parts of the last scaling.json")
    args = ap.parse_args(argv)
    run(args.quick, tuple(p.strip() for p in args.only.split(",") if p.strip()),
        tuple(float(x) for x in args.lengths.split(",") if x), tuple(int(x) for x in args.windows.split(",") if x),
        args.merge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
