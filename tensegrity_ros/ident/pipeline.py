"""The single identification entry point: screening, stage 1 (regression), stage 2 (refinement), covariance.

    from tensegrity_ros.ident import identify, IdentifyOptions
    res = identify(structure, dataset, stages=("regression", "refine"), options=IdentifyOptions(...))
    if res.ok: use(res.params, res.std_devs)       # else keep the last good set (res.error says why)

Used by ``tensegrity identify`` (bags), the online identifier node (sliding windows, warm start from the
last good params via ``prior=``, ``device="cuda"`` when present) and the tests. Never raises on bad data
unless ``raise_errors``: a poisoned window gives ``ok=False`` with a typed ``error``
(:mod:`tensegrity_ros.ident.errors`) and the prior params, never a NaN result.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..engine import Params, build_topology, params_from_structure
from ..engine._common import torch_threads
from ..model import Structure
from ..param_names import GAUGE_KINDS, join_name, kind_of
from .data import Dataset, screen_dataset
from .errors import DataError, DivergenceError, IdentificationError, NotEnoughDataError
from .heldout import HeldOutCheck, compare_on_held_out, prior_dominated, reserve_held_out
from .jackknife import DEFAULT_ITERATIONS as JACKKNIFE_ITERATIONS, Jackknife, widen as jackknife_widen, window_jackknife
from .lawcheck import LawCheck, check_string_law, widen
from .mismatch import MismatchOptions, ModelMismatch, check_model
from .refine import RefineOptions, RefineProblem, RefineResult, refine, without_windows
from .regression import RegressionOptions, RegressionResult, regress
from .stepcheck import DEFAULT_HALVINGS as DEFAULT_STEP_HALVINGS
from .stepcheck import DEFAULT_THRESHOLD_SIGMA as DEFAULT_STEP_THRESHOLD_SIGMA
from .stepcheck import StepCheck, halving_change, largest_shift

__all__ = ["IdentifyOptions", "IdentificationResult", "identify", "STAGES", "structure_prior_std", "rung_windows"]

STAGES = ("regression", "refine")

#: ``IdentifyOptions.longer_windows`` for a 10-20 s recording like the manipulator bench's: after 0.1-s windows,
#: 12 x 0.2 s and 8 x 0.5 s (3 Levenberg-Marquardt iterations each), then 8 x 1.0 s iterated to convergence (at
#: most 10; docs/identification.md, section 5; the bench's schedule and ``tensegrity identify``'s default).
#: Why the last rung iterates: with 3 iterations it stopped unconverged, and on a recording the project did not
#: write (the generality suite's tower, 2026-11-26) that left stiffness 10.2 % off with 74 % of the truths inside
#: +-2 sigma (z-RMS 2.9); 10 iterations converged to 5.7 % and 97 % (a further 4 x 2.0-s rung: 4.6 %, 98 %, but
#: its covariance alone takes minutes on the manipulator).
LONGER_WINDOWS_LADDER = ((0.2, 12, 3), (0.5, 8, 3), (1.0, "auto", 10))

#: a rung's window count ``"auto"``: AUTO_WINDOWS_PER_S per recorded second (all recordings together), at least
#: AUTO_WINDOWS_MIN. 8 up to 12 s of recording (the ladder as it was), 16 for 24 s. A cap: only windows that fit
#: between the held-out ones count (the README's 16-s bag has room for 8, so it is fitted as before).
#: Why: with a fixed count, a longer recording bought nothing. On the generality suite's icosahedron (seed 0),
#: 24 s with 16 one-second windows took the damping median from 18.6 % (12 s, 8 windows) to 8.4 %, stiffness
#: 2.1 -> 1.3 %, rest lengths 0.37 -> 0.20 mm, for 66 s of identify instead of 55 s (2026-11-27).
AUTO_WINDOWS_PER_S = 2.0 / 3.0
AUTO_WINDOWS_MIN = 8


def rung_windows(count, recorded_s: float) -> Optional[int]:
    """A ladder rung's window count: an int (or None: every window) as given; ``"auto"`` from the recorded time."""
    if count == "auto":
        return max(AUTO_WINDOWS_MIN, int(round(AUTO_WINDOWS_PER_S * recorded_s)))
    return count


#: IdentifyOptions.from_flat: the facts both stages use, stated once (stage 1's RegressionOptions and stage 2's
#: RefineOptions fields of the same name)
SHARED_FIELDS = ("known", "ties", "total_mass", "delay_s", "derivative_method", "smooth_window_s")
#: IdentifyOptions.from_flat: flat keywords that are stage 2's RefineOptions fields
STAGE2_FIELDS = ("estimate_delay", "noise_std_m", "prior_std", "prior_center", "window_s", "max_windows", "sim_dt",
                 "optimize_initial_states", "max_iter", "optimizer", "max_time_s", "device", "workers",
                 "bridge_start_gaps")
#: stage 1's default kinds, and stage 2's unless told otherwise
DEFAULT_KINDS = ("mass", "stiffness", "damping")


@dataclass(frozen=True)
class IdentifyOptions:
    """Options of :func:`identify`: each stage's own options, nested, and what the pipeline adds.

    Build them nested (``IdentifyOptions(refine=RefineOptions(...), ...)``) or from one flat set of keywords with
    :meth:`from_flat` (``tensegrity identify``'s flags, the online identifier's parameters), which states a fact
    both stages use (``known``, ``ties``, ``total_mass``, ``delay_s``, ``derivative_method``, ``smooth_window_s``)
    once.

    backend / integrator: engine used by the refinement (``spring_rod`` also switches the regression to
        the cylinder inertia of that engine, unless ``regression.mass_model`` says otherwise).
    regression: stage 1, :class:`RegressionOptions`: ``estimate`` (the kinds it estimates: ``mass, stiffness,
        damping`` [+ ``rest_length``, ``control_force_scalar``]), ``known``, ``ties``, ``total_mass``, its
        derivatives and delay, ...
    refine: stage 2, :class:`RefineOptions`: ``kinds`` freed (default: ``mass, stiffness, damping``; add
        ``rest_length``, ``spool_radius``, ``zero_offset``, never together with ``rest_length`` of the same actuated
        string: collinear), ``known`` / ``ties`` / ``total_mass``, ``estimate_delay`` / ``delay_s``,
        ``noise_std_m`` (marker noise; None: estimated from the residuals by the covariance),
        ``prior_std`` / ``prior_center`` (the Gaussian prior, per kind or per parameter name; a bar's ``mass_std``
        in the structure file is that bar's mass prior, in place of ``prior_std["mass"]``:
        :func:`structure_prior_std`), derivatives, windows (``window_s``, ``max_windows``, ``sim_dt``,
        ``optimize_initial_states``, ``bridge_start_gaps``), ``max_iter``, ``optimizer``, ``max_time_s``,
        ``device`` (``None``/``"cpu"``, ``"cuda"`` or ``"auto"``: cuda when available), ``workers`` (stage 2's
        windows, its Levenberg-Marquardt residuals and Jacobians and the covariance's Jacobians, spread over this
        many forked processes; Linux CPU only, same results; on the manipulator bench two gave 1.77x on 24 x 0.1-s
        Jacobians and 1.54x on 8 x 1.0-s ones). Its windows, data and engine also make the stage-2 start probe, the
        stage-1-only residual and the held-out windows (:meth:`RefineProblem.for_prediction`).
    longer_windows: continuation of stage 2, ``((window_s, max_windows, max_iter), ...)`` (``max_windows``
        ``"auto"``: :func:`rung_windows`, from the recorded time): after the fit on
        ``refine.window_s`` windows, fit again on longer windows, each run starting from the previous result (the
        Gaussian prior stays centred where it was). Short windows are nearly convex from a start ~20 % off;
        long ones carry far more information per window (their start states cost the same 6 nf unknowns),
        but from such a start they stall in local minima. Measured on the manipulator (60 parameters, 1 mm
        noise): 0.3-s windows from the prior stalled at a loss of 74 (noise floor 3); straight from 0.1-s to
        0.3-s windows one seed stayed in a worse basin (5.4 %). The bench's ladder
        :data:`LONGER_WINDOWS_LADDER` after 24 x 0.1 s ends at 0.84 / 2.94 / 1.37 % on seeds
        0 / 1 / 2 (was 2.29 / 1.93 / 4.45 % with 0.1 -> 0.3 s; docs/identification.md, section 5).
    stage2_start: ``auto`` (stage 2 starts from the stage-1 result or the prior, whichever predicts the
        data better, and from the prior whenever stage 1 moved a mass, stiffness or damping by more than
        ``stage1_max_factor``), ``stage1`` or ``prior``.
    residual: after a stage-1-only run, evaluate ``residual_rms_m`` (one multiple-shooting forward pass).
    covariance: compute the Gauss-Newton covariance after stage 2 (``covariance_windows`` windows).
    screen: reject non-finite, bar-length-violating (``bar_tol``) and spiking samples first;
        min_valid_fraction: below this fraction of valid free-node samples the data are refused.
    num_threads: torch intra-op threads during the call (1 is fastest for these small batched ops on a
        busy CPU; None: leave torch's setting).
    raise_errors: raise the typed errors instead of returning ``ok=False``.
    model_check / mismatch: after stage 2, judge whether the model explains the data (the residual against
        the noise estimated from the tracks, and its structure in time; :mod:`.mismatch`), with these
        thresholds (``IdentificationResult.model_mismatch``).
    uncertainty: how the covariance's standard deviations are calibrated (``sandwich``: by the residual's
        actual size and its correlation within windows, prior included; ``none``: the noise level
        ``refine.noise_std_m`` and independent residuals assumed; see :mod:`.uncertainty`).
    heldout_check / heldout_fraction / heldout_window_s / heldout_windows / heldout_margin_sigma: set aside
        about ``heldout_fraction`` of the recording's time in windows of ``heldout_window_s`` (3 to
        ``heldout_windows``) before the fit; after stage 2 predict them with the fit and with the prior, and say
        which predicts better by more than ``heldout_margin_sigma`` standard errors
        (``IdentificationResult.held_out``; :mod:`.heldout`). Off by default here (the online identifier holds
        out its own data); ``tensegrity identify`` turns it on.
    prior_dominated_ratio: a parameter whose posterior std is still above this fraction of its prior std is
        not determined by the data: it keeps the prior's value and std and is listed in ``prior_dominated``
        (None: leave it where the fit put it).
    law_check / law_margin_sigma: after stage 2, refit with the actuated strings' other stiffness law and say which
        law predicts the recording better, by more than ``law_margin_sigma`` standard errors
        (``IdentificationResult.string_law``; :mod:`.lawcheck`). Off by default here (it costs a refit of the last
        rung); ``tensegrity identify`` turns it on for structures with actuated strings.
    set_aside_outlying: after the last rung, set aside the windows fitted far worse than the others
        (:func:`outlying_windows`) and refit that rung without them. Off by default here (the online identifier's
        four short windows are judged by its held-out test instead); ``tensegrity identify`` turns it on.
    step_check / step_threshold_sigma / step_halvings: with the covariance, roll the fit out again at half the
        engine step and ask how far the estimate would move to follow (in sigma); beyond
        ``step_threshold_sigma``, refit the last rung at half the step, up to ``step_halvings`` times
        (``IdentificationResult.engine_step``; :mod:`.stepcheck`). Not made when ``refine.sim_dt`` is given or
        without the covariance.
    jackknife / jackknife_iterations: last, refit the last rung once per window without that window
        (``jackknife_iterations`` Levenberg-Marquardt iterations each) and add the jackknife variance to the
        standard deviations of the parameters the data determine (``IdentificationResult.jackknife``;
        :mod:`.jackknife`). Off by default: it costs one refit per window.
    """

    backend: str = "nodal"
    integrator: str = "semi_implicit"
    regression: RegressionOptions = RegressionOptions(estimate=DEFAULT_KINDS)
    refine: RefineOptions = RefineOptions(kinds=DEFAULT_KINDS)
    longer_windows: Tuple[Tuple[float, Union[int, str, None], int], ...] = ()
    stage2_start: str = "auto"
    stage1_max_factor: float = 3.0
    residual: bool = True
    covariance: bool = True
    covariance_windows: int = 16
    screen: bool = True
    bar_tol: float = 0.05
    min_valid_fraction: float = 0.3
    num_threads: Optional[int] = 1
    raise_errors: bool = False
    model_check: bool = True
    mismatch: MismatchOptions = MismatchOptions()
    uncertainty: str = "sandwich"
    heldout_check: bool = False
    heldout_fraction: float = 0.1
    heldout_window_s: float = 0.2
    heldout_windows: int = 16
    heldout_margin_sigma: float = 2.0
    prior_dominated_ratio: Optional[float] = 0.9
    law_check: bool = False
    law_margin_sigma: float = 3.0
    set_aside_outlying: bool = False
    step_check: bool = True
    step_threshold_sigma: float = DEFAULT_STEP_THRESHOLD_SIGMA
    step_halvings: int = DEFAULT_STEP_HALVINGS
    jackknife: bool = False
    jackknife_iterations: int = JACKKNIFE_ITERATIONS

    @classmethod
    def from_flat(cls, **flat) -> "IdentifyOptions":
        """IdentifyOptions from one flat set of keywords (see :meth:`with_flat`)."""
        return cls().with_flat(**flat)

    def with_flat(self, *, estimate: Optional[Sequence[str]] = None, refine_kinds: Optional[Sequence[str]] = None,
                  regression: Mapping[str, Any] = (), refine: Mapping[str, Any] = (), **flat) -> "IdentifyOptions":
        """A copy with flat keywords applied: the one place where flat option names meet the nested options.

        estimate: stage 1's kinds, and stage 2's unless ``refine_kinds``; refine_kinds: stage 2's kinds.
        :data:`SHARED_FIELDS` (known, ties, total_mass, delay_s, derivative_method, smooth_window_s): both stages.
        :data:`STAGE2_FIELDS` (estimate_delay, noise_std_m, prior_std, prior_center, window_s, max_windows,
        sim_dt, optimize_initial_states, max_iter, optimizer, max_time_s, device, workers, bridge_start_gaps):
        stage 2.
        regression / refine: any further field of that stage's options (applied last). The other keywords are
        this class's own fields (longer_windows, covariance, heldout_check, ...)."""
        stage1 = {k: flat.pop(k) for k in SHARED_FIELDS if k in flat}
        stage2 = {**stage1, **{k: flat.pop(k) for k in STAGE2_FIELDS if k in flat}}
        if estimate is not None:
            stage1["estimate"] = tuple(estimate)
        kinds = refine_kinds if refine_kinds is not None else estimate
        if kinds is not None:
            stage2["kinds"] = tuple(kinds)
        return dataclasses.replace(self, **flat,
                                   regression=dataclasses.replace(self.regression, **{**stage1, **dict(regression)}),
                                   refine=dataclasses.replace(self.refine, **{**stage2, **dict(refine)}))

    def __post_init__(self):
        if self.stage2_start not in ("auto", "stage1", "prior"):
            raise ValueError(f"IdentifyOptions.stage2_start = {self.stage2_start!r} (valid: auto, stage1, prior)")
        if self.uncertainty not in ("sandwich", "none"):
            raise ValueError(f"IdentifyOptions.uncertainty = {self.uncertainty!r} (valid: sandwich, none)")
        if self.backend not in ("nodal", "spring_rod"):
            raise ValueError(f"IdentifyOptions.backend = {self.backend!r} (valid: nodal, spring_rod)")
        for k, stage in enumerate(self.longer_windows):
            count_ok = len(stage) == 3 and (stage[1] is None or stage[1] == "auto"
                                            or (isinstance(stage[1], int) and stage[1] >= 1))
            if not count_ok or not stage[0] > 0 or stage[2] < 0:
                raise ValueError(f"IdentifyOptions.longer_windows[{k}] = {stage!r}: expected (window_s > 0, "
                                 "max_windows >= 1, None or 'auto', max_iter >= 0)")
        if not self.step_threshold_sigma > 0:
            raise ValueError(f"IdentifyOptions.step_threshold_sigma = {self.step_threshold_sigma!r} (expected > 0, "
                             "in standard deviations)")
        if not (isinstance(self.step_halvings, int) and self.step_halvings >= 0):
            raise ValueError(f"IdentifyOptions.step_halvings = {self.step_halvings!r} (expected an integer >= 0)")
        if not (isinstance(self.jackknife_iterations, int) and self.jackknife_iterations >= 1):
            raise ValueError(f"IdentifyOptions.jackknife_iterations = {self.jackknife_iterations!r} (expected an "
                             "integer >= 1)")


@dataclass
class IdentificationResult:
    """Result of :func:`identify`.

    ok: False when the data were refused or a stage failed (then ``params`` is the prior and ``error`` the
        typed exception); params: identified params (unbatched, float64, CPU).
    std_devs: by parameter name, finite values only (estimated parameters whose std is determined: ready
        for ``engine.apply_to_structure``); ``undetermined``: estimated parameters without a finite std
        (not excited by the data, kept at the prior); ``delay_std_s``: the delay's std when estimated.
    identifiability / identifiable: by name (``delay_s`` included when estimated), in [0, 1]; 0 = not
        identifiable from these data.
    ratios: ``{"a/b": (value, std)}`` when only ratios are identifiable (scale gauge), e.g.
        ``s1.stiffness/rod.mass``.
    non_identifiable: readable non-identifiable / weakly identifiable combinations.
    residual_rms_m: RMS 3-D position error of the multiple-shooting prediction at the result (m), NaN if
        it could not be evaluated; history: per loss evaluation {stage, iteration, loss, params, delay_s,
        time_s} (convergence plots); converged; delay_s; notes; timings (s per stage);
    regression / refinement: the stage results (None when not run).
    """

    ok: bool
    params: Params
    std_devs: Dict[str, float]
    identifiability: Dict[str, float]
    identifiable: Dict[str, bool]
    ratios: Dict[str, Tuple[float, float]]
    non_identifiable: List[str]
    residual_rms_m: float
    history: List[Dict[str, Any]]
    converged: bool
    delay_s: float
    notes: List[str]
    timings: Dict[str, float]
    error: Optional[Exception] = None
    regression: Optional[RegressionResult] = None
    refinement: Optional[RefineResult] = None
    delay_std_s: Optional[float] = None
    undetermined: List[str] = field(default_factory=list)
    #: the model check after stage 2 (:mod:`.mismatch`); None when not made (stage 1 only, or switched off)
    model_mismatch: Optional[ModelMismatch] = None
    #: how ``std_devs`` were calibrated (:attr:`.uncertainty.Covariance.calibration`); empty without stage 2
    calibration: Dict[str, Any] = field(default_factory=dict)
    #: (window_s, {name: value}) at the end of each stage-2 run (the first fit, then each longer-windows run)
    stage_values: List[Tuple[float, Dict[str, float]]] = field(default_factory=list)
    #: the fit against the prior on windows the fit did not see (:class:`.heldout.HeldOutCheck`)
    held_out: Optional[HeldOutCheck] = None
    #: {name: (posterior std, prior std)} of the parameters the data do not move: kept at the prior
    prior_dominated: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    #: one entry per recording (the datasets in the order given, several fitted jointly): name, windows (of the
    #: final stage-2 run), observed samples, residual_rms_m (that run's residual on its windows, fitted starts;
    #: NaN when none of its windows came from this recording); empty without stage 2
    recordings: List[Dict[str, Any]] = field(default_factory=list)
    #: the file's string law of the actuated strings against the other one (:class:`.lawcheck.LawCheck`)
    string_law: Optional[LawCheck] = None
    #: whether the engine's step was fine enough for the fit, and the steps it was refitted at
    #: (:class:`.stepcheck.StepCheck`); None when not made
    engine_step: Optional[StepCheck] = None
    #: the delete-one-window jackknife of the last rung (:class:`.jackknife.Jackknife`); None when not asked for
    jackknife: Optional[Jackknife] = None

    def values(self) -> Dict[str, float]:
        """name -> identified value (all parameters)."""
        return {n: float(v) for n, v in self.params.named().items()}

    def summary(self) -> str:
        """A human-readable table of the estimated parameters."""
        lines = [f"identification {'OK' if self.ok else 'FAILED: ' + str(self.error)}; residual RMS "
                 f"{self.residual_rms_m * 1e3:.3f} mm; converged={self.converged}"]
        vals = self.values()
        if self.delay_std_s is not None:
            lines.append(f"  {'delay_s':28s} {self.delay_s:14.6g} +- {self.delay_std_s:.3g}")
        for n in self.std_devs:
            v = vals.get(n, float("nan"))
            score = self.identifiability.get(n, 0.0)
            in_ratio = any(k.startswith(n + "/") or k.endswith("/" + n) for k in self.ratios)
            flag = "" if self.identifiable.get(n, False) else (
                "  (only ratios identifiable)" if in_ratio else
                "  (not identifiable)" if score == 0.0 else "  (weakly identifiable)")
            lines.append(f"  {n:28s} {v:14.6g} +- {self.std_devs[n]:.3g}  "
                         f"ident {self.identifiability.get(n, 0):.2f}{flag}")
        for n, (v, s) in self.ratios.items():
            lines.append(f"  ratio {n:40s} {v:14.6g} +- {s:.3g}")
        for d in self.non_identifiable:
            lines.append(f"  ! {d}")
        lines += [f"  note: {x}" for x in self.notes]
        if self.engine_step is not None:
            lines.append(("  " if self.engine_step.ok else "  !! ") + self.engine_step.line())
        for n, (sd, psd) in self.prior_dominated.items():
            lines.append(f"  {n}: kept at the prior (the data do not move it: std {sd:.3g} vs the prior's {psd:.3g})")
        if self.held_out is not None:
            lines.append(("  !! " if self.held_out.verdict == "worse" else "  ") + self.held_out.line())
        if self.model_mismatch is not None:
            lines.append(("  !! " if self.model_mismatch.mismatch else "  ") + self.model_mismatch.line())
        if self.string_law is not None:
            lines.append(("  !! " if self.string_law.mismatch else "  ") + self.string_law.line())
        if len(self.recordings) > 1:
            lines += ["  " + line for line in self.recording_lines()]
        return "\n".join(lines)

    def recording_lines(self) -> List[str]:
        """One line per recording of a joint fit: its share of the windows and its own residual."""
        return [f"recording {k + 1} {r['name']}: residual RMS {r['residual_rms_m'] * 1e3:.3f} mm over "
                f"{r['windows']} window(s), {r['samples']} observed node samples" for k, r in enumerate(self.recordings)]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {"ok": self.ok, "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
                "params": self.values(), "std_devs": dict(self.std_devs),
                "identifiability": dict(self.identifiability), "identifiable": dict(self.identifiable),
                "ratios": {k: list(v) for k, v in self.ratios.items()}, "non_identifiable": list(self.non_identifiable),
                "residual_rms_m": self.residual_rms_m, "converged": self.converged, "delay_s": self.delay_s,
                "delay_std_s": self.delay_std_s, "undetermined": list(self.undetermined),
                "notes": list(self.notes), "timings": dict(self.timings),
                "model_mismatch": None if self.model_mismatch is None else self.model_mismatch.to_dict(),
                "calibration": dict(self.calibration),
                "held_out": None if self.held_out is None else self.held_out.to_dict(),
                "string_law": None if self.string_law is None else self.string_law.to_dict(),
                "engine_step": None if self.engine_step is None else self.engine_step.to_dict(),
                "jackknife": None if self.jackknife is None else self.jackknife.to_dict(),
                "prior_dominated": {n: {"std": sd, "prior_std": p} for n, (sd, p) in self.prior_dominated.items()},
                "stage_values": [{"window_s": ws, "params": v} for ws, v in self.stage_values],
                "recordings": [dict(r) for r in self.recordings]}


def structure_prior_std(structure: Structure, prior_std: Mapping[str, float]) -> Dict[str, float]:
    """Stage 2's prior widths: ``prior_std`` (per kind or per parameter name) with the structure file's per-element
    statements added by name, which override the kind's width for that element: a bar's ``mass_std`` (kg) becomes
    ``{"<bar>.mass": mass_std / mass}`` (masses are log-parametrised: relative). An entry already given by name in
    ``prior_std`` is kept (the caller's word wins)."""
    out = dict(prior_std)
    for b in structure.bars:
        name = join_name(b.name, "mass")
        if b.mass_std is not None and name not in prior_std:
            out[name] = float(b.mass_std) / float(b.mass)
    return out


def _announce(callback, stage: str, what: str, iterations: Optional[int] = None) -> None:
    """Tell the callback a post-fit step starts ({"stage": stage, "event": "start", "what": what}, with
    "iterations": the Levenberg-Marquardt iterations it will report at most, where known); its return value is
    ignored (only stage 2's evaluations can be stopped)."""
    if callback is not None:
        callback({"stage": stage, "event": "start", "what": what,
                  **({} if iterations is None else {"iterations": int(iterations)})})


def _positive(params: Params, prior: Params, notes: List[str]) -> Params:
    """Replace non-finite or non-positive scale parameters (a poor stage-1 fit) by the prior's."""
    repl = {}
    for kind in ("stiffness", "damping", "mass"):
        v, p = getattr(params, kind), getattr(prior, kind)
        bad = ~torch.isfinite(v) | (v <= 0)
        if kind == "damping":
            bad = ~torch.isfinite(v) | (v < 0)
        if bool(bad.any()):
            names = [e for e, b in zip(params.meta.elements(kind), bad.tolist()) if b]
            notes.append(f"stage 1 gave non-positive {kind} for {names}; stage 2 starts them from the prior")
            repl[kind] = torch.where(bad, p, v)
    rl = params.rest_length
    nom = torch.tensor(params.meta.nominal_rest_length, dtype=rl.dtype)
    bad = ~torch.isfinite(rl) | (rl <= 0.5 * nom) | (rl >= 1.5 * nom)
    if bool(bad.any()):
        repl["rest_length"] = torch.where(bad, prior.rest_length, rl)
    return params.replace(**repl) if repl else params


def _far_from(params: Params, prior: Params, factor: float):
    """(name, ratio) of the first scale parameter outside prior / factor .. prior x factor, else None.

    Why: with marker noise on stiff strings stage 1's errors in variables can be 50x (measured on the
    manipulator at 0.3 mm noise). Such a start can still out-predict a 20 %-off prior over short windows (it
    lets the structure sag instead of ring) and stage 2 then refines a wrong basin, so it is not used."""
    for (name, v), p0 in zip(params.named().items(), prior.named().values()):
        if kind_of(name) not in GAUGE_KINDS or not float(p0) > 0:
            continue
        r = float(v) / float(p0)
        if not (1.0 / factor <= r <= factor):
            return name, r
    return None


def _finite(params: Params) -> bool:
    return all(bool(torch.all(torch.isfinite(t))) for t in (params.stiffness, params.damping, params.rest_length,
                                                             params.mass, params.spool_radius, params.zero_offset))


def model_check(ref: RefineResult, datasets: Sequence[Dataset], options: MismatchOptions = MismatchOptions(),
                gn_rss_decrease_m2: Optional[float] = None) -> ModelMismatch:
    """:func:`~tensegrity_ros.ident.mismatch.check_model` on a stage-2 result: its final windows' residuals
    (fitted starts), its free parameters and window starts as the unknowns, the noise from ``datasets``' tracks;
    ``gn_rss_decrease_m2`` from the covariance tells an unconverged fit from a wrong model."""
    prob = ref.problem
    with torch.no_grad():
        r = prob.residuals(ref.w.detach(), None if ref.x0 is None else ref.x0.detach())
    n_unknowns = int(ref.w.numel()) + (int(ref.x0[0].numel()) * prob.B_win if ref.x0 is not None else 0)
    tracks = [(d.times, d.positions, d.valid) for d in datasets]
    return check_model(tracks, prob.obs_idx, r.cpu().numpy(), prob.mask.cpu().numpy(), n_unknowns, options,
                       gn_rss_decrease_m2)


def _window_squares(ref: RefineResult) -> Tuple[np.ndarray, np.ndarray]:
    """(sum of squared residuals (B,) m^2, observed samples (B,)) per window of a stage-2 result (fitted starts)."""
    prob = ref.problem
    with torch.no_grad():
        r = prob.residuals(ref.w.detach(), None if ref.x0 is None else ref.x0.detach())
    sq = (r * r).sum(dim=(1, 2, 3)).cpu().numpy()
    n = prob.mask.reshape(prob.mask.shape[0], -1).sum(dim=1).cpu().numpy()
    return sq, n


#: a window whose residual RMS is above this many times the median window's (and above it by half the stated
#: noise) is one the fit cannot follow; see :func:`outlying_windows`
OUTLYING_WINDOW_FACTOR = 2.0


def outlying_windows(ref: RefineResult,
                     factor: float = OUTLYING_WINDOW_FACTOR) -> Tuple[List[Tuple[int, float]], float]:
    """([(window index, its residual RMS in m)], the median window's RMS in m): the windows of ``ref`` fitted far
    worse than the others, RMS above ``factor`` x the median window's and above it by half the loss's noise. One such window carries its
    structured misfit into the model check and the covariance (measured: the icosahedron's first 1-s window,
    started one sample after the record's start, 4.4 mm against 1.76-1.85 mm for the other ten; the model check
    flagged the whole fit)."""
    sq, n = _window_squares(ref)
    ok = n > 0
    rms = np.sqrt(sq[ok] / n[ok])
    med = float(np.median(rms)) if rms.size else math.nan
    if rms.size < 3:
        return [], med
    floor = 0.5 * ref.problem.opts.loss_noise_std_m
    idx = np.flatnonzero(ok)
    return [(int(b), float(v)) for b, v in zip(idx, rms) if v > factor * med and v - med > floor], med


def recording_residuals(ref: RefineResult, datasets: Sequence[Dataset]) -> List[Dict[str, Any]]:
    """Per recording (``datasets`` in order): the stage-2 result's residual on that recording's windows (fitted
    starts), m, with the window and observed-sample counts; NaN residual when it had no window."""
    prob = ref.problem
    sq, n = _window_squares(ref)                                        # (B,) m^2 and samples per window
    which = np.array([di for di, _ in prob.window_ids], dtype=int)
    out = []
    for k, d in enumerate(datasets):
        sel = which == k
        cnt = int(n[sel].sum())
        out.append({"name": d.name or f"recording {k + 1}", "windows": int(sel.sum()), "samples": cnt,
                    "residual_rms_m": float(math.sqrt(sq[sel].sum() / cnt)) if cnt else float("nan")})
    return out


def identify(structure: Structure, dataset: Union[Dataset, Sequence[Dataset]], *,
             stages: Sequence[str] = STAGES, options: IdentifyOptions = IdentifyOptions(),
             prior: Optional[Params] = None, callback: Optional[Callable[[Dict[str, Any]], Any]] = None,
             keep_fit: Optional[Callable[[Params], bool]] = None) -> IdentificationResult:
    """Identify the parameters of ``structure`` from ``dataset`` (one recording or several).

    stages: any of ``regression`` (closed-form stage 1) and ``refine`` (stage 2 through engine rollouts),
    in that order. prior: the starting / nominal params (default: the structure file's; the online node
    passes its last good set). callback(info): progress after every stage-2 evaluation (return True to
    stop early), once after stage 1, and ``{"stage": ..., "event": "start", "what": ...}`` before each step
    after the fit (covariance, model_check, held_out; its return value ignored there).
    Several datasets (recordings of one robot) are fitted jointly: their windows are pooled into one problem,
    each keeping its own time base; ``IdentificationResult.recordings`` gives each one's residual.
    keep_fit(params): asked with stage 2's parameters before the steps after the fit; when it returns False
    they are skipped (no standard deviations, no model check; a note says so). The online identifier scores a
    fit on its own held-out data there, and pays for the covariance only for a fit it may publish.
    """
    opts = options
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise ValueError(f"identify: unknown stage(s) {bad or stages} (valid: {', '.join(STAGES)})")
    t0 = time.perf_counter()
    datasets = [dataset] if isinstance(dataset, Dataset) else list(dataset)
    if prior is None:
        prior = params_from_structure(structure, control_force_scalar=1.0 if opts.backend == "spring_rod" else None)
    prior = prior.map(lambda t: t.detach().cpu().double())
    notes: List[str] = []
    timings: Dict[str, float] = {}
    history: List[Dict[str, Any]] = []
    reg: Optional[RegressionResult] = None
    ref: Optional[RefineResult] = None
    params = prior
    std: Dict[str, float] = {}
    ident: Dict[str, float] = {}
    identifiable: Dict[str, bool] = {}
    ratios: Dict[str, Tuple[float, float]] = {}
    nonid: List[str] = []
    rms = float("nan")
    converged = False
    mismatch: Optional[ModelMismatch] = None
    calibration: Dict[str, Any] = {}
    stage_fits: List[Tuple[float, RefineResult]] = []     # (window_s, result) of each stage-2 run, in order
    heldout: Optional[HeldOutCheck] = None
    dominated: Dict[str, Tuple[float, float]] = {}
    recordings: List[Dict[str, Any]] = []
    law: Optional[LawCheck] = None
    step: Optional[StepCheck] = None
    jack: Optional[Jackknife] = None
    # the stages' options as run: stage 1's inertia from the backend unless it names one; stage 2's device
    # resolved and the structure file's per-bar mass priors added (see structure_prior_std)
    ropts = opts.regression
    if ropts.mass_model is None:
        ropts = dataclasses.replace(ropts, mass_model="cylinder" if opts.backend == "spring_rod" else "thin")
    device = opts.refine.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else None
    fopts = dataclasses.replace(opts.refine, device=device,
                                prior_std=structure_prior_std(structure, opts.refine.prior_std))
    delay = float(fopts.delay_s if "refine" in stages else ropts.delay_s)
    start_delay = delay
    try:
        with torch_threads(opts.num_threads):
            # ---- screening -------------------------------------------------------------------------
            top = build_topology(structure)
            free = np.asarray(top.free_nodes, dtype=int)
            if opts.screen:
                screened = []
                for d in datasets:
                    if d.positions.shape[1] != top.n_nodes:
                        raise DataError(f"dataset has {d.positions.shape[1]} nodes; structure {structure.name!r} has "
                                        f"{top.n_nodes}")
                    if d.motor_angles is not None and not np.all(np.isfinite(d.motor_angles)):
                        raise DataError("motor angles contain non-finite values")
                    d2, rep = screen_dataset(d, top.bar_nodes, top.bar_lengths, bar_tol=opts.bar_tol, nodes=free)
                    if rep.non_finite or rep.bar_length or rep.spikes:
                        notes.append(f"screening rejected {rep.non_finite} non-finite, {rep.bar_length} bar-length "
                                     f"and {rep.spikes} spike sample(s)")
                    if rep.valid_fraction < opts.min_valid_fraction:
                        raise NotEnoughDataError(f"only {rep.valid_fraction:.0%} of the free-node samples are valid "
                                                 f"(< {opts.min_valid_fraction:.0%})")
                    screened.append(d2)
                datasets = screened
            # ---- held-out windows, set aside before any fit --------------------------------------------
            held_prob = None
            whole = datasets            # screened, nothing held out: the string-law check scores these
            if opts.heldout_check and "refine" in stages:
                datasets, held_prob = reserve_held_out(
                    structure, datasets, prior, fopts, window_s=opts.heldout_window_s, fraction=opts.heldout_fraction,
                    max_windows=opts.heldout_windows, backend=opts.backend, integrator=opts.integrator)
            # ---- stage 1 -------------------------------------------------------------------------------
            if "regression" in stages:
                ts = time.perf_counter()
                reg = regress(structure, datasets, prior, ropts)
                params = reg.params
                if not _finite(params):
                    raise IdentificationError("stage 1 produced non-finite parameters")
                std.update(reg.std_devs)
                ident.update(reg.identifiability)
                identifiable.update(reg.identifiable)
                ratios.update(reg.ratios)
                nonid.extend(reg.non_identifiable)
                notes.extend(reg.notes)
                timings["regression"] = time.perf_counter() - ts
                info = {"stage": "regression", "iteration": 0, "evaluation": 0, "loss": float(reg.residual_rms),
                        "params": {n: float(v) for n, v in params.named().items()}, "delay_s": delay,
                        "time_s": time.perf_counter() - t0}
                history.append(info)
                if callback is not None:
                    callback(info)
                converged = True
            # ---- stage 2 -------------------------------------------------------------------------------
            if "refine" in stages:
                ts = time.perf_counter()
                start = _positive(params, prior, notes)
                if reg is not None and opts.stage2_start in ("auto", "prior"):
                    # stage 1 can be badly biased (errors in variables: noisy geometry through stiff strings);
                    # start stage 2 from whichever predicts the windows better
                    probe = RefineProblem.for_prediction(structure, datasets, prior, fopts, backend=opts.backend,
                                                         integrator=opts.integrator)
                    e_reg, e_prior = probe.prediction_rms(start), probe.prediction_rms(prior)
                    far = _far_from(start, prior, opts.stage1_max_factor)
                    if opts.stage2_start == "prior" or e_prior < e_reg or far:
                        why = (f"stage 1 puts {far[0]} at {far[1]:.3g}x the prior (> {opts.stage1_max_factor:g}x)"
                               if far else f"stage 1 predicts worse ({e_reg * 1e3:.3g} mm)")
                        notes.append(f"stage 2 starts from the prior (prediction RMS {e_prior * 1e3:.3g} mm): {why}")
                        start = prior
                # the prior is what the user's model file says (its values, prior_std around them), for every
                # run and check: stage 1 only chooses where stage 2 starts. Centred on stage 1's result (until
                # stop 30), weighed masses were held 2 % around stage 1's masses; on a noise-free recording of the
                # generality prism those were 18-23 % off (its smoothed accelerations miss the fast modes), and the
                # fit ended there (masses 13 % off, residual 0.093 mm against the truth's 0.014 mm)
                centre = fopts.prior_center if fopts.prior_center is not None else prior
                ref = refine(structure, datasets, start, dataclasses.replace(fopts, prior_center=centre),
                             backend=opts.backend, integrator=opts.integrator, callback=callback)
                stage_fits.append((float(fopts.window_s), ref))
                recorded_s = sum(d.duration for d in datasets)      # what an "auto" rung's window count follows
                for ws, nw, it in opts.longer_windows:
                    if not (_finite(ref.params) and math.isfinite(ref.loss)):
                        break
                    nw = rung_windows(nw, recorded_s)
                    next_opts = dataclasses.replace(fopts, window_s=float(ws), max_windows=nw, max_iter=int(it),
                                                    delay_s=ref.delay_s, prior_center=centre)
                    try:
                        nxt = refine(structure, datasets, ref.params, next_opts, backend=opts.backend,
                                     integrator=opts.integrator, callback=callback)
                    except NotEnoughDataError:
                        # a short recording (or one cut by gaps and held-out windows) has no room for this
                        # rung's windows, nor for the longer ones after it: keep the fit so far, and say so
                        notes.append(f"stage 2's {ws:g}-s rung (and any longer) skipped: no {ws:g}-s window with "
                                     f"a measured start fits the recording; the {fopts.window_s:g}-s result stands")
                        break
                    notes.extend(ref.notes)
                    history.extend(ref.history)
                    notes.append(f"stage 2 continued on {ws:g}-s windows from the {fopts.window_s:g}-s result")
                    fopts, ref = next_opts, nxt
                    stage_fits.append((float(ws), ref))
                fitted = opts.set_aside_outlying and _finite(ref.params) and math.isfinite(ref.loss)
                bad, med = outlying_windows(ref) if fitted else ([], 0.0)
                if bad:
                    # set them aside and refit the last rung from its result, so that they do not decide the
                    # model check and the covariance
                    datasets = without_windows(datasets, ref.problem, [b for b, _ in bad])
                    again_opts = dataclasses.replace(fopts, delay_s=ref.delay_s, prior_center=centre)
                    try:
                        again = refine(structure, datasets, ref.params, again_opts, backend=opts.backend,
                                       integrator=opts.integrator, callback=callback)
                    except NotEnoughDataError:
                        again = None
                    if again is not None:
                        notes.extend(ref.notes)
                        history.extend(ref.history)
                        notes.append(f"{len(bad)} {fopts.window_s:g}-s window(s) fitted far worse than the others "
                                     f"(residual RMS {', '.join(f'{v * 1e3:.2f}' for _, v in bad)} mm against the "
                                     f"median window's {med * 1e3:.2f} mm): set aside, and the {fopts.window_s:g}-s "
                                     "rung refitted without them")
                        fopts, ref = again_opts, again
                        stage_fits[-1] = (float(fopts.window_s), ref)
                params = ref.params
                delay = ref.delay_s
                rms = ref.residual_rms_m
                converged = ref.converged
                notes.extend(ref.notes)
                history.extend(ref.history)
                timings["refine"] = time.perf_counter() - ts
                if not _finite(params) or not math.isfinite(ref.loss):
                    raise DivergenceError("stage 2 produced non-finite parameters")
                after_fit = keep_fit is None or bool(keep_fit(params))
                if not after_fit:
                    notes.append("the steps after the fit (covariance, model check, held-out and string-law "
                                 "checks) were skipped: the caller does not keep this fit")
                recordings = recording_residuals(ref, datasets)
                if after_fit:
                    if opts.covariance:
                        ts = time.perf_counter()
                        _announce(callback, "covariance", "standard deviations (Gauss-Newton covariance, sandwich)")
                        from .uncertainty import gauss_newton_covariance
                        checking = opts.step_check and fopts.sim_dt is None
                        steps: List[Tuple[float, float, str, float]] = []    # (step, shift / sigma, worst, RMS)
                        while True:
                            change = halving_change(ref) if checking else None
                            cov = gauss_newton_covariance(ref.problem, ref.w, ref.x0, noise_std_m=fopts.noise_std_m,
                                                          max_windows=opts.covariance_windows,
                                                          calibrate=opts.uncertainty, prediction_change=change)
                            if not checking:
                                break
                            worst, moved = largest_shift(cov.shift, cov.std_devs)
                            steps.append((ref.problem.sim_dt, moved, worst,       # the change's RMS per coordinate
                                          ref.problem.residual_rms(change) / math.sqrt(3.0)))
                            if moved <= opts.step_threshold_sigma or len(steps) > opts.step_halvings:
                                break
                            # the same windows and prior, from the fit, at half the step: a step too long biases
                            # the estimate without showing in the residual (.stepcheck)
                            _announce(callback, "engine_step", f"the last rung again at a "
                                      f"{ref.problem.sim_dt / 2 * 1e3:.3g}-ms step (halving the step would move "
                                      f"{worst} {moved:.2g} sigma)")
                            finer = dataclasses.replace(fopts, sim_dt=ref.problem.sim_dt / 2, delay_s=ref.delay_s,
                                                        prior_center=centre)
                            t_refit = time.perf_counter()
                            try:
                                again = refine(structure, datasets, ref.params, finer, backend=opts.backend,
                                               integrator=opts.integrator, callback=callback)
                            except IdentificationError as exc:
                                notes.append(f"the refit at a {finer.sim_dt * 1e3:.3g}-ms step failed ({exc}); the "
                                             f"{ref.problem.sim_dt * 1e3:.3g}-ms fit stands")
                                break
                            fopts, ref = finer, again
                            stage_fits[-1] = (float(fopts.window_s), ref)
                            params, delay, rms, converged = ref.params, ref.delay_s, ref.residual_rms_m, ref.converged
                            notes.extend(ref.notes)
                            history.extend(ref.history)
                            recordings = recording_residuals(ref, datasets)
                            timings["engine_step_refits"] = (timings.get("engine_step_refits", 0.0)
                                                             + time.perf_counter() - t_refit)
                        if steps:
                            step = StepCheck(*(tuple(x) for x in zip(*steps)),
                                             threshold_sigma=opts.step_threshold_sigma)
                        calibration = dict(cov.calibration)
                        # stage-2 values supersede stage 1 for the parameters it estimated (the others keep theirs)
                        for n in cov.names:
                            std[n] = cov.std_devs[n]
                            ident[n] = cov.identifiability[n]
                            identifiable[n] = cov.identifiable[n]
                        ratios = dict(cov.ratios)     # only when stage 2's scale is a gauge (nothing fixes it)
                        nonid = [d for d in nonid if d.startswith("scale")] if ref.problem.gauge else []
                        nonid.extend(cov.weak_directions)
                        notes.extend(cov.notes)
                        timings["covariance"] = time.perf_counter() - ts - timings.get("engine_step_refits", 0.0)
                    if opts.model_check:
                        ts = time.perf_counter()
                        _announce(callback, "model_check", "model check (residual against the marker noise)")
                        mismatch = model_check(ref, datasets, opts.mismatch, calibration.get("gn_rss_decrease_m2"))
                        timings["model_check"] = time.perf_counter() - ts
                    if opts.prior_dominated_ratio is not None and fopts.prior_std:
                        centre_values = {n: float(v) for n, v in centre.named().items()}
                        # whether the data determine a parameter is a question of information: judged on sigma
                        # without the prior's pull (which grows where the data move the estimate off the prior)
                        pull = calibration.get("prior_pull", {})
                        spread = {n: math.sqrt(max(v ** 2 - pull.get(n, 0.0) ** 2, 0.0)) for n, v in std.items()}
                        dominated = prior_dominated(spread, centre_values, fopts.prior_std, opts.prior_dominated_ratio)
                        if dominated:
                            params = params.with_values({n: centre_values[n] for n in dominated})
                            std.update({n: p for n, (_, p) in dominated.items()})
                    if opts.heldout_check:
                        ts = time.perf_counter()
                        _announce(callback, "held_out", "held-out check (the fit and the nominal on unseen windows)")
                        heldout = compare_on_held_out(held_prob, params, prior, fit_delay_s=delay,
                                                      prior_delay_s=start_delay, margin_sigma=opts.heldout_margin_sigma)
                        timings["held_out"] = time.perf_counter() - ts
                    if opts.law_check:
                        ts = time.perf_counter()
                        _announce(callback, "string_law",
                                  "string-law check (the actuated strings' other law, refitted)")
                        law = check_string_law(structure, datasets, ref, centre, scored=whole, backend=opts.backend,
                                               integrator=opts.integrator, margin_sigma=opts.law_margin_sigma)
                        std, note = widen(std, law)
                        if note:
                            notes.append(note)
                        timings["string_law"] = time.perf_counter() - ts
                    if opts.jackknife:
                        ts = time.perf_counter()
                        _announce(callback, "jackknife", "window jackknife (the last rung refitted without each "
                                                         "of its windows in turn)",
                                  iterations=ref.problem.B_win * opts.jackknife_iterations)
                        jack = window_jackknife(structure, datasets, ref, centre, names=list(std),
                                                iterations=opts.jackknife_iterations, backend=opts.backend,
                                                integrator=opts.integrator, callback=callback)
                        # the parameters kept at the prior keep the prior's sigma: the data do not move them
                        std, note = jackknife_widen(std, jack, skip=dominated)
                        notes.append(note or jack.line())
                        timings["jackknife"] = time.perf_counter() - ts
            elif reg is not None and opts.residual:
                # residual of the stage-1 result (one forward multiple-shooting evaluation)
                try:
                    prob = RefineProblem.for_prediction(structure, datasets, params, fopts,
                                                        max_windows=fopts.max_windows or 16, delay_s=delay,
                                                        backend=opts.backend, integrator=opts.integrator)
                    with torch.no_grad():
                        rms = prob.residual_rms(prob.residuals(prob.initial_w(delay), None))
                except IdentificationError as exc:  # too short for a window: no residual
                    notes.append(f"no prediction residual: {exc}")
            if not math.isfinite(rms) and "refine" in stages:
                raise DivergenceError("non-finite prediction residual")
        timings["total"] = time.perf_counter() - t0
        # std_devs: parameter names with finite values only (ready for apply_to_structure); the delay's std
        # and the parameters the data do not determine are reported separately
        delay_std = std.pop("delay_s", None)
        undetermined = sorted(n for n, v in std.items() if not math.isfinite(v))
        for n in undetermined:
            std.pop(n)
        if undetermined:
            notes.append(f"no finite standard deviation (not determined by the data, kept at the prior): "
                         f"{', '.join(undetermined)}")
        return IdentificationResult(ok=True, params=params, std_devs=std, identifiability=ident,
                                    identifiable=identifiable, ratios=ratios, non_identifiable=nonid,
                                    residual_rms_m=rms, history=history, converged=converged, delay_s=delay,
                                    notes=notes, timings=timings, regression=reg, refinement=ref,
                                    delay_std_s=delay_std, undetermined=undetermined,
                                    model_mismatch=mismatch, calibration=calibration,
                                    stage_values=[(ws, {n: float(v) for n, v in r.params.named().items()})
                                                  for ws, r in stage_fits],
                                    held_out=heldout, prior_dominated=dominated, recordings=recordings,
                                    string_law=law, engine_step=step, jackknife=jack)
    except (IdentificationError, RuntimeError, np.linalg.LinAlgError, FloatingPointError) as exc:
        if not isinstance(exc, IdentificationError):
            wrapped = DivergenceError(f"{type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        if opts.raise_errors:
            raise exc
        timings["total"] = time.perf_counter() - t0
        notes.append(f"identification failed ({type(exc).__name__}): {exc}; returning the prior")
        return IdentificationResult(ok=False, params=prior, std_devs={}, identifiability={}, identifiable={},
                                    ratios={}, non_identifiable=[], residual_rms_m=float("nan"), history=history,
                                    converged=False, delay_s=start_delay, notes=notes, timings=timings,
                                    error=exc, regression=reg, refinement=ref)
