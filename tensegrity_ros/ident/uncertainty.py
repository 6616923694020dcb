"""Gauss-Newton covariance of the refined parameters and identifiability.

For the stage-2 residuals r(v) (masked position errors, m) at the optimum, with v = [w (free parameters in
the unconstrained space, gauge direction removed; delay), e (per-window initial-state offsets)]:

    H = J^T J,   Cov(w) = sigma^2 [H_ww - sum_k H_we,k H_ee,k^-1 H_ew,k]^+      (Schur complement: the
                                                                           window starts are marginalised)
    sigma^2 = RSS / (n_residuals - n_unknowns)   (or the given noise level)

J comes from :meth:`RefineProblem.jacobian_blocks` (one engine rollout whose batch carries a copy of every
window per column: central differences by default, or exact forward-mode dual numbers); one column per
free parameter plus one per initial-state coordinate shared by all windows (window k's residuals depend
only on its own start, so the shared column yields every window's block at once). :func:`jacobian` is a
generic ``torch.func`` Jacobian for other residual functions. The covariance
of the unconstrained vector z = z_start + K B w is mapped to physical units through the transforms'
derivatives (exp: x, sigmoid bound: (hi - lo) s (1 - s)). When only ratios are identifiable (scale gauge)
the covariance is also mapped through the final rescaling to the total-mass anchor.

Identifiability (per parameter, in [0, 1]): 0 for parameters that are only identifiable as ratios (the
gauge) and for directions of H below ``rank_tol``; otherwise 1 - std / reference, reference = |value|
(1 % of the nominal rest length for rest lengths, 0.1 rad for zero offsets, 10 ms for the delay). Weakly
identifiable COMBINATIONS (eigenvectors of the correlation-normalised covariance with a large variance)
are listed in ``weak_directions``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ..engine.params import REST_LENGTH_BOUNDS
from ..param_names import GAUGE_KINDS, TRANSFORMS, element_of, join_name, kind_of
from .refine import DELAY_UNIT_S, RefineProblem, truncated_inverse
from .regression import identifiability_reference
from .workers import window_workers

__all__ = ["Covariance", "jacobian", "gauss_newton_covariance", "physical_jacobian_diag", "CALIBRATIONS",
           "add_in_quadrature"]

#: ``gauss_newton_covariance(calibrate=...)``
CALIBRATIONS = ("sandwich", "none")
#: relative eigenvalue cut of a window's start block (J_e^T J_e) when the starts are eliminated. The block's stiff
#: bar-end directions reach its rounding floor (~1e-16 of the largest eigenvalue, refine.X0_RCOND); a plain
#: pseudo-inverse cut at n eps ~ 2e-14, amid that floor, kept or dropped some of them by chance: the standard
#: deviations of the manipulator's 16-s bag moved 0.4 % when the tangent kernel summed in another order (stop 54).
#: Cut at 1e-12 they agree to 1e-5 between the two orders (and lie -10 to +0.5 %, median -1 %, from the plain
#: pseudo-inverse's); cut where the fit truncated (1e-8; X0_RCOND ** 2 = 1e-6 since stop 55) they fell up to 60 %,
#: treating those starts as known.
START_ELIMINATION_RTOL = 1e-12


@dataclass
class Covariance:
    """names: free parameter names (+ ``delay_s``); cov: (p, p) physical units; std_devs / identifiability /
    identifiable by name; ratios: {"a/b": (value, std)} (gauge problems); weak_directions: readable
    combinations; sigma_m: the residual noise level used; gauge: anchor description ('' if none)."""

    names: List[str]
    cov: np.ndarray
    std_devs: Dict[str, float]
    identifiability: Dict[str, float]
    identifiable: Dict[str, bool]
    ratios: Dict[str, Tuple[float, float]]
    weak_directions: List[str]
    sigma_m: float
    gauge: str
    notes: List[str] = field(default_factory=list)
    #: how the standard deviations were calibrated: method, noise_std_m (the loss's weighting), residual_std_m
    #: (the residual's actual std), windows, rss_m2 and gn_rss_decrease_m2 (what one more Gauss-Newton step would
    #: take off it); with the sandwich also model_std_devs (the uncalibrated
    #: sigma^2 (J^T J + prior)^-1 ones) and block_over_white (per parameter, block / white sandwich std)
    calibration: Dict[str, object] = field(default_factory=dict)
    #: with ``prediction_change``: by name, the step the estimate would take to follow that change (physical units)
    shift: Dict[str, float] = field(default_factory=dict)


def jacobian(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str = "auto",
             chunk: Optional[int] = None) -> torch.Tensor:
    """(n_out, n_in) Jacobian of ``fn`` (vector -> tensor, flattened) at ``x``.

    mode: ``forward`` (torch.func.jacfwd; cheap when n_in << n_out), ``reverse`` (torch.func.jacrev) or
    ``auto``. Falls back to a loop of forward-mode dual evaluations when vmap does not support an op.
    """
    x = x.detach()
    f = lambda v: fn(v).reshape(-1)  # noqa: E731
    if mode == "auto":
        mode = "forward"
    try:
        if mode == "forward":
            return torch.func.jacfwd(f, chunk_size=chunk)(x) if chunk else torch.func.jacfwd(f)(x)
        return torch.func.jacrev(f)(x)
    except Exception:  # pragma: no cover - vmap limitation: loop of dual evaluations
        import torch.autograd.forward_ad as fwAD
        cols = []
        for i in range(x.numel()):
            t = torch.zeros_like(x)
            t.view(-1)[i] = 1.0
            with fwAD.dual_level():
                out = f(fwAD.make_dual(x, t))
                cols.append(fwAD.unpack_dual(out).tangent.detach())
        return torch.stack(cols, dim=1)


def physical_jacobian_diag(kinds: Sequence[str], z: torch.Tensor, nominal_rest: Sequence[float]) -> np.ndarray:
    """d x / d z (diagonal) of the engine transforms at z (unconstrained), in ``names`` order."""
    z = z.detach().cpu().double().numpy()
    out = np.ones_like(z)
    ri = 0
    for k, kind in enumerate(kinds):
        tr = TRANSFORMS.get(kind, "identity")
        if tr == "log":
            out[k] = math.exp(z[k])
        elif tr == "bounded":
            nom = nominal_rest[ri] if ri < len(nominal_rest) else 1.0
            lo, hi = nom * REST_LENGTH_BOUNDS[0], nom * REST_LENGTH_BOUNDS[1]
            s = 1.0 / (1.0 + math.exp(-z[k]))
            out[k] = (hi - lo) * s * (1 - s)
        if kind == "rest_length":
            ri += 1
    return out


def add_in_quadrature(std_devs: Mapping[str, float], extra: Mapping[str, float],
                      skip: Sequence[str] = ()) -> Tuple[Dict[str, float], str]:
    """sqrt(sigma^2 + extra^2) for every parameter that ``extra`` names and ``skip`` does not (the others as they
    were), and what grew: "N parameter(s), median xF, most a xF, ..." (empty when nothing did). How the string-law
    check's model spread (:func:`.lawcheck.widen`) and the window jackknife (:func:`.jackknife.widen`) widen
    sigma."""
    out = dict(std_devs)
    for n, sd in std_devs.items():
        e = extra.get(n)
        if e is not None and n not in skip:
            out[n] = math.sqrt(sd * sd + e * e)
    grown = sorted(((out[n] / sd, n) for n, sd in std_devs.items() if sd > 0 and out[n] > sd * (1 + 1e-9)),
                   reverse=True)
    if not grown:
        return out, ""
    factors = sorted(f for f, _ in grown)
    return out, (f"{len(grown)} parameter(s), median x{factors[len(factors) // 2]:.2f}, most "
                 + ", ".join(f"{n} x{f:.2f}" for f, n in grown[:3]))


def _format(v: np.ndarray, names: List[str]) -> str:
    order = np.argsort(-np.abs(v))
    parts = [f"{v[k]:+.2f} {names[k]}" for k in order if abs(v[k]) >= 0.1]
    return " ".join(parts[:6]) + (" ..." if len(parts) > 6 else "")


def gauss_newton_covariance(problem: RefineProblem, w: torch.Tensor, x0: Optional[torch.Tensor] = None, *,
                            noise_std_m: Optional[float] = None, max_windows: Optional[int] = 16,
                            rank_tol: float = 1e-9, identifiable_threshold: float = 0.9,
                            weak_std: float = 0.1, jacobian: str = "auto", calibrate: str = "sandwich",
                            prediction_change: Optional[torch.Tensor] = None) -> Covariance:
    """Gauss-Newton covariance at the refined point (see the module docstring).

    noise_std_m: the residual noise level (None: estimated from the residuals). max_windows: Jacobians on
    at most this many windows (evenly spread); the information is scaled up to all windows. jacobian:
    ``auto`` (the exact tangent-linear model where the engine has one, else central differences), or any
    method of :meth:`RefineProblem.jacobian_blocks`. calibrate: ``sandwich`` (default; see the module
    docstring: the standard deviations follow the residual's actual size and its correlation within windows,
    and include the prior) or ``none`` (sigma^2 (J^T J + prior)^-1 with sigma = ``noise_std_m``).
    prediction_change: (B, H, No, 3) m over all of the problem's windows, a change of the model's predictions
    (:func:`.stepcheck.halving_change`): ``Covariance.shift`` is then the Gauss-Newton step that the estimate
    would take to follow it (window starts refitted), in physical units.
    """
    if calibrate not in CALIBRATIONS:
        raise ValueError(f"gauss_newton_covariance: calibrate = {calibrate!r} (valid: {', '.join(CALIBRATIONS)})")
    prob = problem
    nb = prob.B.shape[1]
    n_w = w.numel()
    nf = len(prob.top.free_nodes)
    B_all = prob.B_win
    idx = list(range(B_all))
    if max_windows is not None and B_all > max_windows:
        idx = sorted(set(np.linspace(0, B_all - 1, max_windows).round().astype(int).tolist()))
    sub = prob.subset(idx) if len(idx) < B_all else prob
    scale = B_all / len(idx)
    x0s = None if x0 is None else x0.detach()[torch.as_tensor(idx, device=prob.device)]
    ne = 6 * nf if x0 is not None else 0
    w = w.detach()

    d_sub = None
    if prediction_change is not None:
        d_sub = prediction_change.detach().to(device=prob.device, dtype=prob.dtype)
        d_sub = d_sub.index_select(0, torch.as_tensor(idx, device=d_sub.device))
    # the normal equations' blocks per window, formed where the Jacobian is (a window worker), and J^T d there too
    with window_workers(sub, prob.opts.workers):
        _, Hww_b, Hwe, Hee, gw_b, ge = sub.normal_blocks(w, x0s, jacobian)
        Jtd = None if d_sub is None else sub.transposed_times(w, d_sub)
    Hww = Hww_b.sum(dim=0)
    if Hee is not None:
        Heep = truncated_inverse(Hee, START_ELIMINATION_RTOL)
        Hww = Hww - torch.einsum("bij,bjk,blk->il", Hwe, Heep, Hwe)

    def window_scores(Jw_v: torch.Tensor, Je_v: Optional[torch.Tensor]) -> torch.Tensor:
        """(Bs, n_w) per-window J_w^T v with each window's start eliminated (Schur): J_w^T v - H_we H_ee^+ J_e^T v,
        from J_w^T v and J_e^T v."""
        return Jw_v if Je_v is None else Jw_v - torch.einsum("bij,bjk,bk->bi", Hwe, Heep, Je_v)

    score = window_scores(gw_b, ge)                                     # (Bs, n_w) per-window score
    Hww = 0.5 * (Hww + Hww.T) * scale
    Hdata = Hww.detach().cpu().double().numpy()
    meat_block = scale * (score.T @ score).detach().cpu().double().numpy()   # sum over windows of g_k g_k^T
    # noise level
    n_res = 3 * prob.n_obs
    n_unknown = n_w + (ne * B_all if x0 is not None else 0)
    # residual sum of squares over ALL windows
    with torch.no_grad():
        rall = prob.residuals(w, None if x0 is None else x0.detach())
        rss = float((rall * rall).sum())
    s_res = math.sqrt(rss / max(n_res - n_unknown, 1))                 # the residual's actual std
    sigma = noise_std_m if noise_std_m is not None else s_res
    Pw = np.zeros_like(Hdata)
    if bool((prob.prior_prec > 0).any()):
        # the Gaussian prior's information (same units as J^T J: divided by sigma^2 below)
        KBt = (prob.K @ prob.B)
        Hp = (sigma ** 2) * (KBt.T @ (prob.prior_prec[:, None] * KBt))
        Pw[:nb, :nb] = Hp.detach().cpu().double().numpy()
        Hww = Hww.clone()
        Hww[:nb, :nb] += Hp.to(Hww.dtype)
    H = Hww.detach().cpu().double().numpy()
    ev, V = np.linalg.eigh(H)
    emax = ev.max() if ev.size else 0.0
    keep = ev > rank_tol * emax if emax > 0 else np.zeros_like(ev, dtype=bool)
    Hinv = (V[:, keep] / ev[keep]) @ V[:, keep].T
    Cw = sigma ** 2 * Hinv
    # RSS decrease that one more Gauss-Newton step would bring (g^T H^+ g, g = the objective's gradient in RSS units,
    # prior included): a fit whose excess residual this step would remove has not converged (ident.mismatch)
    g = scale * score.sum(dim=0).detach().cpu().double().numpy()
    g_prior = np.zeros(n_w)
    if bool((prob.prior_prec > 0).any()):
        KBt = (prob.K @ prob.B)
        gp0 = (sigma ** 2) * (KBt.T @ (prob.prior_prec * prob.prior_offset))
        g_prior[:nb] = Pw[:nb, :nb] @ w[:nb].detach().cpu().double().numpy() + gp0.detach().cpu().double().numpy()
        g += g_prior
    gn_decrease = float(g @ Hinv @ g)
    dw_change = None
    if prediction_change is not None:
        # the residual becomes r + d: at the optimum (J^T r + the prior's gradient = 0) the Gauss-Newton step is
        # -H^-1 J^T d, the windows' starts eliminated as in the score above
        dw_change = -(Hinv @ (scale * window_scores(*Jtd).sum(dim=0).detach().cpu().double().numpy()))
    calib: Dict[str, np.ndarray] = {}
    if calibrate == "sandwich":
        # the estimate's error is H^-1 (sum_k g_k + sigma^2 P (prior mean - truth)), g_k = window k's score:
        # its covariance H^-1 (meat + sigma^2 P) H^-1 (P in units of J^T J, i.e. sigma^2 x the prior precision).
        # "white": meat = s_res^2 x the data information (the residual's actual size, independent samples);
        # "block": meat = sum_k g_k g_k^T (windows independent, samples within a window correlated as they are).
        calib["white"] = Hinv @ ((s_res ** 2) * Hdata + (sigma ** 2) * Pw) @ Hinv
        calib["block"] = Hinv @ (meat_block + (sigma ** 2) * Pw) @ Hinv
        # The prior term above is the prior's bias averaged over truths the prior could hold. For THIS robot the
        # bias is H^-1 sigma^2 P (prior mean - truth); an estimate of its outer product, from the prior's pull
        # H^-1 g_prior with the shrinkage undone (_prior_bias_outer), is added (variance + bias^2). Why: where two
        # parameters trade against each other (a string's stiffness against its rest length: the same tension), a
        # truth off the prior along that trade is shrunk towards the prior by more than the averaged term says. On the
        # generality suite's prism, one truth, five noise draws: the estimates' spread was 0.3-1.1 sigma, but
        # their mean over the draws sat 1.2-1.3 sigma off the truth in stiffness and rest length (RMS per kind).
        calib["pull"] = _prior_bias_outer(V[:, keep], ev[keep], Pw, g_prior, s_res ** 2)
    # map to z (full unconstrained vector) and the delay
    KB = (prob.K @ prob.B).detach().cpu().double().numpy()           # (P, nb)
    P = KB.shape[0]
    Jz = np.zeros((P + 1, n_w))
    Jz[:P, :nb] = KB
    if prob.opts.estimate_delay:
        Jz[P, nb] = DELAY_UNIT_S
    Cz = Jz @ Cw @ Jz.T
    Czs = {k: Jz @ c @ Jz.T for k, c in calib.items()}
    dz_change = None if dw_change is None else Jz @ dw_change
    _, zf = prob.finalize(w)
    names = prob.names
    kinds = [kind_of(n) for n in names]
    notes: List[str] = []
    gauge_desc = ""
    if prob.gauge:
        # final rescaling z_f = z + c(z) s, c = log(M / sum_b m_b(z)): dz_f/dz = I + s (dc/dz)^T
        p_f = prob.params_of(w)
        m = p_f.mass.detach().cpu().double().numpy()
        mv = prob.movable
        dc = np.zeros(P + 1)
        for b, bname in enumerate(prob.top.bar_names):
            if mv[b]:
                dc[names.index(join_name(bname, "mass"))] = -m[b] / m[mv].sum()
        s = np.zeros(P + 1)
        s[:P] = prob.scale_dir.detach().cpu().double().numpy()
        Jf = np.eye(P + 1) + np.outer(s, dc)
        Cz = Jf @ Cz @ Jf.T
        Czs = {k: Jf @ c @ Jf.T for k, c in Czs.items()}
        dz_change = None if dz_change is None else Jf @ dz_change
        gauge_desc = f"total moving mass fixed at {prob.total_mass:g} kg"
    D = np.ones(P + 1)
    D[:P] = physical_jacobian_diag(kinds, zf, prob.template.meta.nominal_rest_length)
    Cx = Cz * D[:, None] * D[None, :]
    free_idx = sorted({k for g in prob.groups for k in g})
    out_idx = free_idx + ([P] if prob.opts.estimate_delay else [])
    out_names = [names[k] for k in free_idx] + (["delay_s"] if prob.opts.estimate_delay else [])
    cov = Cx[np.ix_(out_idx, out_idx)]
    model_std = {n: float(math.sqrt(max(cov[i, i], 0.0))) for i, n in enumerate(out_names)}
    calibration: Dict[str, object] = {"method": calibrate, "noise_std_m": float(sigma), "residual_std_m": s_res,
                                      "windows": len(idx), "rss_m2": rss, "gn_rss_decrease_m2": gn_decrease}
    if calib:
        # per parameter, the larger of the two sandwich variances (the block meat has rank <= windows, so it
        # misses directions the white one holds); the white covariance's correlations, rescaled to those stds
        cw = (Czs["white"] * D[:, None] * D[None, :])[np.ix_(out_idx, out_idx)]
        cb = (Czs["block"] * D[:, None] * D[None, :])[np.ix_(out_idx, out_idx)]
        cp = (Czs["pull"] * D[:, None] * D[None, :])[np.ix_(out_idx, out_idx)]
        var = np.maximum(np.diag(cw), np.diag(cb)).clip(min=0.0)
        dw = np.sqrt(np.diag(cw).clip(min=1e-300))
        f = np.sqrt(var) / dw
        cov = cw * f[:, None] * f[None, :] + cp
        calibration.update(block_over_white={n: float(math.sqrt(max(cb[i, i], 0.0)) / dw[i])
                                             for i, n in enumerate(out_names)},
                           prior_pull={n: float(math.sqrt(max(cp[i, i], 0.0))) for i, n in enumerate(out_names)},
                           model_std_devs=model_std)
    params_f = {n: float(v) for n, v in prob.finalize(w)[0].named().items()}
    params_f["delay_s"] = float(prob.delay_of(w))
    std = {n: float(math.sqrt(max(cov[i, i], 0.0))) for i, n in enumerate(out_names)}
    # non-identifiable directions of H (in w space) -> parameters involved
    unexcited = set()
    weak: List[str] = []
    if (~keep).any():
        for vv in V[:, ~keep].T:
            zdir = Jz @ vv
            for k in np.flatnonzero(np.abs(zdir[:P]) > 1e-3 * max(np.abs(zdir).max(), 1e-300)):
                unexcited.add(names[k])
            if abs(zdir[P]) > 1e-3 * max(np.abs(zdir).max(), 1e-300):
                unexcited.add("delay_s")
            weak.append("not identifiable: " + _format(zdir[out_idx], out_names))
    # weak combinations: eigenvectors of the covariance of relative (log-like) changes
    def reference(n):   # identifiability_reference of parameter (or delay_s) n
        return identifiability_reference("delay" if n == "delay_s" else kind_of(n), params_f[n], _nominal(prob, n))

    rel = np.array([std[n] / max(reference(n), 1e-300) for n in out_names])
    if cov.size:
        Dn = np.array([reference(n) for n in out_names])
        Cn = cov / Dn[:, None] / Dn[None, :]
        if prob.gauge:
            # the gauge direction itself is not a weakness of the data
            pass
        ce, cv = np.linalg.eigh(Cn)
        for val, vec in zip(ce[::-1], cv[:, ::-1].T):
            if math.sqrt(max(val, 0)) < weak_std:
                break
            weak.append(f"weakly identifiable (std {math.sqrt(val):.2g} relative): {_format(vec, out_names)}")
    ratios: Dict[str, Tuple[float, float]] = {}
    gauge_names = set()
    if prob.gauge:
        mv_names = [join_name(b, "mass") for b, m_ in zip(prob.top.bar_names, prob.movable) if m_]
        ref = mv_names[0] if len(mv_names) == 1 else "total_mass"
        for n in out_names:
            if kind_of(n) in GAUGE_KINDS:
                gauge_names.add(n)
                if n != ref:
                    ratios[f"{n}/{ref}"] = (params_f[n] / prob.total_mass, std[n] / prob.total_mass)
        notes.append("only ratios identifiable (scale gauge, " + gauge_desc + ")")
    ident, identifiable = {}, {}
    for i, n in enumerate(out_names):
        score = float(np.clip(1.0 - rel[i], 0.0, 1.0)) if np.isfinite(rel[i]) else 0.0
        if n in unexcited or n in gauge_names:
            score = 0.0
        ident[n] = score
        identifiable[n] = score >= identifiable_threshold
    shift = {} if dz_change is None else {n: float(D[i] * dz_change[i]) for i, n in zip(out_idx, out_names)}
    return Covariance(names=out_names, cov=cov, std_devs=std, identifiability=ident, identifiable=identifiable,
                      ratios=ratios, weak_directions=weak, sigma_m=float(sigma), gauge=gauge_desc, notes=notes,
                      calibration=calibration, shift=shift)


#: the largest share of a direction's information that the prior may hold for :func:`_prior_bias_outer` to undo the
#: estimate's shrinkage along it (1 / (1 - 0.9): at most 10x); beyond it the estimate barely left the prior mean,
#: the prior-averaged term covers the truth, and the undone shrinkage would be noise: the plug-in is kept there (a
#: data-blind direction, such as the masses' common scale against the stiffnesses', otherwise came out 10x its
#: own small move)
MAX_PRIOR_SHARE = 0.9


def _prior_bias_outer(V: np.ndarray, ev: np.ndarray, Pw: np.ndarray, g_prior: np.ndarray,
                      noise_var: float) -> np.ndarray:
    """An estimate of b b^T, b = the prior's pull on THIS estimate (its bias for this robot), in w space.

    V, ev: the total information H's kept eigenvectors and eigenvalues (prior included; units of J^T J); Pw: the
    prior's share of it; g_prior: the prior term's gradient at the estimate; noise_var: the residual's variance.
    In H's whitened coordinates (H = I, the prior's share S with eigenvalues in [0, 1]) the estimate sits at
    (I - S) truth + S mu + noise: b = S (mu - truth). Its plug-in at the estimate, S (mu - estimate) = H^-1 g_prior
    (what stop 35 added), has the mean (I - S) b: it is shrunk towards the prior like the estimate itself, most
    where data and prior share a direction (a string's stiffness traded against its rest length). Undone:
    b^ = (I - S)^-1 S (mu - estimate) has the mean b and the covariance noise_var S^2 (I - S)^-1, so
    b^ b^^T minus that covariance, clipped to its positive part, estimates b b^T. (Measured on the generality
    suite's prism, seed 0: the plug-in was 0.02-0.6 sigma per parameter and 4 of 28 truths lay outside +-2 sigma,
    at |z| 2.01-2.31; with this estimate none.)
    """
    if not ev.size:
        return np.zeros_like(Pw)
    W = V / np.sqrt(ev)                                                 # whitening: W^T H W = I
    S = W.T @ Pw @ W
    lam, Q = np.linalg.eigh(0.5 * (S + S.T))
    lam = np.clip(lam, 0.0, 1.0)
    undo = lam <= MAX_PRIOR_SHARE                   # beyond: the plug-in as it is, shrunk (stop 35's term)
    gain = 1.0 / (1.0 - np.where(undo, lam, 0.0))                       # 1 where not undone
    b = Q @ (gain * (Q.T @ (W.T @ g_prior)))                             # sign irrelevant: b b^T
    bb = np.outer(b, b) - noise_var * (Q * np.where(undo, lam ** 2 * gain, 0.0)) @ Q.T
    e, U = np.linalg.eigh(0.5 * (bb + bb.T))
    return W @ ((U * e.clip(min=0.0)) @ U.T) @ W.T


def _nominal(prob: RefineProblem, name: str) -> Optional[float]:
    if kind_of(name) == "rest_length":
        s = element_of(name)
        return prob.template.meta.nominal_rest_length[prob.template.meta.strings.index(s)]
    return None
