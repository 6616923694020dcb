"""Stage 1: closed-form linear regression of masses, stiffnesses, dampings (and rest-length offsets).

Once the geometry is measured, the nodal equations of motion are linear in the unknowns (the seed's 1-D
reduction: each string acts along its own direction with a scalar tension, each bar's mass enters the
consistent mass matrix and its weight linearly). For every usable sample t, in the reduced coordinates of
the engine (``X = T Q + X_c``: fixed, coincident and midpoint constraints eliminated exactly):

    sum_b m_b T^T (E_b X'' - W_b g) - sum_c k_c a_c(t) P_c - sum_c zeta_c D'_c(t) P_c - h T^T F_u
        = T^T F_ext + J(t)^T lambda(t)

with P_c (n_free, 3) = T^T (unit-tension nodal force pattern of composite string c, through all its
segments), a_c = g_c (xi00_c / xi0_c(t)) D_c(t) for ``cord``-law strings and a_c = g_c D_c(t) for
``spring``-law strings (the contract's kappa_c(t) D_c per unit stiffness; g_c the taut gate), D'_c the
stretch rate, F_u the spring-rod control forces (gain h) and F_ext known external forces. The bar-length
multipliers lambda(t) are unknown; they are ELIMINATED by projecting each sample's equations onto the null
space of the bar-length Jacobian J(t) (rows C_b,q[b] (x) d_b(t)): with Z(t) an orthonormal basis of ker J(t),
Z^T J^T = 0, so every sample gives 3 n_free - n_bars equations free of constraint forces. No masses enter the
projection, so the problem stays linear.

Rest lengths (option ``estimate`` containing ``rest_length``): the tension k (xi00/xi0) D (spring law: k D)
is linearised in a rest-length change delta_c around the current value, k a_c + (k delta_c) b_c with
b_c = d(a_c)/d(xi00), and phi_c = k_c delta_c is regressed as one more linear unknown (exact for
non-actuated and spring-law strings: k (L - xi00 - delta) = k (L - xi00) - k delta). The linearisation point
and the taut gates are then updated and the system re-solved (``relinearize`` passes, each a closed-form
solve).

Gauge: with no known force (no gravity-free known mass, no known external force, no known parameter of
scale), multiplying all masses, stiffnesses and dampings by the same factor leaves the motion unchanged:
only RATIOS are identifiable (the seed's spring-rod: K/M and c/M). The equations are then homogeneous and
the scale is fixed by an anchor, ``total_mass`` (default: the prior's total mass of the moving bars). The
result says so: every scale-carrying parameter gets identifiability 0 and ``identifiable`` False, and the
identifiable ratios (to the reference mass) are reported with their standard deviations.

Solution: (constrained) least squares by SVD with a relative rank tolerance (never an iterative
optimiser); directions below the tolerance are reported as non-identifiable and kept at the prior.
Covariance: sigma^2 (X^T X)^-1 with sigma^2 = RSS / (n - p) (``covariance="iid"``) or the cluster-robust
sandwich over blocks of consecutive samples (``"cluster"``, for smoothed derivatives whose errors are
correlated over the smoothing window); ``"auto"`` picks cluster for smoothed data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..engine import Params, build_topology, params_from_structure
from ..engine.topology import Topology
from ..model import Structure
from ..param_names import GAUGE_KINDS, join_name, kind_of, split_name
from .data import Dataset, derivatives
from .errors import DataError, NotEnoughDataError

__all__ = ["RegressionOptions", "RegressionResult", "regress", "identifiability_reference"]

#: kinds the regression can estimate
REGRESSION_KINDS = ("mass", "stiffness", "damping", "rest_length", "control_force_scalar")


@dataclass(frozen=True)
class RegressionOptions:
    """Stage-1 options.

    estimate: kinds to estimate (subset of ``mass, stiffness, damping, rest_length, control_force_scalar``);
        the other kinds keep the prior's values.
    known: ``{name: value}`` exactly known parameters (held fixed; a known mass breaks the scale gauge).
    ties: groups sharing one value: a kind name (``"stiffness"``: all strings share one stiffness) or a
        tuple of parameter names of one kind.
    total_mass: kg, the scale anchor used when only ratios are identifiable (default: the prior's total
        mass of the bars that move).
    derivative_method / smooth_window_s: see :func:`tensegrity_ros.ident.data.derivatives`.
    delay_s: motor-to-mocap delay applied to the motor angles (u(t - delay)), s.
    relinearize: at most this many extra passes that re-linearise the rest lengths and re-evaluate the taut
        gates (which strings pull in which sample depends on the estimates), stopping as soon as the
        solution no longer changes (default 10; typically 2-5 passes are run).
    outlier_threshold / outlier_min_relative: a sample whose relative residual (residual RMS over the RMS
        of the sum of the magnitudes of its terms) exceeds both median + threshold * 1.4826 MAD and
        ``outlier_min_relative`` is dropped and the system re-solved once (None: off).
    sample_fraction / max_samples: random subset of the usable samples (data-efficiency studies).
    covariance: ``iid`` | ``cluster`` | ``auto``; cluster_s: block length for ``cluster`` (default: the
        smoothing window).
    rank_tol: relative singular-value tolerance (column-normalised design) below which a direction is
        non-identifiable.
    identifiable_threshold: ``identifiable[name]`` is True when identifiability >= this.
    mass_model: ``thin`` (nodal engine, twin) or ``cylinder`` (spring-rod engine), see
        :func:`bar_mass_matrices`; None: the engine's (``thin`` here; :func:`~tensegrity_ros.ident.identify`
        takes its backend's).
    string_gate: ``taut`` (a string pulls when D > 0 and its tension is > 0: the contract's law, the
        engines) or ``tension`` (tension > 0 only: the MuJoCo twin's pull-only actuators cannot express the
        D > 0 gate). The first pass always gates on D > 0 alone (the prior's damping may be far off).
    """

    estimate: Tuple[str, ...] = ("mass", "stiffness", "damping")
    known: Mapping[str, float] = field(default_factory=dict)
    ties: Tuple[Union[str, Tuple[str, ...]], ...] = ()
    total_mass: Optional[float] = None
    derivative_method: str = "auto"
    smooth_window_s: Optional[float] = None
    delay_s: float = 0.0
    relinearize: Optional[int] = None
    outlier_threshold: Optional[float] = 8.0
    outlier_min_relative: float = 0.2
    sample_fraction: Optional[float] = None
    max_samples: Optional[int] = None
    seed: int = 0
    covariance: str = "auto"
    cluster_s: Optional[float] = None
    rank_tol: float = 1e-6
    identifiable_threshold: float = 0.9
    mass_model: Optional[str] = None
    string_gate: str = "taut"

    def __post_init__(self):
        bad = [k for k in self.estimate if k not in REGRESSION_KINDS]
        if bad:
            raise ValueError(f"RegressionOptions.estimate: unknown kind(s) {bad} "
                             f"(valid: {', '.join(REGRESSION_KINDS)})")
        if self.string_gate not in ("taut", "tension"):
            raise ValueError(f"RegressionOptions.string_gate = {self.string_gate!r} (valid: taut, tension)")
        if self.covariance not in ("iid", "cluster", "auto"):
            raise ValueError(f"RegressionOptions.covariance = {self.covariance!r} (valid: iid, cluster, auto)")


@dataclass(frozen=True)
class RegressionResult:
    """Stage-1 result.

    params: the prior with the estimates substituted (unbatched, float64).
    estimates / std_devs: ``{name: value}`` for every estimated parameter (physical units); a parameter the
        data do not excite keeps its prior value and gets std ``inf``.
    identifiability: ``{name: score in [0, 1]}``; 0 = not identifiable from these data (gauge or
        unexcited), otherwise 1 - std / reference (reference: |value|, 1 % of the rest length for rest
        lengths; see :func:`identifiability_reference`).
    identifiable: ``{name: bool}`` (score >= threshold).
    ratios: ``{"a/b": (value, std)}`` identifiable ratios, filled when only ratios are identifiable.
    gauge: description of the scale anchor ("" when the scale is identifiable).
    non_identifiable: human-readable non-identifiable directions (``+0.71 s1.stiffness -0.71 s2.stiffness``).
    residual_rms: RMS of the projected force residual, N; n_samples / n_equations used; dropped_samples:
        samples rejected as outliers.
    covariance: (p, p) over ``names`` (physical units).
    """

    params: Params
    estimates: Dict[str, float]
    std_devs: Dict[str, float]
    identifiability: Dict[str, float]
    identifiable: Dict[str, bool]
    ratios: Dict[str, Tuple[float, float]]
    gauge: str
    non_identifiable: List[str]
    residual_rms: float
    n_samples: int
    n_equations: int
    dropped_samples: int
    names: List[str]
    covariance: np.ndarray
    notes: List[str]


def identifiability_reference(kind: str, value: float, nominal: Optional[float] = None) -> float:
    """The scale against which a standard deviation is judged (identifiability = 1 - std / reference)."""
    if kind == "rest_length":
        return 0.01 * abs(nominal if nominal is not None else value)
    if kind == "zero_offset":
        return 0.1
    if kind == "delay":
        return 0.01
    return max(abs(value), 1e-12)


# =====================================================================================================
# per-sample geometry
# =====================================================================================================
@dataclass
class _Samples:
    """Usable samples of one or more datasets (reduced coordinates), stacked."""

    Q: np.ndarray        # (n, nf, 3) m
    V: np.ndarray        # (n, nf, 3) m/s
    A: np.ndarray        # (n, nf, 3) m/s^2
    u: Optional[np.ndarray]    # (n, A) rad
    ud: Optional[np.ndarray]   # (n, A) rad/s
    fext: Optional[np.ndarray]  # (n, nf, 3) N (reduced)
    fctrl: Optional[np.ndarray]  # (n, nf, 3) N (reduced, per unit gain)
    cluster: np.ndarray  # (n,) block ids
    smoothed: bool


def _interp_rows(t_query: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.stack([np.interp(t_query, t, y[:, k]) for k in range(y.shape[1])], axis=1) if y.shape[1] else \
        np.zeros((t_query.shape[0], 0))


def _control_to_nodes(top: Topology, data: Dataset, rows: np.ndarray) -> np.ndarray:
    """Spring-rod control forces (n, R, 3) on bars with arms (local z along the bar) -> node forces (n, N, 3)."""
    F = data.control_forces[rows]
    n = F.shape[0]
    out = np.zeros((n, top.n_nodes, 3))
    if data.control_arms is not None:
        arm = data.control_arms[rows][..., 2] / top.bar_lengths[None, :]
    else:
        arm = np.zeros(F.shape[:2])
    for b, (i, j) in enumerate(top.bar_nodes):
        out[:, i] += (0.5 - arm[:, b, None]) * F[:, b]
        out[:, j] += (0.5 + arm[:, b, None]) * F[:, b]
    return out


def _collect(top: Topology, datasets: Sequence[Dataset], opts: RegressionOptions, rng: np.random.Generator) -> _Samples:
    free = np.asarray(top.free_nodes, dtype=int)
    Tm = top.T
    parts = []
    smoothed = False
    cluster_offset = 0
    for data in datasets:
        if data.positions.shape[1] != top.n_nodes:
            raise DataError(f"dataset has {data.positions.shape[1]} nodes, structure {top.structure.name!r} has "
                            f"{top.n_nodes}")
        method = opts.derivative_method
        if method == "auto":
            d = np.diff(data.times)
            uniform = bool(np.all(np.abs(d - data.dt) <= 1e-6 * max(data.dt, 1e-12)))
            method = "central" if (uniform and data.valid[:, free].all()) else "smooth"
        sub = data
        der = derivatives(sub, method, window_s=opts.smooth_window_s)
        smoothed |= method == "smooth"
        ok = der.ok[:, free].all(axis=1)
        for arr in (der.positions, der.velocities, der.accelerations):
            ok &= np.all(np.isfinite(arr[:, free]), axis=(1, 2))
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            continue
        Q = der.positions[rows][:, free]
        V = der.velocities[rows][:, free]
        A = der.accelerations[rows][:, free]
        u = ud = None
        if data.motor_angles is not None and top.n_actuators:
            U = data.motor_angles
            tq = data.times - opts.delay_s
            Ush = _interp_rows(tq, data.times, U)
            if method == "smooth":
                from ..mocap.filtering import smooth_derivatives
                r = smooth_derivatives(data.times, Ush[:, None, :], None,
                                       window_s=0.2 if opts.smooth_window_s is None else opts.smooth_window_s)
                Ud = np.where(np.isfinite(r.velocities[:, 0]), r.velocities[:, 0],
                              np.gradient(Ush, data.times, axis=0))
            else:
                Ud = np.gradient(Ush, data.times, axis=0)
            u, ud = Ush[rows], Ud[rows]
        fext = None
        if data.external_forces is not None:
            fext = np.einsum("nf,tnk->tfk", Tm, data.external_forces[rows])
        fctrl = None
        if data.control_forces is not None:
            fctrl = np.einsum("nf,tnk->tfk", Tm, _control_to_nodes(top, data, rows))
        block = opts.cluster_s if opts.cluster_s is not None else (
            (0.2 if opts.smooth_window_s is None else opts.smooth_window_s) if method == "smooth" else 0.0)
        nblk = max(1, int(round(block / data.dt))) if data.dt > 0 and block > 0 else 1
        cluster = cluster_offset + rows // nblk
        cluster_offset = int(cluster.max()) + 1
        parts.append((Q, V, A, u, ud, fext, fctrl, cluster))
    if not parts:
        raise NotEnoughDataError("no usable samples: every sample lacks a valid position/derivative of a free node")

    def cat(k, shape_tail=None):
        xs = [p[k] for p in parts]
        if all(x is None for x in xs):
            return None
        out = []
        for p, x in zip(parts, xs):
            out.append(np.zeros((p[0].shape[0],) + (shape_tail or ())) if x is None else x)
        return np.concatenate(out)

    nf = top.n_free
    S = _Samples(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                 np.concatenate([p[2] for p in parts]), cat(3, (top.n_actuators,)), cat(4, (top.n_actuators,)),
                 cat(5, (nf, 3)), cat(6, (nf, 3)), np.concatenate([p[7] for p in parts]), smoothed)
    n = S.Q.shape[0]
    keep = None
    if opts.sample_fraction is not None:
        m = max(1, int(round(opts.sample_fraction * n)))
        keep = np.sort(rng.choice(n, size=min(m, n), replace=False))
    if opts.max_samples is not None and (keep is None or keep.size > opts.max_samples):
        base = np.arange(n) if keep is None else keep
        keep = np.sort(rng.choice(base, size=min(opts.max_samples, base.size), replace=False))
    if keep is not None:
        S = _take(S, keep)
    return S


def _take(S: _Samples, idx: np.ndarray) -> _Samples:
    f = lambda x: None if x is None else x[idx]  # noqa: E731
    return _Samples(S.Q[idx], S.V[idx], S.A[idx], f(S.u), f(S.ud), f(S.fext), f(S.fctrl), S.cluster[idx], S.smoothed)


def nullspace_bases(top: Topology, Q: np.ndarray) -> np.ndarray:
    """(n, 3 nf, 3 nf - nb) orthonormal bases of ker J(t) (bar-length Jacobian in reduced coordinates)."""
    act = top.active_bars
    nf = top.n_free
    n = Q.shape[0]
    if act.size == 0:
        return np.broadcast_to(np.eye(3 * nf), (n, 3 * nf, 3 * nf))
    Cbq = top.Cb_q[act]
    d = np.einsum("bf,tfk->tbk", Cbq, Q) + top.d_c[act][None]
    J = np.einsum("bf,tbk->tbfk", Cbq, d).reshape(n, act.size, 3 * nf)
    _, _, Vh = np.linalg.svd(J, full_matrices=True)
    return np.swapaxes(Vh[:, act.size:, :], 1, 2)


# =====================================================================================================
# design matrix
# =====================================================================================================
@dataclass
class _Layout:
    names: List[str]          # full unknown names (rest-length unknowns named "<s>.rest_length")
    kinds: List[str]
    elem: List[int]
    groups: List[List[int]]   # reduced param -> full indices
    group_names: List[str]


def bar_mass_matrices(top: Topology, mass_model: str = "thin") -> np.ndarray:
    """(n_bars, n_free, n_free) reduced per-unit-mass matrices T^T E_b T.

    ``thin``: the consistent mass matrix of a zero-thickness rod, 1/6 [[2, 1], [1, 2]] (nodal engine, twin).
    ``cylinder``: a solid cylinder of the bar's radius R (the spring-rod engine's inertia
    I11 = m (L^2/12 + R^2/4)): [[1/3 + 2 d, 1/6 - 2 d], [1/6 - 2 d, 1/3 + 2 d]], d = R^2 / (4 L^2).
    """
    if mass_model == "thin":
        return top.E_q
    if mass_model != "cylinder":
        raise ValueError(f"unknown mass_model {mass_model!r} (valid: thin, cylinder)")
    E = top.E.copy()
    for b, (i, j) in enumerate(top.bar_nodes):
        dl = top.bar_radius[b] ** 2 / (4.0 * top.bar_lengths[b] ** 2)
        E[b, i, i] += 2 * dl
        E[b, j, j] += 2 * dl
        E[b, i, j] -= 2 * dl
        E[b, j, i] -= 2 * dl
    return np.einsum("nf,bnm,mg->bfg", top.T, E, top.T)


def _design(top: Topology, S: _Samples, Z: np.ndarray, cur: Dict[str, np.ndarray], lay: _Layout,
            known_full: Dict[int, float], Eq: np.ndarray, gate_mode: str = "taut"
            ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Full design X (n_eq, p_full) and right-hand side y (n_eq,) and per-row sample index.

    gate_mode: ``geometric`` (taut: D > 0), ``taut`` (D > 0 and tension > 0 at the current values: the
    engine's string law) or ``tension`` (tension > 0 only: the MuJoCo twin's pull-only actuator).
    """
    n, nf = S.Q.shape[0], top.n_free
    Xf = np.einsum("nf,tfk->tnk", top.T, S.Q) + top.Xc[None]
    Vf = np.einsum("nf,tfk->tnk", top.T, S.V)
    i, j = top.seg_nodes[:, 0], top.seg_nodes[:, 1]
    s = Xf[:, j] - Xf[:, i]
    sd = Vf[:, j] - Vf[:, i]
    xi = np.linalg.norm(s, axis=-1)
    e = s / xi[..., None]
    xid = (e * sd).sum(-1)
    L, Ld = xi @ top.G, xid @ top.G                                 # (n, S)
    xi00 = cur["rest_length"]
    Y = top.Ydir * cur["spool_radius"][None, :]
    if S.u is not None and Y.shape[1]:
        xi0 = xi00[None] + (S.u - cur["zero_offset"][None]) @ Y.T
        xi0d = S.ud @ Y.T
    else:
        xi0 = np.broadcast_to(xi00, L.shape)
        xi0d = np.zeros_like(L)
    D, Dd = L - xi0, Ld - xi0d
    # tension per unit stiffness: cord law (xi00/xi0) D, spring law D (kappa = k whatever xi0); d a / d xi00
    # (xi0 moves with xi00 one to one): cord (L/xi0 - 1) - xi00 L / xi0^2, spring -1
    spring = top.spring.astype(bool)[None]
    kscale = np.where(spring, 1.0, xi00[None] / xi0)
    a = kscale * D
    b = np.where(spring, -1.0, (L / xi0 - 1.0) - xi00[None] * L / xi0 ** 2)
    if gate_mode == "geometric":
        gate = (D > 0).astype(float)
    else:
        # the gate uses the current estimates where they are physical, else the prior's values
        kg = np.where(cur["stiffness"] > 0, cur["stiffness"], cur["prior_stiffness"])
        cg = np.where(cur["damping"] >= 0, cur["damping"], cur["prior_damping"])
        tension = kg[None] * a + cg[None] * Dd
        gate = ((tension > 0) & ((D > 0) | (gate_mode == "tension"))).astype(float)
    # (n, S, nf, 3) reduced unit-tension nodal forces of each composite string
    patt = -np.einsum("sc,sf,tsk->tcfk", top.G, top.Cs_q, e, optimize=True)
    def column(kind, el):
        if kind == "mass":
            return Eq[el] @ S.A - top.W_q[:, el][None, :, None] * top.gravity[None, None]
        if kind == "stiffness":
            return -(gate[:, el] * a[:, el])[:, None, None] * patt[:, el]
        if kind == "damping":
            return -(gate[:, el] * Dd[:, el])[:, None, None] * patt[:, el]
        if kind == "rest_length":
            return -(gate[:, el] * b[:, el])[:, None, None] * patt[:, el]
        if kind == "control_force_scalar":
            return -(S.fctrl if S.fctrl is not None else np.zeros_like(S.Q))
        raise AssertionError(kind)  # pragma: no cover

    Xfull = np.stack([column(k, e).reshape(n, 3 * nf) for k, e in zip(lay.kinds, lay.elem)], axis=-1)
    rhs = np.zeros((n, 3 * nf)) if S.fext is None else S.fext.reshape(n, 3 * nf).copy()
    for idx, val in known_full.items():
        rhs -= Xfull[:, :, idx] * val
    # terms of the kinds that are not estimated, at their current (prior or known) values
    estimated = set(zip(lay.kinds, lay.elem))
    n_el = {"mass": top.n_bars, "stiffness": top.n_strings, "damping": top.n_strings}
    for kind, count in n_el.items():
        for el in range(count):
            if (kind, el) not in estimated and cur[kind][el] != 0:
                rhs -= column(kind, el).reshape(n, 3 * nf) * cur[kind][el]
    if S.fctrl is not None and ("control_force_scalar", 0) not in estimated:
        rhs -= column("control_force_scalar", 0).reshape(n, 3 * nf) * cur["control_force_scalar"][0]
    Zt = np.swapaxes(Z, 1, 2)
    Xp = Zt @ Xfull                                                  # project: (n, m, p)
    yp = (Zt @ rhs[..., None])[..., 0]
    m = Xp.shape[1]
    row_sample = np.repeat(np.arange(n), m)
    return Xp.reshape(n * m, -1), yp.reshape(n * m), row_sample


# =====================================================================================================
# solver
# =====================================================================================================
def _solve(G: np.ndarray, bvec: np.ndarray, a: Optional[np.ndarray], d: float, rank_tol: float,
           th_ref: Optional[np.ndarray] = None):
    """min |X th - y| (s.t. a.th = d if a is given) from the normal equations G = X^T X, bvec = X^T y, by an
    eigen-decomposition of the column-normalised system with a rank tolerance (on singular values of X);
    along directions below the tolerance th stays at ``th_ref`` (minimum-norm change from it).

    Returns th, N (p, q) basis of the constraint's null space, P (q, q) = (A^T A)^+ in z coordinates with
    A = X N, the null directions (q', p) of A (in th coordinates, unit norm), singular values (relative).
    """
    p = G.shape[0]
    ref = np.zeros(p) if th_ref is None else np.asarray(th_ref, dtype=float)
    if a is None:
        N = np.eye(p)
        th0 = ref
    else:
        a = a.astype(float)
        th0 = ref + a * (d - a @ ref) / (a @ a)
        # orthonormal basis of a-perp
        Qm, _ = np.linalg.qr(np.concatenate([a[:, None], np.eye(p)], axis=1))
        N = Qm[:, 1:p]
    AtA = N.T @ G @ N
    Atr0 = N.T @ (bvec - G @ th0)
    cn = np.sqrt(np.maximum(np.diag(AtA), 0.0))
    cn = np.where(cn > 0, cn, 1.0)
    Gm = AtA / cn[:, None] / cn[None, :]
    ev, Vm = np.linalg.eigh(0.5 * (Gm + Gm.T))
    ev, Vm = ev[::-1], Vm[:, ::-1]
    sv = np.sqrt(np.maximum(ev, 0.0))
    Vh = Vm.T
    smax = sv.max() if sv.size else 0.0
    keep = sv > rank_tol * smax if smax > 0 else np.zeros_like(sv, dtype=bool)
    zs = Vh[keep].T @ ((Vh[keep] @ (Atr0 / cn)) / sv[keep] ** 2)
    z = zs / cn
    th = th0 + N @ z
    Pz = (Vh[keep].T / sv[keep] ** 2) @ Vh[keep]
    Pz = Pz / cn[:, None] / cn[None, :]
    null_dirs = []
    for v in Vh[~keep]:
        w = N @ (v / cn)
        null_dirs.append(w / np.linalg.norm(w))
    return th, N, Pz, np.array(null_dirs).reshape(-1, p), sv / smax if smax > 0 else sv


def _format_direction(v: np.ndarray, names: List[str]) -> str:
    order = np.argsort(-np.abs(v))
    parts = [f"{v[k]:+.2f} {names[k]}" for k in order if abs(v[k]) >= 0.05]
    return " ".join(parts[:8]) + (" ..." if len(parts) > 8 else "")


# =====================================================================================================
# main entry
# =====================================================================================================
def _layout(top: Topology, prior: Params, opts: RegressionOptions) -> Tuple[_Layout, Dict[int, float]]:
    names, kinds, elem = [], [], []
    elements = {"mass": top.bar_names, "stiffness": top.string_names, "damping": top.string_names,
                "rest_length": top.string_names}
    for kind in REGRESSION_KINDS:
        if kind not in opts.estimate:
            continue
        if kind == "control_force_scalar":
            if prior.control_force_scalar is None:
                raise ValueError("control_force_scalar requested but the params have none (nodal engine)")
            names.append(kind)
            kinds.append(kind)
            elem.append(0)
            continue
        for k, e in enumerate(elements[kind]):
            names.append(join_name(e, kind))
            kinds.append(kind)
            elem.append(k)
    index = {n: k for k, n in enumerate(names)}
    known_full: Dict[int, float] = {}
    for n, v in opts.known.items():
        if n not in index:
            continue  # known and not estimated: handled through the current values
        if kind_of(n) == "rest_length":
            known_full[index[n]] = 0.0  # deviation from the (known) current rest length
        else:
            known_full[index[n]] = float(v)
    # groups
    assigned: Dict[int, int] = {}
    groups: List[List[int]] = []
    gnames: List[str] = []
    for tie in opts.ties:
        members = [k for k, kd in enumerate(kinds) if kd == tie] if isinstance(tie, str) else \
            [index[n] for n in tie if n in index]
        members = [k for k in members if k not in known_full and k not in assigned]
        if not members:
            continue
        if len({kinds[k] for k in members}) != 1:
            raise ValueError(f"tie {tie!r} mixes kinds")
        for k in members:
            assigned[k] = len(groups)
        groups.append(members)
        gnames.append(names[members[0]] if len(members) == 1 else
                      (f"{kinds[members[0]]}[all]" if isinstance(tie, str) else "+".join(names[k] for k in members)))
    for k in range(len(names)):
        if k in known_full or k in assigned:
            continue
        assigned[k] = len(groups)
        groups.append([k])
        gnames.append(names[k])
    return _Layout(names, kinds, elem, groups, gnames), known_full


def _current_values(prior: Params, opts: RegressionOptions) -> Dict[str, np.ndarray]:
    cur = {}
    for kind in ("stiffness", "damping", "rest_length", "mass", "spool_radius", "zero_offset"):
        cur[kind] = getattr(prior, kind).detach().cpu().double().numpy().reshape(-1).copy()
    h = prior.control_force_scalar
    cur["control_force_scalar"] = np.array([1.0 if h is None else float(h)])
    cur["prior_stiffness"] = np.abs(cur["stiffness"]).copy()
    cur["prior_damping"] = np.abs(cur["damping"]).copy()
    meta = prior.meta
    for n, v in opts.known.items():
        elem, kind = split_name(n)
        if n == "control_force_scalar":
            cur[n][0] = float(v)
            continue
        if kind not in cur:
            raise ValueError(f"unknown parameter {n!r} in known")
        elems = meta.elements(kind)
        if elem not in elems:
            raise ValueError(f"unknown parameter {n!r} in known")
        cur[kind][elems.index(elem)] = float(v)
    return cur


def regress(structure: Structure, data: Union[Dataset, Sequence[Dataset]], prior: Optional[Params] = None,
            options: RegressionOptions = RegressionOptions()) -> RegressionResult:
    """Stage-1 closed-form identification (see the module docstring).

    structure: the model (topology, gravity); data: one dataset or several trajectories (stacked);
    prior: starting/nominal params (default: the structure file's), supplying every value that is not
    estimated (rest lengths unless estimated, spool radii, zero offsets) and the linearisation point.
    Raises :class:`~tensegrity_ros.ident.errors.NotEnoughDataError` when there are fewer equations than
    unknowns, :class:`~tensegrity_ros.ident.errors.DataError` on unusable data.
    """
    opts = options
    datasets = [data] if isinstance(data, Dataset) else list(data)
    top = build_topology(structure)
    if prior is None:
        prior = params_from_structure(structure)
    prior = prior.map(lambda t: t.detach().cpu().double())
    if len(prior.batch_shape):
        raise ValueError("regress needs unbatched prior params")
    rng = np.random.default_rng(opts.seed)
    S = _collect(top, datasets, opts, rng)
    lay, known_full = _layout(top, prior, opts)
    cur = _current_values(prior, opts)
    prior_vals = {k: v.copy() for k, v in cur.items()}
    nominal_rest = np.array(prior.meta.nominal_rest_length)
    notes: List[str] = []
    p_full, q = len(lay.names), len(lay.groups)
    if q == 0:
        raise ValueError("nothing to estimate (every requested parameter is known)")
    K = np.zeros((p_full, q))
    for g, mem in enumerate(lay.groups):
        K[mem, g] = 1.0
    Z = nullspace_bases(top, S.Q)
    Eq = bar_mass_matrices(top, opts.mass_model or "thin")
    m_eq = Z.shape[2]
    if S.Q.shape[0] * m_eq <= q:
        raise NotEnoughDataError(f"{S.Q.shape[0]} usable samples give {S.Q.shape[0] * m_eq} equations for {q} "
                                 "unknowns")
    movable = np.abs(top.Cb_q).sum(axis=1) > 0   # bars that move (mass enters the dynamics)
    rest_est = "rest_length" in opts.estimate
    n_pass = 1 + max(0, int(opts.relinearize if opts.relinearize is not None else 10))

    chunk = max(1, int(4_000_000 // max(1, m_eq * p_full)))     # samples per design chunk (memory bound)

    def chunks(S, Z):
        n = S.Q.shape[0]
        for c0 in range(0, n, chunk):
            idx = np.arange(c0, min(n, c0 + chunk))
            yield c0, (_take(S, idx) if idx.size < n else S), Z[c0:c0 + idx.size]

    def design_chunks(S, Z, gate):
        for c0, Sc, Zc in chunks(S, Z):
            X, y, rs = _design(top, Sc, Zc, cur, lay, known_full, Eq, gate)
            Xr = X @ K
            good = np.all(np.isfinite(Xr), axis=1) & np.isfinite(y)
            if not good.all():
                Xr, y, rs = Xr[good], y[good], rs[good]
            yield Xr, y, rs + c0

    def gauge_constraint(homogeneous):
        a, d, gauge = None, 0.0, ""
        if homogeneous:
            a = np.zeros(q)
            for g, mem in enumerate(lay.groups):
                for k in mem:
                    if lay.kinds[k] == "mass" and movable[lay.elem[k]]:
                        a[g] += 1.0
            if not a.any():
                # no mass estimated: anchor the first scale-carrying group at its current value
                g0 = next((g for g, mem in enumerate(lay.groups) if lay.kinds[mem[0]] in GAUGE_KINDS), 0)
                a[g0] = 1.0
                k0 = lay.groups[g0][0]
                d = float(cur[lay.kinds[k0]][lay.elem[k0]])
                gauge = f"{lay.group_names[g0]} fixed at {d:g}"
            else:
                known_mass = sum(v for k, v in known_full.items()
                                 if lay.kinds[k] == "mass" and movable[lay.elem[k]])
                total = opts.total_mass
                if total is None:
                    total = float(sum(cur["mass"][b] for b in range(top.n_bars) if movable[b]))
                d = float(total) - known_mass
                gauge = f"total moving mass fixed at {float(total):g} kg"
        return a, d, gauge

    def one_pass(S, Z, gate):
        G = np.zeros((q, q))
        bv = np.zeros(q)
        yy = xx = 0.0
        n_rows = 0
        for Xr, y, _ in design_chunks(S, Z, gate):
            G += Xr.T @ Xr
            bv += Xr.T @ y
            yy += float(y @ y)
            xx += float((Xr * Xr).sum())
            n_rows += y.shape[0]
        # gauge: homogeneous equations -> anchor on the total mass
        homogeneous = bool(math.sqrt(yy) <= 1e-12 * max(math.sqrt(xx), 1e-300))
        a, d, gauge = gauge_constraint(homogeneous)
        th_ref = np.zeros(q)   # directions the data do not determine stay at the prior's values
        for g, mem in enumerate(lay.groups):
            vals = [0.0 if lay.kinds[k] == "rest_length" else float(prior_vals[lay.kinds[k]][lay.elem[k]])
                    for k in mem]
            th_ref[g] = float(np.mean(vals))
        th, N, Pz, null_dirs, rel_sv = _solve(G, bv, a, d, opts.rank_tol, th_ref)
        rss = max(yy - 2.0 * float(th @ bv) + float(th @ G @ th), 0.0)
        # update the linearisation point and the values used by the gates
        full = K @ th
        for k, v in known_full.items():
            full[k] = v
        for k, (kind, el) in enumerate(zip(lay.kinds, lay.elem)):
            if kind in ("mass", "stiffness", "damping"):
                cur[kind][el] = full[k]
            elif kind == "control_force_scalar":
                cur[kind][0] = full[k]
        if rest_est:
            for k, (kind, el) in enumerate(zip(lay.kinds, lay.elem)):
                if kind == "rest_length" and k not in known_full:
                    kk = cur["stiffness"][el]
                    if kk > 0 and np.isfinite(full[k]):
                        lo, hi = 0.5 * nominal_rest[el], 1.5 * nominal_rest[el]
                        cur["rest_length"][el] = float(np.clip(cur["rest_length"][el] + full[k] / kk,
                                                               lo + 1e-9, hi - 1e-9))
        return dict(th=th, N=N, Pz=Pz, null_dirs=null_dirs, gauge=gauge, homogeneous=homogeneous, d=d,
                    rss=rss, n_rows=n_rows, gate=gate)

    first_geometric = [True]

    def solve_all(S, Z):
        sol, prev = None, None
        for it in range(n_pass):
            rest_before = cur["rest_length"].copy()
            gate = "geometric" if (it == 0 and first_geometric[0]) else opts.string_gate
            sol = one_pass(S, Z, gate)
            th = sol["th"]
            moved = np.abs(cur["rest_length"] - rest_before).max() if rest_est else 0.0
            if prev is not None and moved < 1e-9 and \
                    np.all(np.abs(th - prev) <= 1e-9 * np.maximum(np.abs(th), 1e-300)):
                break
            prev = th
        return sol

    def per_sample(S, Z, sol, clusters: bool):
        """Second pass at the solution: per-sample residual and term magnitudes; cluster score sums."""
        n = S.Q.shape[0]
        ss, mag, cnt = np.zeros(n), np.zeros(n), np.zeros(n)
        th, N = sol["th"], sol["N"]
        scores = {}
        for Xr, y, rs in design_chunks(S, Z, sol["gate"]):
            res = y - Xr @ th
            ss += np.bincount(rs, weights=res ** 2, minlength=n)
            mag += np.bincount(rs, weights=(np.abs(Xr * th[None, :]).sum(1) + np.abs(y)) ** 2, minlength=n)
            cnt += np.bincount(rs, minlength=n)
            if clusters:
                A = Xr @ N
                cl = S.cluster[rs]
                uc, inv = np.unique(cl, return_inverse=True)
                Gc = np.zeros((uc.size, A.shape[1]))
                np.add.at(Gc, inv, A * res[:, None])
                for u_, g_ in zip(uc, Gc):
                    scores[u_] = scores.get(u_, 0.0) + g_
        return ss, mag, cnt, scores

    sol = solve_all(S, Z)
    dropped = 0
    if opts.outlier_threshold is not None:
        ss, mag, cnt, _ = per_sample(S, Z, sol, False)
        use = cnt > 0
        # relative to the sample's own force level, floored at the typical level (slack samples have ~no force)
        level = np.sqrt(mag)
        rel = np.sqrt(ss) / np.maximum(level, np.median(level[use]) if use.any() else 1e-300)
        med = np.median(rel[use])
        mad = 1.4826 * np.median(np.abs(rel[use] - med))
        bad = ((rel > med + opts.outlier_threshold * mad) & (rel > opts.outlier_min_relative)) | ~use
        if bad.any() and (~bad).sum() * m_eq > q:
            dropped = int(bad.sum())
            keep = np.flatnonzero(~bad)
            S, Z = _take(S, keep), Z[keep]
            first_geometric[0] = False
            notes.append(f"{dropped} outlying sample(s) rejected (relative residual > median + "
                         f"{opts.outlier_threshold:g} MAD and > {opts.outlier_min_relative:g})")
            sol = solve_all(S, Z)
    th, N, Pz, null_dirs = sol["th"], sol["N"], sol["Pz"], sol["null_dirs"]
    gauge, homogeneous, d = sol["gauge"], sol["homogeneous"], sol["d"]
    n_rows = sol["n_rows"]
    rank = int(np.linalg.matrix_rank(Pz, tol=1e-300)) if Pz.size else 0
    dof = max(n_rows - rank, 1)
    sigma2 = sol["rss"] / dof
    cov_mode = opts.covariance
    if cov_mode == "auto":
        cov_mode = "cluster" if S.smoothed else "iid"
    if cov_mode == "iid":
        Cz = sigma2 * Pz
    else:
        _, _, _, scores = per_sample(S, Z, sol, True)
        Gs = np.array(list(scores.values())).reshape(-1, Pz.shape[0])
        meat = Gs.T @ Gs * (n_rows / dof)
        Cz = Pz @ meat @ Pz
        # never more optimistic than the iid estimate
        Cz_iid = sigma2 * Pz
        if np.trace(Cz) < np.trace(Cz_iid):
            Cz = Cz_iid
    Cth = N @ Cz @ N.T                                             # reduced params
    Cfull = K @ Cth @ K.T
    full = K @ th
    for k, v in known_full.items():
        full[k] = v
    # ---- physical estimates ------------------------------------------------------------------
    estimates: Dict[str, float] = {}
    std: Dict[str, float] = {}
    out_names: List[str] = []
    sd_full = np.sqrt(np.maximum(np.diag(Cfull), 0.0))
    for k, name in enumerate(lay.names):
        kind, el = lay.kinds[k], lay.elem[k]
        if k in known_full:
            continue
        if kind == "rest_length":
            estimates[name] = float(cur["rest_length"][el])
            # delta-method std of phi/k (the last pass linearised at the current value: delta ~ 0)
            ks = [kk for kk, (kd, ee) in enumerate(zip(lay.kinds, lay.elem)) if kd == "stiffness" and ee == el]
            kval = cur["stiffness"][el]
            std[name] = float(sd_full[k] / kval) if kval > 0 else float("inf")
            if ks and kval > 0:
                kk = ks[0]
                dlt = full[k] / kval
                var = (Cfull[k, k] + dlt ** 2 * Cfull[kk, kk] - 2 * dlt * Cfull[k, kk]) / kval ** 2
                std[name] = float(math.sqrt(max(var, 0.0)))
        else:
            estimates[name] = float(full[k])
            std[name] = float(sd_full[k])
        out_names.append(name)
    # ---- identifiability --------------------------------------------------------------------
    unexcited = set()
    non_ident: List[str] = []
    for v in null_dirs:
        vfull = K @ v
        for k in np.flatnonzero(np.abs(vfull) > 1e-3 * np.abs(vfull).max()):
            unexcited.add(lay.names[k])
        non_ident.append("not excited by the data: " + _format_direction(v, lay.group_names))
    ratios: Dict[str, Tuple[float, float]] = {}
    gauge_names = set()
    if homogeneous:
        moving_mass_names = [lay.names[k] for k in range(p_full)
                             if lay.kinds[k] == "mass" and movable[lay.elem[k]] and lay.names[k] in estimates]
        ref = moving_mass_names[0] if len(moving_mass_names) == 1 else "total_mass"
        ref_val = float(sum(estimates[n] for n in moving_mass_names)) if moving_mass_names else None
        if ref_val is None or ref_val <= 0:
            ref_val = d
            ref = gauge
        for name in out_names:
            if kind_of(name) in GAUGE_KINDS:
                gauge_names.add(name)
                if name != ref:
                    ratios[f"{name}/{ref}"] = (estimates[name] / ref_val, std[name] / ref_val)
        non_ident.insert(0, "scale (gauge): multiplying every mass, stiffness and damping by the same factor leaves "
                            "the motion unchanged; only ratios are identifiable (" + gauge + ")")
        # the ratios themselves are in ``ratios`` (identify prints them, and drops them when stage 2's weighed
        # masses fix the scale); a note repeating them outlived stage 2 and contradicted its absolute values
    for name in unexcited:
        if name in std:
            std[name] = float("inf")   # the data do not determine it (kept at the prior value)
    ident: Dict[str, float] = {}
    identifiable: Dict[str, bool] = {}
    for name in out_names:
        kind = kind_of(name)
        el = lay.elem[lay.names.index(name)]
        refv = identifiability_reference(kind, estimates[name], nominal_rest[el] if kind == "rest_length" else None)
        score = float(np.clip(1.0 - std[name] / refv, 0.0, 1.0)) if np.isfinite(std[name]) else 0.0
        if name in unexcited or name in gauge_names:
            score = 0.0
        ident[name] = score
        identifiable[name] = score >= opts.identifiable_threshold
    # ---- params ----------------------------------------------------------------------------------
    values = dict(estimates)
    params = prior.with_values({n: v for n, v in values.items()})
    if opts.known:
        params = params.with_values({n: v for n, v in opts.known.items() if n in params.named()})
    cov_names = [lay.names[k] for k in range(p_full) if k not in known_full]
    idx = [k for k in range(p_full) if k not in known_full]
    cov = Cfull[np.ix_(idx, idx)]
    # rest-length rows/cols are in phi units; convert to metres (diagonal only is exact)
    for a_i, k in enumerate(idx):
        if lay.kinds[k] == "rest_length":
            kval = cur["stiffness"][lay.elem[k]]
            if kval > 0:
                cov[a_i, :] /= kval
                cov[:, a_i] /= kval
    return RegressionResult(params=params, estimates=estimates, std_devs=std, identifiability=ident,
                            identifiable=identifiable, ratios=ratios, gauge=gauge if homogeneous else "",
                            non_identifiable=non_ident, residual_rms=float(math.sqrt(sol["rss"] / max(n_rows, 1))),
                            n_samples=int(S.Q.shape[0]), n_equations=int(n_rows), dropped_samples=dropped,
                            names=cov_names, covariance=cov, notes=notes)
