"""Is the engine's step fine enough for the fit? Halve it, and see how far the estimate would move.

Identification rolls the engine out with steps of ``RefineProblem.sim_dt`` (the sampling period split into
steps within the stability limit and ``max_sim_dt``; see :func:`.refine.max_step_for_noise`). A step too long
for the motion biases the parameters, and the residual does not show it: the fit absorbs the discretisation
error into stiffnesses, dampings and rest lengths and lands as close to the data as at a fine step. The check
asks the question in the units that matter: the fitted parameters and window starts are rolled out again at half
the step, and the change of the predictions goes through the covariance's Gauss-Newton system
(:func:`.uncertainty.gauss_newton_covariance`, ``prediction_change``): the step the estimate would take to follow
it, window starts refitted, per parameter in units of that parameter's sigma. A first-order method's bias is
about twice that shift (4/3 of it where the error is a smooth mode's frequency error, second order). Above
``threshold`` sigma the last rung is refitted at half the step, up to ``halvings`` times.

Where it matters: strings that go slack. The pull-only gate switches a string's force off and on, and
semi-implicit Euler places each switch only to within a step, an O(h) error where smooth motion has O(h^2).
Measured on the test hoist of ``test_ident_uncertainty.py`` (a 1-kg rod on two actuated strings, its two lateral
strings slack 60 % of the time; MuJoCo-twin recordings, 6 s at 125 Hz, 1 mm noise, 16 windows of 0.5 s, 6 seeds;
the engine step fixed): 2 ms (the default there), 89 % of the truths inside +-2 sigma, z-RMS 1.25-1.38, the actuated
strings' stiffnesses low in 11 of 12 fits; 1 ms, 92 %, 1.06-1.20; 0.5 ms, 93 %, 0.94-1.17. The predictions' own
change is reported beside (``differences_m``, RMS per coordinate), but does not rank the cases: 0.12-0.15 mm at
2 ms on the hoist (the estimate 0.59-1.1 sigma), 0.07-0.10 mm on the generality suite's structures at 1.67 ms
(0.21-0.52 sigma; docs/identification.md, "The engine's step"). What matters is whether the change lies along the
parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

import torch

__all__ = ["StepCheck", "halving_change", "largest_shift"]

#: refit at half the step when halving it would move some estimate by more than this many of its sigmas
DEFAULT_THRESHOLD_SIGMA = 0.25
#: at most this many refits, each at half the step before
DEFAULT_HALVINGS = 2


def halving_change(ref) -> torch.Tensor:
    """(B, H, No, 3) m: a stage-2 result's predictions (its parameters and fitted window starts) at half its engine
    step minus the same at its step, zero where nothing is observed."""
    prob = ref.problem
    w = ref.w.detach()
    x0 = None if ref.x0 is None else ref.x0.detach()
    with torch.no_grad():
        return prob.with_step(prob.sim_dt / 2).residuals(w, x0) - prob.residuals(w, x0)


def largest_shift(shift: Mapping[str, float], std: Mapping[str, float]) -> Tuple[str, float]:
    """(name, |shift| / sigma) of the parameter that a change moves most in units of its sigma."""
    ratios = {n: abs(v) / std[n] for n, v in shift.items() if std.get(n, 0.0) > 0}
    if not ratios:
        return "", 0.0
    name = max(ratios, key=ratios.get)
    return name, float(ratios[name])


@dataclass(frozen=True)
class StepCheck:
    """steps_s: the engine steps the last rung was fitted with, in order (the last one stands); per step,
    shifts_sigma: how far halving it would move the estimate, the largest |shift| / sigma over the parameters, and
    worst: that parameter; differences_m: the predictions' change (RMS per coordinate, m); threshold_sigma."""

    steps_s: Tuple[float, ...]
    shifts_sigma: Tuple[float, ...]
    worst: Tuple[str, ...]
    differences_m: Tuple[float, ...]
    threshold_sigma: float

    @property
    def step_s(self) -> float:
        return self.steps_s[-1]

    @property
    def ok(self) -> bool:
        """Halving the step that stands moves no estimate by more than the threshold."""
        return bool(self.shifts_sigma[-1] <= self.threshold_sigma)

    def line(self) -> str:
        ms = lambda h: f"{h * 1e3:.3g} ms"  # noqa: E731
        def moved(k):
            return (f"{self.shifts_sigma[k]:.2g} sigma ({self.worst[k]}; predictions "
                    f"{self.differences_m[k] * 1e3:.2g} mm RMS)")
        head = (f"engine step {ms(self.step_s)}: halving it would move the estimate {moved(-1)}, "
                f"{'within' if self.ok else 'MORE than'} {self.threshold_sigma:g} sigma")
        if len(self.steps_s) > 1:
            head += ("; the last rung refitted at " + ", ".join(ms(h) for h in self.steps_s[1:]) + " (at "
                     + "; at ".join(f"{ms(h)}: {moved(k)}" for k, h in enumerate(self.steps_s[:-1])) + ")")
        if not self.ok:
            head += "; the step's bias may exceed sigma (give a shorter one: RefineOptions.sim_dt)"
        return head

    def to_dict(self) -> Dict[str, Any]:
        return {"step_s": self.step_s, "ok": self.ok, "steps_s": list(self.steps_s),
                "shifts_sigma": list(self.shifts_sigma), "worst": list(self.worst),
                "differences_m": list(self.differences_m), "threshold_sigma": self.threshold_sigma}
