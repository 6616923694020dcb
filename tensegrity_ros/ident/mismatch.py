"""Model-mismatch detection: can the fitted model explain the data down to the measurement noise?

After a fit, two questions are asked of the stage-2 residuals r (measured minus predicted node positions on
the multiple-shooting windows, initial states fitted):

1. **Is the residual larger than the noise?** The measurement noise is estimated from the data alone, from
   the high-frequency content of the labelled node tracks: for white noise of std sigma, the n-th
   difference (n = ``difference_order``, default 6) has variance C(2n, n) sigma^2 (924 sigma^2 for n = 6),
   while a motion sampled at 120 Hz barely enters it: a signal at frequency f is multiplied by
   (2 sin(pi f / f_s))^n, so a 1 Hz motion vanishes, and a 1-mm, 25-Hz vibration (a lightly damped mode)
   adds 6 % to a 0.3-mm noise estimate at n = 6 against 21 % at n = 3 (test_ident_mismatch). Modes near
   f_s / 3 and above cannot be told from noise by any model-free estimate: they raise the noise estimate,
   which makes the ratio test below more lenient, never stricter. The scale is the median absolute
   deviation (1.4826 MAD, robust to label swaps and spikes) of the differences over every run of n + 1
   regularly spaced valid samples of every observed node coordinate, divided by sqrt(C(2n, n)). The residual's
   std is sqrt(RSS / (n_residuals - n_unknowns)) (the fitted parameters and window starts removed), and
   ``ratio`` = residual std / noise std is ~1 when the model explains the data.
2. **Is the residual structured in time?** Noise is white; what a wrong model leaves behind is smooth.
   Every (window, node, axis) residual series gives autocorrelations at lags 1..``lags`` (pooled over
   all series, pairs where both samples are observed); the Ljung-Box-type statistic
   Q = sum_k n_k rho_k^2 is chi^2 with ``lags`` degrees of freedom for white residuals. The size of the
   structured part is estimated separately from the lag-1 autocovariance (white noise contributes
   nothing to it): ``structured_rms_m`` = sqrt(max(gamma_1, 0)).

The model is flagged (``mismatch``) when the residual exceeds max(noise, ``floor_m``) by more than
``max_ratio``, or when the residual is significantly structured (p < ``alpha``) AND that structure is large
against the noise (lag-1 autocorrelation above ``max_lag1``) and above ``floor_m`` (0.5 mm: model errors
smaller than a marker are not flagged; noise-free simulations would otherwise flag every model). A fit that
one more Gauss-Newton step would still improve a lot is ``fit_not_converged`` instead. Both figures are effect sizes, so a recording with many
samples does not flag a model whose error is real but far below the noise.

Pure functions over numpy arrays; no torch, no ROS.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = ["MismatchOptions", "NoiseEstimate", "ResidualStructure", "ModelMismatch", "noise_from_tracks",
           "residual_structure", "check_model"]

#: 1.4826 MAD = std for a Gaussian
MAD_TO_STD = 1.482602218505602


@dataclass(frozen=True)
class MismatchOptions:
    """Thresholds of :func:`check_model`.

    max_ratio: residual std / noise std above this is a mismatch (the right model gives ~1.0; measured on
        twin recordings of the hoist, 1.00-1.03).
    max_lag1 / alpha: a residual whose pooled lag-1 autocorrelation exceeds ``max_lag1`` and whose
        Ljung-Box statistic over ``lags`` lags has p < ``alpha`` is structured: a mismatch. A lag-1
        autocorrelation rho means a smooth part of rms sqrt(rho / (1 - rho)) x the noise: 0.2 is half the noise.
    difference_order: order n of the differences of the noise estimate (variance C(2n, n) sigma^2).
    regular_tol: successive samples whose spacing differs from the median by more than this fraction are not
        used by the noise estimate (a dropped frame doubles it); smaller jitter is taken for stamps rounded to the
        millisecond (120 Hz stamped 8, 8, 9 ms), the samples themselves regular.
    min_differences: fewer differences than this: no noise estimate (the check is then not made).
    max_unconverged: see :func:`check_model` (``gn_rss_decrease_m2``).
    floor_m: the smallest model error worth flagging (m): the residual is judged against max(noise, floor_m), and
        a structured part below it is not flagged. Without it noise-free data flag every model: the identifying
        engine's own step differs from a recording's by ~0.3 mm on the actuated pendulum (test_nodes_identifier).
    """

    max_ratio: float = 1.3
    max_lag1: float = 0.2
    alpha: float = 1e-3
    lags: int = 5
    difference_order: int = 6
    regular_tol: float = 0.25
    min_differences: int = 30
    max_unconverged: float = 0.5
    floor_m: float = 5e-4

    def __post_init__(self):
        if not (self.max_ratio > 1.0 and 0.0 < self.max_lag1 < 1.0 and 0.0 < self.alpha < 1.0):
            raise ValueError(f"MismatchOptions: need max_ratio > 1, 0 < max_lag1 < 1, 0 < alpha < 1 (got {self})")
        if not (self.lags >= 1 and self.difference_order >= 1 and self.min_differences >= 1):
            raise ValueError(f"MismatchOptions: need lags, difference_order, min_differences >= 1 (got {self})")


@dataclass(frozen=True)
class NoiseEstimate:
    """std_m: the white measurement noise per coordinate (m); n: differences used; per_axis_m: (3,) x, y, z."""

    std_m: float
    n: int
    per_axis_m: Tuple[float, float, float]


@dataclass(frozen=True)
class ResidualStructure:
    """rho: pooled autocorrelations at lags 1..L; q: Ljung-Box-type statistic; p_value: its chi^2 tail
    probability (L degrees of freedom); structured_rms_m: sqrt(max(lag-1 autocovariance, 0)); pairs: lag-1 pairs."""

    rho: Tuple[float, ...]
    q: float
    p_value: float
    structured_rms_m: float
    pairs: int


@dataclass(frozen=True)
class ModelMismatch:
    """The verdict of :func:`check_model`, with its figures and the thresholds it was judged by.

    mismatch: the model does not explain the data (None: not checked, ``reason`` says why); reason: one
    line; converged: False when one more Gauss-Newton step would remove most of the residual's excess (None: not
    known); noise_std_m: the noise estimated from the tracks; residual_std_m: the fit's residual std per
    coordinate (dof-corrected); ratio: residual / noise; lag1: pooled lag-1 autocorrelation of the residual;
    ljung_box_q / ljung_box_p / lags; structured_rms_m; n_residuals / n_unknowns; options: the thresholds."""

    mismatch: Optional[bool]
    reason: str
    converged: Optional[bool]
    noise_std_m: float
    residual_std_m: float
    ratio: float
    lag1: float
    ljung_box_q: float
    ljung_box_p: float
    lags: int
    structured_rms_m: float
    n_residuals: int
    n_unknowns: int
    options: MismatchOptions

    @property
    def status(self) -> str:
        """``model_mismatch``, ``model_ok``, ``fit_not_converged`` or ``model_not_checked``."""
        if self.mismatch is None:
            return "fit_not_converged" if self.converged is False else "model_not_checked"
        return "model_mismatch" if self.mismatch else "model_ok"

    def to_dict(self) -> Dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "options"}
        d["status"] = self.status
        d["thresholds"] = asdict(self.options)
        return d

    def line(self) -> str:
        """One console line."""
        if self.mismatch is None:
            return f"model check: {'FIT NOT CONVERGED' if self.converged is False else 'not made'} ({self.reason})"
        head = "MODEL MISMATCH" if self.mismatch else "model check OK"
        return f"{head}: {self.reason}"


def noise_from_tracks(times: np.ndarray, positions: np.ndarray, valid: np.ndarray, nodes: Sequence[int],
                      order: int = 6, regular_tol: float = 0.25) -> NoiseEstimate:
    """White measurement noise of the labelled tracks (see the module docstring).

    times: (T,) s; positions: (T, N, 3) m; valid: (T, N) bool; nodes: indices of the observed nodes.
    Returns NaN std when fewer than one difference exists."""
    t = np.asarray(times, dtype=float)
    X = np.asarray(positions, dtype=float)[:, list(nodes)]              # (T, n, 3)
    V = np.asarray(valid, dtype=bool)[:, list(nodes)] & np.all(np.isfinite(X), axis=2)
    if t.size < order + 2:
        return NoiseEstimate(math.nan, 0, (math.nan,) * 3)
    dt = np.diff(t)
    med = float(np.median(dt))
    regular = np.abs(dt - med) <= regular_tol * med                      # (T-1,)
    coef = np.array([math.comb(order, j) * (-1) ** (order - j) for j in range(order + 1)], dtype=float)
    T = t.size
    n_d = T - order
    d = np.zeros((n_d,) + X.shape[1:])
    ok = np.ones((n_d, X.shape[1]), dtype=bool)
    reg_ok = np.ones(n_d, dtype=bool)
    for j in range(order + 1):
        d += coef[j] * np.nan_to_num(X[j:j + n_d])
        ok &= V[j:j + n_d]
        if j < order:
            reg_ok &= regular[j:j + n_d]
    ok &= reg_ok[:, None]
    scale = math.sqrt(float((coef ** 2).sum()))                          # C(2 order, order)
    per_axis = []
    for a in range(3):
        v = d[..., a][ok]
        per_axis.append(MAD_TO_STD * float(np.median(np.abs(v - np.median(v)))) / scale if v.size else math.nan)
    allv = d[ok].reshape(-1)
    std = MAD_TO_STD * float(np.median(np.abs(allv - np.median(allv)))) / scale if allv.size else math.nan
    return NoiseEstimate(std, int(allv.size), tuple(per_axis))


def residual_structure(residuals: np.ndarray, mask: np.ndarray, lags: int = 5) -> ResidualStructure:
    """Pooled autocorrelation of residual time series.

    residuals: (B, H, No, 3) m (B windows of H samples, No nodes); mask: (B, H, No) bool (observed)."""
    r = np.asarray(residuals, dtype=float)
    m = np.asarray(mask, dtype=bool)[..., None] & np.isfinite(r)
    m = np.broadcast_to(m, r.shape)
    r = np.where(m, r, 0.0)
    # series along axis 1 (time within a window)
    c0 = float((r * r)[m].sum())
    n0 = int(m.sum())
    if n0 == 0 or c0 <= 0:
        return ResidualStructure((), math.nan, math.nan, math.nan, 0)
    var = c0 / n0
    rho, q, pairs1, gamma1 = [], 0.0, 0, math.nan
    H = r.shape[1]
    for k in range(1, max(1, min(lags, H - 1)) + 1):
        if k >= H:
            break
        both = m[:, k:] & m[:, :-k]
        nk = int(both.sum())
        if nk == 0:
            break
        ck = float((r[:, k:] * r[:, :-k])[both].sum()) / nk
        rk = ck / var
        rho.append(rk)
        q += nk * rk * rk
        if k == 1:
            pairs1, gamma1 = nk, ck
    if not rho:
        return ResidualStructure((), math.nan, math.nan, math.nan, 0)
    from scipy.stats import chi2
    p = float(chi2.sf(q, len(rho)))
    return ResidualStructure(tuple(rho), float(q), p, math.sqrt(max(gamma1, 0.0)), pairs1)


def check_model(times_positions_valid: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]], nodes: Sequence[int],
                residuals: np.ndarray, mask: np.ndarray, n_unknowns: int,
                options: MismatchOptions = MismatchOptions(), gn_rss_decrease_m2: Optional[float] = None
                ) -> ModelMismatch:
    """Judge a fit (see the module docstring).

    times_positions_valid: per recording (times (T,), positions (T, N, 3), valid (T, N)), the data the
        noise is estimated from; nodes: the observed node indices; residuals: (B, H, No, 3) m, the fit's
        residuals on its windows; mask: (B, H, No); n_unknowns: the fitted quantities (parameters and
        window starts) for the residual's degrees of freedom; gn_rss_decrease_m2: the decrease of the residual sum
        of squares (m^2) one more Gauss-Newton step would bring (``Covariance.calibration``). When that step
        would remove more than ``max_unconverged`` of the residual's excess over the noise, the residual says
        nothing about the model yet: status ``fit_not_converged``, ``mismatch`` None.
    """
    o = options
    ests = [noise_from_tracks(t, X, V, nodes, o.difference_order, o.regular_tol) for t, X, V in times_positions_valid]
    ests = [e for e in ests if e.n > 0 and math.isfinite(e.std_m)]
    n_d = sum(e.n for e in ests)
    noise = math.sqrt(sum(e.n * e.std_m ** 2 for e in ests) / n_d) if n_d else math.nan
    r = np.asarray(residuals, dtype=float)
    mk = np.asarray(mask, dtype=bool)
    n_res = int(3 * mk.sum())
    rss = float(np.nansum(np.where(mk[..., None], r, 0.0) ** 2))
    dof = n_res - int(n_unknowns)
    res_std = math.sqrt(rss / dof) if dof > 0 else math.nan
    st = residual_structure(r, mk, o.lags)
    lag1 = st.rho[0] if st.rho else math.nan
    common = dict(noise_std_m=noise, residual_std_m=res_std, ratio=res_std / noise if noise > 0 else math.nan,
                  lag1=lag1, ljung_box_q=st.q, ljung_box_p=st.p_value, lags=len(st.rho),
                  structured_rms_m=st.structured_rms_m, n_residuals=n_res, n_unknowns=int(n_unknowns), options=o)
    excess = rss - max(dof, 0) * noise ** 2 if noise > 0 else math.nan
    unconverged = bool(gn_rss_decrease_m2 is not None and math.isfinite(excess) and excess > 0
                       and gn_rss_decrease_m2 > o.max_unconverged * excess)
    common["converged"] = None if gn_rss_decrease_m2 is None else not unconverged
    if n_d < o.min_differences or not noise > 0:
        return ModelMismatch(None, f"too few regularly sampled track differences for a noise estimate ({n_d})",
                             **common)
    if not (dof > 0 and math.isfinite(res_std) and st.rho):
        return ModelMismatch(None, f"too few residuals ({n_res} for {n_unknowns} unknowns)", **common)
    ratio = common["ratio"]
    figures = (f"residual {res_std * 1e3:.3g} mm vs noise {noise * 1e3:.3g} mm from the tracks (ratio {ratio:.2f}, "
               f"limit {o.max_ratio:g}); lag-1 autocorrelation {lag1:+.2f} (limit {o.max_lag1:g}), Ljung-Box "
               f"Q = {st.q:.1f} over {len(st.rho)} lags, p = {st.p_value:.2g}; structured part "
               f"{st.structured_rms_m * 1e3:.3g} mm (floor {o.floor_m * 1e3:.2g} mm)")
    why = []
    eff = max(noise, o.floor_m)
    if res_std > o.max_ratio * eff:
        why.append("the residual exceeds the measurement noise")
    if lag1 > o.max_lag1 and st.p_value < o.alpha and st.structured_rms_m > o.floor_m:
        why.append("the residual is structured in time")
    if why and unconverged:
        return ModelMismatch(None, f"one more Gauss-Newton step would remove {gn_rss_decrease_m2 / excess:.0%} of the "
                             "residual's excess over the noise, so the residual does not judge the model yet; "
                             + figures, **common)
    if why:
        what = ("the model cannot explain the data (e.g. a wrong string law); " if common["converged"] else
                "the fitted model does not explain the data (a model that cannot, e.g. a wrong string law, or a fit "
                "that has not converged); ")
        return ModelMismatch(True, " and ".join(why) + ": " + what + figures, **common)
    return ModelMismatch(False, figures, **common)
