"""Never worse than the prior without saying so: a final check on windows the fit did not see, and the
parameters the data cannot move.

* :func:`reserve_held_out`: before the fit, about 10 % of the recordings' time, in short windows spread
  evenly over them, is set aside (marked invalid in the fit's copy of the data), so the check scores data the
  fit never saw.
* :func:`compare_on_held_out`: the fit and the nominal (prior) predict those windows, each window's start
  fitted for each set (positions and velocities of the free nodes, the parameters held: a measured start
  carries the marker noise into the whole window); per window the log ratio of their mean squared errors, its
  mean and standard error. The fit is ``better`` / ``worse`` when the mean is beyond ``margin_sigma``
  standard errors AND the mean squared error differs by at least ``min_relative`` (5 %), else
  ``no_clear_difference``.
* :func:`prior_dominated`: parameters whose posterior standard deviation is still above ``ratio`` x the
  prior's: the data do not determine them, so they keep the prior's value and standard deviation.

Pure functions over the stage-2 problem; no ROS.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..engine import Params
from ..model import Structure
from ..param_names import RELATIVE_KINDS, kind_of
from .data import Dataset
from .errors import IdentificationError
from .refine import RefineOptions, RefineProblem, without_windows

__all__ = ["HeldOutCheck", "reserve_held_out", "compare_on_held_out", "prior_dominated", "prior_std_of",
           "fitted_start_mse", "paired_log_ratio", "paired_verdict"]


@dataclass(frozen=True)
class HeldOutCheck:
    """windows: held-out windows scored (0: none left, ``verdict`` = ``not_checked``); window_s;
    fit_rms_m / prior_rms_m: open-loop prediction RMS of the fit and of the nominal over them (m);
    log_ratio_mean / log_ratio_se: mean and standard error of ln(nominal MSE / fit MSE) per window;
    verdict: ``better`` | ``worse`` | ``no_clear_difference`` | ``not_checked``; margin_sigma."""

    windows: int
    window_s: float
    fit_rms_m: float
    prior_rms_m: float
    log_ratio_mean: float
    log_ratio_se: float
    verdict: str
    margin_sigma: float
    reason: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        if self.verdict == "not_checked":
            return f"held-out check: not made ({self.reason})"
        head = {"better": "held-out check: the fit predicts better than the nominal",
                "worse": "HELD-OUT CHECK: THE FIT PREDICTS WORSE THAN THE NOMINAL",
                "no_clear_difference": "held-out check: the fit and the nominal predict alike"}
        return (f"{head[self.verdict]}: prediction RMS {self.fit_rms_m * 1e3:.3g} mm vs the nominal's "
                f"{self.prior_rms_m * 1e3:.3g} mm over {self.windows} unseen {self.window_s:g}-s windows, starts fitted "
                f"(mean squared error {math.exp(-self.log_ratio_mean):.2f}x the nominal's, "
                f"{self.log_ratio_mean / self.log_ratio_se if self.log_ratio_se > 0 else math.inf:.1f} sigma)")


def reserve_held_out(structure: Structure, datasets: Sequence[Dataset], start: Params,
                     options: Optional[RefineOptions] = None, *, window_s: float = 0.2, fraction: float = 0.1,
                     min_windows: int = 3, max_windows: int = 16, backend: str = "nodal",
                     integrator: str = "semi_implicit") -> Tuple[List[Dataset], Optional[RefineProblem]]:
    """Set aside held-out windows before the fit.

    About ``fraction`` of the recordings' time, in windows of ``window_s`` (at least ``min_windows``, at most
    ``max_windows``) spread evenly over them (never the first or the last), become the open-loop prediction
    problem of the final check; in the returned copies of ``datasets`` (the fit's data) their samples are
    marked invalid, so no fitted window sees them. ``options``: the fit's stage-2 options (delay, derivatives,
    device, engine: the held-out windows are predicted as the fit's are). Returns (fit datasets, held-out problem
    or None when the recordings are too short: then the datasets are returned unchanged)."""
    try:
        cand = RefineProblem.for_prediction(structure, datasets, start, options, window_s=window_s, max_windows=None,
                                            backend=backend, integrator=integrator)
    except IdentificationError:
        return list(datasets), None
    total = sum(d.duration for d in datasets)
    n = int(min(max_windows, max(min_windows, math.floor(fraction * total / window_s))))
    if cand.B_win < n + 2:
        return list(datasets), None
    pick = np.unique(np.linspace(0, cand.B_win - 1, n + 2).round().astype(int)[1:-1]).tolist()
    held = cand.subset(pick)
    return without_windows(datasets, held), held


def compare_on_held_out(prob: Optional[RefineProblem], fit: Params, prior: Params, *, fit_delay_s: float = 0.0,
                        prior_delay_s: float = 0.0, margin_sigma: float = 2.0, min_windows: int = 3,
                        start_iterations: int = 3, min_relative: float = 0.05) -> HeldOutCheck:
    """The fit against the nominal on the held-out windows (see the module docstring)."""
    ws = float(prob.opts.window_s) if prob is not None else math.nan
    if prob is None or prob.B_win < min_windows:
        n = 0 if prob is None else prob.B_win
        return HeldOutCheck(n, ws, math.nan, math.nan, math.nan, math.nan, "not_checked", margin_sigma,
                            f"{n} held-out window(s) (need {min_windows}): the recording is too short to set "
                            "data aside, or the check was not asked for")
    f = fitted_start_mse(prob, fit, fit_delay_s, start_iterations)
    a = fitted_start_mse(prob, prior, prior_delay_s, start_iterations)
    n, mean, se, rms_f, rms_a = paired_log_ratio(a, f)
    if n < min_windows:
        return HeldOutCheck(n, ws, math.nan, math.nan, math.nan, math.nan, "not_checked", margin_sigma,
                            "held-out predictions not finite")
    return HeldOutCheck(n, ws, rms_f, rms_a, mean, se, paired_verdict(mean, se, margin_sigma, min_relative,
                                                                      ("better", "worse", "no_clear_difference")),
                        margin_sigma)


def paired_log_ratio(a_mse: np.ndarray, b_mse: np.ndarray) -> Tuple[int, float, float, float, float]:
    """Two parameter sets' per-window mean squared errors on the same windows, paired: (windows, mean and standard
    error of ln(a / b) per window (> 0: b predicts better), RMS of b, RMS of a). Windows where either is not finite
    and positive are left out. Log ratios, not differences: window errors differ by orders of magnitude, their
    ratios much less, so one violent window does not swamp the others."""
    a, b = np.asarray(a_mse, dtype=float), np.asarray(b_mse, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    n = int(ok.sum())
    if n < 2:
        return n, math.nan, math.nan, math.nan, math.nan
    r = np.log(a[ok]) - np.log(b[ok])
    return (n, float(r.mean()), float(r.std(ddof=1) / math.sqrt(n)), float(math.sqrt(b[ok].mean())),
            float(math.sqrt(a[ok].mean())))


def paired_verdict(mean: float, se: float, margin_sigma: float, min_relative: float,
                   names: Tuple[str, str, str]) -> str:
    """``names[0]`` when the mean log ratio is beyond ``margin_sigma`` standard errors above 0 AND the typical
    mean squared error falls by at least ``min_relative``; ``names[1]`` for the same below 0; else ``names[2]``."""
    rel = 1.0 - math.exp(-mean)
    if mean > margin_sigma * se and rel >= min_relative:
        return names[0]
    if mean < -margin_sigma * se and -rel >= min_relative:
        return names[1]
    return names[2]


#: dtype of the start columns in :func:`fitted_start_mse`'s Gauss-Newton steps. The steps only move each window's
#: start toward its best fit, and every trial is scored with float64 residuals, so float32's ~1e-6 (relative)
#: columns leave the verdicts as they were: on the README's 16-s manipulator bag the held-out check's figure moved
#: from 17.9 to 17.8 standard errors and the string-law check's was the same to every printed digit, while the
#: start fits took 24.5 s instead of 33.1 s (identify 116 s instead of 132 s, 2026-11-28, 2-core machine).
#: (The fit's own Jacobians stay in the fit's dtype: see :attr:`~.refine.RefineOptions.tangent_dtype`.)
#: Where the step's tangent fused in C runs (float64 only, :func:`..engine.native.rollout_tangents`), the start
#: fits take float64 columns from it instead: faster than the dense model's float32 ones, and exact.
START_FIT_TANGENT_DTYPE = torch.float32


def fitted_start_mse(prob: RefineProblem, params: Params, delay_s: float = 0.0, iterations: int = 3) -> np.ndarray:
    """(B,) mean squared 3-D position error (m^2) of ``params`` on each window of ``prob`` after fitting only that
    window's start (positions and velocities of the free nodes; Gauss-Newton, ``iterations`` steps with the start
    columns in :data:`START_FIT_TANGENT_DTYPE` or from the native kernel in float64, the stage-2 truncation
    :data:`~.refine.X0_RCOND`): the parameters are judged, not the noise of a measured start (open loop from the
    measured starts the 1-mm marker noise alone gave ~10 mm over 0.2 s on the hoist)."""
    from .refine import X0_RCOND, truncated_inverse
    p = prob.with_params(params, delay_s)
    w = p.initial_w(float(delay_s))
    nf = len(p.top.free_nodes)
    x0 = torch.zeros(p.B_win, nf, 6, dtype=p.dtype, device=p.device)
    n = p.mask.reshape(p.B_win, -1).sum(dim=1).clamp(min=1).to(p.dtype)

    def mse_of(x):
        r = p.residuals(w, x)
        m = (r * r).sum(dim=(1, 2, 3)) / n
        return torch.where(torch.isfinite(m), m, torch.full_like(m, math.inf))

    tangent_dtype = None if p._native_tangents() else START_FIT_TANGENT_DTYPE
    with torch.no_grad():
        cur = mse_of(x0)
        for _ in range(max(int(iterations), 0)):
            # the starts' columns alone (the parameters are held); J_e^+ r through the normal equations with the
            # squared cut (the same directions as a pseudo-inverse cut at X0_RCOND): the products formed where the
            # Jacobian is (a window worker), a 6 nf eigendecomposition per window instead of an SVD of the window's
            # rows (the held-out check's 88 SVDs took 1.4 s on the 16-s bag, stop 54)
            _, _, _, Hee, _, ge = p.normal_blocks(w, x0, "auto", tangent_dtype, True)
            Hee, ge = Hee.to(torch.float64), ge.to(torch.float64)
            step = (truncated_inverse(Hee, X0_RCOND ** 2) @ ge.unsqueeze(-1)).squeeze(-1)
            step = step.to(p.dtype).reshape(x0.shape)
            step = torch.nan_to_num(step, nan=0.0, posinf=0.0, neginf=0.0)
            todo = torch.ones(p.B_win, dtype=torch.bool, device=p.device)
            for alpha in (1.0, 0.5, 0.25, 0.125):      # per window: keep a step only if it lowers that window's error
                trial = x0 - alpha * step * todo[:, None, None].to(p.dtype)
                m = mse_of(trial)
                ok = todo & (m < cur)
                x0 = torch.where(ok[:, None, None], trial, x0)
                cur = torch.where(ok, m, cur)
                todo = todo & ~ok
                if not bool(todo.any()):
                    break
    return cur.cpu().numpy()


def prior_std_of(name: str, center: float, prior_std: Mapping[str, float]) -> Optional[float]:
    """The prior's standard deviation of parameter ``name`` in its own unit, or None: relative for the
    log-parametrised kinds (x |centre|), absolute for the others, as the refinement applies it (an entry under
    the parameter's own name overrides its kind's)."""
    kind = kind_of(name)
    sd = prior_std.get(name, prior_std.get(kind))
    if sd is None or not sd > 0:
        return None
    return float(sd) * abs(center) if kind in RELATIVE_KINDS else float(sd)


def prior_dominated(std_devs: Mapping[str, float], center: Mapping[str, float], prior_std: Mapping[str, float],
                    ratio: float = 0.9) -> Dict[str, Tuple[float, float]]:
    """{name: (posterior std, prior std)} of the parameters whose posterior std exceeds ``ratio`` x the prior's."""
    out = {}
    for n, sd in std_devs.items():
        p = prior_std_of(n, center.get(n, math.nan), prior_std)
        if p is not None and p > 0 and math.isfinite(sd) and sd > ratio * p:
            out[n] = (float(sd), p)
    return out
