"""The online identifier's core (no rclpy): what the ``online_identifier`` node runs, as plain functions and
dataclasses that tests and offline replays call exactly as the node does.

* Accept or reject a fit (:func:`decide`, pure): a set with NaN, a residual jump against the recent accepted
  sets, a parameter outside its bounds (:func:`parameter_bounds`), or a fit not better than the active set on
  held-out data (:func:`held_out_improvement`) is NOT published; :class:`Decision` says why.
* Drift (:class:`DriftDetector`, pure): a warning naming the strings whose parameters moved when the residuals
  grow on a stable set.
* The sliding window of node and motor states (:class:`SlidingWindow`).
* The compute job (:func:`fit_window` -> :class:`FitResult`; runs in the node's worker, a spawned process by
  default): :func:`tensegrity_ros.ident.identify` over one window, the fit then scored against the active set on
  the held-out end of the window (:func:`held_out_mse`).
* The node's parameters as the rules and options of an update (:func:`accept_config`, :func:`update_options`),
  and the published set (:class:`ActiveSet`).
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..model import Structure
from ..param_names import RELATIVE_KINDS, STRING_KINDS, kind_of, split_name
from ..parameter_set import ParameterSet
from .data import resample_motor_angles


# =====================================================================================================
# pure decision logic (no rclpy, no torch)
# =====================================================================================================


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
    reference is the median residual of the last ``reference_sets`` accepted sets. bounds_factor: parameters of
    the relative kinds (``param_names.RELATIVE_KINDS``: stiffness, damping, mass, spool radius, control gain)
    must stay within [nominal / f, nominal x f] (damping: [0, max(nominal x f, damping_floor)]); rest_lengths
    within ``rest_length_bounds`` x nominal
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


#: the reason given when a fit does not predict held-out data better than the active set
NOT_BETTER = "not better on held-out data"


@dataclass(frozen=True)
class Decision:
    accept: bool
    reasons: Tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @property
    def routine(self) -> bool:
        """A rejection whose only reason is that the fit does not predict held-out data better than the active
        set: the steady state once the active set is good (logged as information, not as a warning)."""
        return not self.accept and len(self.reasons) == 1 and self.reasons[0].startswith(NOT_BETTER)


def parameter_bounds(name: str, nominal: float, cfg: AcceptConfig) -> Tuple[float, float]:
    """(lo, hi) allowed for parameter ``name`` with nominal value ``nominal``."""
    kind = kind_of(name)
    if kind == "damping":
        return 0.0, max(abs(nominal) * cfg.bounds_factor, cfg.damping_floor)
    if kind in RELATIVE_KINDS:
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
    from .heldout import paired_log_ratio, paired_verdict       # the held-out check's paired statistics
    n, mean, se, rms_f, rms_a = paired_log_ratio(a, f)
    rel = 1.0 - math.exp(-mean)          # < 0: the fit's typical error is higher, by -rel
    text = (f"held-out open-loop RMS {rms_f * 1e3:.3f} mm vs the active set's {rms_a * 1e3:.3f} mm over {n} windows "
            f"(mean squared error {abs(100 * rel):.1f} % {'lower' if rel >= 0 else 'higher'}, "
            f"{mean / se if se > 0 else math.inf:.1f} sigma; needs > "
            f"{cfg.margin_sigma:g} sigma and >= {100 * cfg.min_relative_improvement:g} % lower)")
    if paired_verdict(mean, se, cfg.margin_sigma, cfg.min_relative_improvement, ("better", "worse", "")) == "better":
        return True, text
    return False, f"{NOT_BETTER}: {text}"


class DriftDetector:
    """Residuals growing on a stable parameter set -> a warning naming the strings whose parameters moved.

    The *baseline* is the median residual of the first ``window`` fits after the active set last moved by
    more than ``stable_fraction`` (relative, any parameter). Drift: the median of the last ``window`` fit
    residuals exceeds ``ratio`` x baseline. Moved strings: string parameters (stiffness, damping,
    rest_length) of the latest fit that differ from the active set by more than max(moved_sigma x std,
    moved_fraction x |value|); a fit the node did not keep carries no std (its covariance is skipped,
    :func:`fit_window`), so only moved_fraction applies to it. Pure Python.
    """

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
            elem, kind = split_name(name)
            if elem not in self.strings or kind not in STRING_KINDS or name not in self._active:
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
        #: node-state samples ever appended (never decreases): a reader that saw this count knows whether the
        #: window has changed since, even when old samples were dropped or the window cleared and refilled
        self.appended = 0

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
            self.appended += 1
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
            # as tensegrity identify resamples them (a cubic spline; a NaN reading stays NaN around it: the window is
            # then refused, never repaired)
            U = resample_motor_angles(t, tm, um)
        if t[-1] - t[0] < min_span_s:
            return None
        return t, P, V, U


# =====================================================================================================
# the compute job (runs in the worker: a spawned process by default; no rclpy use)
# =====================================================================================================
@dataclass(frozen=True)
class FitResult:
    """What :func:`fit_window` returns: one fit as plain data (it crosses the worker's pipe).

    ok / error: whether identify() succeeded (why not); values / std_devs / identifiability by parameter name
    (``values``: only the kinds taken, ``kinds_taken``); residual_m: the fit's residual over the window, m;
    converged; timings (s) by stage; notes; held-out scores: ``holdout_mse`` / ``active_holdout_mse`` (W,)
    per-window mean squared errors of the fit and of the active set, m^2, and ``window_rms_m`` /
    ``active_window_rms_m`` their RMS, m; model_check / model_check_line: the fit's model check (ident.mismatch);
    seconds: the job's wall time."""

    ok: bool
    error: str = ""
    values: Dict[str, float] = field(default_factory=dict)
    std_devs: Dict[str, float] = field(default_factory=dict)
    identifiability: Dict[str, float] = field(default_factory=dict)
    residual_m: float = math.nan
    converged: bool = False
    timings: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    window_rms_m: float = math.nan
    active_window_rms_m: float = math.nan
    holdout_mse: Tuple[float, ...] = ()
    active_holdout_mse: Tuple[float, ...] = ()
    kinds_taken: Tuple[str, ...] = ()
    model_check: str = ""
    model_check_line: str = ""
    seconds: float = math.nan

    def candidate(self) -> Candidate:
        """The fit as :func:`decide` judges it."""
        return Candidate(values=self.values, std_devs=self.std_devs, identifiability=self.identifiability,
                         residual_m=self.residual_m, ok=self.ok, error=self.error, converged=self.converged,
                         window_rms_m=self.window_rms_m, active_window_rms_m=self.active_window_rms_m,
                         holdout_mse=tuple(self.holdout_mse), active_holdout_mse=tuple(self.active_holdout_mse),
                         model_check=self.model_check, model_check_line=self.model_check_line)


#: the order in which a fit's kinds are taken (held-out scoring, :func:`fit_window`): the best seen in short
#: windows first; damping, weakly seen there, last, and only if the held-out data support it over the rest
NESTED_KINDS = ("stiffness", "rest_length", "mass", "spool_radius", "zero_offset", "damping",
                "control_force_scalar")


def fit_window(structure: Structure, times, positions, valid, motors, prior_values: Mapping[str, float],
               stages: Tuple[str, ...], options, holdout_s: float = 2.0, holdout_window_s: float = 0.25,
               holdout_windows: int = 8, accept: AcceptConfig = AcceptConfig()) -> FitResult:
    """identify() over one window, returned as plain data (:class:`FitResult`, picklable): ok, error, values,
    std_devs, identifiability, residual_m, converged, timings, notes, and the held-out scores.

    The last ``holdout_s`` of the window are held out: the fit sees only what comes before, and the fit and
    the active set (``prior_values``) are then both predicted open loop over ``holdout_windows`` windows of
    ``holdout_window_s`` in the held-out part, from the same measured starts (``holdout_mse``,
    ``active_holdout_mse``: per-window mean squared errors, m^2; ``window_rms_m``, ``active_window_rms_m``:
    their RMS). :func:`decide` accepts the fit only if it is better there by a margin the data support
    (``accept``: the node's acceptance rules, :func:`accept_config`). The scoring runs right after stage 2,
    and the covariance and model check only for a fit that is better there (the others carry no std_devs).

    Nested: the fit's kinds are taken in the order :data:`NESTED_KINDS`, each group only if the held-out
    prediction with it is significantly better than without it (the others stay at the active set's values);
    ``values`` then holds what was taken, ``kinds_taken`` which kinds, and ``notes`` what was left and why. A
    kind the short windows barely see (damping) thus keeps the active value instead of wandering with noise."""
    from ..engine import params_from_structure
    from . import pipeline
    from .data import make_dataset

    t0 = time.perf_counter()
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
        kinds = [k for k in NESTED_KINDS if k in tuple(options.regression.estimate)]
        scored: Dict[str, object] = {}

        def score(values: Dict[str, float]) -> Dict[str, object]:
            """The fit and the active set, open loop over the held-out windows: is the fit better?"""
            ts = time.perf_counter()
            # nested candidates: the fit's values of the first j kinds, the rest kept at the active set's
            nested = [{n: v for n, v in values.items() if kind_of(n) in kinds[:j]}
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
            return dict(fit=values, better=choice is not None, values=nested[j], why=why,
                        holdout_mse=tuple(float(x) for x in mses[j]),
                        active_holdout_mse=tuple(float(x) for x in act_mse), kinds_taken=tuple(kinds[:j + 1]),
                        seconds=time.perf_counter() - ts)

        def keep_fit(params) -> bool:
            # scored before the covariance and the model check: most online fits are not better than the
            # active set, and those steps were ~20 % of an update that is then thrown away
            scored.update(score({n: float(v) for n, v in params.named().items()}))
            return bool(scored["better"])

        res = pipeline.identify(structure, ds, stages=stages, options=options, prior=prior, keep_fit=keep_fit)
        out = {"ok": res.ok, "error": "" if res.error is None else f"{type(res.error).__name__}: {res.error}",
               "values": res.values(), "std_devs": dict(res.std_devs), "identifiability": dict(res.identifiability),
               "residual_m": float(res.residual_rms_m), "converged": bool(res.converged),
               "timings": dict(res.timings), "notes": list(res.notes),
               **({} if res.model_mismatch is None else {"model_check": res.model_mismatch.status,
                                                         "model_check_line": res.model_mismatch.line()})}
        if res.ok:
            seconds = scored.get("seconds", 0.0)
            if scored.get("fit") != out["values"]:   # changed after scoring (a prior-dominated value reset)
                scored.update(score(out["values"]))
                seconds += scored["seconds"]
            out["values"] = scored["values"]
            out["notes"] += scored["why"]
            fit_mse, act_mse = np.asarray(scored["holdout_mse"]), np.asarray(scored["active_holdout_mse"])
            out.update(holdout_mse=scored["holdout_mse"], active_holdout_mse=scored["active_holdout_mse"],
                       window_rms_m=float(np.sqrt(np.mean(fit_mse))),
                       active_window_rms_m=float(np.sqrt(np.mean(act_mse))), kinds_taken=scored["kinds_taken"])
            out["timings"]["held_out_scoring"] = seconds
        return FitResult(**out, seconds=time.perf_counter() - t0)
    except Exception as e:   # a refused window (e.g. non-finite motor angles): no set, say why
        return FitResult(ok=False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)


def held_out_mse(structure: Structure, held, param_sets, options, window_s: float = 0.25, windows: int = 8):
    """Per-window mean squared errors (W,) m^2 of each of ``param_sets`` (engine Params) predicting the dataset
    ``held`` open loop over ``windows`` windows of ``window_s``, all from the same measured window starts (so
    the figures of two sets are paired). ``options``: the update's IdentifyOptions (stage 2's derivatives, delay
    and engine; on the CPU)."""
    from .refine import RefineProblem

    prob = RefineProblem.for_prediction(structure, [held], param_sets[0], options.refine, window_s=window_s,
                                        max_windows=windows, device=None, backend=options.backend,
                                        integrator=options.integrator)
    return list(prob.window_mse(list(param_sets)))     # all sets in one engine batch


def accept_config(p: Mapping[str, object]) -> AcceptConfig:
    """The acceptance rules from the node's parameters ``p`` (a plain mapping, like :func:`update_options`)."""
    return AcceptConfig(max_residual_ratio=p["max_residual_ratio"], residual_floor_m=p["residual_floor_m"],
                        bounds_factor=p["bounds_factor"], margin_sigma=p["accept_margin_sigma"],
                        min_relative_improvement=p["accept_min_improvement"])


def update_options(p: Mapping[str, object], nominal_params, first: bool = False):
    """(stages, IdentifyOptions) of one update from the node's parameters ``p`` (a plain mapping, so tests and
    offline replays run exactly what the node runs). ``first``: no set accepted yet (the active set is the
    nominal, ~20 % off): ``first_update_iterations``, ``first_update_max_s``, ``first_update_windows`` and
    ``first_update_window_s`` instead of ``stage2_iterations``, ``max_update_s``, ``stage2_max_windows`` and
    ``stage2_window_s``. Two iterations from that far off, or a fit cut short by the 20-s budget on a shared
    CPU, left the stiffnesses at a common scale 25-35 % too high (the shape right): a set that predicts better
    than the nominal, but lies further from the truth. With four windows of 0.1 s, converged, the first set landed
    6.6-12.3 % off in 21 of 40 demo runs over stops 44-46 (nominal 14.8 %; a better set came 4-44 s later in 17 of
    them, never in 4). Replayed from two such demos' bags, the same first window with 8 windows of 0.2 s landed at
    0.97 % and 0.40 % instead of 9.03 % and 8.18 % (at twice the update's time), and on the test recording at
    0.27-0.31 % instead of 0.17-2.07 %."""
    from . import pipeline

    stages = (("regression",) if p["stage1"] or p["stage2_iterations"] == 0 else ()) + \
        (("refine",) if p["stage2_iterations"] > 0 else ())
    prior_std = {k: float(v) for k, v in zip(("stiffness", "damping", "mass", "rest_length"), p["prior_std"])
                 if v > 0}
    iterations, max_s, windows, window_s = (
        (p["first_update_iterations"], p["first_update_max_s"], p["first_update_windows"], p["first_update_window_s"])
        if first else (p["stage2_iterations"], p["max_update_s"], p["stage2_max_windows"], p["stage2_window_s"]))
    options = pipeline.IdentifyOptions.from_flat(
        estimate=tuple(p["estimate"]), window_s=window_s, max_windows=windows, max_iter=max(1, iterations),
        max_time_s=max_s, delay_s=p["delay_s"],
        noise_std_m=p["noise_std_m"] or None, device=p["device"], num_threads=p["torch_threads"],
        # the covariance costs one more Jacobian: half the windows (information scaled up) keeps updates short
        covariance_windows=max(1, windows // 2), prior_std=prior_std,
        prior_center=nominal_params,
        # no engine-step check: a refit at a shorter step after keep_fit accepted the fit on held-out windows would
        # publish a set that was not judged (offline, halving the manipulator's 0.73-ms step moved its fit 0.1 sigma)
        step_check=False,
        refine={"jacobian": p["stage2_jacobian"]}, regression={"max_samples": int(p["stage1_max_samples"])})
    return stages, options


@dataclass
class ActiveSet:
    """The published set: engine params + its ParameterSet record."""

    params: object
    record: ParameterSet
