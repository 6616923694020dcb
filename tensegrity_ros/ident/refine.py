"""Stage 2: refine all parameters by differentiating through engine rollouts (multiple shooting).

The recording is cut into short windows. Each window starts from the measured state (smoothed positions
and velocities of the free nodes, projected onto the bar lengths; with ``bridge_start_gaps`` a node unmeasured
at that sample is estimated by the same smoothing fit from its neighbours on both sides), the engine is rolled
out over the window with the recorded motor angles (interpolated at t - delay) and the predicted node positions
are compared with the measured ones where valid:

    loss = 1/n_obs sum_windows sum_samples sum_valid nodes |x_pred - x_meas|^2 / sigma^2
           [+ continuity_weight * |end state of window k - start state of window k+1|^2 / sigma^2]
           [+ 1/n_obs sum_k ((z_k - z_prior,k) / s_k)^2]     (Gaussian prior, ``prior_std``, centred on
                                                               ``prior_center``, default the start)

Optimised quantities (all unconstrained): the engine's unconstrained parameter vector (``to_unconstrained``:
log stiffness, log damping, logit rest lengths, log masses, log spool radii, zero offsets, log control gain)
restricted to the free entries (``kinds`` / ``free`` / ``ties``), the motor-to-mocap delay
(``estimate_delay``, in units of 10 ms; parameters in units of 10 % (log kinds), 1 cm (rest lengths) and
0.1 rad (zero offsets) for conditioning), and optionally per-window offsets of the initial positions (mm) and
velocities (cm/s) (``optimize_initial_states``: true multiple shooting, removes the bias of noisy starts).

Scale gauge: when every mass, stiffness and damping (and control gain) is free and no known force acts,
the loss is exactly invariant to scaling them together (only ratios are identifiable). The optimiser then
works in the complement of that direction and the final values are rescaled (loss unchanged) so that the
total moving mass equals ``total_mass``.

Optimisers: ``gauss_newton`` (default): Levenberg-Marquardt on the residuals with the window starts
eliminated by a Schur complement (the classical multiple-shooting Gauss-Newton; Jacobian columns from one
batched rollout), ``lbfgs``: ``torch.optim.LBFGS`` with strong-Wolfe line search on the loss gradient from
autograd, ``adam``: Adam with the lr halved every ``adam_halve_every`` iterations (the seed's schedule).
On the noisy actuated-pendulum test Gauss-Newton converges ~15x faster than L-BFGS (2 s vs 32 s).
Progress: ``callback(info)`` after every loss
evaluation with info = {stage, iteration, evaluation, loss, params (name -> value), delay_s, time_s}.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..engine import (REST_LENGTH_BOUNDS, Inputs, Params, from_unconstrained, make_engine, stack_params,
                      to_unconstrained)
from ..engine._common import differentiated, is_dual
from ..engine.tangent import sample_brackets
from ..model import Structure
from ..param_names import GAUGE_KINDS, element_of, join_name, kind_of
from .data import Dataset, derivatives
from .errors import DivergenceError, NotEnoughDataError
from .workers import window_workers

__all__ = ["RefineOptions", "RefineResult", "refine", "RefineProblem"]

#: the noise (m) that normalises the loss when ``RefineOptions.noise_std_m`` is not known
UNKNOWN_NOISE_STD_M = 1e-3
#: the marker noise (m) for which ``RefineOptions.max_sim_dt`` is chosen; quieter data get shorter steps
#: (:func:`max_step_for_noise`)
STEP_REFERENCE_NOISE_M = 1e-3


def max_step_for_noise(max_sim_dt: float, noise_std_m: Optional[float]) -> float:
    """The longest engine step for marker noise ``noise_std_m``: ``max_sim_dt`` x sqrt(noise / 1 mm), at most
    ``max_sim_dt`` (unchanged when the noise is not known).

    Why: semi-implicit Euler runs a mode of frequency w at (2 / h) arcsin(w h / 2), fast by (w h)^2 / 24, so a fit
    lowers the stiffnesses by about (w h)^2 / 12: 1 % on the generality prism at 1.67 ms (noise-free recording,
    started from the truth: -1.3 %, -0.7 % at 0.83 ms). That bias goes as h^2 and a parameter's sigma as the noise,
    so h ~ sqrt(noise) keeps it the same fraction of sigma as at 1 mm, where it is ~1/4 sigma. Measured at 0.2 mm
    (the prism, seed 0, 24 s): 1.67-ms steps put 86 % of the truths inside +-2 sigma (an actuated string's rest
    length 5.0 sigma off), 0.83-ms steps 93 % (3.5 sigma), in 62 s instead of 36 s."""
    if noise_std_m is None or not noise_std_m > 0:
        return max_sim_dt
    return max_sim_dt * min(1.0, math.sqrt(noise_std_m / STEP_REFERENCE_NOISE_M))


def without_windows(datasets: Sequence[Dataset], prob: "RefineProblem",
                    windows: Optional[Sequence[int]] = None) -> List[Dataset]:
    """Copies of ``datasets`` (the ones ``prob`` was cut from) with the samples of ``prob``'s windows ``windows``
    (default: all of them) marked invalid, so that no window cut from the copies sees them."""
    masks = [d.valid.copy() for d in datasets]
    for b in range(prob.B_win) if windows is None else windows:
        di, s0 = prob.window_ids[b]
        masks[di][s0:s0 + prob.window_lengths[b] + 1] = False
    return [dataclasses.replace(d, valid=m) for d, m in zip(datasets, masks)]


#: Jacobian methods of the Gauss-Newton refinement (``RefineOptions.jacobian``)
JACOBIANS = ("auto", "tangent", "central", "forward", "forward_ad")
DELAY_UNIT_S = 0.01
LOG_UNIT = 0.1
REST_UNIT_M = 0.01
X0_UNIT_M = 1e-3
V0_UNIT_MPS = 1e-2
#: projections of each measured window start onto the bar lengths (A re-formed each time)
START_PROJECTION_ITERS = 2
#: relative singular-value cut of a window's initial-state Jacobian. Measured window starts are projected onto
#: the bar lengths, and the stiff bar-end modes (~90 Hz on the manipulator) are barely seen at 120 Hz, so that
#: block has directions 1e-8 and below the largest. A plain inverse turns them into metre-sized "steps" that
#: the rollout cannot follow (NaN), and Levenberg-Marquardt then crawled (~1 % loss decrease per iteration).
#: Truncated, one Gauss-Newton step fits a window's start to the noise level. 1e-3, not 1e-4 (until stop 55): the
#: start steps along the weakest directions kept at 1e-4 left the linear range near the optimum (on the README's
#: 16-s bag a last-rung step predicted to lower chi^2 by 13 raised it by 78 with its start part alone, a tenth of
#: it did what the linear model said); each rejected step raised the damping, which shortened the parameters'
#: steps too, and the last rung crawled and stopped short: 8 iterations to a loss 2.2 chi^2 above the one 1e-3
#: reaches in 6, stiffness median error 2.9 % against 0.35 %. 1e-2 cuts real information (a higher loss).
X0_RCOND = 1e-3
#: relative singular-value cut of each window's projected start tangents (:func:`start_basis`), with positions
#: in X0_UNIT_M and velocities in V0_UNIT_MPS. Why: the 6 nf unit offsets of a window's start, projected onto the
#: bar lengths (START_PROJECTION_ITERS), span 6 nf - 2 x (bar constraints) directions, along which a projection
#: keeps an offset whole (singular values near 1); the others are what two projection iterations leave of the
#: bar-length violations. The manipulator's 108 columns: 72 at 0.79-1.0, the other 36 at 7e-8 and below on the
#: README's 16-s bag (1-s windows), at 1.5e-5 and below on 0.1-s windows of a simulated recording with 1 mm noise.
#: Pushing 72 basis directions through the tangent model instead of 108 columns costs the kernel a third less on
#: the start fits and a fifth less on a stage-2 Jacobian (n_w + 6 nf columns); the start columns then differ by
#: what was dropped (test_engine_tangent.py: 3e-6 of their norm on those 0.1-s windows).
START_BASIS_RTOL = 1e-3
#: residual rollouts whose states a problem keeps for a tangent Jacobian at the same point (RefineProblem.residuals):
#: Levenberg-Marquardt's accepted point is at most 3 evaluations back (a chord step or two tried after it).
#: ~4 MB each for 4 one-second windows of the manipulator; 0 turns the reuse off
PRIMAL_KEPT = 3


@dataclass(frozen=True)
class RefineOptions:
    """Stage-2 options.

    kinds: parameter kinds that are free (``stiffness, damping, rest_length, mass, spool_radius,
        zero_offset, control_force_scalar``); ``free``: explicit names instead (overrides ``kinds``).
        NB: ``zero_offset`` and ``rest_length`` of an actuated string are collinear (only
        xi00 - direction * radius * zero_offset is identifiable): free one of them.
    known: ``{name: value}`` held fixed at that value.
    ties: groups sharing one value (a kind name = all of that kind, or a tuple of names).
    total_mass: scale anchor when only ratios are identifiable (default: the starting total moving mass; with
        a mass prior (``prior_std["mass"]``, or one on any moving bar's mass by name) and no total_mass, the
        prior sets the scale instead: no gauge,
        absolute values whose standard deviations carry the masses' uncertainty).
    estimate_delay / delay_s: the motor-to-mocap delay (motor angles used at t - delay), s, and its start.
    window_s / stride_s / max_windows: multiple-shooting windows (length, spacing, cap; evenly spread).
    only_windows: exactly these windows, as ``RefineProblem.window_ids`` names them ((recording, start sample)
        pairs), instead of the cap's spread (the window jackknife refits a fit's windows less one, :mod:`.jackknife`).
    sim_dt: engine step, s (default: the median sampling period divided into steps no longer than
        max_sim_dt (times sqrt(noise_std_m / 1 mm) below 1 mm of noise: :func:`max_step_for_noise`) and 75 % of
        semi-implicit Euler's stability limit with the strings' damping, see
        :func:`stable_step`); the predictions are interpolated
        linearly between steps at the (possibly irregular) sample times.
    optimize_initial_states: per-window initial position/velocity offsets are optimised too.
    continuity_weight: weight of the window-to-window continuity penalty (needs contiguous windows).
    prior_std: Gaussian prior around ``prior_center``, per kind: relative for log-parametrised kinds
        (``{"stiffness": 0.2}`` = 20 %), metres for ``rest_length``, rad for ``zero_offset`` (MAP estimate;
        parameters the data do not determine then stay near the nominal model and their covariance says so).
        A key may also be one parameter's name (``{"b3.mass": 0.02}``, same units): it overrides its kind's
        entry for that parameter (per-element priors, e.g. a structure file's ``mass_std``).
    prior_center: the prior's mean (default: the start). Online, where each update starts from the last
        accepted set, centring the prior on the NOMINAL model keeps weakly seen parameters (damping in short
        windows) from random-walking away update after update.
    noise_std_m: the marker noise when known: it normalises the loss (None: unknown; the loss is normalised by
        :data:`UNKNOWN_NOISE_STD_M` (:attr:`loss_noise_std_m`), and the covariance of :func:`identify` estimates
        the noise from the residuals).
    optimizer: ``lbfgs`` | ``adam`` | ``gauss_newton`` (Levenberg-Marquardt on the multiple-shooting
        residuals, window starts eliminated by a Schur complement; ``jacobian`` = ``auto`` (``tangent``
        where the engine has a tangent-linear model, else ``central``), ``tangent``, ``central``, ``forward``
        or ``forward_ad``, see :meth:`RefineProblem.jacobian_blocks`; ``lm_lambda`` its initial damping,
        ``lm_max_step`` its trust region: the largest
        change of one parameter per iteration in scaled units, 0.1 in log for scale kinds, 1 cm for rest
        lengths); ``lm_chord_steps``: after each accepted step, up to this many further steps from the same
        normal equations with fresh residuals (one rollout each instead of a Jacobian; each kept only if it
        lowers the loss, and the run stops once one gains less than half of the step before); max_iter:
        iterations; lr: step (1 for L-BFGS, 0.05 for Adam by default);
        tolerance_grad / tolerance_change: L-BFGS stops; history_size: L-BFGS memory;
        stall_evaluations / stall_tolerance / stall_chi2: stop (converged) after this many evaluations
        without an improvement of the best loss by more than stall_tolerance (relative) and more than a
        chi^2 change of stall_chi2 (i.e. stall_chi2 / (3 n_obs) in the normalised loss).
        converged_chi2: Levenberg-Marquardt also stops (converged) once an iteration lowers chi^2 (the loss,
        prior included, in units of the noise variance) by less than this, and the geometric tail of its
        decreases (the last one times rho / (1 - rho), rho the ratio of the last two) is below it too: the loss
        is then within ~converged_chi2 of its minimum, so the estimate is within sqrt(converged_chi2) standard
        deviations of the optimum along any direction (Mahalanobis), 0.5 sigma for 0.25. The unit is the smaller
        of the stated noise's variance and the residuals' own mean square, so a noise stated too large (or none)
        never loosens the stop; noise-free data never stop on it. 0: off. Measured on the README's 16-s
        manipulator bag: the last rung's iterations 9 and 10 lowered chi^2 by 0.02 and 0.01 and moved no
        parameter by more than 0.003 sigma, at ~11 s each.
        tangent_dtype: dtype of the tangent-linear model behind Levenberg-Marquardt's Jacobians (the checks' window
        start fits use :data:`~.heldout.START_FIT_TANGENT_DTYPE`); the residuals stay in ``dtype``, and the covariance
        always uses ``dtype``. None (default): ``dtype``. ``torch.float32``: 26 % less time per Jacobian on the
        manipulator's 1-s windows, columns within 6e-6 (relative) of float64's; but where the minimum is a
        flat valley the path decides where a fit stops, and on the manipulator bench (every kind free) seed 2's
        masses ended at 6.4 % median error instead of 5.1 % (seed 0 the same, seed 1 7.3 instead of 7.5 %).
    max_time_s: wall-time budget (the best point so far is returned).
    smooth_window_s: smoothing window for the initial states of noisy data (see data.derivatives).
    bridge_start_gaps: where a window's start lacks a node's marker, estimate it from the node's neighbours
        (short gaps) or move the start past the gap (longer ones, by at most half a window), instead of dropping
        the window (docs/identification.md, "Window starts under occlusion"). Off by default: on the generality
        suite at 20 % occlusion or in 0.3-s dropouts it met 57 of 60 targets against 47, and was neutral at 5 %,
        but on the manipulator bench (whole frames dropped) it does not help: 1.77 / 1.95 / 2.40 % median error on
        seeds 0-2 against 0.95 / 1.28 / 0.91 %, the masses further along their valley (stop 41: scored on common
        windows the fits are no worse in chi^2 as a rule; another draw of windows).
    device / dtype: where the rollouts run (``"cuda"`` when present).
    workers: Levenberg-Marquardt's residuals and Jacobians spread over this many forked processes, a share of
        the windows each (Linux CPU only; same results; see :mod:`.workers`). 1: all in this process.
    observed_nodes: node names compared (default: the free nodes).
    engine_options: extra ``make_engine`` options (nodal: ``solver``, ``projection_iters``, ...).
    """

    kinds: Tuple[str, ...] = ("stiffness", "damping", "rest_length", "mass")
    free: Optional[Tuple[str, ...]] = None
    known: Mapping[str, float] = field(default_factory=dict)
    ties: Tuple[Union[str, Tuple[str, ...]], ...] = ()
    total_mass: Optional[float] = None
    estimate_delay: bool = False
    delay_s: float = 0.0
    window_s: float = 0.25
    stride_s: Optional[float] = None
    max_windows: Optional[int] = None
    only_windows: Optional[Tuple[Tuple[int, int], ...]] = None
    sim_dt: Optional[float] = None
    max_sim_dt: float = 2e-3
    optimize_initial_states: bool = True
    continuity_weight: float = 0.0
    prior_std: Mapping[str, float] = field(default_factory=dict)
    prior_center: Optional[Params] = None
    noise_std_m: Optional[float] = None
    optimizer: str = "gauss_newton"
    max_iter: int = 50
    lr: Optional[float] = None
    adam_halve_every: int = 30
    tolerance_grad: float = 1e-9
    tolerance_change: float = 1e-12
    history_size: int = 20
    stall_evaluations: int = 8
    stall_tolerance: float = 1e-7
    stall_chi2: float = 0.1
    converged_chi2: float = 0.25
    tangent_dtype: Optional[torch.dtype] = None
    max_time_s: Optional[float] = None
    jacobian: str = "auto"
    lm_lambda: float = 1e-3
    lm_max_step: float = 2.0
    lm_chord_steps: int = 4
    derivative_method: str = "auto"
    smooth_window_s: Optional[float] = None
    bridge_start_gaps: bool = False
    device: Optional[str] = None
    dtype: torch.dtype = torch.float64
    workers: int = 1
    observed_nodes: Optional[Tuple[str, ...]] = None
    engine_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.optimizer not in ("lbfgs", "adam", "gauss_newton"):
            raise ValueError(f"RefineOptions.optimizer = {self.optimizer!r} (valid: lbfgs, adam, gauss_newton)")
        if self.optimizer == "gauss_newton" and self.continuity_weight > 0:
            raise ValueError("RefineOptions: continuity_weight needs optimizer='lbfgs' or 'adam' (it couples the "
                             "windows, which the Gauss-Newton Schur complement assumes independent)")
        if self.window_s <= 0:
            raise ValueError("RefineOptions.window_s must be > 0")
        if self.jacobian not in JACOBIANS:
            raise ValueError(f"RefineOptions.jacobian = {self.jacobian!r} (valid: {', '.join(JACOBIANS)})")
        if not self.converged_chi2 >= 0:
            raise ValueError(f"RefineOptions.converged_chi2 = {self.converged_chi2!r} (expected >= 0; 0: off)")
        if self.tangent_dtype is not None and not (isinstance(self.tangent_dtype, torch.dtype)
                                                   and self.tangent_dtype.is_floating_point):
            raise ValueError(f"RefineOptions.tangent_dtype = {self.tangent_dtype!r} (expected None or a floating "
                             "torch dtype, e.g. torch.float32)")
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"RefineOptions.workers = {self.workers!r} (expected an integer >= 1)")

    @property
    def loss_noise_std_m(self) -> float:
        """The noise that normalises the loss: ``noise_std_m``, or :data:`UNKNOWN_NOISE_STD_M` when not known."""
        return UNKNOWN_NOISE_STD_M if self.noise_std_m is None else float(self.noise_std_m)


@dataclass
class RefineResult:
    """params: refined (unbatched, float64, CPU); delay_s; loss (normalised) and residual_rms_m (RMS of the
    3-D position error over the observed samples, m) at the end;
    history: one dict per loss evaluation {iteration, evaluation, loss, params, delay_s, time_s};
    converged: the optimiser stopped on a tolerance (not on max_iter / time); problem: the
    :class:`RefineProblem` (for the covariance); z / x0: the final free vector and initial-state offsets."""

    params: Params
    delay_s: float
    loss: float
    residual_rms_m: float
    history: List[Dict[str, Any]]
    converged: bool
    iterations: int
    evaluations: int
    seconds: float
    problem: "RefineProblem"
    w: torch.Tensor
    x0: Optional[torch.Tensor]
    notes: List[str]


# =====================================================================================================
# problem setup
# =====================================================================================================
def _axial_matrices(top, params: Params, positions: Optional[np.ndarray] = None):
    """Strings' axial stiffness K = sum_c k_c g_c g_c^T and damping C = sum_c zeta_c g_c g_c^T (g_c = dL_c/dQ)
    and the reduced mass matrix M at ``positions`` (default: the structure's), restricted to the motions
    that keep the bar lengths (Z^T K Z etc., Z a basis of the bar-length Jacobian's null space): along a bar
    a light bar end would otherwise show a damping rate ~10x above any the constrained model has."""
    from .regression import nullspace_bases
    X = top.X0 if positions is None else positions
    k = params.stiffness.detach().cpu().double().numpy().reshape(-1)
    z = params.damping.detach().cpu().double().numpy().reshape(-1)
    m = params.mass.detach().cpu().double().numpy().reshape(-1)
    nf = top.n_free
    s = X[top.seg_nodes[:, 1]] - X[top.seg_nodes[:, 0]]
    e = s / np.linalg.norm(s, axis=1, keepdims=True)
    Csq = top.Cs_q                                              # (n_seg, nf)
    K = np.zeros((3 * nf, 3 * nf))
    C = np.zeros((3 * nf, 3 * nf))
    for c in range(top.n_strings):
        segs = np.flatnonzero(top.G[:, c])
        g = np.einsum("sf,sk->fk", Csq[segs], e[segs]).reshape(-1)
        gg = np.outer(g, g)
        K += k[c] * gg
        C += z[c] * gg
    Mq = np.einsum("b,bfg->fg", m, top.E_q)
    M = np.kron(Mq, np.eye(3))
    Z = nullspace_bases(top, X[np.asarray(top.free_nodes)][None])[0]
    return Z.T @ K @ Z, Z.T @ C @ Z, Z.T @ M @ Z


def _largest_generalized_eig(A: np.ndarray, M: np.ndarray) -> float:
    import scipy.linalg
    try:
        return float(max(scipy.linalg.eigh(A, M, eigvals_only=True).max(), 0.0))
    except Exception:  # singular mass matrix (massless node): no bound
        return float("inf")


def max_frequency(top, params: Params, positions: Optional[np.ndarray] = None) -> float:
    """Highest natural frequency (rad/s) of the strings' axial stiffness K = sum_c k_c g_c g_c^T
    (g_c = dL_c/dQ) against the reduced mass matrix, over the motions that keep the bar lengths (prestress
    and gravity, i.e. geometric stiffness, left out)."""
    K, _, M = _axial_matrices(top, params, positions)
    return math.sqrt(_largest_generalized_eig(K, M))


def stable_step(top, params: Params, positions: Optional[np.ndarray] = None, safety: float = 0.75) -> float:
    """Largest semi-implicit Euler step (s) for the nodal model, times ``safety``.

    A mode x'' + g x' + w^2 x = 0 stays bounded under semi-implicit Euler iff h g < 2 and
    h^2 w^2 + 2 h g < 4, i.e. h < (sqrt(g^2 + 4 w^2) - g) / w^2. The bound uses the largest w (see
    :func:`max_frequency`) and the largest damping rate g (largest generalised eigenvalue of the strings'
    damping against the mass); on the manipulator and the icosahedron it is the linearised model's exact
    limit (test_ident_stage2_numerics). Damping matters: the light bar ends on stiff, damped strings are nearly
    critically damped. On the manipulator the undamped 2 / w is 3.6 ms against the damped 1.2 ms; the earlier
    default (1.5 / w with w from the unconstrained model) gave 1.14 ms, where windows started from noisy
    states diverged.
    """
    K, C, M = _axial_matrices(top, params, positions)
    w2 = _largest_generalized_eig(K, M)
    g = _largest_generalized_eig(C, M)
    if not (math.isfinite(w2) and math.isfinite(g)):
        return 0.0
    if w2 <= 0.0:
        return safety * 2.0 / g if g > 0 else float("inf")
    return safety * (math.sqrt(g * g + 4.0 * w2) - g) / w2


def _groups(names: List[str], free_names: List[str], ties) -> List[List[int]]:
    index = {n: k for k, n in enumerate(names)}
    kinds = [kind_of(n) for n in names]
    assigned = set()
    groups: List[List[int]] = []
    free_set = set(free_names)
    for tie in ties:
        mem = [k for k, n in enumerate(names) if kinds[k] == tie and n in free_set] if isinstance(tie, str) else \
            [index[n] for n in tie if n in index and n in free_set]
        mem = [k for k in mem if k not in assigned]
        if mem:
            groups.append(mem)
            assigned.update(mem)
    for n in free_names:
        k = index[n]
        if k not in assigned:
            groups.append([k])
            assigned.add(k)
    return groups


class RefineProblem:
    """The multiple-shooting problem: windows, targets, inputs and the map from the optimisation vector to
    params. ``residuals(w, x0)`` gives the (masked, m) position residuals (for the Gauss-Newton covariance)."""

    def __init__(self, structure: Structure, data: Sequence[Dataset], start: Params, opts: RefineOptions,
                 backend: str = "nodal", integrator: str = "semi_implicit"):
        self.opts = opts
        dev = torch.device(opts.device) if opts.device else torch.device("cpu")
        self.device, self.dtype = dev, opts.dtype
        self._workers = None                  # WindowWorkers while refine() spreads the windows (.workers)
        self.engine = make_engine(structure, backend=backend, integrator=integrator, dtype=opts.dtype, device=dev,
                                  **dict(opts.engine_options))
        top = self.engine.topology
        self.top = top
        self.backend = backend
        start = start.map(lambda t: t.detach().to(dtype=opts.dtype, device=dev))
        if backend == "spring_rod" and start.control_force_scalar is None:
            start = Params(start.stiffness, start.damping, start.rest_length, start.mass, start.spool_radius,
                           start.zero_offset, torch.ones((), dtype=opts.dtype, device=dev), start.meta)
        if opts.known:
            start = start.with_values({k: v for k, v in opts.known.items() if k in start.named()})
        self.template = start
        self.names = start.names()
        self.z_start = to_unconstrained(start).detach()
        kinds = [kind_of(n) for n in self.names]
        if opts.free is not None:
            unknown = [n for n in opts.free if n not in self.names]
            if unknown:
                raise ValueError(f"RefineOptions.free: unknown parameter(s) {unknown}")
            free = [n for n in self.names if n in set(opts.free)]
        else:
            free = [n for n, k in zip(self.names, kinds) if k in opts.kinds]
        free = [n for n in free if n not in opts.known]
        # bars welded to the world and strings never in the data cannot move anything: keep them out
        movable = np.abs(top.Cb_q).sum(axis=1) > 0
        bar_index = {b: i for i, b in enumerate(top.bar_names)}
        free = [n for n in free if not (kind_of(n) == "mass" and not movable[bar_index[element_of(n)]])]
        self.free_names = free
        self.groups = _groups(self.names, free, opts.ties)
        P, G = len(self.names), len(self.groups)
        # column scaling: one unit of the optimisation variable is a "typical" change of the parameter
        # (10 % for log-parametrised kinds, 1 cm for rest lengths, 0.1 rad for zero offsets)
        zs = self.z_start.detach().cpu().double().numpy()
        nom = list(start.meta.nominal_rest_length)
        K = torch.zeros(P, G, dtype=opts.dtype, device=dev)
        for g, mem in enumerate(self.groups):
            k0 = mem[0]
            kind = kinds[k0]
            if kind == "rest_length":
                el = start.meta.strings.index(element_of(self.names[k0]))
                sg = 1.0 / (1.0 + math.exp(-zs[k0]))
                sc = REST_UNIT_M / ((REST_LENGTH_BOUNDS[1] - REST_LENGTH_BOUNDS[0]) * nom[el] * sg * (1 - sg))
            elif kind == "zero_offset":
                sc = 0.1
            else:
                sc = LOG_UNIT
            K[mem, g] = sc
        self.K = K
        # Gaussian prior precision (per unconstrained entry, in z units)
        prec = np.zeros(P)
        for k, kind in enumerate(kinds):
            sd = opts.prior_std.get(self.names[k], opts.prior_std.get(kind))
            if sd is None or not (sd > 0):
                continue
            if kind == "rest_length":
                el = start.meta.strings.index(element_of(self.names[k]))
                sg = 1.0 / (1.0 + math.exp(-zs[k]))
                dxdz = (REST_LENGTH_BOUNDS[1] - REST_LENGTH_BOUNDS[0]) * nom[el] * sg * (1 - sg)
                prec[k] = (dxdz / sd) ** 2
            else:
                prec[k] = 1.0 / sd ** 2
        self.prior_prec = torch.as_tensor(prec, dtype=opts.dtype, device=dev)
        # prior mean offset in z: dz = K B w + prior_offset (0 when the prior is centred on the start)
        self.prior_offset = torch.zeros_like(self.z_start)
        if opts.prior_center is not None:
            c = opts.prior_center.map(lambda t: t.detach().to(dtype=opts.dtype, device=dev))
            self.prior_offset = (self.z_start - to_unconstrained(c)).detach()
        # scale gauge
        scale_dir = torch.tensor([1.0 if k in GAUGE_KINDS else 0.0 for k in kinds], dtype=opts.dtype, device=dev)
        for b, mv in enumerate(movable):  # immovable masses do not carry the scale
            if not mv:
                scale_dir[self.names.index(join_name(top.bar_names[b], "mass"))] = 0.0
        has_known_force = any(d.external_forces is not None and np.any(d.external_forces) for d in data)
        if any((d.control_forces is not None and np.any(d.control_forces)) for d in data) and \
                "control_force_scalar" not in free:
            has_known_force = True
        scale_free = all((scale_dir[k] == 0) or (self.names[k] in free) for k in range(P))
        # weighed masses (a Gaussian prior on them) set the scale with their uncertainty, unless an explicit
        # total_mass anchors it
        mass_prior = opts.total_mass is None and any(
            float(opts.prior_std.get(join_name(b, "mass"), opts.prior_std.get("mass")) or 0.0) > 0
            for b, mv in zip(top.bar_names, movable) if mv)
        self.gauge = bool(scale_free and not has_known_force and any(scale_dir[k] > 0 for k in range(P))
                          and not mass_prior)
        self.scale_dir = scale_dir
        self.movable = movable
        if self.gauge:
            sw = (K.T @ scale_dir > 0).to(opts.dtype)           # scale direction in group space (uniform units)
            sw = sw / torch.linalg.vector_norm(sw)
            Qm, _ = torch.linalg.qr(torch.cat([sw[:, None], torch.eye(G, dtype=opts.dtype, device=dev)], 1))
            self.B = Qm[:, 1:G]                                  # orthonormal basis of the complement
            self.sw = sw
        else:
            self.B = torch.eye(G, dtype=opts.dtype, device=dev)
            self.sw = None
        self.total_mass = opts.total_mass
        if self.total_mass is None:
            self.total_mass = float(start.mass[torch.as_tensor(movable, device=dev)].sum())
        self.n_w = self.B.shape[1] + (1 if opts.estimate_delay else 0)
        self._build_windows(data)

    @classmethod
    def for_prediction(cls, structure: Structure, data: Sequence[Dataset], params: Params,
                       options: Optional[RefineOptions] = None, *, backend: str = "nodal",
                       integrator: str = "semi_implicit", **changes) -> "RefineProblem":
        """The problem with nothing to fit: ``params`` predicting each window open loop from its measured start
        (:meth:`prediction_rms`, :meth:`window_mse`, :meth:`residuals` at :meth:`initial_w`), to score a
        parameter set or set windows aside. The windows, data and engine come from ``options`` (default:
        :class:`RefineOptions`'s) with ``changes`` (any of its fields) applied; no parameter is free, nothing is
        known or tied, no prior, the delay and the window starts are not optimised."""
        opts = dataclasses.replace(options if options is not None else RefineOptions(), kinds=(), free=None,
                                   known={}, ties=(), total_mass=None, estimate_delay=False,
                                   optimize_initial_states=False, prior_std={}, prior_center=None, **changes)
        return cls(structure, data, params, opts, backend=backend, integrator=integrator)

    # ---------------------------------------------------------------------------------------------
    def _build_windows(self, datasets: Sequence[Dataset]) -> None:
        opts, top = self.opts, self.top
        dt_obs = float(np.median([d.dt for d in datasets]))
        self.dt_obs = dt_obs
        if opts.sim_dt is not None:
            self.sim_dt = float(opts.sim_dt)
        else:
            # semi-implicit Euler's stability limit (with the strings' damping), 75 %, and <= max_sim_dt (shorter
            # for quieter data: max_step_for_noise)
            h_stab = stable_step(top, self.template)
            h_cap = max_step_for_noise(opts.max_sim_dt, opts.noise_std_m)
            h_max = min(h_cap, h_stab if h_stab > 0 else h_cap)
            self.sim_dt = dt_obs / max(1, int(math.ceil(dt_obs / h_max - 1e-9)))
        H = max(1, int(round(opts.window_s / dt_obs)))
        stride = H if opts.stride_s is None else max(1, int(round(opts.stride_s / dt_obs)))
        self.H = H
        free = np.asarray(top.free_nodes, dtype=int)
        if opts.observed_nodes is None:
            obs = free
        else:
            obs = np.array([top.node_names.index(n) for n in opts.observed_nodes], dtype=int)
        self.obs_idx = obs
        A = top.n_actuators
        X0, V0, tgt, msk, U, Uts, F, Fc, Arm, wid, rel, span = [], [], [], [], [], [], [], [], [], [], [], []
        pad_before = int(math.ceil(0.2 / dt_obs)) + 2   # delays up to 0.2 s
        M = H + pad_before + 3
        for di, d in enumerate(datasets):
            if d.n_samples < H + 1:
                continue
            # Under occlusion a grid start lacks SOME node's marker more often than not (0.95^9 of the starts keep
            # all nine free nodes of a tower at 5 % occlusion, 0.8^4 a prism's four at 20 %), and a window dropped
            # for that loses ~1 s of data for one sample's marker. With bridge_start_gaps, short gaps are filled for
            # the starts (the smoothing fit of the node's neighbours; the start is fitted anyway), and past longer
            # ones the start moves forward (below)
            bridge = opts.bridge_start_gaps
            der = derivatives(d, opts.derivative_method, window_s=opts.smooth_window_s, fill_gaps=bridge)
            if d.velocities is not None:
                vel = np.where(d.valid[..., None], d.velocities, np.nan)
                pos = np.where(d.valid[..., None], d.positions, np.nan)
                okv = d.valid
            else:
                vel, pos, okv = der.velocities, der.positions, der.ok
            startable = okv[:, free].all(axis=1) & np.isfinite(pos[:, free]).all(axis=(1, 2)) \
                & np.isfinite(vel[:, free]).all(axis=(1, 2))
            # A start where some node is unmeasured for longer than the smoothing can bridge (a marker hidden
            # behind a bar for 0.3 s) moves forward to the first startable sample, by at most half a window; the
            # window keeps the grid's end (samples after it are the next window's). Only in a recording with gaps:
            # without any, the one start with no estimate is the record's first sample (central differences), which
            # is dropped as before, so that such a recording is cut exactly as it was
            reach = H // 2 + 1 if bridge and not d.valid[:, free].all() else 1
            for grid in range(0, d.n_samples - H, stride):
                ahead = np.flatnonzero(startable[grid:min(grid + reach, d.n_samples - H)])
                if ahead.size == 0:
                    continue
                s = grid + int(ahead[0])
                v = d.valid[s + 1:s + 1 + H][:, obs].copy()
                v[grid + H - s:] = False
                if v.sum() < 0.5 * v.size:
                    continue
                X0.append(pos[s])
                V0.append(vel[s])
                tgt.append(np.where(v[..., None], d.positions[s + 1:s + 1 + H][:, obs], 0.0))
                msk.append(v)
                rel.append(d.times[s:s + 1 + H] - d.times[s])
                if A and d.motor_angles is not None:
                    ii = np.arange(s - pad_before, s - pad_before + M)
                    idx = np.clip(ii, 0, d.n_samples - 1)
                    U.append(d.motor_angles[idx])
                    # sample times, extrapolated uniformly outside the record (constant angles there)
                    tt = np.where(ii < 0, d.times[0] + ii * dt_obs,
                                  np.where(ii >= d.n_samples, d.times[-1] + (ii - d.n_samples + 1) * dt_obs,
                                           d.times[idx]))
                    Uts.append(tt - d.times[s])
                if d.external_forces is not None:
                    F.append(d.external_forces[s:s + H])
                if d.control_forces is not None:
                    Fc.append(d.control_forces[s:s + H])
                    Arm.append(d.control_arms[s:s + H] if d.control_arms is not None else
                               np.zeros_like(d.control_forces[s:s + H]))
                wid.append((di, s))
                span.append(grid + H - s)
        if not X0:
            raise NotEnoughDataError("refine: no window with a measured start and >= 50 % valid samples")
        pick = None
        if opts.only_windows is not None:
            wanted = {(int(a), int(b)) for a, b in opts.only_windows}
            pick = [i for i, w in enumerate(wid) if w in wanted]
            if len(pick) != len(wanted):
                raise NotEnoughDataError(f"refine: {len(wanted) - len(pick)} of the {len(wanted)} windows asked for "
                                         "(only_windows) cannot be cut from these recordings")
        elif opts.max_windows is not None and len(X0) > opts.max_windows:
            pick = np.unique(np.linspace(0, len(X0) - 1, opts.max_windows).round().astype(int))
        if pick is not None:
            sel = lambda L: [L[i] for i in pick] if L else L  # noqa: E731
            X0, V0, tgt, msk, U, Uts, F, Fc, Arm, wid, rel, span = map(sel, (X0, V0, tgt, msk, U, Uts, F, Fc, Arm,
                                                                             wid, rel, span))
        t = lambda x: torch.as_tensor(np.asarray(x), dtype=self.dtype, device=self.device)  # noqa: E731
        X0 = np.nan_to_num(np.stack(X0))
        V0 = np.nan_to_num(np.stack(V0))
        self.X0m, self.V0m = t(X0), t(V0)
        self.targets = t(np.stack(tgt))                         # (B, H, No, 3)
        self.mask = torch.as_tensor(np.stack(msk), device=self.device)  # (B, H, No)
        self.n_obs = int(self.mask.sum())
        self.window_ids = wid
        self.window_lengths = span                              # samples after each start that it covers (<= H)
        self.B_win = len(wid)
        # sample times relative to each window start -> fractional engine steps (irregular stamps are fine)
        self._rel = np.stack(rel)                               # (B, H + 1)
        self._set_step(self.sim_dt)
        if U:
            self.U = t(np.stack(U))                             # (B, M, A)
            self.U_t = t(np.stack(Uts))                         # (B, M) motor sample times rel. to the start
            self.U_t0 = self.U_t[:, 0]
        else:
            self.U = None
            self.U_t = None
        self.Fext = t(np.stack(F)) if F else None               # (B, H, N, 3)
        self.Fc = t(np.stack(Fc)) if Fc else None
        self.Arm = t(np.stack(Arm)) if Arm else None
        self.contiguous = [(k, k + 1) for k in range(self.B_win - 1)
                           if wid[k][0] == wid[k + 1][0] and wid[k + 1][1] - wid[k][1] == self.H]

    def _set_step(self, h: float) -> None:
        """The engine step ``h`` (s) and what follows from it: steps per window, each target's fractional step
        index, and the sample in force at each step (zero-order hold of external and control forces)."""
        rel, H = self._rel, self.H
        self.sim_dt = float(h)
        self.n_steps = int(math.ceil(rel[:, -1].max() / self.sim_dt - 1e-6))
        self.f_steps = torch.as_tensor(rel[:, 1:] / self.sim_dt, dtype=self.dtype, device=self.device)   # (B, H)
        k_t = np.arange(self.n_steps) * self.sim_dt
        self.hold_idx = torch.as_tensor(np.stack([np.clip(np.searchsorted(r, k_t + 1e-9, side="right") - 1, 0, H - 1)
                                                  for r in rel]), device=self.device)   # (B, n_steps)

    def with_step(self, h: float) -> "RefineProblem":
        """The same windows, targets and starts, rolled out with engine steps of ``h`` (s)."""
        import copy
        other = copy.copy(self)
        other._workers = None
        other._set_step(h)
        return other

    def with_params(self, params: Params, delay_s: float) -> "RefineProblem":
        """The same windows and free columns around ``params``, the motor delay held at ``delay_s`` (s). The window
        workers evaluate the problem as it was built, so the copy keeps them only for the parameters and delay it
        was built with."""
        import copy
        other = copy.copy(self)
        other.template = params.map(lambda t: t.detach().to(dtype=self.dtype, device=self.device))
        other.z_start = to_unconstrained(other.template).detach()
        other.opts = dataclasses.replace(self.opts, delay_s=float(delay_s), estimate_delay=False)
        if not (torch.equal(other.z_start, self.z_start) and float(delay_s) == self.opts.delay_s
                and not self.opts.estimate_delay):
            other._workers = None
        return other

    def subset(self, idx: Sequence[int]) -> "RefineProblem":
        """A view of the problem on the windows ``idx`` (for Jacobians on a subset)."""
        import copy
        sub = copy.copy(self)
        ii = torch.as_tensor(list(idx), device=self.device, dtype=torch.long)
        for name in ("X0m", "V0m", "targets", "mask", "U", "U_t", "U_t0", "Fext", "Fc", "Arm", "f_steps", "hold_idx"):
            v = getattr(self, name)
            if v is not None:
                setattr(sub, name, v.index_select(0, ii))
        sub._rel = self._rel[list(idx)]
        sub.n_obs = int(sub.mask.sum())
        sub.window_ids = [self.window_ids[i] for i in idx]
        sub.window_lengths = [self.window_lengths[i] for i in idx]
        sub.B_win = len(idx)
        sub.contiguous = []
        sub._workers = None
        return sub

    # ---------------------------------------------------------------------------------------------
    def initial_w(self, delay_s: float) -> torch.Tensor:
        parts = [torch.zeros(self.B.shape[1], dtype=self.dtype, device=self.device)]
        if self.opts.estimate_delay:
            parts.append(torch.tensor([delay_s / DELAY_UNIT_S], dtype=self.dtype, device=self.device))
        return torch.cat(parts)

    def z_of(self, w: torch.Tensor) -> torch.Tensor:
        nb = self.B.shape[1]
        g = self.B @ w[:nb]
        return self.z_start + self.K @ g

    def delay_of(self, w: torch.Tensor) -> torch.Tensor:
        if self.opts.estimate_delay:
            return w[-1] * DELAY_UNIT_S
        return torch.tensor(self.opts.delay_s, dtype=self.dtype, device=self.device)

    def params_of(self, w: torch.Tensor) -> Params:
        return from_unconstrained(self.z_of(w), self.template)

    def finalize(self, w: torch.Tensor) -> Tuple[Params, torch.Tensor]:
        """Params at w, rescaled along the gauge so the total moving mass equals the anchor."""
        z = self.z_of(w).detach()
        if self.gauge:
            p = from_unconstrained(z, self.template)
            mv = torch.as_tensor(self.movable, device=self.device)
            tot = float(p.mass[mv].sum())
            c = math.log(self.total_mass / tot)
            z = z + c * self.scale_dir
        return from_unconstrained(z, self.template), z

    # ---------------------------------------------------------------------------------------------
    def _motor_curve(self, delay: torch.Tensor, copies: int = 1):
        """Motor angles, rates and their rates of change (C*B, n_steps, A) at each step's start time less the
        delay (:func:`_hermite` between the recorded samples; irregular stamps allowed); delay: () or (C,) s."""
        steps = torch.arange(self.n_steps, dtype=self.dtype, device=self.device) * self.sim_dt
        U, Ut = self.U, self.U_t
        if copies > 1:
            U = U.repeat(copies, 1, 1)
            Ut = Ut.repeat(copies, 1)
            d = delay.reshape(copies, 1).repeat_interleave(self.B_win, dim=0)          # (C*B, 1)
        else:
            d = delay.reshape(-1)[:1].reshape(1, 1) if delay.dim() else delay
        tau = steps[None, :] - d                                                      # (CB, n) query times
        return _hermite(U, Ut, tau, _primal(tau) if is_dual(tau) else tau.detach())

    def _inputs(self, delay: torch.Tensor, copies: int = 1) -> Optional[Inputs]:
        """Engine inputs (n_steps, C*B, ...) for ``copies`` parameter copies; delay: () or (C,) s.

        Motor angles and rates: :meth:`_motor_curve`. Forces are held per sample.
        """
        n = self.n_steps
        C = copies
        kw = {}
        if self.U is not None:
            u, ud, _ = self._motor_curve(delay, C)
            kw["motor_angles"] = u.transpose(0, 1)
            kw["motor_velocities"] = ud.transpose(0, 1)

        def hold(x):                                      # (B, H, ...) -> (n, C*B, ...)
            idx = self.hold_idx.reshape(self.B_win, n, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
            y = torch.gather(x, 1, idx)
            return y.repeat(C, *([1] * (y.dim() - 1))).transpose(0, 1)

        if self.Fext is not None:
            kw["external_forces"] = hold(self.Fext)
        if self.Fc is not None:
            kw["control_forces"] = hold(self.Fc)
            kw["control_arms"] = hold(self.Arm)
        return Inputs(**kw) if kw else None

    def _free_selector(self) -> torch.Tensor:
        S = torch.zeros(self.top.n_nodes, len(self.top.free_nodes), dtype=self.dtype, device=self.device)
        for k, i in enumerate(self.top.free_nodes):
            S[i, k] = 1.0
        return S

    def _offset_starts(self, x0: Optional[torch.Tensor], copies: int = 1):
        """Measured start positions and velocities (C*B, N, 3) plus the offsets x0 ((C, B, nf, 6) or None)."""
        X0, V0 = self.X0m, self.V0m
        if copies > 1:
            X0, V0 = X0.repeat(copies, 1, 1), V0.repeat(copies, 1, 1)
        if x0 is not None:
            Sx = self._free_selector()
            xx = x0.reshape(-1, x0.shape[-2], 6)
            X0 = X0 + Sx @ (xx[..., :3] * X0_UNIT_M)
            V0 = V0 + Sx @ (xx[..., 3:] * V0_UNIT_MPS)
        return X0, V0

    def simulate(self, params: Params, delay: torch.Tensor, x0: Optional[torch.Tensor], copies: int = 1,
                 states: Optional[list] = None):
        """Predicted observed-node positions and the final full states.

        copies = 1: params unbatched, x0 (B, nf, 6) or None -> pred (B, H, No, 3).
        copies = C > 1: params batched (C,), delay (C,), x0 (C, B, nf, 6) or None -> pred (C, B, H, No, 3)
        (all copies run as one engine batch of C*B windows; used for forward-mode Jacobians).
        states: a list that receives the rollout's reduced states (Qs, Vs) (n_steps + 1, C*B, 3, nf), start first.
        """
        C, B = copies, self.B_win
        if C > 1:
            params = params.map(lambda t: t.reshape(C, 1, *t.shape[1:]).expand(C, B, *t.shape[1:])
                                .reshape(C * B, *t.shape[1:]))
        st = self.engine.initial_state(*self._offset_starts(x0, C))
        if hasattr(self.engine, "project"):
            st = self.engine.project(params, st, iters=START_PROJECTION_ITERS)
        inp = self._inputs(delay, C)
        n = self.n_steps
        out = self.engine.rollout(params, st, inp, dt=self.sim_dt, steps=None if inp is not None else n,
                                  **self._primal_kernel(params, st, inp))
        if states is not None:
            from ..engine.nodal import reduce
            c = self.engine.constants
            states.append(tuple(reduce(c, torch.cat([s0.unsqueeze(0), s])) for s0, s in
                                ((st.positions, out.positions), (st.velocities, out.velocities))))
        obs = torch.as_tensor(self.obs_idx, device=self.device)
        seq = torch.cat([st.positions.index_select(-2, obs).unsqueeze(0),
                         out.positions.index_select(-2, obs)]).transpose(0, 1)        # (CB, n + 1, No, 3)
        f = self.f_steps.repeat(C, 1) if C > 1 else self.f_steps                       # (CB, H)
        k0, wgt = sample_brackets(f, n)
        wgt = wgt[..., None, None]
        ga = torch.gather(seq, 1, k0[..., None, None].expand(-1, -1, *seq.shape[2:]))
        gb = torch.gather(seq, 1, (k0 + 1)[..., None, None].expand(-1, -1, *seq.shape[2:]))
        pred = ga + wgt * (gb - ga)                                                    # (CB, H, No, 3)
        if C > 1:
            pred = pred.reshape(C, B, *pred.shape[1:])
        return pred, out.positions[-1], out.velocities[-1]

    def _primal_kernel(self, params: Params, st, inp: Optional[Inputs]) -> dict:
        """The rollout options of :meth:`simulate`: the engine's native kernel (the semi-implicit step fused in C,
        :mod:`..engine.native`) where it runs this rollout, i.e. where no derivative flows through it (the
        residuals of Levenberg-Marquardt, the scorings, the checks), else the eager engine (autograd and forward-mode
        Jacobians). The same states to float64 round-off (test_engine_native.py). On CUDA, where no derivative
        flows, the eager steps replayed from a CUDA graph (:mod:`..engine.graphs`; the same states to round-off)."""
        from ..engine import NodalEngine, fast, graphs
        if not isinstance(self.engine, NodalEngine):
            return {}
        leaves = [getattr(params, k) for k in params.kinds()] + [st.positions, st.velocities]
        if inp is not None:
            leaves += [inp.motor_angles, inp.motor_velocities, inp.external_forces]
        grad = differentiated(*leaves)
        if graphs.for_identification(self.device, grad, self.engine.integrator):
            return {"cuda_graph": True}
        kernel = fast.choose_kernel("auto", self.device.type, grad, self.engine.integrator, self.dtype)
        return {"compile": True, "kernel": "native"} if kernel == "native" else {}

    def _open_loop_residuals(self, params: Union[Params, Sequence[Params]], delay_s: Optional[float]) -> torch.Tensor:
        """Masked residuals (B, H, No, 3), m, of ``params`` from the measured window starts (no optimisation);
        for a sequence of C parameter sets (C, B, H, No, 3), all in one engine batch of C x B windows (a few short
        windows are too small a batch to fill a core: the online identifier's two held-out scorings took 0.29-0.31 s
        one after the other, 0.21-0.27 s in one batch)."""
        d = torch.tensor(self.opts.delay_s if delay_s is None else delay_s, dtype=self.dtype, device=self.device)

        def prepared(q: Params) -> Params:
            q = q.map(lambda t: t.detach().to(dtype=self.dtype, device=self.device))
            if self.template.control_force_scalar is not None and q.control_force_scalar is None:
                q = Params(q.stiffness, q.damping, q.rest_length, q.mass, q.spool_radius, q.zero_offset,
                           self.template.control_force_scalar, q.meta)
            return q

        single = isinstance(params, Params)
        sets = [params] if single else list(params)
        C = len(sets)
        with torch.no_grad():
            p = prepared(sets[0]) if C == 1 else stack_params([prepared(q) for q in sets])
            pred, _, _ = self.simulate(p, d if C == 1 else d.expand(C), None, copies=C)
            r = (pred - self.targets) * self.mask[..., None].to(self.dtype)      # broadcast over the sets
        return r if single or C > 1 else r.unsqueeze(0)

    def residual_rms(self, r: torch.Tensor) -> float:
        """RMS 3-D position error (m) of masked residuals ``r`` (:meth:`residuals`) over the observed samples."""
        return float(torch.sqrt((r * r).sum() / max(self.n_obs, 1)))

    def prediction_rms(self, params: Params, delay_s: Optional[float] = None) -> float:
        """RMS 3-D position error (m) of ``params`` from the measured window starts (no optimisation)."""
        val = self.residual_rms(self._open_loop_residuals(params, delay_s))
        return val if math.isfinite(val) else float("inf")

    def window_mse(self, params: Union[Params, Sequence[Params]], delay_s: Optional[float] = None) -> np.ndarray:
        """(B,) mean squared 3-D position error (m^2) of each window, open loop from its measured start: the
        per-window figures a paired comparison of two parameter sets needs (inf where not finite). For a
        sequence of C sets, (C, B), simulated as one batch."""
        r = self._open_loop_residuals(params, delay_s)
        n = self.mask.reshape(self.mask.shape[0], -1).sum(dim=1).clamp(min=1).to(self.dtype)
        mse = ((r * r).sum(dim=(-3, -2, -1)) / n).cpu().numpy()
        return np.where(np.isfinite(mse), mse, np.inf)

    def _parallel(self, w: torch.Tensor, x0: Optional[torch.Tensor]) -> bool:
        """Whether to hand this evaluation to the window workers (see :mod:`.workers`): they are running and no
        gradient has to flow back through the result."""
        if self._workers is None:
            return False
        return not (torch.is_grad_enabled() and (w.requires_grad or (x0 is not None and x0.requires_grad)))

    def residuals(self, w: torch.Tensor, x0: Optional[torch.Tensor]) -> torch.Tensor:
        """Masked position residuals (B, H, No, 3), m (zero where not observed)."""
        if self._parallel(w, x0):
            return self._workers.map("residuals", w, x0)
        keep = self._keeps_primal(w, x0)
        states = [] if keep else None
        pred, _, _ = self.simulate(self.params_of(w), self.delay_of(w), x0, states=states)
        if keep and not states[0][0].requires_grad:
            self._primal_kept = ([(self, w.detach().clone(), None if x0 is None else x0.detach().clone(), states[0])]
                                 + [k for k in getattr(self, "_primal_kept", []) if k[0] is self])[:PRIMAL_KEPT]
        return (pred - self.targets) * self.mask[..., None].to(self.dtype)

    def _keeps_primal(self, w: torch.Tensor, x0: Optional[torch.Tensor]) -> bool:
        """Whether :meth:`residuals` keeps its rollout's states for a tangent Jacobian at the same point: Levenberg-
        Marquardt evaluates the residuals at a point, then (accepted) takes the Jacobian there, and the tangent
        model would otherwise step the same primal again (~12 % of a Jacobian's time)."""
        return (PRIMAL_KEPT > 0 and not w.requires_grad and (x0 is None or not x0.requires_grad)
                and self.jacobian_method() == "tangent" and not self._native_tangents())

    def _native_tangents(self) -> bool:
        """Whether the tangent Jacobians run the step's tangent fused in C (:func:`..engine.native.rollout_tangents`,
        which steps its own primal: nothing to keep for it)."""
        from ..engine import native, tangent
        return (tangent.supports(self.engine)
                and native.tangent_unsuitable(self.device.type, self.dtype, None, self.engine.options) is None)

    def _kept_primal(self, w: torch.Tensor, x0: Optional[torch.Tensor]):
        """The states :meth:`residuals` kept at exactly (w, x0) for this problem, or None."""
        for owner, wk, xk, states in getattr(self, "_primal_kept", []):
            if owner is self and torch.equal(wk, w) and ((xk is None and x0 is None) or
                                                         (xk is not None and x0 is not None and torch.equal(xk, x0))):
                return states
        return None

    def _params_batched(self, W: torch.Tensor) -> Params:
        """Params batched (C,) for C copies of the optimisation vector W (C, n_w)."""
        z = self.z_start + (self.K @ (self.B @ W[:, :self.B.shape[1]].T)).T          # (C, P)
        return from_unconstrained(z, self.template)

    def _batched(self, W: torch.Tensor, X: Optional[torch.Tensor]):
        """Residuals (C, B, H, No, 3) for C copies of the optimisation vector W (C, n_w) and offsets X."""
        C = W.shape[0]
        params = self._params_batched(W)
        delay = W[:, -1] * DELAY_UNIT_S if self.opts.estimate_delay else \
            torch.full((C,), float(self.opts.delay_s), dtype=self.dtype, device=self.device)
        pred, _, _ = self.simulate(params, delay, X, copies=C)
        return (pred - self.targets) * self.mask[..., None].to(self.dtype)

    def jacobian_method(self, method: str = "auto") -> str:
        """``auto`` resolved: ``tangent`` where the engine has an exact tangent-linear model, else ``central``."""
        if method != "auto":
            return method
        from ..engine import tangent
        return "tangent" if tangent.supports(self.engine) else "central"

    def jacobian_blocks(self, w: torch.Tensor, x0: Optional[torch.Tensor], method: str = "auto",
                        tangent_dtype: Optional[torch.dtype] = None, starts_only: bool = False):
        """Residuals r (B, R) and the Jacobian blocks J_w (B, R, n_w) (free parameters and delay) and
        J_e (B, R, 6 nf) (each window's own initial-state offsets; None without x0), R = H * No * 3.

        tangent_dtype: the tangent-linear model's dtype (default: the problem's; see
        :attr:`RefineOptions.tangent_dtype`); the blocks are returned in the problem's. starts_only: J_e alone
        (J_w is returned with no columns), for fits of the window starts with the parameters held: the tangent
        then carries 6 nf columns instead of n_w + 6 nf (on the manipulator's 1-s windows 3.1 s instead of 5.2 s).

        ``tangent`` (the default where available, see :meth:`jacobian_method`): exact, from ONE rollout of
        the windows through the engine's tangent-linear model (:mod:`tensegrity_ros.engine.tangent`), every
        column pushed through each step's linearisation by batched matrix products; 5-10x faster than the
        copies below on the manipulator. The others evaluate all columns in ONE engine rollout whose batch
        holds a copy of every window per column: ``forward_ad`` (exact, dual numbers: each copy carries its
        own tangent), ``central``
        (central differences, step 1e-5 in the scaled units: 1e-6 relative; primal-only and several times
        faster than dual numbers in torch) or ``forward`` (one-sided, step 1e-6: half the copies).
        Window k's residuals depend only on its own initial state, so
        one column per initial-state coordinate (shared by all windows) gives every window's block.
        """
        method = self.jacobian_method(method)
        if self._workers is not None:
            return self._workers.map("jacobian_blocks", w.detach(), None if x0 is None else x0.detach(), method,
                                     tangent_dtype, starts_only)
        if starts_only and x0 is None:
            raise ValueError("jacobian_blocks: starts_only needs the window starts' offsets x0")
        n_w = w.numel()
        nf = len(self.top.free_nodes)
        ne = 6 * nf if x0 is not None else 0
        if method == "tangent":
            r, T = self._tangent_jacobian(w.detach(), None if x0 is None else x0.detach(), tangent_dtype,
                                          starts_only)
            if starts_only:
                return r, T[..., :0], T
            return r, T[..., :n_w], (T[..., n_w:] if ne else None)
        C = n_w + ne
        B = self.B_win
        eye = torch.eye(C, dtype=self.dtype, device=self.device)
        w = w.detach()
        Wb = w.reshape(1, n_w).expand(C, n_w)
        Xb = None if x0 is None else x0.detach().reshape(1, B, nf, 6).expand(C, B, nf, 6)
        tx = None if x0 is None else eye[:, n_w:].reshape(C, 1, nf, 6).expand(C, B, nf, 6)
        if method == "forward_ad":
            import torch.autograd.forward_ad as fwAD
            with fwAD.dual_level():
                W = fwAD.make_dual(Wb.clone(), eye[:, :n_w].contiguous())
                X = None if x0 is None else fwAD.make_dual(Xb.clone(), tx.contiguous())
                primal, tangent = fwAD.unpack_dual(self._batched(W, X))
            r = primal[0].reshape(B, -1)
            T = tangent.reshape(C, B, -1)
        elif method == "forward":
            h = 1e-6
            W2 = torch.cat([Wb[:1], Wb + h * eye[:, :n_w]])
            X2 = None if x0 is None else torch.cat([Xb[:1], Xb + h * tx])
            with torch.no_grad():
                out = self._batched(W2, X2).reshape(C + 1, B, -1)
            r = out[0]
            T = (out[1:] - out[:1]) / h
        elif method == "central":
            h = 1e-5
            W2 = torch.cat([Wb + h * eye[:, :n_w], Wb - h * eye[:, :n_w]])
            X2 = None if x0 is None else torch.cat([Xb + h * tx, Xb - h * tx])
            with torch.no_grad():
                out = self._batched(W2, X2).reshape(2, C, B, -1)
                r = self.residuals(w, None if x0 is None else x0.detach()).reshape(B, -1)
            T = (out[0] - out[1]) / (2 * h)
        else:
            raise ValueError(f"unknown jacobian method {method!r} (valid: {', '.join(JACOBIANS)})")
        T = T.permute(1, 2, 0)                                                      # (B, R, C)
        return r.detach(), T[..., :0 if starts_only else n_w].detach(), (T[..., n_w:].detach() if ne else None)

    def normal_blocks(self, w: torch.Tensor, x0: Optional[torch.Tensor], method: str = "auto",
                      tangent_dtype: Optional[torch.dtype] = None, starts_only: bool = False):
        """The Gauss-Newton normal equations' blocks of each window, from :meth:`jacobian_blocks` (same arguments):
        residuals r (B, R), J_w^T J_w (B, n_w, n_w), J_w^T J_e (B, n_w, E), J_e^T J_e (B, E, E), J_w^T r (B, n_w)
        and J_e^T r (B, E) (the J_e items None without x0).

        The Jacobian stays with the problem (with a window worker's share, in that worker), where
        :meth:`residual_gradients` multiplies later residuals by it. Why: Levenberg-Marquardt needs only these
        products, and the Jacobian itself (~60 MB for the manipulator's 7 one-second windows) crossed a pipe
        and was multiplied out in the parent while the workers waited (py-spy on the README's 16-s bag, stop 54:
        1.7 s of those products and the concatenation in the parent, 1.8 s receiving)."""
        if self._workers is not None:
            # where the Jacobian was taken, for a parent that has to finish alone (a worker stopped)
            self._normal_point = (w.detach(), None if x0 is None else x0.detach(), method, tangent_dtype, starts_only)
            self._kept_jacobian = None          # one kept in this process earlier is not this point's
            return self._workers.map("normal_blocks", w.detach(), None if x0 is None else x0.detach(), method,
                                     tangent_dtype, starts_only)
        r, Jw, Je = self.jacobian_blocks(w, x0, method, tangent_dtype, starts_only)
        self._kept_jacobian = (self, Jw, Je)
        return (r, Jw.mT @ Jw, None if Je is None else Jw.mT @ Je, None if Je is None else Je.mT @ Je,
                *_transposed_times(Jw, Je, r))

    def residual_gradients(self, w: torch.Tensor, x0: Optional[torch.Tensor]):
        """Residuals r (B, R) at (w, x0) with J_w^T r (B, n_w) and J_e^T r (B, E) (None without x0), J the
        Jacobian of the last :meth:`normal_blocks` (the chord steps' gradients: the same normal equations, fresh
        residuals). Without a kept Jacobian (a worker that stopped: the parent finishes alone) it is taken at
        (w, x0)."""
        if self._workers is not None:
            return self._workers.map("residual_gradients", w.detach(), None if x0 is None else x0.detach())
        kept = getattr(self, "_kept_jacobian", None)
        if kept is None or kept[0] is not self:
            self.normal_blocks(w, x0)
            kept = self._kept_jacobian
        _, Jw, Je = kept
        with torch.no_grad():
            r = self.residuals(w, x0).reshape(self.B_win, -1)
        return (r, *_transposed_times(Jw, Je, r))

    def transposed_times(self, w: torch.Tensor, v: torch.Tensor):
        """J_w^T v (B, n_w) and J_e^T v (B, E) (None without starts) for per-window vectors v (B, R), J the
        Jacobian of the last :meth:`normal_blocks` (formed where that Jacobian stays; ``w`` only routes the call
        like the other window methods). Without a kept Jacobian (a worker stopped after forming it) it is taken
        again where the last :meth:`normal_blocks` took it."""
        if self._workers is not None:
            return self._workers.map("transposed_times", w.detach(), v)
        kept = getattr(self, "_kept_jacobian", None)
        if kept is None or kept[0] is not self:
            point = getattr(self, "_normal_point", None)
            if point is None:
                raise RuntimeError("RefineProblem.transposed_times: no Jacobian kept (call normal_blocks first)")
            self.normal_blocks(*point)
            kept = self._kept_jacobian
        return _transposed_times(kept[1], kept[2], v.reshape(self.B_win, -1).to(kept[1].dtype))

    def _start_tangents(self, der, dth, x0: Optional[torch.Tensor], n_w: int):
        """Reduced start states Q0, V0 (B, 3, nf) (as :meth:`simulate` starts) and their tangents (B, C, 3, nf)
        along the columns of :meth:`jacobian_blocks`: zero for the n_w parameter columns before the start
        projection, one unit of x0 for the others. der: the engine's per-params quantities at w."""
        from ..engine import tangent
        from ..engine.nodal import reduce
        B, nf = self.B_win, len(self.top.free_nodes)
        c = self.engine.constants
        st = self.engine.initial_state(*self._offset_starts(x0))
        Q, V = reduce(c, st.positions), reduce(c, st.velocities)
        ne = 6 * nf if x0 is not None else 0
        SQ = Q.new_zeros(B, n_w + ne, 3, nf)
        SV = Q.new_zeros(B, n_w + ne, 3, nf)
        if ne:
            cols = n_w + 6 * torch.arange(nf, device=self.device)
            k = torch.arange(nf, device=self.device)
            for m in range(3):
                SQ[:, cols + m, m, k] = X0_UNIT_M
                SV[:, cols + 3 + m, m, k] = V0_UNIT_MPS
        Q, V, SQ, SV = tangent.project_with_tangents(c, der, dth, Q, V, SQ, SV, iters=START_PROJECTION_ITERS)
        return Q, V, SQ, SV

    def _tangent_jacobian(self, w: torch.Tensor, x0: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None,
                          starts_only: bool = False):
        """Residuals (B, R) and Jacobian (B, R, C) from ONE rollout of the tangent-linear model
        (:mod:`tensegrity_ros.engine.tangent`) in ``dtype`` (default: the problem's); columns as
        :meth:`jacobian_blocks` (only the window starts' with ``starts_only``), the starts' formed from a basis of
        their span pushed through the model (:func:`start_basis`)."""
        from ..engine import native, tangent
        from ..engine.nodal import prepare
        c, B = self.engine.constants, self.B_win
        n_w = 0 if starts_only else w.numel()
        with torch.no_grad():
            der = prepare(c, self.params_of(w))
        dth = None if starts_only else tangent.param_tangents(c, self._params_batched, w)
        with torch.no_grad():
            Q0, V0, SQ0, SV0 = self._start_tangents(der, dth, x0, n_w)
            coef = None
            if x0 is not None:
                SQ0, SV0, coef = start_basis(SQ0, SV0, n_w)
        inp = self._inputs(self.delay_of(w))
        u = ud = du = dud = fq = None
        if inp is not None:
            u, ud = inp.motor_angles, inp.motor_velocities
            if inp.external_forces is not None:
                fq = inp.external_forces.mT @ c.T
            if self.opts.estimate_delay and u is not None and not starts_only:
                du = torch.zeros(*u.shape, n_w, dtype=self.dtype, device=self.device)
                du[..., -1] = -ud * DELAY_UNIT_S                   # u(t - delay): du/d delay = -u'
                dud = torch.zeros_like(du)
                dud[..., -1] = -self._motor_curve(self.delay_of(w))[2].transpose(0, 1) * DELAY_UNIT_S   # -u''
        tdt = dtype if dtype != self.dtype else None
        with torch.no_grad():
            if tdt is None and self._native_tangents():
                # the step's tangent fused in C (engine/native.py): the same columns to ~1e-13, 4-5x faster on the
                # manipulator (test_engine_native_tangent.py); it steps its own primal, so no kept states
                Qs, S = native.rollout_tangents(c, der, dth, Q0, V0, SQ0, SV0, u, ud, du, fq, self.sim_dt,
                                                self.n_steps, self.engine.options, self.f_steps, dud=dud)
            else:
                Qs, S = tangent.rollout_tangents(c, der, dth, Q0, V0, SQ0, SV0, u, ud, du, fq, self.sim_dt,
                                                 self.n_steps, self.engine.options, self.f_steps, dtype=tdt, dud=dud,
                                                 primal=self._kept_primal(w, x0))
        obs = torch.as_tensor(self.obs_idx, device=self.device)
        m = self.mask.to(self.dtype)
        X = (Qs @ c.Tt + c.XcT).mT.index_select(-2, obs)                       # (B, H, No, 3)
        r = ((X - self.targets) * m[..., None]).reshape(B, -1)
        # rows (sample, marker, coordinate), columns the directions: one product on the directions-last tangents
        # (the kernel's own layout, a permuted view of the dense model's) and one masked copy into place
        dX = c.Tt.index_select(-1, obs).mT @ S.to(self.dtype).permute(0, 1, 3, 4, 2)   # (B, H, 3, No, C)
        J = dX.new_empty(B, dX.shape[1], dX.shape[3], 3, dX.shape[4])
        torch.mul(dX.transpose(2, 3), m[:, :, :, None, None], out=J)
        J = J.reshape(B, r.shape[1], -1)
        if coef is not None and coef.shape[-1] < coef.shape[-2]:     # the start columns from their basis
            J = torch.cat([J[..., :n_w], J[..., n_w:] @ coef.mT.to(J.dtype)], -1)
        return r, J

    def loss(self, w: torch.Tensor, x0: Optional[torch.Tensor]) -> torch.Tensor:
        opts = self.opts
        params = self.params_of(w)
        pred, Xend, Vend = self.simulate(params, self.delay_of(w), x0)
        r = (pred - self.targets) * self.mask[..., None].to(self.dtype)
        L = (r * r).sum() / (self.n_obs * opts.loss_noise_std_m ** 2)
        if opts.continuity_weight > 0 and self.contiguous:
            a = torch.tensor([i for i, _ in self.contiguous], device=self.device)
            b = torch.tensor([j for _, j in self.contiguous], device=self.device)
            X0n = self.X0m[b] + (0 if x0 is None else
                                 torch.zeros_like(self.X0m[b]).index_copy(
                                     1, torch.as_tensor(self.top.free_nodes, device=self.device),
                                     x0[b, :, :3] * X0_UNIT_M))
            gap = Xend[a] - X0n
            L = L + opts.continuity_weight * (gap * gap).sum() / (len(self.contiguous) * opts.loss_noise_std_m ** 2)
        if bool((self.prior_prec > 0).any()):
            dz = self.z_of(w) - self.z_start + self.prior_offset
            L = L + (self.prior_prec * dz * dz).sum() / max(self.n_obs, 1)
        return L


def _transposed_times(Jw: torch.Tensor, Je: Optional[torch.Tensor], r: torch.Tensor):
    """Per window J_w^T r (B, n_w) and J_e^T r (B, E) (None without J_e): J (B, R, n), r (B, R)."""
    rc = r.unsqueeze(-1)
    return (Jw.mT @ rc).squeeze(-1), None if Je is None else (Je.mT @ rc).squeeze(-1)


def start_basis(SQ: torch.Tensor, SV: torch.Tensor, n_w: int, rtol: Optional[float] = None):
    """The start columns of the tangents SQ, SV (B, n_w + E, 3, nf) (the last E: the window starts' projected unit
    offsets) replaced by a basis of their span: returns SQ', SV' (B, n_w + k, 3, nf) and coef (B, E, k) with
    start column i = sum_j coef[:, i, j] x basis column j, k the most singular values above ``rtol`` x the largest
    in any window (positions scaled by X0_UNIT_M, velocities by V0_UNIT_MPS, so a unit offset of either has norm
    1). The tangent model is linear in its starting directions, so the k pushed-through basis columns give all E
    columns (rtol default :data:`START_BASIS_RTOL`: what is dropped lies orders of magnitude below what is kept).
    Unchanged (coef with k = E) when nothing would be dropped, and for rtol = 0."""
    rtol = START_BASIS_RTOL if rtol is None else rtol
    B, C, _, nf = SQ.shape
    E = C - n_w
    whole = SQ, SV, torch.eye(E, dtype=SQ.dtype, device=SQ.device).expand(B, E, E)
    if E == 0 or not rtol > 0:
        return whole
    M = torch.cat([SQ[:, n_w:].reshape(B, E, -1) / X0_UNIT_M, SV[:, n_w:].reshape(B, E, -1) / V0_UNIT_MPS], -1)
    if not bool(torch.isfinite(M).all()):                 # non-finite: left whole, for the caller's check to see
        return whole
    # the span from the eigenvectors of M^T M (singular values squared), not an SVD of M: batched, torch's SVD failed
    # to converge on one finite 54 x 54 window of the generality suite's tower (test_generality.py, "ill-conditioned";
    # its kept singular values 0.91-1.0, the dropped 1.7e-5 and below), which the symmetric solver takes
    ev, V = torch.linalg.eigh(M.mT @ M)                                   # ascending
    k = max(int((ev > rtol ** 2 * ev[:, -1:]).sum(dim=1).max()), 1)
    if k >= E:
        return whole
    basis = V[..., -k:].mT                                                # (B, k, 6 nf), orthonormal rows
    bq = basis[..., :3 * nf].reshape(B, k, 3, nf) * X0_UNIT_M
    bv = basis[..., 3 * nf:].reshape(B, k, 3, nf) * V0_UNIT_MPS
    return (torch.cat([SQ[:, :n_w], bq], 1).contiguous(), torch.cat([SV[:, :n_w], bv], 1).contiguous(),
            M @ basis.mT)


def _hermite(U: torch.Tensor, Ut: torch.Tensor, tau: torch.Tensor, tq: torch.Tensor):
    """Samples U (B, M, A) at times Ut (B, M, increasing) interpolated at tau (B, n) (tq: its primal values, which
    pick the segments): values, rates and second derivatives (B, n, A), differentiable in tau (forward and reverse
    mode).

    Cubic Hermite on each segment [t1, t2], tangents from the neighbours, (p2 - p0) / (t2 - t0) (one-sided at the
    ends; outside the samples the end segment's curve continues, as the line did). Why not a line: the 120-Hz
    samples are interpolated at the engine's ~1.7-ms steps, and a line cuts a 9-Hz drive's peaks by up to 2.8 %
    (1.2 % of its amplitude on average) and puts a rate error of up to 23 % of the peak rate into the strings'
    damping term; this curve: 0.18 % and 3.7 %."""
    M = U.shape[1]
    i1 = torch.clamp(torch.searchsorted(Ut.contiguous(), tq.expand(Ut.shape[0], -1).contiguous(), right=True) - 1,
                     0, M - 2)
    i0, i2, i3 = torch.clamp(i1 - 1, min=0), i1 + 1, torch.clamp(i1 + 2, max=M - 1)
    t0, t1, t2, t3 = (torch.gather(Ut, 1, i) for i in (i0, i1, i2, i3))
    p0, p1, p2, p3 = (torch.gather(U, 1, i[..., None].expand(-1, -1, U.shape[2])) for i in (i0, i1, i2, i3))
    hseg = (t2 - t1)[..., None]
    m1 = (p2 - p0) / (t2 - t0)[..., None]
    m2 = (p3 - p1) / (t3 - t1)[..., None]
    s = (tau - t1)[..., None] / hseg
    s2, s3 = s * s, s * s * s
    u = ((2 * s3 - 3 * s2 + 1) * p1 + (s3 - 2 * s2 + s) * hseg * m1 + (3 * s2 - 2 * s3) * p2
         + (s3 - s2) * hseg * m2)
    ud = ((6 * s2 - 6 * s) * p1 + (3 * s2 - 4 * s + 1) * hseg * m1 + (6 * s - 6 * s2) * p2
          + (3 * s2 - 2 * s) * hseg * m2) / hseg
    udd = ((12 * s - 6) * (p1 - p2) + (6 * s - 4) * hseg * m1 + (6 * s - 2) * hseg * m2) / (hseg * hseg)
    return u, ud, udd


def _primal(t: torch.Tensor) -> torch.Tensor:
    import torch.autograd.forward_ad as fwAD
    return fwAD.unpack_dual(t).primal


class _Stop(Exception):
    def __init__(self, converged: bool = False, why: str = ""):
        super().__init__(why)
        self.converged = converged
        self.why = why


# =====================================================================================================
# optimisation
# =====================================================================================================
def refine(structure: Structure, data: Union[Dataset, Sequence[Dataset]], start: Params,
           options: RefineOptions = RefineOptions(), *, backend: str = "nodal", integrator: str = "semi_implicit",
           callback: Optional[Callable[[Dict[str, Any]], Any]] = None) -> RefineResult:
    """Stage-2 refinement from ``start`` params (see the module docstring).

    Raises :class:`DivergenceError` when the starting point already gives a non-finite loss, and
    :class:`NotEnoughDataError` when no window can be cut.
    """
    opts = options
    datasets = [data] if isinstance(data, Dataset) else list(data)
    t_start = time.perf_counter()
    prob = RefineProblem(structure, datasets, start, opts, backend, integrator)
    w = prob.initial_w(opts.delay_s).clone().requires_grad_(True)
    x0 = None
    opt_vars = [w]
    if opts.optimize_initial_states:
        x0 = torch.zeros(prob.B_win, len(prob.top.free_nodes), 6, dtype=prob.dtype, device=prob.device,
                         requires_grad=True)
        opt_vars.append(x0)
    history: List[Dict[str, Any]] = []
    best = {"loss": math.inf, "w": w.detach().clone(), "x0": None if x0 is None else x0.detach().clone(),
            "since": 0}
    counters = {"eval": 0, "iter": 0}
    notes: List[str] = []

    def record(loss_val: float):
        counters["eval"] += 1
        p, _ = prob.finalize(w.detach())
        info = {"stage": "refine", "iteration": counters["iter"], "evaluation": counters["eval"], "loss": loss_val,
                "params": {n: float(v) for n, v in p.named().items()},
                "delay_s": float(prob.delay_of(w.detach())), "time_s": time.perf_counter() - t_start}
        history.append(info)
        if callback is not None and callback(info) is True:
            raise _Stop(False, "stopped by the callback")
        if opts.max_time_s is not None and info["time_s"] > opts.max_time_s:
            raise _Stop(False, f"time budget of {opts.max_time_s:g} s reached")
        if best["since"] >= opts.stall_evaluations:
            raise _Stop(True, f"no improvement in the last {opts.stall_evaluations} evaluations")

    def _update_best(val: float):
        ref = abs(best["loss"]) if math.isfinite(best["loss"]) else 0.0
        # improvements below stall_tolerance (relative) or a chi^2 change of stall_chi2 do not count
        if val < best["loss"] - max(opts.stall_tolerance * ref, opts.stall_chi2 / max(prob.n_obs * 3, 1)):
            best["since"] = 0
        else:
            best["since"] += 1
        if val < best["loss"]:
            best["loss"] = val
            best["w"] = w.detach().clone()
            best["x0"] = None if x0 is None else x0.detach().clone()

    def evaluate():
        L = prob.loss(w, x0)
        return L

    converged = False
    if opts.optimizer == "lbfgs":
        lbfgs = torch.optim.LBFGS(opt_vars, lr=opts.lr or 1.0, max_iter=opts.max_iter,
                                  max_eval=int(opts.max_iter * 2.5), tolerance_grad=opts.tolerance_grad,
                                  tolerance_change=opts.tolerance_change, history_size=opts.history_size,
                                  line_search_fn="strong_wolfe")

        def closure():
            lbfgs.zero_grad()
            L = evaluate()
            val = float(L.detach())
            if not math.isfinite(val):
                if counters["eval"] == 0:
                    raise DivergenceError("refine: non-finite loss at the starting point (poisoned data or an "
                                          "unstable rollout; try a smaller sim_dt)")
                # a trial point of the line search blew up: report a large loss so that it backtracks
                for v in opt_vars:
                    v.grad = torch.zeros_like(v)
                counters["iter"] = lbfgs.state[lbfgs._params[0]].get("n_iter", counters["iter"])
                best["since"] += 1
                record(float("inf"))
                return torch.tensor(1e30 * max(1.0, best["loss"]), dtype=prob.dtype)
            L.backward()
            for v in opt_vars:
                if v.grad is not None and not torch.all(torch.isfinite(v.grad)):
                    v.grad = torch.nan_to_num(v.grad, nan=0.0, posinf=0.0, neginf=0.0)
            counters["iter"] = lbfgs.state[lbfgs._params[0]].get("n_iter", counters["iter"])
            _update_best(val)
            record(val)
            return L

        try:
            lbfgs.step(closure)
            n_iter = lbfgs.state[lbfgs._params[0]].get("n_iter", 0)
            converged = n_iter < opts.max_iter
        except _Stop as stop:
            converged = stop.converged
            notes.append(stop.why)
    elif opts.optimizer == "gauss_newton":
        with window_workers(prob, opts.workers) as workers:
            try:
                converged = _levenberg_marquardt(prob, w, x0, opts, counters, _update_best, record, notes)
            except _Stop as stop:
                converged = stop.converged
                notes.append(stop.why)
            if workers is not None and workers.failure:
                notes.append(workers.failure)
    else:
        adam = torch.optim.Adam(opt_vars, lr=opts.lr or 0.05)
        sched = torch.optim.lr_scheduler.StepLR(adam, step_size=max(1, opts.adam_halve_every), gamma=0.5)
        prev = math.inf
        try:
            for it in range(opts.max_iter):
                counters["iter"] = it
                adam.zero_grad()
                L = evaluate()
                val = float(L.detach())
                if not math.isfinite(val):
                    if it == 0:
                        raise DivergenceError("refine: non-finite loss at the starting point")
                    notes.append(f"non-finite loss at iteration {it}; stopped at the best point")
                    break
                _update_best(val)
                record(val)
                if abs(prev - val) <= opts.tolerance_change * max(1.0, abs(val)):
                    converged = True
                    break
                prev = val
                L.backward()
                adam.step()
                sched.step()
        except _Stop as stop:
            converged = stop.converged
            notes.append(stop.why)
    if not math.isfinite(best["loss"]):
        raise DivergenceError("refine: no finite loss was ever reached")
    w_best, x0_best = best["w"], best["x0"]
    params, _ = prob.finalize(w_best)
    with torch.no_grad():
        rms = prob.residual_rms(prob.residuals(w_best, x0_best))
    params = params.map(lambda t: t.detach().to("cpu", torch.float64))
    return RefineResult(params=params, delay_s=float(prob.delay_of(w_best)), loss=best["loss"], residual_rms_m=rms,
                        history=history, converged=converged, iterations=counters["iter"],
                        evaluations=counters["eval"], seconds=time.perf_counter() - t_start, problem=prob,
                        w=w_best, x0=x0_best, notes=notes)


def truncated_inverse(A: torch.Tensor, rtol: float) -> torch.Tensor:
    """Pseudo-inverse of symmetric PSD blocks (..., n, n), eigenvalues below ``rtol`` x the largest dropped."""
    ev, V = torch.linalg.eigh(0.5 * (A + A.mT))
    keep = ev > rtol * ev[..., -1:].clamp_min(1e-300)
    inv = torch.where(keep, 1.0 / torch.where(keep, ev, torch.ones_like(ev)), torch.zeros_like(ev))
    return (V * inv.unsqueeze(-2)) @ V.mT


def limit_step(dw: torch.Tensor, n_params: int, max_step: float) -> torch.Tensor:
    """Levenberg-Marquardt's trust region: each of the first ``n_params`` entries of ``dw`` (scaled units)
    clipped to +-max_step, the rest (the delay) untouched.

    A Gauss-Newton step from far away (20 % off on the manipulator) asked for 16x stiffness changes; accepted
    (the loss fell), they led where the rollout is barely stable, and the fit crawled. Each parameter is
    clipped on its own: scaling the whole step instead let one weakly determined parameter that asked for
    10-19 units shrink every other step five- to tenfold (manipulator, seed 2: loss 203 after 8 iterations on
    0.1-s windows, stiffnesses where they started; clipped: 2.9 after 6). The window starts then follow the
    clipped step through their own normal equations.
    """
    if n_params == 0 or float(dw[:n_params].abs().max()) <= max_step:
        return dw
    return torch.cat([dw[:n_params].clamp(-max_step, max_step), dw[n_params:]])


def _levenberg_marquardt(prob: RefineProblem, w: torch.Tensor, x0: Optional[torch.Tensor], opts: RefineOptions,
                         counters: Dict[str, int], update_best: Callable[[float], None],
                         record: Callable[[float], None], notes: List[str]) -> bool:
    """Levenberg-Marquardt on f = sum r^2 (+ prior) over (w, per-window x0), updating w and x0 in place.

    Normal equations with the window starts eliminated (Schur complement, block-diagonal in windows):
        S dw = -(g_w - sum_k H_we,k H_ee,k^-1 g_e,k),   dx0_k = -H_ee,k^-1 (g_e,k + H_ew,k dw)
    with Marquardt damping lambda diag(H). After each accepted step up to ``lm_chord_steps`` chord steps reuse
    the factorised equations with fresh residuals (a rollout each, not a Jacobian). Returns True when converged
    (the loss stopped decreasing by more than ``stall_tolerance`` (relative) or a chi^2 of ``stall_chi2 * 1e-2``,
    or by ``converged_chi2`` in chi^2: see :class:`RefineOptions`). The Jacobians are taken in
    ``opts.tangent_dtype``.
    """
    sig2 = opts.loss_noise_std_m ** 2
    norm = prob.n_obs * sig2
    nb = prob.B.shape[1]
    KB = prob.K @ prob.B
    has_prior = bool((prob.prior_prec > 0).any())

    def loss_of(r, wv) -> float:
        f = float((r * r).sum())
        if has_prior:
            dz = KB @ wv[:nb] + prob.prior_offset
            f += sig2 * float((prob.prior_prec * dz * dz).sum())
        return f

    def f_of(wv, xv):
        """(loss, residuals (B, R), the gradient (g_w, g_e) with the last normal equations' Jacobian) at wv, xv."""
        with torch.no_grad():
            r, gw_b, ge = prob.residual_gradients(wv, xv)
        return loss_of(r, wv), r, gradients(gw_b, ge, wv)

    def gradients(gw_b, ge, wv):
        """(g_w, g_e) from the windows' J^T r: g_w summed over the windows, with the prior's."""
        gw = gw_b.sum(dim=0)
        if has_prior:
            gw[:nb] += Hp @ wv[:nb] + gp0
        return gw, ge

    def solve(A, Ainv, Hwe, gw, ge):
        """The step (dw, dx) from the (damped, Schur-reduced) normal equations."""
        rhs = gw if ge is None else gw - torch.einsum("bij,bjk,bk->i", Hwe, Ainv, ge)
        dw = limit_step(-torch.linalg.solve(A, rhs), nb, opts.lm_max_step)
        dx = None if ge is None else -torch.einsum("bij,bj->bi", Ainv, ge + torch.einsum("bij,i->bj", Hwe, dw))
        return dw, dx

    def take(wv, xv, dw, dx):
        return wv + dw, (None if dx is None else xv + dx.reshape(xv.shape))

    def accept(w_new, x_new, f_new):
        with torch.no_grad():
            w.copy_(w_new)
            if x0 is not None:
                x0.copy_(x_new)
        update_best(f_new / norm)
        record(f_new / norm)

    Hp = gp0 = None
    if has_prior:                       # the prior's Hessian and the constant part of its gradient
        Hp = sig2 * (KB.T @ (prob.prior_prec[:, None] * KB))
        gp0 = sig2 * (KB.T @ (prob.prior_prec * prob.prior_offset))
    lam = opts.lm_lambda
    chi2_gains: List[float] = []          # each iteration's decrease of chi^2 (see converged_chi2 for the unit)
    with torch.no_grad():
        r = prob.residuals(w.detach(), None if x0 is None else x0.detach())
    f, r = loss_of(r, w.detach()), r.reshape(r.shape[0], -1)
    if not math.isfinite(f):
        raise DivergenceError("refine: non-finite loss at the starting point (poisoned data or an unstable "
                              "rollout; try a smaller sim_dt)")
    update_best(f / norm)
    record(f / norm)
    for it in range(opts.max_iter):
        counters["iter"] = it + 1
        r, Hww, Hwe, Hee, gw_b, ge = prob.normal_blocks(w.detach(), None if x0 is None else x0.detach(),
                                                        opts.jacobian, opts.tangent_dtype)
        if not all(bool(torch.all(torch.isfinite(t))) for t in (Hww, Hwe, Hee, gw_b, ge) if t is not None):
            notes.append("non-finite Jacobian; stopped at the best point")
            return False
        Hww = Hww.sum(dim=0)
        if has_prior:
            Hww[:nb, :nb] += Hp
        gw, ge = gradients(gw_b, ge, w.detach())
        accepted = False
        f_start = f
        for _ in range(12):
            dW = torch.diagonal(Hww)
            dW = dW.clamp_min(1e-12 * (float(dW.max()) if dW.numel() else 0.0) + 1e-300)   # nothing free: starts only
            A = Hww + lam * torch.diag(dW)
            Ainv = None
            if Hee is not None:
                dE = torch.diagonal(Hee, dim1=-2, dim2=-1)
                dE = dE.clamp_min(1e-12 * float(dE.max()) + 1e-300)
                Ainv = truncated_inverse(Hee + lam * torch.diag_embed(dE), X0_RCOND ** 2)
                A = A - torch.einsum("bij,bjk,blk->il", Hwe, Ainv, Hwe)
            A = 0.5 * (A + A.T)
            try:
                dw, dx = solve(A, Ainv, Hwe, gw, ge)
            except RuntimeError:
                lam *= 10.0
                continue
            w_new, x_new = take(w.detach(), None if x0 is None else x0.detach(), dw, dx)
            f_new, r_new, g_new = f_of(w_new, x_new)
            if math.isfinite(f_new) and f_new < f:
                accept(w_new, x_new, f_new)
                lam = max(lam / 3.0, 1e-9)
                accepted = True
                break
            counters["eval_rejected"] = counters.get("eval_rejected", 0) + 1
            lam *= 4.0
        if not accepted:
            notes.append("Levenberg-Marquardt: no decreasing step (at a minimum or noisy loss)")
            return True
        # chord steps: the same normal equations with fresh residuals (one rollout each instead of a
        # Jacobian), while each still gains at least half of what the one before it gained
        gain = f - f_new
        f, r, (gw, ge) = f_new, r_new, g_new
        for _ in range(opts.lm_chord_steps):
            try:
                dw, dx = solve(A, Ainv, Hwe, gw, ge)
            except RuntimeError:
                break
            w_new, x_new = take(w.detach(), None if x0 is None else x0.detach(), dw, dx)
            f_new, r_new, g_new = f_of(w_new, x_new)
            if not (math.isfinite(f_new) and f_new < f):
                break
            accept(w_new, x_new, f_new)
            step_gain, f, r, (gw, ge) = f - f_new, f_new, r_new, g_new
            if step_gain < 0.5 * gain:
                break
            gain = step_gain
        if f_start - f <= max(opts.stall_tolerance * f, 1e-2 * opts.stall_chi2 * sig2):
            return True
        ms = prob.residual_rms(r) ** 2 / 3.0                      # the residuals' own mean square per coordinate
        chi2_gains.append((f_start - f) / min(sig2, ms) if ms > 0 else math.inf)
        if _within_chi2_of_minimum(chi2_gains, opts.converged_chi2):
            return True
    return False


def _within_chi2_of_minimum(gains: Sequence[float], tol: float) -> bool:
    """Whether Levenberg-Marquardt's chi^2 decreases ``gains`` (one per iteration, in order) say that the loss is
    within ``tol`` of its minimum: the last decrease is below ``tol`` and so is the geometric tail that the ratio
    of the last two predicts (linear convergence). False for tol <= 0, before two iterations, and while the
    decreases do not shrink."""
    if tol <= 0 or len(gains) < 2 or not gains[-1] < tol:
        return False
    last, before = gains[-1], gains[-2]
    rho = last / before if before > 0 else 0.0
    return rho < 1.0 and last * rho / (1.0 - rho) < tol
