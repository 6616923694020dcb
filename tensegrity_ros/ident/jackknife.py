"""Standard deviations that follow the fit off its quadratic: a delete-one-window jackknife of the last rung.

The reported sigma (:mod:`.uncertainty`) is the Gauss-Newton covariance at the fit, with the window-block sandwich
and the prior: it describes the objective's quadratic neighbourhood. Where the objective is a long, curved valley
that is not enough. On the manipulator bench (60 parameters, masses not weighed) the masses end 2-40 of their
sigma from the truth (seed 6: 75 % of the truths inside +-2 sigma, masses' z RMS 11.8), and along the line from the
fit to the truth the data-only chi^2 rises 3x less than the quadratic says at a tenth of the way and 64x less at the
truth (docs/identification.md, section 5, "Stop 40"). Which windows the fit sees then decides where along the
valley it ends: fits of one record from different window sets differ by 1 000-1 400 in chi^2 on common windows.

:func:`window_jackknife` measures that dependence directly. For each of the last rung's n windows it refits the
rung from the fit without that window (the same other windows, prior, options and free parameters, a few
Levenberg-Marquardt iterations: the optima lie close) and takes the jackknife variance
(n - 1) / n * sum_k (theta_k - mean)^2 per parameter. :func:`widen` adds it to the reported variance. The two
overlap where the objective is quadratic (both then measure the noise's effect), so the sum errs on the wide side
there; that is the price of holding the valley. Measured on the manipulator bench (docs/identification.md, "The
window jackknife"). Costs n refits, 1.4-2x the rest of ``identify`` on the manipulator bench, so it is an
option (``identify --jackknife``), not the default.

Pure functions over the stage-2 result; no ROS.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..engine import Params
from ..model import Structure
from .data import Dataset
from .errors import IdentificationError
from .refine import RefineResult, refine
from .uncertainty import add_in_quadrature

__all__ = ["Jackknife", "window_jackknife", "widen", "DEFAULT_ITERATIONS", "MIN_WINDOWS"]

#: Levenberg-Marquardt iterations of each refit (the bench's seeds 3 and 6 were measured with 3)
DEFAULT_ITERATIONS = 3
#: fewer windows than this give a jackknife variance with too few degrees of freedom to add
MIN_WINDOWS = 4


@dataclass(frozen=True)
class Jackknife:
    """windows / window_s: the last rung's windows (each left out once); refits: those refitted (a refit that
    fails is left out, and the variance taken over the others); iterations: each refit's; std: the jackknife
    standard deviation per parameter (its unit); seconds; reason: why nothing was measured (then std is empty)."""

    windows: int
    window_s: float
    refits: int = 0
    iterations: int = DEFAULT_ITERATIONS
    std: Dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        if not self.std:
            return f"window jackknife: not made ({self.reason})"
        return (f"window jackknife: {self.refits} refits of the {self.window_s:g}-s rung, each without one of its "
                f"{self.windows} windows ({self.iterations} iterations each, {self.seconds:.0f} s)")


def window_jackknife(structure: Structure, datasets: Sequence[Dataset], fit: RefineResult, prior_center: Params, *,
                     names: Optional[Sequence[str]] = None, iterations: int = DEFAULT_ITERATIONS,
                     backend: str = "nodal", integrator: str = "semi_implicit",
                     callback: Optional[Callable[[Dict[str, Any]], Any]] = None) -> Jackknife:
    """The delete-one-window jackknife of ``fit`` (the last stage-2 run, on ``datasets``; see the module
    docstring). names: the parameters to report (default: every parameter of the fit); prior_center: where the
    fit's prior was centred (each refit keeps it); callback: the refits' progress, as :func:`~.refine.refine`'s."""
    t0 = time.perf_counter()
    prob = fit.problem
    ids = [tuple(w) for w in prob.window_ids]
    n = len(ids)
    ws = float(prob.opts.window_s)
    if n < MIN_WINDOWS:
        return Jackknife(n, ws, reason=f"{n} window(s) in the last rung (need {MIN_WINDOWS})",
                         seconds=time.perf_counter() - t0)
    base = dataclasses.replace(prob.opts, delay_s=fit.delay_s, prior_center=prior_center, max_iter=int(iterations))
    fitted = {k: float(v) for k, v in fit.params.named().items()}
    keys = list(fitted) if names is None else [k for k in names if k in fitted]
    thetas = []
    for k in range(n):
        opts = dataclasses.replace(base, only_windows=tuple(ids[:k] + ids[k + 1:]))
        try:
            res = refine(structure, datasets, fit.params, opts, backend=backend, integrator=integrator,
                         callback=callback)
        except IdentificationError:
            continue
        v = {a: float(b) for a, b in res.params.named().items()}
        if all(math.isfinite(v[a]) for a in keys):
            thetas.append([v[a] for a in keys])
    m = len(thetas)
    if m < MIN_WINDOWS:
        return Jackknife(n, ws, m, iterations, reason=f"only {m} of {n} refits succeeded",
                         seconds=time.perf_counter() - t0)
    T = np.asarray(thetas)
    sd = np.sqrt((m - 1) / m * ((T - T.mean(axis=0)) ** 2).sum(axis=0))
    return Jackknife(n, ws, m, iterations, {a: float(s) for a, s in zip(keys, sd)}, time.perf_counter() - t0)


def widen(std_devs: Dict[str, float], jk: Jackknife, skip: Sequence[str] = ()) -> Tuple[Dict[str, float], str]:
    """sigma^2 + jackknife^2 per parameter (those in ``skip``, e.g. kept at the prior, unchanged). Returns (the
    standard deviations, a note; empty when nothing changed)."""
    out, grown = add_in_quadrature(std_devs, {n: j for n, j in jk.std.items() if math.isfinite(j)}, skip)
    return out, (f"standard deviations widened by the window jackknife ({jk.refits} refits, each without one of the "
                 f"{jk.window_s:g}-s rung's {jk.windows} windows): {grown}" if grown else "")
