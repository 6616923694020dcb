"""MuJoCo-in-the-loop objective and the black-box optimisers (see the package docstring)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ...engine import apply_to_structure, params_from_structure
from ...model import Structure

__all__ = ["TwinTrial", "TwinObjective", "BaselineResult", "twin_rollout", "least_squares_lbfgsb", "cma_es",
           "mujoco_minimize", "mujoco_sysid", "mujoco_sysid_available", "BOUNDS"]

#: the seed's search interval for every parameter (Sec. 4.1)
BOUNDS = (0.1, 1000.0)


def mujoco_sysid_available() -> Tuple[bool, str]:
    """(True, "") when ``mujoco.sysid`` imports with its optimiser, else (False, reason)."""
    try:
        from mujoco.sysid._src import optimize  # noqa: F401
        return True, ""
    except Exception as exc:  # ModuleNotFoundError: absl
        return False, f"{type(exc).__name__}: {exc}"


def twin_rollout(structure: Structure, X0: np.ndarray, V0: np.ndarray, n_steps: int, *, every: int = 1,
                 timestep: float = 1e-3, integrator: str = "Euler", motor_angles: Optional[np.ndarray] = None,
                 bar_forces: Optional[np.ndarray] = None, sim=None) -> Tuple[np.ndarray, np.ndarray]:
    """Simulate the twin from node state (X0, V0) (N, 3) for ``n_steps`` steps; record every ``every``-th.

    motor_angles: (n_steps, A) rad held over each step; bar_forces: (n_steps, n_bars, 3) N applied at each
    bar body's centre of mass (world frame). Returns positions and velocities (T, N, 3), sample 0 = start.
    """
    from ...twin import TwinSim
    import mujoco
    sim = sim or TwinSim(structure, timestep=timestep, integrator=integrator)
    sim.set_node_state(X0, V0)
    body_of_bar = {}
    if bar_forces is not None:
        for spec, bid in zip(sim.layout.bodies, sim._body_ids):
            if len(spec.bars) == 1:
                body_of_bar[spec.bars[0]] = bid
        bar_ids = [body_of_bar.get(b.name, -1) for b in structure.bars]
    P = [sim.node_positions()]
    V = [sim.node_velocities()]
    for k in range(n_steps):
        if bar_forces is not None:
            sim.data.xfrc_applied[:] = 0.0
            for b, bid in enumerate(bar_ids):
                if bid >= 0:
                    sim.data.xfrc_applied[bid, :3] = bar_forces[k, b]
        sim.step(None if motor_angles is None else motor_angles[k], 1)
        if (k + 1) % every == 0:
            P.append(sim.node_positions())
            V.append(sim.node_velocities())
    del mujoco
    return np.asarray(P), np.asarray(V)


@dataclass
class TwinTrial:
    """One recorded trajectory: start state, length, recording stride, recorded positions (T, N, 3) and the
    inputs (motor angles (n_steps, A), bar forces (n_steps, n_bars, 3))."""

    X0: np.ndarray
    V0: np.ndarray
    n_steps: int
    every: int
    targets: np.ndarray
    motor_angles: Optional[np.ndarray] = None
    bar_forces: Optional[np.ndarray] = None


@dataclass
class BaselineResult:
    """method; values: group -> value; seconds (wall, total); iterations / evaluations; seconds_per_iteration;
    history: [{iteration, time_s, loss, values}]; converged: the optimiser's own stop reason was met;
    backend: what actually ran; message."""

    method: str
    values: Dict[str, float]
    seconds: float
    iterations: int
    evaluations: int
    seconds_per_iteration: float
    loss: float
    history: List[Dict[str, Any]] = field(default_factory=list)
    converged: bool = False
    backend: str = ""
    message: str = ""


class TwinObjective:
    """Trajectory error of the twin for group values x (one value per group; each group sets its parameter
    names). ``mse(x)`` in mm^2 (mean over trials, samples, observed nodes, axes); ``residual(x)`` in mm.

    ``prior``: optional (centre, std) per group, and ``noise_mm``: then ``residual`` also carries one row per group,
    noise_mm (x - centre) / std, so that least squares on it minimises sum (r / noise)^2 + sum ((x - centre) /
    std)^2 times noise^2: the same Gaussian prior `tensegrity identify` puts on the parameters (without one, a
    scale that nothing in the data fixes stays free). ``mse`` is over the trajectory rows only."""

    def __init__(self, structure: Structure, trials: Sequence[TwinTrial], groups: Mapping[str, Sequence[str]], *,
                 timestep: float = 1e-3, integrator: str = "Euler", observed: Optional[Sequence[int]] = None,
                 base=None, prior: Optional[Tuple[Sequence[float], Sequence[float]]] = None, noise_mm: float = 1.0):
        self.structure = structure
        self.trials = list(trials)
        self.groups = {k: tuple(v) for k, v in groups.items()}
        self.labels = list(self.groups)
        self.timestep, self.integrator = timestep, integrator
        self.base = base if base is not None else params_from_structure(structure)
        fixed = np.array([n.fixed for n in structure.nodes])
        self.observed = np.flatnonzero(~fixed) if observed is None else np.asarray(observed, dtype=int)
        self.evaluations = 0
        self.failed = 0
        self.prior = None if prior is None else (np.asarray(prior[0], float), np.asarray(prior[1], float))
        self.noise_mm = float(noise_mm)

    def structure_for(self, x: Sequence[float]) -> Structure:
        vals = {}
        for lab, v in zip(self.labels, np.asarray(x, dtype=float).reshape(-1)):
            for name in self.groups[lab]:
                vals[name] = float(v)
        return apply_to_structure(self.structure, self.base.with_values(vals))

    def residual(self, x: Sequence[float]) -> np.ndarray:
        self.evaluations += 1
        s = self.structure_for(x)
        out = []
        for tr in self.trials:
            try:
                P, _ = twin_rollout(s, tr.X0, tr.V0, tr.n_steps, every=tr.every, timestep=self.timestep,
                                    integrator=self.integrator, motor_angles=tr.motor_angles, bar_forces=tr.bar_forces)
                r = (P[:, self.observed] - tr.targets[:, self.observed]) * 1e3
                if not np.all(np.isfinite(r)):
                    raise FloatingPointError
            except Exception:  # unstable candidate (MuJoCo warning / NaN): a large finite residual
                self.failed += 1
                r = np.full(tr.targets[:, self.observed].shape, 1e4)
            out.append(r.reshape(-1))
        if self.prior is not None:
            out.append(self.noise_mm * (np.asarray(x, float).reshape(-1) - self.prior[0]) / self.prior[1])
        return np.concatenate(out)

    def mse(self, x: Sequence[float]) -> float:
        r = self.residual(x)
        if self.prior is not None:
            r = r[:-len(self.labels)]
        return float(np.mean(r * r))

    def values(self, x: Sequence[float]) -> Dict[str, float]:
        return {lab: float(v) for lab, v in zip(self.labels, np.asarray(x, dtype=float).reshape(-1))}


def least_squares_lbfgsb(obj: TwinObjective, x0: Sequence[float], *, max_iter: int = 30,
                         bounds: Tuple[float, float] = BOUNDS, max_time_s: Optional[float] = None) -> BaselineResult:
    """The seed's LS baseline: scipy L-BFGS-B on the trajectory MSE with finite-difference gradients."""
    from scipy.optimize import minimize
    t0 = time.perf_counter()
    hist: List[Dict[str, Any]] = []
    ev0 = obj.evaluations

    class _Timeout(Exception):
        pass

    best = {"x": np.asarray(x0, dtype=float), "f": math.inf}

    def f(x):
        v = obj.mse(x)
        if v < best["f"]:
            best["x"], best["f"] = np.array(x, dtype=float), v
        if max_time_s is not None and time.perf_counter() - t0 > max_time_s:
            raise _Timeout
        return v

    def cb(xk, *args):
        hist.append({"iteration": len(hist) + 1, "time_s": time.perf_counter() - t0, "loss": best["f"],
                     "values": obj.values(xk)})

    msg, conv = "", False
    try:
        res = minimize(f, np.asarray(x0, dtype=float), method="L-BFGS-B", bounds=[bounds] * len(obj.labels),
                       callback=cb, options={"maxiter": max_iter})
        x, msg, conv = res.x, str(res.message), bool(res.success)
    except _Timeout:
        x, msg = best["x"], "time budget reached"
    secs = time.perf_counter() - t0
    n_it = max(len(hist), 1)
    return BaselineResult("LS (L-BFGS-B)", obj.values(x), secs, len(hist), obj.evaluations - ev0, secs / n_it,
                          obj.mse(x), hist, conv, "scipy.optimize L-BFGS-B, 2-point FD gradient", msg)


def cma_es(obj: TwinObjective, x0: Sequence[float], *, sigma0: float = 2.0, tolfun: float = 1.0,
           max_iter: int = 30, bounds: Tuple[float, float] = BOUNDS, seed: int = 1,
           max_time_s: Optional[float] = None) -> BaselineResult:
    """The seed's CMA-ES baseline (``cma`` package), tolerance (``tolfun``) 1 on the MSE in mm^2.

    Searches log(x) (x0 mapped, sigma0 in log units: 2 ~ a factor e^2) within log(bounds) -- a stronger
    variant than a linear search over [0.1, 1000] from x0 = 1.
    """
    import cma
    t0 = time.perf_counter()
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    es = cma.CMAEvolutionStrategy(np.log(np.asarray(x0, dtype=float)), sigma0,
                                  {"bounds": [lo, hi], "tolfun": tolfun, "maxiter": max_iter, "verbose": -9,
                                   "seed": seed})
    hist: List[Dict[str, Any]] = []
    ev0 = obj.evaluations
    msg = ""
    while not es.stop():
        X = es.ask()
        es.tell(X, [obj.mse(np.exp(x)) for x in X])
        xb = np.exp(es.result.xbest)
        hist.append({"iteration": len(hist) + 1, "time_s": time.perf_counter() - t0, "loss": float(es.result.fbest),
                     "values": obj.values(xb)})
        if max_time_s is not None and time.perf_counter() - t0 > max_time_s:
            msg = "time budget reached"
            break
    stop = dict(es.stop())
    msg = msg or ", ".join(f"{k}={v}" for k, v in stop.items())
    x = np.exp(es.result.xbest)
    secs = time.perf_counter() - t0
    n_it = max(len(hist), 1)
    return BaselineResult("CMA-ES", obj.values(x), secs, len(hist), obj.evaluations - ev0, secs / n_it,
                          float(es.result.fbest), hist, "tolfun" in stop, "cma.CMAEvolutionStrategy (log space)", msg)


def mujoco_minimize(obj: TwinObjective, x0: Sequence[float], *, max_iter: int = 30,
                    bounds: Tuple[float, float] = BOUNDS, max_time_s: Optional[float] = None) -> BaselineResult:
    """``mujoco.minimize.least_squares`` on the trajectory residual (mm) -- the optimiser behind
    ``mujoco.sysid.optimize(optimizer="mujoco")``; the sysid wrapper is used when importable."""
    from mujoco import minimize as mjmin
    t0 = time.perf_counter()
    hist: List[Dict[str, Any]] = []
    ev0 = obj.evaluations
    n = len(obj.labels)

    def residual(x):
        x = np.asarray(x, dtype=float)
        if x.ndim == 1:
            return obj.residual(x)
        return np.stack([obj.residual(x[:, j]) for j in range(x.shape[1])], axis=1)

    def cb(trace):
        e = trace[-1]
        hist.append({"iteration": len(hist) + 1, "time_s": time.perf_counter() - t0, "loss": float(e.objective),
                     "values": obj.values(np.asarray(e.candidate).reshape(-1))})
        if max_time_s is not None and time.perf_counter() - t0 > max_time_s:
            raise StopIteration

    backend = "mujoco.minimize.least_squares (the optimiser behind mujoco.sysid.optimize's mujoco backend)"
    msg = ""
    try:
        x, trace = mjmin.least_squares(np.asarray(x0, dtype=float),
                                       residual, bounds=[np.full(n, bounds[0]), np.full(n, bounds[1])],
                                       max_iter=max_iter, verbose=0, iter_callback=cb)
        x = np.asarray(x).reshape(-1)
        conv = len(trace) < max_iter
    except StopIteration:
        x = np.asarray(list(hist[-1]["values"].values())) if hist else np.asarray(x0, float)
        conv, msg = False, "time budget reached"
    secs = time.perf_counter() - t0
    n_it = max(len(hist), 1)
    return BaselineResult("mujoco.sysid (LM)", obj.values(x), secs, len(hist), obj.evaluations - ev0, secs / n_it,
                          obj.mse(x), hist, conv, backend, msg)


def mujoco_sysid(obj: TwinObjective, x0: Sequence[float], *, max_iter: int = 30,
                 bounds: Tuple[float, float] = BOUNDS, optimizer: str = "mujoco") -> BaselineResult:
    """``mujoco.sysid`` itself: its :class:`~mujoco.sysid.Parameter` / ``ParameterDict`` (one parameter per group,
    nominal ``x0``, box ``bounds``) and :func:`mujoco.sysid.optimize` (``optimizer``: ``mujoco`` = its default
    backend, or ``scipy``), on this objective's residual: every trial is one sequence, their residuals (mm)
    concatenated, as sysid does with several sequences. sysid's own residual builder compares sensor data of a
    model whose MjSpec its modifiers edit; here the twin is regenerated from the structure file for each
    candidate instead (:meth:`TwinObjective.residual`), the same MuJoCo physics. Needs absl-py, colorama and
    tabulate (:func:`mujoco_sysid_available`)."""
    ok, why = mujoco_sysid_available()
    if not ok:
        raise RuntimeError(f"mujoco.sysid is not importable ({why}); install absl-py colorama tabulate "
                           "(requirements/lock.txt)")
    from mujoco.sysid._src.optimize import optimize
    from mujoco.sysid._src.parameter import Parameter, ParameterDict
    t0 = time.perf_counter()
    ev0 = obj.evaluations
    params = ParameterDict({lab: Parameter(lab, float(v), bounds[0], bounds[1])
                            for lab, v in zip(obj.labels, np.asarray(x0, dtype=float).reshape(-1))})

    def residual_fn(x, _params):
        # mujoco.minimize asks for several candidates at once (finite differences): x (n, k) -> (n_res, k)
        x = np.asarray(x, dtype=float)
        if x.ndim == 1:
            return [obj.residual(x)], None, None
        return [np.stack([obj.residual(x[:, j]) for j in range(x.shape[1])], axis=1)], None, None

    fitted, res = optimize(params, residual_fn, optimizer=optimizer, verbose=False, max_iters=max_iter)
    x = fitted.as_vector()
    secs = time.perf_counter() - t0
    losses = list(getattr(res, "extras", {}).get("objective", []))
    n_it = max(len(losses), 1)
    return BaselineResult(f"mujoco.sysid ({optimizer})", obj.values(x), secs, len(losses),
                          obj.evaluations - ev0, secs / n_it, obj.mse(x), [], True,
                          f"mujoco.sysid.optimize(optimizer={optimizer!r}), Parameter/ParameterDict", "")
