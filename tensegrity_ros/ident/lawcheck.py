"""Which string law do the data prefer? The structure file's, or the other one for the actuated strings.

A string's ``stiffness_law`` (``cord``: EA / xi0, ``spring``: constant; :data:`~tensegrity_ros.model.STIFFNESS_LAWS`)
only matters while an actuator changes its rest length, and a lab rarely knows which one its spool-and-cable
assembly follows. The residual-based model check (:mod:`.mismatch`) does not see a wrong law on the generality
suite: the fit absorbs most of the difference into stiffnesses and rest lengths, and what is left (0.3-0.5 mm
over 1 s from the true parameters) hides under 1-mm marker noise (residual ratio 1.06 against 1.04 on the prism).
A paired comparison sees it: measured with both laws fitted through the whole ladder on the suite's recordings
(seeds 0 and 1), every 1-s window of the recording predicted with its start fitted gave the file's (right) law
a lower mean squared error than the swapped one in all six cases, by 0.3-43 % (1.2-10.5 standard errors over 5-10
windows; the icosahedron 35-43 %, the prism 5 %, the tower 0.3-2.4 %).

:func:`check_string_law` after a fit:

1. swaps the law of every actuated string (cord <-> spring; one alternative, the lab's convention being the
   usual slip) and refits from the fit's parameters with the fit's last stage-2 options (same windows, same
   free parameters, same prior centred where the fit's was; 2 iterations: the two optima lie close);
2. predicts every window of that length over the recordings with each model, each window's start fitted
   (:func:`~.heldout.fitted_start_mse`), and takes the paired log ratio of the two mean squared errors per
   window (:func:`~.heldout.paired_log_ratio`); both sets have the same number of parameters, so the
   better-predicting law is the better model;
3. says ``other_law_better`` when the other law predicts better by more than ``margin_sigma`` standard errors
   and by at least ``min_relative`` of the mean squared error, ``file_law_better`` for the same the other way,
   else ``no_clear_difference`` (the data cannot tell: then the stiffness estimates of the actuated strings
   depend on an assumption the data do not check; the alternative's values are reported beside them);
4. when the data cannot tell, :func:`widen` adds the spread between the two fits to the standard deviations:
   either law is as good a model of the robot, and a sigma that is to hold the truth must hold that too.

Pure functions over the stage-2 problem; no ROS.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..engine import Params
from ..model import Structure
from ..model.schema import STIFFNESS_LAWS
from .data import Dataset
from .errors import IdentificationError
from .heldout import fitted_start_mse, paired_log_ratio, paired_verdict
from .refine import RefineResult, RefineProblem, refine
from .uncertainty import add_in_quadrature
from .workers import window_workers

__all__ = ["LawCheck", "swap_actuated_laws", "check_string_law", "widen"]

#: the verdicts of :class:`LawCheck`, the first the one that fails the file, with the words that start its line
HEADS = {"other_law_better": "STRING LAW:", "file_law_better": "string-law check OK:",
         "no_clear_difference": "string-law check: the data do not tell", "not_checked": "string-law check: not made"}
VERDICTS = tuple(HEADS)


@dataclass(frozen=True)
class LawCheck:
    """strings: the actuated strings whose law was swapped, with their law in the file (``file_laws``);
    windows / window_s: the windows scored; file_rms_m / other_rms_m: prediction RMS of the two fits over them (m,
    starts fitted); log_ratio_mean / log_ratio_se: ln(file MSE / other MSE) per window (> 0: the other law predicts
    better); verdict: one of :data:`VERDICTS`; other_values: the alternative fit's values (every parameter);
    spread: half the difference between the two fits per parameter (its unit), the model uncertainty that
    :func:`widen` adds to the standard deviations when the data do not tell the laws apart; seconds: the check's
    wall time; reason: why ``not_checked``."""

    verdict: str
    strings: Tuple[str, ...] = ()
    file_laws: Tuple[str, ...] = ()
    windows: int = 0
    window_s: float = math.nan
    file_rms_m: float = math.nan
    other_rms_m: float = math.nan
    log_ratio_mean: float = math.nan
    log_ratio_se: float = math.nan
    margin_sigma: float = 3.0
    other_values: Dict[str, float] = field(default_factory=dict)
    spread: Dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""

    @property
    def mismatch(self) -> bool:
        """The other law explains the data better: the file's law is wrong."""
        return self.verdict == "other_law_better"

    @staticmethod
    def verdict_in(text: str) -> Optional[str]:
        """The verdict of the last :meth:`line` in a console text (None: no check in it)."""
        found = [(text.rfind(head), v) for v, head in HEADS.items() if head in text]
        return max(found)[1] if found else None

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strings"], d["file_laws"] = list(self.strings), list(self.file_laws)
        return d

    def line(self) -> str:
        if self.verdict == "not_checked":
            return f"{HEADS['not_checked']} ({self.reason})"
        mine = "the file's laws (" + ", ".join(f"{n} {x}" for n, x in zip(self.strings, self.file_laws)) + ")"
        other = "the other laws (" + ", ".join(f"{n} {_other(x)}" for n, x in zip(self.strings, self.file_laws)) + ")"
        z = self.log_ratio_mean / self.log_ratio_se if self.log_ratio_se > 0 else math.inf
        figures = (f"prediction RMS {self.file_rms_m * 1e3:.3g} mm with the file's law against {self.other_rms_m * 1e3:.3g} "
                   f"mm with the other over {self.windows} {self.window_s:g}-s windows, starts fitted (the other's mean squared "
                   f"error {math.exp(-self.log_ratio_mean):.3f}x the file's, {abs(z):.1f} sigma, limit {self.margin_sigma:g})")
        if self.verdict == "other_law_better":
            return (f"{HEADS['other_law_better']} the actuated strings follow {other} better than {mine}: {figures}; set "
                    f"stiffness_law in the structure file and identify again")
        if self.verdict == "file_law_better":
            return f"{HEADS['file_law_better']} the actuated strings follow {mine} better than {other}: {figures}"
        k = {n: self.other_values[n] for n in (f"{s}.stiffness" for s in self.strings) if n in self.other_values}
        return (f"{HEADS['no_clear_difference']} {mine} from {other}: {figures}; the actuated strings' "
                f"stiffnesses rest on the file's laws (with the other laws: "
                + ", ".join(f"{n} {v:.4g}" for n, v in list(k.items())[:6]) + (", ..." if len(k) > 6 else "")
                + "), and the standard deviations include half the difference between the two fits")


def _other(law: str) -> str:
    return STIFFNESS_LAWS[1] if law == STIFFNESS_LAWS[0] else STIFFNESS_LAWS[0]


def swap_actuated_laws(structure: Structure) -> Tuple[Structure, Tuple[str, ...]]:
    """``structure`` with the law of every actuated string swapped (cord <-> spring), and those strings' names
    (empty when no string has an actuator: the law then changes nothing)."""
    names = tuple(s.name for s in structure.strings if s.actuator)
    swapped = tuple(dataclasses.replace(s, stiffness_law=_other(s.stiffness_law)) if s.actuator else s
                    for s in structure.strings)
    return dataclasses.replace(structure, strings=swapped), names


def check_string_law(structure: Structure, datasets: Sequence[Dataset], fit: RefineResult, prior_center: Params, *,
                     scored: Optional[Sequence[Dataset]] = None, backend: str = "nodal",
                     integrator: str = "semi_implicit", margin_sigma: float = 3.0, min_relative: float = 0.01,
                     min_windows: int = 4, start_iterations: int = 2, max_iter: Optional[int] = 2,
                     callback: Optional[Callable[[Dict[str, Any]], Any]] = None) -> LawCheck:
    """The structure file's law of the actuated strings against the other one (see the module docstring).

    fit: the last stage-2 run (its options and windows are reused); prior_center: where the fit's prior was
    centred (the alternative is held to the same prior); datasets: the fit's data (held-out windows masked);
    scored: the data whose windows are predicted (default ``datasets``; ``identify`` passes the recordings before
    the held-out windows were masked: neither fit saw those, and 0.2-s gaps would cut the 1-s windows in half);
    max_iter: the alternative fit's Levenberg-Marquardt iterations (None: the fit's); start_iterations: Gauss-Newton
    steps on each scored window's start. Measured on the prism and the icosahedron: 2, 3, 5 or 10 iterations of
    the alternative fit gave the same mean squared error ratio to 4 digits (the two laws' optima lie close), on the
    manipulator 2 and 3 gave 0.881 and 0.884; 2 start steps the same as 3 (1 step moved the tower's figure from 2.4
    to 0.9 sigma). The check took 14-17 s on the suite (identify ~35 s without it) and 29 s of identify's 114 s on
    the README's 16-s manipulator bag (2026-11-28), 2-core machine. callback: the alternative fit's progress, as
    :func:`~.refine.refine`'s."""
    t0 = time.perf_counter()
    other, names = swap_actuated_laws(structure)
    file_laws = tuple(s.stiffness_law for s in structure.strings if s.actuator)
    if not names:
        return LawCheck("not_checked", reason="no string has an actuator: with fixed rest lengths both laws are "
                                              "the same model")
    opts = dataclasses.replace(fit.problem.opts, delay_s=fit.delay_s, prior_center=prior_center,
                               **({} if max_iter is None else {"max_iter": int(max_iter)}))
    try:
        alt = refine(other, datasets, fit.params, opts, backend=backend, integrator=integrator, callback=callback)
        mse = []
        for st, res in ((structure, fit), (other, alt)):
            # built with the set's own delay: the forked workers evaluate the problem as it was built
            prob = RefineProblem.for_prediction(st, datasets if scored is None else scored, res.params, opts,
                                                window_s=opts.window_s, max_windows=None, delay_s=res.delay_s,
                                                backend=backend, integrator=integrator)
            with window_workers(prob, opts.workers):
                mse.append((prob.window_ids, fitted_start_mse(prob, res.params, res.delay_s, start_iterations)))
    except IdentificationError as exc:
        return LawCheck("not_checked", names, file_laws, reason=f"the other law could not be fitted: {exc}",
                        seconds=time.perf_counter() - t0)
    (ids_f, mse_f), (ids_o, mse_o) = mse
    if ids_f != ids_o:          # the windows come from the data alone; say so rather than compare unpaired
        return LawCheck("not_checked", names, file_laws, reason="the two models' windows differ",
                        seconds=time.perf_counter() - t0)
    n, mean, se, rms_o, rms_f = paired_log_ratio(mse_f, mse_o)
    ws = float(opts.window_s)
    values = {k: float(v) for k, v in alt.params.named().items()}
    mine = {k: float(v) for k, v in fit.params.named().items()}
    spread = {k: abs(mine[k] - v) / 2 for k, v in values.items() if k in mine}
    if n < min_windows:
        return LawCheck("not_checked", names, file_laws, n, ws, reason=f"{n} window(s) of {ws:g} s scored (need "
                        f"{min_windows})", other_values=values, spread=spread, seconds=time.perf_counter() - t0)
    verdict = paired_verdict(mean, se, margin_sigma, min_relative, VERDICTS[:3])
    return LawCheck(verdict, names, file_laws, n, ws, rms_f, rms_o, mean, se, margin_sigma, values, spread,
                    time.perf_counter() - t0)


def widen(std_devs: Dict[str, float], check: LawCheck) -> Tuple[Dict[str, float], str]:
    """When the data do not tell the laws apart (``no_clear_difference``), either law's fit is as good a model of
    the robot, so a standard deviation that is to hold the truth must hold the model's uncertainty too: the two
    fits as an equal mixture, sigma^2 + (half their difference)^2 per parameter (the values stay the file
    law's). Returns (the standard deviations, a note; empty when nothing changed). Measured on the generality
    suite's tower (seed 0), the one structure the check leaves undecided: from the file with the swapped law,
    80 % of the truths inside +-2 sigma before (stiffness z RMS 2.16), 89 % after; from the right file 98 %
    either way (stiffness z RMS 1.10 -> 0.96)."""
    if check.verdict != "no_clear_difference" or not check.spread:
        return dict(std_devs), ""
    out, grown = add_in_quadrature(std_devs, check.spread)
    return out, (f"standard deviations widened by the string-law model spread (the data do not tell the laws "
                 f"apart): {grown}" if grown else "")
