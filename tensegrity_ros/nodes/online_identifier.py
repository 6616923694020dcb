"""``online_identifier``: keeps the model identified while the robot moves.

Subscribes ``/tensegrity/node_states`` and ``/tensegrity/motor_states`` into a sliding window (default
10 s). A timer (default 1 Hz) hands the window to a worker thread (callbacks never block; a tick while the
worker is busy is skipped and counted), which runs :func:`tensegrity_ros.ident.identify`: stage 1 (closed-form
regression) and a few stage-2 iterations (multiple shooting through the engine), warm-started from the last
good set, on the GPU when present (``device: auto``). The result goes through :func:`decide` (pure,
module level): a set with NaN, a residual jump against the recent accepted sets, or a parameter outside its
bounds is NOT published; the last good set stays active and diagnostics say why. :class:`DriftDetector`
(pure) raises a WARN naming the strings whose parameters moved when the residuals grow on a stable set.

Publishes ``/tensegrity/identified_parameters`` (IdentifiedParameters, latched: the nominal set at start,
then every accepted set) and diagnostics. Services ``~/save_parameters`` (SaveParameters: a structure YAML
with the identified values and standard deviations, via ``engine.apply_to_structure`` +
``model.dump_structure``) and ``~/load_parameters`` (LoadParameters: a structure YAML becomes the active set).
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..model import Structure, load_structure
from . import _common as C
from ._common import ParamSpec

# =====================================================================================================
# pure decision logic (no rclpy, no torch)
# =====================================================================================================
#: kinds bounded by a factor around the nominal value
SCALE_KINDS = ("stiffness", "damping", "mass", "spool_radius", "control_force_scalar")


@dataclass(frozen=True)
class Candidate:
    """One fit as plain numbers: values / std_devs by parameter name (``<element>.<kind>``), the fit
    residual (RMS node-position error over the window, m), whether the pipeline succeeded (``error``
    says why not) and converged."""

    values: Mapping[str, float]
    std_devs: Mapping[str, float] = field(default_factory=dict)
    identifiability: Mapping[str, float] = field(default_factory=dict)
    residual_m: float = math.nan
    ok: bool = True
    error: str = ""
    converged: bool = True
    #: open-loop prediction RMS (m) of this fit and of the active (last good) set on the HELD-OUT windows: the
    #: most recent part of the sliding window, which the fit did not see
    window_rms_m: float = math.nan
    active_window_rms_m: float = math.nan
    #: per held-out window mean squared error (m^2) of the fit and of the active set (paired, same windows)
    holdout_mse: Tuple[float, ...] = ()
    active_holdout_mse: Tuple[float, ...] = ()
    #: the model check of the fit (ident.mismatch): its status and one line; a ``model_mismatch`` is rejected
    model_check: str = ""
    model_check_line: str = ""


@dataclass(frozen=True)
class AcceptConfig:
    """Acceptance rules of :func:`decide`.

    max_residual_ratio / residual_floor_m: a residual above max(ratio x reference, floor) is a jump; the
    reference is the median residual of the last ``reference_sets`` accepted sets. bounds_factor: scale
    parameters (stiffness, damping, mass, spool radius) must stay within [nominal / f, nominal x f]
    (damping: [0, max(nominal x f, damping_floor)]); rest_lengths within ``rest_length_bounds`` x nominal
    (the engine's); zero offsets within ``zero_offset_range_rad`` of nominal. require_converged: refuse a
    fit whose optimiser did not converge (off by default: a few stage-2 iterations rarely converge fully).
    margin_sigma: a fit is accepted only if it predicts the held-out windows (recent data it was not fitted
    on) better than the active set by more than ``margin_sigma`` standard errors of the paired per-window
    improvement (mean of active MSE - fit MSE over the windows, its standard error from their spread): an
    improvement the data support, not one inside the noise of a few windows; and by at least
    ``min_relative_improvement`` of the active set's held-out mean squared error (a significant but negligible
    gain is not worth a new set: measured offline, such accepts at 2.7-4.9 sigma and 11-14 % were the ones that
    moved the parameters away from the truth, while real improvements were 59-99.9 %). Without held-out windows
    (``min_holdout_windows``) nothing is accepted: a set is never published on the strength of its own fit.
    """

    max_residual_ratio: float = 3.0
    residual_floor_m: float = 2e-3
    margin_sigma: float = 3.0
    min_relative_improvement: float = 0.25
    min_holdout_windows: int = 3
    reference_sets: int = 5
    bounds_factor: float = 3.0
    damping_floor: float = 1.0
    rest_length_bounds: Tuple[float, float] = (0.5, 1.5)
    zero_offset_range_rad: float = 1.0
    require_converged: bool = False


@dataclass(frozen=True)
class Decision:
    accept: bool
    reasons: Tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def parameter_bounds(name: str, nominal: float, cfg: AcceptConfig) -> Tuple[float, float]:
    """(lo, hi) allowed for parameter ``name`` with nominal value ``nominal``."""
    kind = C.split_name(name)[1]
    if kind == "damping":
        return 0.0, max(abs(nominal) * cfg.bounds_factor, cfg.damping_floor)
    if kind in SCALE_KINDS:
        return abs(nominal) / cfg.bounds_factor, abs(nominal) * cfg.bounds_factor
    if kind == "rest_length":
        return nominal * cfg.rest_length_bounds[0], nominal * cfg.rest_length_bounds[1]
    if kind == "zero_offset":
        return nominal - cfg.zero_offset_range_rad, nominal + cfg.zero_offset_range_rad
    return -math.inf, math.inf


def decide(candidate: Candidate, nominal: Mapping[str, float], accepted_residuals: Sequence[float] = (),
           cfg: AcceptConfig = AcceptConfig()) -> Decision:
    """Accept or reject a fit. Reasons name the offending parameters and values.

    nominal: the model's values (for the bounds); accepted_residuals: residuals (m) of the previously
    accepted sets, oldest first (the reference for a residual jump).
    """
    reasons: List[str] = []
    if not candidate.ok:
        reasons.append(f"identification failed: {candidate.error or 'unknown error'}")
    nan = [n for n, v in candidate.values.items() if not math.isfinite(float(v))]
    if nan:
        reasons.append(f"NaN/inf in {len(nan)} value(s): {', '.join(sorted(nan)[:5])}")
    nan_sd = [n for n, v in candidate.std_devs.items() if math.isnan(float(v))]
    if nan_sd:
        reasons.append(f"NaN standard deviation(s): {', '.join(sorted(nan_sd)[:5])}")
    if not math.isfinite(candidate.residual_m):
        reasons.append("non-finite fit residual")
    out = []
    for n, v in candidate.values.items():
        if n in nominal and math.isfinite(float(v)):
            lo, hi = parameter_bounds(n, float(nominal[n]), cfg)
            if not lo <= float(v) <= hi:
                out.append(f"{n} = {float(v):.4g} outside [{lo:.4g}, {hi:.4g}]")
    if out:
        reasons.append("out of bounds: " + ", ".join(out[:5]) + (f" (+{len(out) - 5} more)" if len(out) > 5 else ""))
    ref = [r for r in list(accepted_residuals)[-cfg.reference_sets:] if math.isfinite(r)]
    if ref and math.isfinite(candidate.residual_m):
        limit = max(cfg.max_residual_ratio * float(np.median(ref)), cfg.residual_floor_m)
        if candidate.residual_m > limit:
            reasons.append(f"residual jump: {candidate.residual_m * 1e3:.2f} mm > {limit * 1e3:.2f} mm "
                           f"({cfg.max_residual_ratio:g} x the recent {float(np.median(ref)) * 1e3:.2f} mm)")
    if candidate.ok:
        better, why = held_out_improvement(candidate.holdout_mse, candidate.active_holdout_mse, cfg)
        if not better:
            reasons.append(why)
    if candidate.model_check == "model_mismatch":
        reasons.append(candidate.model_check_line)
    if cfg.require_converged and not candidate.converged:
        reasons.append("the optimiser did not converge")
    return Decision(not reasons, tuple(reasons))


def held_out_improvement(fit_mse: Sequence[float], active_mse: Sequence[float],
                         cfg: AcceptConfig = AcceptConfig()) -> Tuple[bool, str]:
    """Whether a fit predicts the held-out windows better than the active set by a margin the data support.

    fit_mse / active_mse: (W,) per-window mean squared errors (m^2), paired (same windows, same measured starts).
    The improvement of window w is the log ratio r_w = ln(active_w / fit_w) (errors of windows differ by orders
    of magnitude, their ratios much less: one violent window does not swamp the others); accepted when
    mean(r) > margin_sigma x SE(mean r) and the typical reduction 1 - exp(-mean r) is at least
    min_relative_improvement. Returns (accepted, the figures as text)."""
    a = np.asarray(active_mse, dtype=float)
    f = np.asarray(fit_mse, dtype=float)
    if a.size != f.size or a.size < cfg.min_holdout_windows:
        return False, (f"not scored on held-out data ({min(a.size, f.size)} windows, need "
                       f"{cfg.min_holdout_windows}): a set is not accepted on its own fit")
    if not (np.all(np.isfinite(f)) and np.all(np.isfinite(a)) and np.all(f > 0) and np.all(a > 0)):
        return False, "held-out prediction not finite"
    r = np.log(a) - np.log(f)
    mean = float(r.mean())
    se = float(r.std(ddof=1) / math.sqrt(r.size))
    rel = 1.0 - math.exp(-mean)
    rms_f, rms_a = math.sqrt(f.mean()) * 1e3, math.sqrt(a.mean()) * 1e3
    text = (f"held-out open-loop RMS {rms_f:.3f} mm vs the active set's {rms_a:.3f} mm over {r.size} windows "
            f"(mean squared error {100 * rel:+.1f} % lower, {mean / se if se > 0 else math.inf:.1f} sigma; needs > "
            f"{cfg.margin_sigma:g} sigma and >= {100 * cfg.min_relative_improvement:g} %)")
    if mean > cfg.margin_sigma * se and rel >= cfg.min_relative_improvement:
        return True, text
    return False, "not better on held-out data: " + text


class DriftDetector:
    """Residuals growing on a stable parameter set -> a warning naming the strings whose parameters moved.

    The *baseline* is the median residual of the first ``window`` fits after the active set last moved by
    more than ``stable_fraction`` (relative, any parameter). Drift: the median of the last ``window`` fit
    residuals exceeds ``ratio`` x baseline. Moved strings: string parameters (stiffness, damping,
    rest_length) of the latest fit that differ from the active set by more than max(moved_sigma x std,
    moved_fraction x |value|). Pure Python.
    """

    STRING_KINDS = ("stiffness", "damping", "rest_length")

    def __init__(self, string_names: Sequence[str], ratio: float = 1.5, window: int = 5,
                 stable_fraction: float = 0.02, moved_sigma: float = 3.0, moved_fraction: float = 0.05):
        self.strings = set(string_names)
        self.ratio, self.window = ratio, int(window)
        self.stable_fraction, self.moved_sigma, self.moved_fraction = stable_fraction, moved_sigma, moved_fraction
        self._active: Optional[Dict[str, float]] = None
        self._baseline: List[float] = []
        self._recent: Deque[float] = deque(maxlen=self.window)
        self.warning = ""

    @property
    def baseline(self) -> float:
        return float(np.median(self._baseline)) if len(self._baseline) >= self.window else math.nan

    def set_active(self, values: Mapping[str, float]) -> None:
        """The published set changed: restart the baseline if it moved noticeably."""
        values = {k: float(v) for k, v in values.items()}
        if self._active is not None:
            moved = any(abs(values[k] - v) > self.stable_fraction * max(abs(v), 1e-12)
                        for k, v in self._active.items() if k in values)
            if not moved:
                return
        self._active = values
        self._baseline = []
        self._recent.clear()

    def update(self, residual_m: float, fit_values: Mapping[str, float],
               fit_std: Mapping[str, float] = ()) -> Optional[str]:
        """One fit (accepted or not). Returns the warning text while drifting, else None."""
        if not math.isfinite(residual_m) or self._active is None:
            return None
        if len(self._baseline) < self.window:
            self._baseline.append(residual_m)
            return None
        self._recent.append(residual_m)
        if len(self._recent) < self.window or float(np.median(self._recent)) <= self.ratio * self.baseline:
            self.warning = ""
            return None
        fit_std = dict(fit_std)
        moved: Dict[str, List[str]] = {}
        for name, v in fit_values.items():
            elem, kind = C.split_name(name)
            if elem not in self.strings or kind not in self.STRING_KINDS or name not in self._active:
                continue
            a = self._active[name]
            sd = fit_std.get(name, 0.0)
            sd = sd if math.isfinite(sd) else 0.0
            if abs(float(v) - a) > max(self.moved_sigma * sd, self.moved_fraction * abs(a)):
                moved.setdefault(elem, []).append(f"{kind} {100.0 * (float(v) - a) / max(abs(a), 1e-12):+.0f}%")
        med = float(np.median(self._recent))
        names = ", ".join(f"{e} ({'; '.join(k)})" for e, k in sorted(moved.items())) or "none singled out"
        self.warning = (f"drift: residual {med * 1e3:.2f} mm vs {self.baseline * 1e3:.2f} mm on a stable set; "
                        f"strings whose parameters moved: {names}")
        return self.warning


# =====================================================================================================
# the sliding window (pure)
# =====================================================================================================
class SlidingWindow:
    """Node states (structure node order) and motor angles of the last ``window_s`` seconds."""

    def __init__(self, node_names: Sequence[str], actuator_names: Sequence[str], window_s: float = 10.0):
        self.node_names = tuple(node_names)
        self.actuator_names = tuple(actuator_names)
        self.window_s = float(window_s)
        self._nodes: Deque[Tuple[float, np.ndarray, np.ndarray]] = deque()
        self._motors: Deque[Tuple[float, np.ndarray]] = deque()
        self._maps: Dict[Tuple[str, ...], Tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _map(self, names: Tuple[str, ...]) -> Tuple[np.ndarray, np.ndarray]:
        m = self._maps.get(names)
        if m is None:
            idx = {n: i for i, n in enumerate(self.node_names)}
            src = np.array([i for i, n in enumerate(names) if n in idx], dtype=int)
            dst = np.array([idx[n] for n in names if n in idx], dtype=int)
            m = self._maps[names] = (src, dst)
        return m

    def add_nodes(self, t: float, names: Sequence[str], positions: np.ndarray, valid: np.ndarray) -> None:
        src, dst = self._map(tuple(names))
        P = np.full((len(self.node_names), 3), np.nan)
        V = np.zeros(len(self.node_names), dtype=bool)
        P[dst], V[dst] = positions[src], valid[src]
        with self._lock:
            if self._nodes and t <= self._nodes[-1][0]:
                return      # duplicate / out of order
            self._nodes.append((float(t), P, V))
            while self._nodes and t - self._nodes[0][0] > self.window_s:
                self._nodes.popleft()

    def add_motors(self, t: float, names: Sequence[str], angles: np.ndarray) -> None:
        a = np.full(len(self.actuator_names), np.nan)
        for n, v in zip(names, angles):
            if n in self.actuator_names:
                a[self.actuator_names.index(n)] = v
        with self._lock:
            if self._motors and t <= self._motors[-1][0]:
                return
            self._motors.append((float(t), a))
            while self._motors and t - self._motors[0][0] > self.window_s + 1.0:
                self._motors.popleft()

    def span(self) -> float:
        with self._lock:
            return self._nodes[-1][0] - self._nodes[0][0] if len(self._nodes) > 1 else 0.0

    def snapshot(self, min_span_s: float = 1.0):
        """(times (T,), positions (T, N, 3), valid (T, N), motor angles (T, A) or None) over the part of the
        window the motor states cover (motor angles interpolated at the node-state stamps; NaN next to a NaN
        reading); None when shorter than ``min_span_s``."""
        with self._lock:
            nodes, motors = list(self._nodes), list(self._motors)
        if len(nodes) < 3:
            return None
        t = np.array([x[0] for x in nodes])
        P = np.stack([x[1] for x in nodes])
        V = np.stack([x[2] for x in nodes])
        U = None
        if self.actuator_names:
            if len(motors) < 2:
                return None
            tm = np.array([x[0] for x in motors])
            um = np.stack([x[1] for x in motors])
            keep = (t >= tm[0]) & (t <= tm[-1] + 0.05)
            t, P, V = t[keep], P[keep], V[keep]
            if t.size < 3:
                return None
            # linear interpolation; a NaN reading stays NaN around it (the window is then refused, never
            # repaired)
            U = np.stack([np.interp(t, tm, um[:, j]) for j in range(um.shape[1])], axis=1)
        if t[-1] - t[0] < min_span_s:
            return None
        return t, P, V, U


# =====================================================================================================
# the compute job (runs in the worker: a spawned process by default; no rclpy use)
# =====================================================================================================
#: the order in which a fit's kinds are taken (held-out scoring, :func:`fit_window`): the best seen in short
#: windows first; damping, weakly seen there, last, and only if the held-out data support it over the rest
NESTED_KINDS = ("stiffness", "rest_length", "mass", "spool_radius", "zero_offset", "damping",
                "control_force_scalar")


def fit_window(structure: Structure, times, positions, valid, motors, prior_values: Mapping[str, float],
               stages: Tuple[str, ...], options, holdout_s: float = 2.0, holdout_window_s: float = 0.25,
               holdout_windows: int = 8, accept: AcceptConfig = AcceptConfig()) -> Dict[str, object]:
    """identify() over one window, returned as plain data (picklable): ok, error, values, std_devs,
    identifiability, residual_m, converged, timings, notes, and the held-out scores.

    The last ``holdout_s`` of the window are held out: the fit sees only what comes before, and the fit and
    the active set (``prior_values``) are then both predicted open loop over ``holdout_windows`` windows of
    ``holdout_window_s`` in the held-out part, from the same measured starts (``holdout_mse``,
    ``active_holdout_mse``: per-window mean squared errors, m^2; ``window_rms_m``, ``active_window_rms_m``:
    their RMS). :func:`decide` accepts the fit only if it is better there by a margin the data support
    (``accept``: the node's acceptance rules, :func:`accept_config`).

    Nested: the fit's kinds are taken in the order :data:`NESTED_KINDS`, each group only if the held-out
    prediction with it is significantly better than without it (the others stay at the active set's values);
    ``values`` then holds what was taken, ``kinds_taken`` which kinds, and ``notes`` what was left and why. A
    kind the short windows barely see (damping) thus keeps the active value instead of wandering with noise."""
    from ..engine import params_from_structure
    from ..ident import pipeline
    from ..ident.data import make_dataset

    t0 = time.perf_counter()
    empty = {"values": {}, "std_devs": {}, "identifiability": {}, "residual_m": math.nan, "converged": False,
             "timings": {}, "notes": [], "window_rms_m": math.nan, "active_window_rms_m": math.nan,
             "holdout_mse": (), "active_holdout_mse": (), "kinds_taken": ()}
    try:
        times = np.asarray(times, dtype=float)
        cut = times[-1] - holdout_s
        fit_sel, hold_sel = times <= cut, times > cut
        if fit_sel.sum() < 3 or hold_sel.sum() < 3:
            raise ValueError(f"a {times[-1] - times[0]:.2f}-s window cannot hold out {holdout_s:g} s")
        names = dict(node_names=structure.node_names, actuator_names=tuple(a.name for a in structure.actuators))

        def part(sel, name):
            return make_dataset(times[sel], np.asarray(positions)[sel], np.asarray(valid)[sel],
                                None if motors is None else np.asarray(motors)[sel], name=name, **names)

        ds, held = part(fit_sel, "online window"), part(hold_sel, "held-out part")
        prior = params_from_structure(structure).with_values(dict(prior_values))
        res = pipeline.identify(structure, ds, stages=stages, options=options, prior=prior)
        out = {**empty, "ok": res.ok, "error": "" if res.error is None else f"{type(res.error).__name__}: {res.error}",
               "values": res.values(), "std_devs": dict(res.std_devs), "identifiability": dict(res.identifiability),
               "residual_m": float(res.residual_rms_m), "converged": bool(res.converged),
               "timings": dict(res.timings), "notes": list(res.notes),
               **({} if res.model_mismatch is None else {"model_check": res.model_mismatch.status,
                                                         "model_check_line": res.model_mismatch.line()})}
        if res.ok:   # the fit and the active set, open loop over the held-out windows: is the fit better?
            ts = time.perf_counter()
            values = res.values()
            kinds = [k for k in NESTED_KINDS if k in tuple(options.estimate)]
            # nested candidates: the fit's values of the first j kinds, the rest kept at the active set's
            nested = [{n: v for n, v in values.items() if n.rpartition(".")[2] in kinds[:j]}
                      for j in range(1, len(kinds) + 1)] or [values]
            sets = [prior.with_values(c) for c in nested]
            *mses, act_mse = held_out_mse(structure, held, (*sets, prior), options, holdout_window_s, holdout_windows)
            choice, why = None, []
            for j, mse in enumerate(mses):      # the smallest change the held-out data support, then grow it
                ref = act_mse if choice is None else mses[choice]
                better, _ = held_out_improvement(mse, ref, accept)
                if better:
                    choice = j
                elif choice is not None:
                    why.append(f"{', '.join(kinds[j:])} kept at the active set's values (not better on held-out "
                               "data than without them)")
                    break
            j = len(mses) - 1 if choice is None else choice
            out["values"] = nested[j]
            fit_mse = mses[j]
            out["notes"] += why
            out.update(holdout_mse=tuple(float(x) for x in fit_mse),
                       active_holdout_mse=tuple(float(x) for x in act_mse),
                       window_rms_m=float(np.sqrt(np.mean(fit_mse))),
                       active_window_rms_m=float(np.sqrt(np.mean(act_mse))), kinds_taken=tuple(kinds[:j + 1]))
            out["timings"]["held_out_scoring"] = time.perf_counter() - ts
        out["seconds"] = time.perf_counter() - t0
        return out
    except Exception as e:   # a refused window (e.g. non-finite motor angles): no set, say why
        return {**empty, "ok": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}


def held_out_mse(structure: Structure, held, param_sets, options, window_s: float = 0.25, windows: int = 8):
    """Per-window mean squared errors (W,) m^2 of each of ``param_sets`` (engine Params) predicting the dataset
    ``held`` open loop over ``windows`` windows of ``window_s``, all from the same measured window starts (so
    the figures of two sets are paired). ``options``: the update's IdentifyOptions (derivatives, delay, engine)."""
    from ..ident.refine import RefineOptions, RefineProblem

    prob = RefineProblem(structure, [held], param_sets[0], RefineOptions(
        kinds=(), window_s=window_s, max_windows=windows, optimize_initial_states=False,
        derivative_method=options.derivative_method, smooth_window_s=options.smooth_window_s,
        delay_s=options.delay_s), backend=options.backend, integrator=options.integrator)
    return [prob.window_mse(p) for p in param_sets]


def accept_config(p: Mapping[str, object]) -> AcceptConfig:
    """The acceptance rules from the node's parameters ``p`` (a plain mapping, like :func:`update_options`)."""
    return AcceptConfig(max_residual_ratio=p["max_residual_ratio"], residual_floor_m=p["residual_floor_m"],
                        bounds_factor=p["bounds_factor"], margin_sigma=p["accept_margin_sigma"],
                        min_relative_improvement=p["accept_min_improvement"])


def update_options(p: Mapping[str, object], nominal_params, first: bool = False):
    """(stages, IdentifyOptions) of one update from the node's parameters ``p`` (a plain mapping, so tests and
    offline replays run exactly what the node runs). ``first``: no set accepted yet (the active set is the
    nominal, ~20 % off): ``first_update_iterations`` and ``first_update_max_s`` instead of ``stage2_iterations``
    and ``max_update_s``. Two iterations from that far off, or a fit cut short by the 20-s budget on a shared
    CPU, left the stiffnesses at a common scale 25-35 % too high (the shape right): a set that predicts better
    than the nominal, but lies further from the truth."""
    from ..ident import pipeline

    stages = (("regression",) if p["stage1"] or p["stage2_iterations"] == 0 else ()) + \
        (("refine",) if p["stage2_iterations"] > 0 else ())
    prior_std = {k: float(v) for k, v in zip(("stiffness", "damping", "mass", "rest_length"), p["prior_std"])
                 if v > 0}
    options = pipeline.IdentifyOptions(
        estimate=tuple(p["estimate"]), window_s=p["stage2_window_s"], max_windows=p["stage2_max_windows"],
        max_iter=max(1, p["first_update_iterations"] if first else p["stage2_iterations"]),
        max_time_s=p["first_update_max_s"] if first else p["max_update_s"], delay_s=p["delay_s"],
        noise_std_m=p["noise_std_m"] or None, device=p["device"], num_threads=p["torch_threads"],
        # the covariance costs one more Jacobian: half the windows (information scaled up) keeps updates short
        covariance_windows=max(1, p["stage2_max_windows"] // 2), prior_std=prior_std,
        prior_center=nominal_params,
        refine={"jacobian": p["stage2_jacobian"]}, regression={"max_samples": int(p["stage1_max_samples"])})
    return stages, options


# =====================================================================================================
# the node
# =====================================================================================================
PARAMS = (
    ParamSpec("model_file", "", "nominal structure YAML (the start values and the bounds)", check=C.required_file,
              read_only=True),
    ParamSpec("window_s", 10.0, "sliding window length [s]", range=(0.5, 600.0)),
    ParamSpec("update_period_s", 1.0, "re-identification period [s] (skipped while the worker is busy)",
              range=(0.05, 3600.0), read_only=True),
    ParamSpec("min_window_s", 3.0, "identify only once the window spans this long [s]", range=(0.1, 600.0)),
    ParamSpec("estimate", ["stiffness"], "kinds identified (stage 1 and stage 2); with mass, the "
              "scale is anchored on the nominal total mass; damping: see config/nodes/online_identifier.yaml",
              read_only=True, check=lambda v: None if set(v) <= {"mass", "stiffness", "damping", "rest_length"}
              and v else "subset of mass, stiffness, damping, rest_length"),
    ParamSpec("stage1", True, "run the closed-form stage 1 first (stage 2 then starts from whichever of stage 1 "
              "and the active set predicts the window better: stage 1 is biased by marker noise on stiff "
              "strings)", read_only=True),
    ParamSpec("stage1_max_samples", 300, "samples of the window used by stage 1 (random subset; bounds its time)",
              range=(10, 1000000)),
    ParamSpec("stage2_iterations", 2, "stage-2 (Levenberg-Marquardt) iterations per update; 0 = stage 1 only",
              range=(0, 1000)),
    ParamSpec("first_update_iterations", 8, "stage-2 iterations of the updates before the first set is accepted "
              "(from the nominal, far off: converge further before the held-out test)", range=(1, 1000)),
    ParamSpec("first_update_max_s", 90.0, "wall-time budget of stage 2 until the first set is accepted [s]",
              range=(0.1, 3600.0)),
    ParamSpec("stage2_window_s", 0.1, "stage-2 multiple-shooting window [s] (short windows keep the problem "
              "nearly linear from a 20 %-off start)", range=(0.01, 10.0)),
    ParamSpec("stage2_max_windows", 4, "stage-2 windows per update (spread over the sliding window)",
              range=(1, 1000)),
    ParamSpec("stage2_jacobian", "auto", "stage-2 Jacobian: auto (tangent where the engine has a tangent-linear "
              "model, else central) | tangent (exact, one rollout) | forward | central (finite differences in one "
              "batched rollout) | forward_ad (dual numbers)",
              choices=("auto", "tangent", "forward", "central", "forward_ad")),
    ParamSpec("prior_std", [0.3, 0.2, 0.2, 0.003], "stage-2 Gaussian prior around the NOMINAL model (each update "
              "starts from the active set), per kind: stiffness, damping, mass (relative), rest length [m]; "
              "0 = none. Damping is weakly seen in short windows: the prior keeps it near the nominal value "
              "instead of letting it random-walk from update to update",
              check=lambda v: None if len(v) == 4 and all(x >= 0 for x in v) else "4 values >= 0"),
    ParamSpec("max_update_s", 20.0, "wall-time budget of stage 2 per update [s]", range=(0.1, 3600.0)),
    ParamSpec("max_duty", 0.8, "largest share of the time the worker computes (after an update of T s it rests "
              "T (1/duty - 1) s)", range=(0.01, 1.0)),
    ParamSpec("delay_s", 0.0, "motor-to-mocap delay [s]", range=(0.0, 1.0)),
    ParamSpec("noise_std_m", 3e-4, "marker noise of the mocap system [m]: weighs the data against prior_std "
              "(0 = 1 mm)", range=(0.0, 0.1)),
    ParamSpec("device", "auto", "stage-2 device: auto (cuda when present) | cpu | cuda",
              choices=("auto", "cpu", "cuda"), read_only=True),
    ParamSpec("torch_threads", 1, "torch intra-op threads during an update", range=(1, 256), read_only=True),
    ParamSpec("worker", "process", "where updates run: process (a spawned child: never holds the callbacks' "
              "GIL) | thread", choices=C.WORKER_KINDS, read_only=True),
    ParamSpec("worker_nice", 5, "niceness of the worker process (background work)", range=(0, 19),
              read_only=True),
    ParamSpec("holdout_s", 2.0, "the most recent part of the window held out of each fit, to score the fit against "
              "the active set on data it did not see [s]", range=(0.2, 60.0)),
    ParamSpec("holdout_window_s", 0.25, "open-loop windows of the held-out scoring [s]", range=(0.02, 10.0)),
    ParamSpec("holdout_windows", 8, "held-out windows per update (at least 3)", range=(3, 1000)),
    ParamSpec("accept_margin_sigma", 3.0, "accept a fit only if it predicts the held-out windows better than the "
              "active set by more than this many standard errors of the paired improvement", range=(0.0, 100.0)),
    ParamSpec("accept_min_improvement", 0.25, "... and by at least this fraction of the active set's held-out mean "
              "squared error", range=(0.0, 1.0)),
    ParamSpec("max_residual_ratio", 3.0, "reject a fit whose residual exceeds this x the recent accepted ones",
              range=(1.0, 1000.0)),
    ParamSpec("residual_floor_m", 2e-3, "residuals below this are never a jump [m]", range=(0.0, 1.0)),
    ParamSpec("bounds_factor", 3.0, "scale parameters must stay within nominal / f .. nominal x f",
              range=(1.01, 1000.0)),
    ParamSpec("drift_ratio", 1.5, "drift warning when residuals grow by this factor on a stable set",
              range=(1.0, 1000.0)),
    ParamSpec("drift_window", 5, "fits per drift baseline / recent median", range=(1, 1000)),
    ParamSpec("save_dir", "", "default folder of ~/save_parameters ('' = build/identified)", read_only=True),
    ParamSpec("publish_nominal", True, "publish the nominal set at start (latched)", read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)


@dataclass
class ActiveSet:
    """The published set: engine params + its ParameterSet record."""

    params: object
    record: C.ParameterSet


class OnlineIdentifierNode(C.GraphNode):
    DEFAULT_NAME = "online_identifier"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates
        from tensegrity_ros.srv import LoadParameters, SaveParameters
        from ..engine import params_from_structure

        p = self.p
        self.structure: Structure = load_structure(p["model_file"])
        self.nominal_params = params_from_structure(self.structure)
        self.nominal = {n: float(v) for n, v in self.nominal_params.named().items()}
        self.window = SlidingWindow(self.structure.node_names, [a.name for a in self.structure.actuators],
                                    p["window_s"])
        self.drift = DriftDetector([s.name for s in self.structure.strings], p["drift_ratio"], p["drift_window"])
        self._lock = threading.Lock()
        self._counter = 0
        self.active = ActiveSet(self.nominal_params, self._record(self.nominal_params, {}, {}, math.nan, (0.0, 0.0),
                                                                  False, "nominal (not identified yet)", "nominal"))
        self.accepted_residuals: List[float] = []
        self.seq = C.SequenceMonitor()
        self.update_time = C.RollingStats(500)
        self.update_ends: Deque[float] = deque(maxlen=2000)   # monotonic s at the end of each finished update
        self.stats = {"updates": 0, "accepted": 0, "rejected": 0, "skipped_busy": 0, "skipped_duty": 0,
                      "skipped_short": 0}
        self._last_update_s, self._last_update_end = 0.0, -math.inf
        self.last_decision: Optional[Decision] = None
        self.last_candidate: Optional[Candidate] = None
        self.last_window = (0.0, 0.0)
        self.last_samples = 0
        self.last_error = ""
        self.last_timings: Dict[str, float] = {}
        self.history: List[Tuple[float, str, Dict[str, float], float, bool]] = []   # (t, id, values, residual, accepted)
        self._pool = C.make_worker(p["worker"], C.worker_init,
                                   (p["torch_threads"], p["worker_nice"] if p["worker"] == "process" else 0))
        self.worker_pid = self._pool.submit(C.worker_pid).result()   # start it (imports) before data flows
        # the update in flight: a daemon thread that waits on the worker (never blocks the interpreter's exit;
        # the worker's future always settles, see tensegrity_ros.workers)
        self._updating: Optional[threading.Thread] = None
        self._closing = False

        self.pub = self.counting_publisher(IdentifiedParameters, C.TOPICS["identified_parameters"], C.LATCHED_QOS)
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._on_node_states, C.STREAM_QOS, raw=True)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._on_motor_states, C.STREAM_QOS, raw=True)
        self.create_service(SaveParameters, "~/save_parameters", self._on_save)
        self.create_service(LoadParameters, "~/load_parameters", self._on_load)
        self.timer = self.every(p["update_period_s"], self._on_timer)
        self.diag_timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        if p["publish_nominal"]:
            self.pub.publish(C.parameter_set_to_msg(self.active.record))

    # ---- parameters at run time --------------------------------------------------------------------------
    def on_parameter_change(self, name, value):
        if name == "window_s":
            self.window.window_s = float(value)
        return None

    def accept_config(self) -> AcceptConfig:
        return accept_config(self.p)

    # ---- inputs ---------------------------------------------------------------------------------------
    def _on_node_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["node_states"], info)
        r = C.node_states_from_cdr(data)
        self.window.add_nodes(r.stamp, r.names, r.positions, r.valid)

    def _on_motor_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["motor_states"], info)
        r = C.joint_state_from_cdr(data)
        self.window.add_motors(r.stamp, r.names, r.position)

    # ---- updates ----------------------------------------------------------------------------------------
    def _on_timer(self) -> None:
        if self._updating is not None and self._updating.is_alive():
            self.stats["skipped_busy"] += 1
            return
        # duty cycle: after an update that took T, rest T (1/duty - 1) so the worker leaves CPU to the rest
        rest = self._last_update_s * (1.0 / self.p["max_duty"] - 1.0)
        if time.monotonic() - self._last_update_end < rest:
            self.stats["skipped_duty"] += 1
            return
        snap = self.window.snapshot(self.p["min_window_s"])
        if snap is None:
            self.stats["skipped_short"] += 1
            return
        if self._closing:
            return
        self._updating = threading.Thread(target=self._update, args=(snap,), name="online-identifier-update",
                                          daemon=True)
        self._updating.start()

    def run_update(self, times, positions, valid, motors, timeout: Optional[float] = None):
        """One identification over the given window, in the worker; returns (candidate, params or None)."""
        fut = self._submit(times, positions, valid, motors)
        return self._collect(fut.result(timeout=timeout))

    def _submit(self, times, positions, valid, motors) -> Future:
        stages, options = update_options(self.p, self.nominal_params, first=self.stats["accepted"] == 0)
        with self._lock:
            prior = {n: float(v) for n, v in self.active.params.named().items()}
        p = self.p
        return self._pool.submit(fit_window, self.structure, times, positions, valid, motors, prior, stages,
                                 options, p["holdout_s"], p["holdout_window_s"], p["holdout_windows"],
                                 accept_config(p))

    def _collect(self, out: Mapping[str, object]):
        cand = Candidate(values=out["values"], std_devs=out["std_devs"], identifiability=out["identifiability"],
                         residual_m=out["residual_m"], ok=out["ok"], error=out["error"], converged=out["converged"],
                         window_rms_m=out["window_rms_m"], active_window_rms_m=out["active_window_rms_m"],
                         holdout_mse=tuple(out.get("holdout_mse", ())),
                         active_holdout_mse=tuple(out.get("active_holdout_mse", ())),
                         model_check=out.get("model_check", ""), model_check_line=out.get("model_check_line", ""))
        self.last_timings = dict(out.get("timings", {}))
        params = None
        if out["values"]:
            try:
                params = self.nominal_params.with_values(out["values"])
            except (ValueError, RuntimeError) as e:
                cand = Candidate({}, ok=False, error=f"{type(e).__name__}: {e}")
        return cand, params

    def _update(self, snap) -> None:
        times, P, V, U = snap
        t0 = time.perf_counter()
        try:
            out = self._submit(times, P, V, U).result()
            cand, params = self._collect(out)
        except Exception as e:   # the worker died or refused: keep the last good set
            if self._closing:    # the node is shutting the worker down mid-update: nothing to decide
                return
            cand, params = Candidate({}, ok=False, error=f"{type(e).__name__}: {e}"), None
        self._last_update_s = time.perf_counter() - t0
        self._last_update_end = time.monotonic()
        self.update_ends.append(self._last_update_end)
        self.update_time.add(self._last_update_s)
        self.consider(cand, params, (float(times[0]), float(times[-1])), len(times))

    def consider(self, cand: Candidate, params, window: Tuple[float, float], samples: int = 0) -> Decision:
        """Decide on a fit, publish it if accepted, update drift and diagnostics state."""
        with self._lock:
            dec = decide(cand, self.nominal, self.accepted_residuals, self.accept_config())
            self.stats["updates"] += 1
            self.last_decision, self.last_candidate = dec, cand
            self.last_window, self.last_samples = window, samples
            if dec.accept:
                self._counter += 1
                set_id = f"{self.get_name()}-{self._counter}"
                rec = self._record(params, cand.std_devs, cand.identifiability, cand.residual_m, window, cand.converged,
                                   "; ".join(x for x in ("accepted", cand.model_check_line) if x), set_id)
                self.active = ActiveSet(params, rec)
                self.accepted_residuals.append(cand.residual_m)
                self.stats["accepted"] += 1
                self.drift.set_active(rec.as_dict())
            else:
                self.stats["rejected"] += 1
                self.last_error = dec.reason
            self.history.append((window[1], self.active.record.set_id, dict(cand.values), cand.residual_m, dec.accept))
            if len(self.history) > 10000:
                del self.history[:1000]
        if dec.accept:
            self.pub.publish(C.parameter_set_to_msg(self.active.record))
            _, figures = held_out_improvement(cand.holdout_mse, cand.active_holdout_mse, self.accept_config())
            self.get_logger().info(f"accepted {self.active.record.set_id}: {figures}")
        else:
            self.get_logger().warn(f"fit rejected, keeping {self.active.record.set_id}: {dec.reason}",
                                   throttle_duration_sec=5.0)
        if cand.values:
            self.drift.update(cand.residual_m, cand.values, cand.std_devs)
        return dec

    def _record(self, params, std: Mapping[str, float], ident: Optional[Mapping[str, float]], residual: float,
                window, converged: bool, status: str, set_id: str) -> C.ParameterSet:
        named = {n: float(v) for n, v in params.named().items()}
        names = tuple(named)
        sd = np.array([float(std.get(n, math.nan)) for n in names])
        idf = np.array([float((ident or {}).get(n, 0.0)) for n in names])
        return C.ParameterSet(set_id, names, np.array([named[n] for n in names]), sd, idf, float(residual),
                              (float(window[0]), float(window[1])), bool(converged), status, self.now_s())

    # ---- services -----------------------------------------------------------------------------------------
    def save(self, path: str = "") -> str:
        """Write the active set as a structure YAML (values + finite std devs); returns the absolute path."""
        from ..engine import apply_to_structure
        from ..model import dump_structure

        with self._lock:
            active = self.active
        if not path:
            folder = self.p["save_dir"] or os.path.join("build", "identified")
            path = os.path.join(folder, f"{self.structure.name}_{active.record.set_id}.yaml")
        path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        std = {n: float(v) for n, v in zip(active.record.names, active.record.std_devs) if math.isfinite(v)}
        s = apply_to_structure(self.structure, active.params, std)
        dump_structure(s, path, header=f"identified online by {self.get_name()}: set {active.record.set_id}, "
                                       f"residual {active.record.fit_residual * 1e3:.3f} mm, window "
                                       f"{active.record.window[0]:.3f}..{active.record.window[1]:.3f} s")
        return path

    def load(self, path: str) -> str:
        """Make the parameters of a structure YAML the active set (published); returns its set id."""
        from ..engine import params_from_structure

        s = load_structure(path)
        if [x.name for x in s.strings] != [x.name for x in self.structure.strings] or \
                [x.name for x in s.bars] != [x.name for x in self.structure.bars] or \
                [x.name for x in s.actuators] != [x.name for x in self.structure.actuators]:
            raise ValueError(f"{path}: its strings/bars/actuators differ from {self.structure.name!r}")
        params = params_from_structure(s)
        std = dict(s.std_devs)
        with self._lock:
            self._counter += 1
            set_id = f"loaded-{self._counter}"
            rec = self._record(params, std, None, math.nan, (0.0, 0.0), True, f"loaded from {path}", set_id)
            self.active = ActiveSet(params, rec)
            self.accepted_residuals.clear()
            self.drift.set_active(rec.as_dict())
        self.pub.publish(C.parameter_set_to_msg(rec))
        return set_id

    def _on_save(self, request, response):
        try:
            response.path_written = self.save(request.path)
            response.success, response.message = True, f"wrote {response.path_written}"
        except (OSError, ValueError) as e:
            response.success, response.message, response.path_written = False, f"{type(e).__name__}: {e}", ""
        return response

    def _on_load(self, request, response):
        try:
            response.parameter_set_id = self.load(request.path)
            response.success, response.message = True, f"active set {response.parameter_set_id} from {request.path}"
        except (OSError, ValueError) as e:
            response.success, response.message, response.parameter_set_id = False, f"{type(e).__name__}: {e}", ""
        return response

    # ---- diagnostics -------------------------------------------------------------------------------------
    def _diagnostics(self) -> None:
        rec = self.active.record
        vals: Dict[str, object] = dict(self.stats)
        vals.update({"active_set": rec.set_id, "active_residual_mm": rec.fit_residual * 1e3,
                     "window_span_s": self.window.span(), "last_window_samples": self.last_samples,
                     "input_dropped": self.seq.total_dropped, "device": self.p["device"]})
        vals.update(self.update_time.summary(1.0, "update_s_"))
        if self.last_candidate is not None:
            vals["last_fit_residual_mm"] = self.last_candidate.residual_m * 1e3
            vals["last_fit_open_loop_rms_mm"] = self.last_candidate.window_rms_m * 1e3
            vals["active_open_loop_rms_mm"] = self.last_candidate.active_window_rms_m * 1e3
        for k, v in self.last_timings.items():
            vals[f"last_{k}_s"] = v
        level, message = "ok", f"active {rec.set_id}"
        if self.last_decision is not None and not self.last_decision.accept:
            level, message = "warn", f"last fit rejected, keeping {rec.set_id}: {self.last_decision.reason}"
        if self.drift.warning:
            level, message = "warn", self.drift.warning
            vals["drift"] = self.drift.warning
        if self.stats["updates"] == 0:
            level, message = "ok", f"collecting data ({self.window.span():.1f} s of {self.p['min_window_s']:g} s)"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: online identifier", level, message, vals,
                                                self.structure.name)])

    def update_period_p50(self, run_s: float) -> float:
        """Median time (s) between finished updates; ``run_s`` (the run's length) when fewer than two finished:
        an identifier that never updates has an update period of at least the whole run."""
        ends = np.asarray(self.update_ends, dtype=float)
        return float(np.median(np.diff(ends))) if ends.size >= 2 else float(run_s)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the running update (if any) has finished (tests, shutdown)."""
        t = self._updating
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def destroy_node(self):
        self._closing = True
        C.stop_worker(self._pool)      # settles the update's future: its thread ends
        t = self._updating
        if t is not None and t is not threading.current_thread():
            t.join(1.0)
        return super().destroy_node()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(OnlineIdentifierNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
