"""Identification benchmark: the spring-rod seed's experiments (Sec. 4, appendices) and the manipulator.

Ground truth comes from the MuJoCo twin (``tensegrity_ros.twin``). Printed next to the paper's numbers:

1. spring-rod table (Sec. 4.1): K/M, c/M, seconds per iteration, success rate (both ratios within 5 %) over
   >= 20 random initial conditions, for ours (closed-form stage 1), LS (scipy L-BFGS-B, MuJoCo in the loop),
   CMA-ES (``cma``, tolerance 1) and ``mujoco.sysid``'s least-squares backend;
2. icosahedron (Sec. 4.2) with uniform parameters (K, c, M tied) and with 20 %-spread parameters
   (54 per-element parameters);
3. data efficiency (Sec. 4.3): 73,617 / 7,362 / 736 / 74 training steps (the paper's 10 % ... 0.01 % of
   736,167; capped by the pool we simulate);
4. generalisation to random pushes (Sec. 4.4): the control force scalar identified with the other
   parameters frozen, and long-horizon prediction errors of the spring-rod engine with and without it;
5. the stacked manipulator: 14 s of the twin driven by the seed references, 1 mm marker noise, 5 % of the
   frames missing, nominal model perturbed by ~20 %; every string's stiffness, damping, rest length and
   every bar / plate mass (0.1-s windows, continued on 0.3-s windows), and the record's Cramer-Rao bound.

    python bench/bench_identification.py [--quick]        # writes build/bench/identification.json

``run(quick) -> dict`` is what ``bench/run_all.py`` calls. Targets (benchmarks, not tests): 100 % success,
parameter error < 0.5 % on clean data, >= 10x faster than the best baseline; manipulator median error < 2 %
in < 10 s CPU wall time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from tensegrity_ros.paths import REPO_ROOT  # noqa: E402

from tensegrity_ros.engine import Inputs, make_engine, params_from_structure  # noqa: E402
from tensegrity_ros.ident import (LONGER_WINDOWS_LADDER, IdentifyOptions, add_marker_noise, drop_frames,  # noqa: E402
                                  identify, make_dataset)
from tensegrity_ros.ident.workers import usable_cores  # noqa: E402
from tensegrity_ros.ident.baselines.mujoco_loop import (TwinObjective, TwinTrial, cma_es,  # noqa: E402
                                                        least_squares_lbfgsb, mujoco_minimize, twin_rollout)
from tensegrity_ros.ident.synthetic import random_initial_state  # noqa: E402
from tensegrity_ros.model import load_structure  # noqa: E402
from tensegrity_ros.param_names import kind_of  # noqa: E402

MODELS = REPO_ROOT / "config" / "models"
OUT = REPO_ROOT / "build" / "bench"
DT = 1e-3

PAPER_SPRING_ROD = {  # Sec. 4.1 table: K/M, c/M, s/iteration, success
    "GT": (10.0, 1.0, None, None),
    "LS": ("19.19+-7.91", "1.51+-1.16", "1.97+-1.43", 0.01),
    "CMA-ES": ("10.29+-3.73", "3.61+-8.22", "2.25+-0.30", 0.18),
    "Ours": ("10.00+-0.01", "1.00+-0.00", "0.11+-0.01", 1.00),
}


def _log(*a):
    print(*a, flush=True)


def _mean_std(xs) -> str:
    xs = np.asarray([x for x in xs if np.isfinite(x)], dtype=float)
    if xs.size == 0:
        return "n/a"
    return f"{xs.mean():.4g}+-{xs.std():.2g}"


# =====================================================================================================
# ground truth from the twin
# =====================================================================================================
def twin_dataset(structure, X0, V0, steps, *, every=1, bar_forces=None, name=""):
    """A Dataset recorded from the twin (semi-implicit Euler, 1 kHz) with its exact node velocities."""
    P, V = twin_rollout(structure, X0, V0, steps, every=every, timestep=DT, integrator="Euler", bar_forces=bar_forces)
    t = np.arange(P.shape[0]) * DT * every
    kw = {}
    if bar_forces is not None:
        Fc = np.concatenate([bar_forces, bar_forces[-1:]])[::every]
        kw = dict(control_forces=Fc, control_arms=np.zeros_like(Fc))
    return make_dataset(t, P, velocities=V, name=name, dt=DT * every, **kw), P


def closed_form(structure, data, *, ties=(), total_mass=None, estimate=("mass", "stiffness", "damping"), known=None,
                max_samples=None, seed=0):
    opts = IdentifyOptions.from_flat(ties=tuple(ties), total_mass=total_mass, estimate=tuple(estimate),
                                     known=dict(known or {}), derivative_method="semi_implicit", residual=False,
                                     regression={"max_samples": max_samples, "seed": seed} if max_samples else {})
    t0 = time.perf_counter()
    res = identify(structure, data, stages=("regression",), options=opts)
    return res, time.perf_counter() - t0


# =====================================================================================================
# 1. spring-rod table
# =====================================================================================================
def spring_rod_table(quick: bool, seed: int = 0) -> Dict[str, Any]:
    s = load_structure(MODELS / "spring_rod.yaml")
    n_trials = 20 if quick else 30
    steps = 300 if quick else 1000
    bl_iter = 8 if quick else 30
    rng = np.random.default_rng(seed)
    groups = {"K": ("s1.stiffness", "s2.stiffness"), "c": ("s1.damping", "s2.damping"), "M": ("rod.mass",)}
    rows: Dict[str, List[Dict[str, float]]] = {"Ours": [], "LS": [], "CMA-ES": [], "mujoco.sysid": []}
    backend = ""
    for k in range(n_trials):
        X0, V0 = random_initial_state(s, rng, pos_std=0.2, vel_std=0.5)
        data, P = twin_dataset(s, X0, V0, steps)
        res, secs = closed_form(s, data, ties=("stiffness", "damping"))
        KM = res.ratios["s1.stiffness/rod.mass"][0]
        cM = res.ratios["s1.damping/rod.mass"][0]
        rows["Ours"].append(dict(KM=KM, cM=cM, s_it=secs, s_total=secs, flagged=not any(res.identifiable.values())))
        obj = TwinObjective(s, [TwinTrial(X0, V0, steps, 1, P)], groups, timestep=DT, integrator="Euler")
        for lab, fn in (("LS", least_squares_lbfgsb), ("CMA-ES", cma_es), ("mujoco.sysid", mujoco_minimize)):
            r = fn(obj, [1.0, 1.0, 1.0], max_iter=bl_iter)
            v = r.values
            rows[lab].append(dict(KM=v["K"] / v["M"], cM=v["c"] / v["M"], s_it=r.seconds_per_iteration,
                                  s_total=r.seconds))
            if lab == "mujoco.sysid":
                backend = r.backend
        if (k + 1) % 5 == 0:
            _log(f"  spring-rod: {k + 1}/{n_trials} trials")
    out: Dict[str, Any] = {"trials": n_trials, "steps_per_trajectory": steps, "baseline_max_iter": bl_iter,
                           "mujoco_sysid_backend": backend}
    for lab, rs in rows.items():
        KM = np.array([r["KM"] for r in rs])
        cM = np.array([r["cM"] for r in rs])
        succ = (np.abs(KM / 10 - 1) < 0.05) & (np.abs(cM / 1 - 1) < 0.05)
        out[lab.lower().replace("-", "_").replace(".", "_") if lab != "Ours" else "ours"] = {
            "method": lab, "KM_mean": float(np.nanmean(KM)), "KM_std": float(np.nanstd(KM)),
            "cM_mean": float(np.nanmean(cM)), "cM_std": float(np.nanstd(cM)),
            "KM_error_pct_max": float(np.nanmax(np.abs(KM / 10 - 1)) * 100),
            "cM_error_pct_max": float(np.nanmax(np.abs(cM - 1)) * 100),
            "seconds_per_iteration": float(np.mean([r["s_it"] for r in rs])),
            "seconds_to_converge": float(np.mean([r["s_total"] for r in rs])),
            "success_rate": float(succ.mean())}
    out["ours"]["individually_flagged_non_identifiable"] = all(r["flagged"] for r in rows["Ours"])
    _log("\nSpring-rod system (seed Sec. 4.1; K=100, c=10, M=10; success = K/M and c/M within 5 %)")
    _log(f"  {n_trials} random initial conditions, {steps} steps each at 1 kHz; baselines x0 = 1, bounds "
         f"[0.1, 1000], {bl_iter} iterations max")
    _log(f"  {'method':14s} {'K/M':>16s} {'c/M':>16s} {'s/iter':>12s} {'s total':>9s} {'success':>8s}   "
         f"| paper: K/M, c/M, s/iter, success")
    paper = {"Ours": "Ours", "LS": "LS", "CMA-ES": "CMA-ES", "mujoco.sysid": None}
    for lab, rs in rows.items():
        key = "ours" if lab == "Ours" else lab.lower().replace("-", "_").replace(".", "_")
        o = out[key]
        pp = PAPER_SPRING_ROD.get(paper[lab] or "", None)
        ptxt = f"{pp[0]}, {pp[1]}, {pp[2]}, {pp[3]}" if pp else "(not in paper)"
        _log(f"  {lab:14s} {_mean_std([r['KM'] for r in rs]):>16s} {_mean_std([r['cM'] for r in rs]):>16s} "
             f"{_mean_std([r['s_it'] for r in rs]):>12s} {o['seconds_to_converge']:9.3f} "
             f"{o['success_rate']:8.2f}   | {ptxt}")
    _log(f"  ours flags K, c, M individually non-identifiable and reports the ratios: "
         f"{out['ours']['individually_flagged_non_identifiable']}")
    return out


# =====================================================================================================
# 2. icosahedron, uniform and 20 %-spread parameters
# =====================================================================================================
def _param_errors(est: Dict[str, float], true: Dict[str, float], names: Sequence[str]) -> Dict[str, float]:
    return {n: abs(est[n] / true[n] - 1) * 100 for n in names}


def icosahedron(quick: bool, seed: int = 1) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    n_traj = 4 if quick else 20
    steps = 300 if quick else 1000
    rng = np.random.default_rng(seed)
    for variant in ("icosahedron", "icosahedron_spread"):
        s = load_structure(MODELS / f"{variant}.yaml")
        p = params_from_structure(s)
        true = {n: float(v) for n, v in p.named().items()}
        datas, trials = [], []
        t0 = time.perf_counter()
        for _ in range(n_traj):
            X0, V0 = random_initial_state(s, rng, pos_std=0.05, vel_std=1.0)
            d, P = twin_dataset(s, X0, V0, steps)
            datas.append(d)
            trials.append(TwinTrial(X0, V0, steps, 1, P))
        t_gt = time.perf_counter() - t0
        uniform = variant == "icosahedron"
        total = float(p.mass.sum())
        res, secs = closed_form(s, datas, ties=("stiffness", "damping", "mass") if uniform else (), total_mass=total)
        names = [n for n in true if kind_of(n) in ("stiffness", "damping", "mass")]
        errs = _param_errors(res.values(), true, names)
        # ratios are anchor-free: error of every parameter relative to the total mass
        e = {"method": "ours (closed form)", "parameters": 3 if uniform else len(names),
             "max_error_pct": max(errs.values()), "median_error_pct": float(np.median(list(errs.values()))),
             "seconds_to_converge": secs, "success_rate": float(max(errs.values()) < 5.0),
             "trajectories": n_traj, "steps_each": steps, "ground_truth_seconds": t_gt,
             "note": "scale anchored on the true total mass (only ratios are identifiable; ratio errors are equal)"}
        out[variant] = {"ours": e}
        _log(f"\n{variant} ({'uniform K=100, c=10, M=10' if uniform else '20 % spread: 54 parameters'}); "
             f"{n_traj} x {steps} steps of twin data")
        _log(f"  ours: max error {e['max_error_pct']:.4f} %, median {e['median_error_pct']:.4f} %, {secs:.2f} s "
             f"| paper: Fig. 10 (trajectory errors only; no parameter table)")
        if uniform or not quick:
            groups = {"K": tuple(n for n in names if kind_of(n) == "stiffness"),
                      "c": tuple(n for n in names if kind_of(n) == "damping"),
                      "M": tuple(n for n in names if kind_of(n) == "mass")} if uniform else {n: (n,) for n in names}
            n_bl = min(1 if quick else 5, n_traj)
            obj = TwinObjective(s, trials[:n_bl], groups, timestep=DT, integrator="Euler")
            x0 = [1.0] * len(groups)
            it = 5 if quick else (30 if uniform else 10)
            for lab, fn in (("LS", least_squares_lbfgsb), ("CMA-ES", cma_es), ("mujoco.sysid", mujoco_minimize)):
                r = fn(obj, x0, max_iter=it, max_time_s=60 if quick else 600)
                v = r.values
                if uniform:
                    bl_err = {"K/M": abs(v["K"] / v["M"] / 10 - 1) * 100, "c/M": abs(v["c"] / v["M"] - 1) * 100}
                else:  # compare ratios to the total mass (the baselines see no anchor)
                    tot = sum(v[n] for n in names if kind_of(n) == "mass")
                    bl_err = {n: abs(v[n] / tot * total / true[n] - 1) * 100 for n in names}
                out[variant][lab] = {"method": lab, "max_error_pct": max(bl_err.values()),
                                     "median_error_pct": float(np.median(list(bl_err.values()))),
                                     "seconds_to_converge": r.seconds, "iterations": r.iterations,
                                     "success_rate": float(max(bl_err.values()) < 5.0), "message": r.message}
                _log(f"  {lab}: max ratio error {max(bl_err.values()):.3g} %, {r.seconds:.1f} s, "
                     f"{r.iterations} it ({r.message[:50]})")
    return out


# =====================================================================================================
# 3. data efficiency
# =====================================================================================================
def data_efficiency(quick: bool, seed: int = 2) -> Dict[str, Any]:
    s = load_structure(MODELS / "icosahedron_spread.yaml")
    p = params_from_structure(s)
    true = {n: float(v) for n, v in p.named().items()}
    names = [n for n in true if kind_of(n) in ("stiffness", "damping", "mass")]
    n_traj, steps = (6, 500) if quick else (40, 2000)
    rng = np.random.default_rng(seed)
    datas = []
    for _ in range(n_traj):
        X0, V0 = random_initial_state(s, rng, pos_std=0.05, vel_std=1.0)
        datas.append(twin_dataset(s, X0, V0, steps)[0])
    pool = n_traj * steps
    out: Dict[str, Any] = {"pool_steps": pool, "paper_pool_steps": 736167, "rows": []}
    _log(f"\nData efficiency (seed Sec. 4.3; 54 parameters; pool {pool} twin steps, paper 736,167)")
    for frac, want in ((0.1, 73617), (0.01, 7362), (0.001, 736), (0.0001, 74)):
        n = min(want, pool)
        res, secs = closed_form(s, datas, total_mass=float(p.mass.sum()), max_samples=n, seed=seed)
        if res.ok:
            errs = _param_errors(res.values(), true, names)
            row = {"fraction_of_paper_pool": frac, "steps": n, "max_error_pct": max(errs.values()),
                   "median_error_pct": float(np.median(list(errs.values()))), "seconds": secs,
                   "not_excited": sum(1 for nm in names if not np.isfinite(res.std_devs.get(nm, np.inf)))}
        else:
            row = {"fraction_of_paper_pool": frac, "steps": n, "error": str(res.error), "seconds": secs}
        out["rows"].append(row)
        _log(f"  {frac * 100:g} % ({n} steps): " + (f"max error {row['max_error_pct']:.3g} %, median "
                                                   f"{row['median_error_pct']:.3g} %, {secs:.2f} s" if res.ok else
                                                   f"failed: {row['error']}") + "  | paper: good down to 73 steps")
    return out


# =====================================================================================================
# 4. generalisation with the control force scalar
# =====================================================================================================
def _pushes(rng, steps, n_bars, every=100, hold=20, scale=30.0):
    F = np.zeros((steps, n_bars, 3))
    for k0 in range(0, steps, every):
        b = rng.integers(n_bars)
        d = rng.normal(size=3)
        F[k0:k0 + hold, b] = scale * d / np.linalg.norm(d)
    return F


def generalisation(quick: bool, seed: int = 3, h_true: float = 2.5) -> Dict[str, Any]:
    s = load_structure(MODELS / "icosahedron_spread.yaml")
    p = params_from_structure(s)
    rng = np.random.default_rng(seed)
    n_train, n_test = (2, 2) if quick else (5, 10)
    steps_train = 500 if quick else 2000
    horizon = 1000 if quick else 4000
    # 1. the other parameters from push-free data (frozen afterwards)
    base = []
    for _ in range(2 if quick else 5):
        X0, V0 = random_initial_state(s, rng, pos_std=0.05, vel_std=1.0)
        base.append(twin_dataset(s, X0, V0, 500)[0])
    res0, _ = closed_form(s, base, total_mass=float(p.mass.sum()))
    frozen = {n: v for n, v in res0.values().items() if kind_of(n) in ("stiffness", "damping", "mass")}
    # 2. pushes: the twin applies h_true * f_u, the data record f_u
    train = []
    for _ in range(n_train):
        X0, V0 = random_initial_state(s, rng, pos_std=0.05, vel_std=1.0)
        F = _pushes(rng, steps_train, len(s.bars))
        d, _ = twin_dataset(s, X0, V0, steps_train, bar_forces=h_true * F)
        # the data record the commanded force f_u, not what the twin applied (h_true f_u)
        train.append(dataclasses.replace(d, control_forces=np.concatenate([F, F[-1:]])))
    opts = IdentifyOptions.from_flat(estimate=("control_force_scalar",), known=frozen,
                                     derivative_method="semi_implicit", backend="spring_rod",
                                     regression={"mass_model": "thin"})
    t0 = time.perf_counter()
    res = identify(s, train, stages=("regression",), options=opts)
    secs = time.perf_counter() - t0
    h = float(res.params.control_force_scalar) if res.ok else float("nan")
    # 3. long-horizon prediction with the spring-rod engine: h identified vs h = 1
    eng = make_engine(s, backend="spring_rod")
    params = eng.default_params().with_values(frozen)
    errs = {"identified": [], "untuned_h1": []}
    checkpoints = [100, 500, 1000] + ([2000, 4000] if horizon >= 4000 else [])
    for _ in range(n_test):
        X0, V0 = random_initial_state(s, rng, pos_std=0.05, vel_std=1.0)
        F = _pushes(rng, horizon, len(s.bars))
        P, _ = twin_rollout(s, X0, V0, horizon, timestep=DT, integrator="Euler", bar_forces=h_true * F)
        st = eng.initial_state(torch.as_tensor(X0), torch.as_tensor(V0))
        for lab, hv in (("identified", h), ("untuned_h1", 1.0)):
            pr = params.with_values({"control_force_scalar": hv})
            with torch.no_grad():
                out = eng.rollout(pr, st, Inputs(control_forces=torch.as_tensor(F)[:, None],
                                                 control_arms=torch.zeros(horizon, 1, len(s.bars), 3,
                                                                          dtype=torch.float64)), dt=DT)
            E = np.linalg.norm(out.positions[:, 0].numpy() - P[1:], axis=-1).mean(-1)
            errs[lab].append([float(E[c - 1]) for c in checkpoints if c <= horizon])
    out = {"h_true": h_true, "h_identified": h, "h_error_pct": abs(h / h_true - 1) * 100, "seconds": secs,
           "checkpoints_steps": [c for c in checkpoints if c <= horizon],
           "mean_node_error_mm": {k: (np.mean(v, axis=0) * 1e3).tolist() for k, v in errs.items()}}
    _log(f"\nGeneralisation to random pushes (seed Sec. 4.4): control force scalar h (true {h_true})")
    _log(f"  identified h = {h:.5g} ({out['h_error_pct']:.3g} % error) in {secs:.2f} s from {n_train} x "
         f"{steps_train} steps, other parameters frozen")
    for k, v in out["mean_node_error_mm"].items():
        _log(f"  mean node error [mm] at {out['checkpoints_steps']} steps, {k}: " + ", ".join(f"{x:.3g}" for x in v))
    _log("  | paper: Fig. 11b / Fig. 18 (error curves; the scalar converges to a stable value)")
    return out


# =====================================================================================================
# 5. manipulator
# =====================================================================================================
def manipulator_problem(duration_s: float = 14.0, noise_m: float = 1e-3, drop: float = 0.05, seed: int = 0,
                        spread: float = 0.2, rest_offset_m: float = 0.003):
    """Twin data of the manipulator driven by the seed references, noisy labelled node positions with missing
    frames, and a nominal model perturbed by ~``spread`` (k, c, m) and ~``rest_offset_m`` (rest lengths)."""
    from tensegrity_ros.references import load_reference, motor_angles
    from tensegrity_ros.twin import simulate
    s = load_structure(MODELS / "stacked_manipulator.yaml")
    ref = load_reference(REPO_ROOT / "config" / "references" / "seed_sinusoids.yaml")
    fn = lambda t: motor_angles(ref, s.actuators, t)  # noqa: E731
    # RK4: MuJoCo's default implicitfast is mm-level off the converged physics at 1 ms on this model (docs/twin.md);
    # with it as ground truth the engine at the TRUE parameters missed 0.25-s windows by 2 mm (RK4: 0.1 mm)
    traj = simulate(s, fn, duration_s, record_hz=120.0, timestep=DT, progress=False, integrator="RK4")
    ds = make_dataset(traj.times, traj.positions, None, traj.motor_angles, name="manipulator")
    rng = np.random.default_rng(seed)
    noisy = drop_frames(add_marker_noise(ds, noise_m, rng), drop, rng)
    p = params_from_structure(s)
    true = {n: float(v) for n, v in p.named().items()}
    names = [n for n in p.names() if kind_of(n) in ("stiffness", "damping", "mass")]
    f = np.clip(np.exp(rng.normal(0, spread, len(names))), 1 - 2 * spread, 1 + 2 * spread)
    prior = p.with_values({n: true[n] * k for n, k in zip(names, f)})
    rl = [n for n in p.names() if kind_of(n) == "rest_length"]
    prior = prior.with_values({n: true[n] + rng.normal(0, rest_offset_m) for n in rl})
    from tensegrity_ros.engine import build_topology
    top = build_topology(s)
    movable = np.abs(top.Cb_q).sum(1) > 0
    total = float(p.mass[torch.as_tensor(movable)].sum())
    return s, noisy, prior, true, total


def manipulator_errors(values: Dict[str, float], true: Dict[str, float]) -> Dict[str, float]:
    """Relative errors (%) of k, c, m and rest lengths (rest-length error relative to the rest length)."""
    out = {}
    for n, v in values.items():
        kind = kind_of(n)
        if kind in ("stiffness", "damping", "mass"):
            out[n] = abs(v / true[n] - 1) * 100
        elif kind == "rest_length":
            out[n] = abs(v - true[n]) / true[n] * 100
    return out


def _median_by_kind(errors: Dict[str, float], kinds: Sequence[str]) -> Dict[str, float]:
    """Median of ``errors`` ({"element.kind": value}) per kind."""
    return {k: float(np.median([v for n, v in errors.items() if kind_of(n) == k])) for k in kinds}


#: Seeds of the manipulator runs: each draws its own marker noise, missing frames and prior offsets. The full
#: bench runs them all and its headline is the worst seed's median error; a single seed hid that seed 2 (prior
#: stiffnesses 21 % off) stalled at 5.3 % under the earlier uniformly scaled trust-region step.
MANIPULATOR_SEEDS = (0, 1, 2)


def manipulator(quick: bool) -> Dict[str, Any]:
    """The manipulator identification (seed 0; in full mode every seed of MANIPULATOR_SEEDS): seed 0's record in
    full, plus per seed its median error, by kind, and wall time; ``worst_seed_*``: the headline figures."""
    runs = [manipulator_run(quick, seed, record=seed == MANIPULATOR_SEEDS[0])
            for seed in (MANIPULATOR_SEEDS[:1] if quick else MANIPULATOR_SEEDS)]
    out = dict(runs[0])
    out["seeds"] = [{"seed": seed, "ok": r["ok"], "median_error_pct": r["median_error_pct"],
                     "median_error_pct_by_kind": r["median_error_pct_by_kind"], "wall_s": r["wall_s"],
                     "residual_rms_mm": r["residual_rms_mm"]} for seed, r in zip(MANIPULATOR_SEEDS, runs)]
    out["worst_seed_median_error_pct"] = max(r["median_error_pct"] for r in runs)
    out["worst_seed_wall_s"] = max(r["wall_s"] for r in runs)
    if len(runs) > 1:
        _log(f"  over {len(runs)} seeds: median error " + ", ".join(f"{r['median_error_pct']:.3g} %" for r in runs) +
             f" (worst {out['worst_seed_median_error_pct']:.3g} %, target < 2 %); wall " +
             ", ".join(f"{r['wall_s']:.0f} s" for r in runs))
    return out


def manipulator_run(quick: bool, seed: int = 0, record: bool = True) -> Dict[str, Any]:
    """One manipulator identification; ``record`` adds stage 1 alone and the Cramer-Rao bound (full mode)."""
    t0 = time.perf_counter()
    s, noisy, prior, true, total = manipulator_problem(seed=seed)
    t_gt = time.perf_counter() - t0
    kinds = ("mass", "stiffness", "damping", "rest_length")
    out: Dict[str, Any] = {"ground_truth_seconds": t_gt}
    if record and not quick:
        # stage 1 alone, for the record: errors in variables (1 mm noise through 20 kN/m strings) bias it badly
        t1 = time.perf_counter()
        r1 = identify(s, noisy, prior=prior, stages=("regression",), options=IdentifyOptions.from_flat(
            estimate=kinds, total_mass=total, smooth_window_s=0.05, residual=False))
        e1 = manipulator_errors(r1.values(), true) if r1.ok else {}
        out["stage1_only"] = {"seconds": time.perf_counter() - t1,
                              "median_error_pct": float(np.median(list(e1.values()))) if e1 else None}
        _log(f"  manipulator stage 1 alone: median error {out['stage1_only']['median_error_pct']:.3g} % in "
             f"{out['stage1_only']['seconds']:.1f} s (biased by the marker noise; stage 2 starts from the prior)")
    # the nominal model's declared uncertainty is the prior (MAP): ~20 % on k, c, m, 3 mm on rest lengths
    prior_std = {"stiffness": 0.2, "damping": 0.2, "mass": 0.2, "rest_length": 0.003}
    # continuation: 0.1-s windows from the prior (nearly convex), then ever longer windows, each stage from the
    # result before (far more information per window, see manipulator_bound; 0.3-s windows straight from the
    # prior stalled in a local minimum, loss 74 vs 3). Seed 2 shows why the ladder: 0.1 -> 0.3 s ended at 5.4 %,
    # 0.1 -> 0.2 -> 0.3 s at 2.7 %, and the 0.5-s and 1.0-s stages then see the dampings (and through them the
    # masses) that short windows cannot: 1.3 % (docs/identification.md, section 5).
    longer = ((0.2, 6, 2), (0.5, 4, 2), (1.0, 4, 2)) if quick else LONGER_WINDOWS_LADDER
    opts = IdentifyOptions.from_flat(estimate=kinds, refine_kinds=kinds, total_mass=total, window_s=0.1,
                                     max_windows=12 if quick else 24, max_iter=8, smooth_window_s=0.05,
                                     longer_windows=longer, covariance_windows=4 if quick else 12,
                                     prior_std=prior_std, noise_std_m=1e-3, workers=usable_cores())
    t1 = time.perf_counter()
    res = identify(s, noisy, prior=prior, stages=("refine",), options=opts)
    wall = time.perf_counter() - t1
    e_prior = manipulator_errors({n: float(v) for n, v in prior.named().items()}, true)
    e = manipulator_errors(res.values(), true) if res.ok else e_prior
    by_kind = _median_by_kind(e, kinds)
    rest_mm = [abs(res.values()[n] - true[n]) * 1e3 for n in true if kind_of(n) == "rest_length"]
    z = [(res.values()[n] - true[n]) / res.std_devs[n] for n in e
         if n in res.std_devs and np.isfinite(res.std_devs[n]) and res.std_devs[n] > 0]
    out.update({"ok": res.ok, "error": None if res.ok else str(res.error), "wall_s": wall, "timings": res.timings,
                "median_error_pct": float(np.median(list(e.values()))), "median_error_pct_by_kind": by_kind,
                "prior_median_error_pct": float(np.median(list(e_prior.values()))),
                "prior_median_error_pct_by_kind": _median_by_kind(e_prior, kinds),
                "rest_length_error_mm_median": float(np.median(rest_mm)), "errors_pct": e,
                "residual_rms_mm": res.residual_rms_m * 1e3,
                "z_rms": float(np.sqrt(np.mean(np.square(z)))) if z else None,
                "settings": {"windows": opts.refine.max_windows, "window_s": opts.refine.window_s, "max_iter": opts.refine.max_iter,
                             "longer_windows": [list(x) for x in longer], "stages": ["refine"], "workers": opts.refine.workers,
                             "prior_std": prior_std},
                "notes": res.notes[-4:]})
    if record and not quick:
        out["cramer_rao"] = manipulator_bound(s, noisy, true, total)
    _log(f"\nStacked manipulator, seed {seed}: 14 s twin data, 1 mm marker noise, 5 % frames missing, prior ~20 % "
         "off (k, c, m) and ~3 mm (rest lengths); scale anchored on the weighed total mass")
    _log(f"  {'ok' if res.ok else 'FAILED: ' + str(res.error)}; median error {out['median_error_pct']:.3g} % "
         f"(prior {out['prior_median_error_pct']:.3g} %), by kind " +
         ", ".join(f"{k} {v:.3g} %" for k, v in by_kind.items()) +
         f"; rest lengths median {out['rest_length_error_mm_median']:.3g} mm; residual "
         f"{out['residual_rms_mm']:.2f} mm; wall {wall:.1f} s (targets: < 2 %, < 10 s)")
    for row in out.get("cramer_rao", []):
        _log(f"  Cramer-Rao (Gauss-Newton covariance at the TRUE parameters, no prior): {row['windows']} x "
             f"{row['window_s']:g}-s windows -> expected median |error| {row['median_error_pct']:.2g} % "
             "(" + ", ".join(f"{k} {v:.2g} %" for k, v in row["by_kind"].items()) + ")")
    return out


def manipulator_bound(s, data, true: Dict[str, float], total: float) -> List[Dict[str, Any]]:
    """What the record can tell at best: the Gauss-Newton (Cramer-Rao) covariance at the true parameters, no
    prior, window starts free, for the bench's window choices and for the whole record cut into 0.3-s windows;
    expected |error| = 0.674 sigma (median of a half-normal). Jacobians on 16 windows, scaled to all."""
    from tensegrity_ros.ident.refine import RefineOptions, RefineProblem
    from tensegrity_ros.ident.uncertainty import gauss_newton_covariance
    kinds = ("mass", "stiffness", "damping", "rest_length")
    rows = []
    for ws, nw in ((0.1, 24), (0.3, 24), (0.3, None)):
        prob = RefineProblem(s, [data], params_from_structure(s), RefineOptions(
            kinds=kinds, window_s=ws, max_windows=nw, total_mass=total, noise_std_m=1e-3, smooth_window_s=0.05))
        x0 = torch.zeros(prob.B_win, len(prob.top.free_nodes), 6, dtype=prob.dtype)
        cov = gauss_newton_covariance(prob, prob.initial_w(0.0), x0, noise_std_m=1e-3, max_windows=16)
        rel = {n: 100 * 0.674 * sd / true[n] for n, sd in cov.std_devs.items()}
        rows.append({"window_s": ws, "windows": prob.B_win, "median_error_pct": float(np.median(list(rel.values()))),
                     "by_kind": _median_by_kind(rel, kinds)})
    return rows


# =====================================================================================================
def run(quick: bool = True, only: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """All experiments; writes build/bench/identification.json and returns the same dict."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res: Dict[str, Any] = {"quick": quick}
    exps = {"spring_rod": spring_rod_table, "icosahedron": icosahedron, "data_efficiency": data_efficiency,
            "generalisation": generalisation, "manipulator": manipulator}
    try:
        for name, fn in exps.items():
            if only and name not in only:
                continue
            try:
                res[name] = fn(quick)
            except Exception as exc:  # report, keep going
                import traceback
                traceback.print_exc()
                res[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.set_num_threads(old)
    sr = res.get("spring_rod", {})
    if "ours" in sr:
        best = min((sr[k]["seconds_to_converge"] for k in ("ls", "cma_es", "mujoco_sysid") if k in sr), default=None)
        res["speedup_vs_best_baseline"] = best / sr["ours"]["seconds_to_converge"] if best else None
        _log(f"\nspeed-up of ours vs the fastest baseline (spring-rod, seconds to converge): "
             f"{res['speedup_vs_best_baseline']:.1f}x (target >= 10x)")
    res["total_seconds"] = time.perf_counter() - t0
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "identification.json").write_text(json.dumps(res, indent=2, default=float))
    _log(f"wrote {OUT / 'identification.json'} ({res['total_seconds']:.0f} s)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced version (< 2 min on 2 cores)")
    ap.add_argument("--only", default="", help="comma-separated subset: spring_rod,icosahedron,data_efficiency,"
                                              "generalisation,manipulator")
    a = ap.parse_args(argv)
    run(quick=a.quick, only=[x for x in a.only.split(",") if x] or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
