"""Nodal tensegrity dynamics in reduced coordinates (the product's main engine).

Same physics as the nodal-dynamics seed (eqs. 1-10): point-mass nodes with the bars' consistent mass
matrix, composite Kelvin-Voigt strings (pull only), bar lengths held by Lagrange multipliers, linear nodal
constraints. The linear constraints are eliminated exactly by reduced coordinates (``X = T Q + X_c``, see
:mod:`.topology`), the bar-length multipliers are solved exactly each evaluation:

    M_q Q'' = F_q + (C_b T)^T (lambda * d),          F_q = T^T (F_strings + F_gravity + F_external)
    a0 = M_q^-1 F_q,  A = G * (D D^T),  G = (C_b T) M_q^-1 (C_b T)^T   (constant per params)
    A lambda = -(|d'|^2 + d . (C_b T) a0) - (2 alpha g' + beta^2 g),   g = (|d|^2 - l^2) / 2
    Q'' = a0 + M_q^-1 (C_b T)^T (lambda * d)

lambda is the seed's bar force density (lambda_hat, eq. 5/8, up to sign). After each step, positions and
velocities are projected back onto the bar-length manifold (mass-weighted Gauss-Newton, reusing A^-1).

Everything is a pure function of (constants, params, state, inputs); the :class:`NodalEngine` only bundles
the constants of one structure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import integrators
from ._common import (as_tensor, convert_like, register_tensor_dataclass, setup_compile, spd_inverse,
                      unsqueeze_batch)
from .params import Params, params_from_structure
from .state import Inputs, State
from .topology import Topology, build_topology


# =====================================================================================================
# constants and per-params derived quantities
# Internal layout is the seed's: coordinates first, nodes last (Q: (B, 3, n_free)), so every constant
# matrix multiplies from the right and batched products fold into one matrix multiply.
# =====================================================================================================
def _gather_form(M: np.ndarray):
    """(idx, w) with X @ M == (X[..., idx] * w).sum(-1); idx, w: (k_out, max nonzeros per column)."""
    k_in, k_out = M.shape
    nnz = [np.flatnonzero(M[:, o]) for o in range(k_out)]
    width = max([1] + [len(z) for z in nnz])
    idx = np.zeros((k_out, width), dtype=np.int64)
    w = np.zeros((k_out, width))
    for o, z in enumerate(nnz):
        idx[o, :len(z)] = z
        w[o, :len(z)] = M[z, o]
    return idx, w


def rmul(X: torch.Tensor, M: torch.Tensor, idx: Optional[torch.Tensor] = None, w: Optional[torch.Tensor] = None,
         fused: bool = False) -> torch.Tensor:
    """X (..., k_in) @ M (k_in, k_out) or batched M (Bp, k_in, k_out).

    ``fused``: as elementwise products and sums (a gather for sparse constant matrices given as idx, w),
    which torch.compile fuses into a few loops instead of calling small matrix multiplies.
    """
    if not fused:
        return X @ M
    if idx is not None:
        return (X[..., idx] * w).sum(-1)
    if M.dim() == 2:
        return (X.unsqueeze(-1) * M).sum(-2)
    return (X.unsqueeze(-1) * M.unsqueeze(-3)).sum(-2)


@register_tensor_dataclass
@dataclass(frozen=True)
class NodalConstants:
    """Constant tensors of a structure (see :mod:`.topology`); floating ones follow the state's dtype/device.

    T: (N, n_free); Tt: (n_free, N) = T^T; XcT: (3, N) m; free_idx: (n_free,) long;
    Cb_q: (nba, n_free) = C_b T over the nba bars with a free node; Cbt: (n_free, nba); dcT: (3, nba) m;
    l2: (nba,) squared bar lengths, m^2; Cs_q: (n_seg, n_free); Cst: (n_free, n_seg); scT: (3, n_seg) m;
    G: (n_seg, n_strings); Gt: (n_strings, n_seg); Ydir: (n_strings, A); spring, cord: (n_strings,) the stiffness
    law's masks (1.0 where a string follows the ``spring`` / ``cord`` law, else 0.0); E_q: (n_bars, n_free, n_free);
    WqT: (n_bars, n_free); gravity: (3,) m/s^2; bar_nodes: (n_bars, 2) long; bar_lengths: (n_bars,) m;
    seg_nodes: (n_seg, 2) long; E: (n_bars, N, N); W: (N, n_bars).
    ``*_i`` / ``*_w``: the same constant matrices in gather form (see :func:`rmul`): for ``X @ M``, output
    column o is sum_k w[o, k] X[..., i[o, k]] (padded with zero weights).
    """

    T: torch.Tensor
    Tt: torch.Tensor
    XcT: torch.Tensor
    free_idx: torch.Tensor
    Cb_q: torch.Tensor
    Cbt: torch.Tensor
    dcT: torch.Tensor
    l2: torch.Tensor
    Cs_q: torch.Tensor
    Cst: torch.Tensor
    scT: torch.Tensor
    G: torch.Tensor
    Gt: torch.Tensor
    Ydir: torch.Tensor
    spring: torch.Tensor
    cord: torch.Tensor
    E_q: torch.Tensor
    WqT: torch.Tensor
    gravity: torch.Tensor
    bar_nodes: torch.Tensor
    bar_lengths: torch.Tensor
    seg_nodes: torch.Tensor
    E: torch.Tensor
    W: torch.Tensor
    Cst_i: torch.Tensor
    Cst_w: torch.Tensor
    Cs_q_i: torch.Tensor
    Cs_q_w: torch.Tensor
    Cbt_i: torch.Tensor
    Cbt_w: torch.Tensor
    G_i: torch.Tensor
    G_w: torch.Tensor
    Gt_i: torch.Tensor
    Gt_w: torch.Tensor
    Tt_i: torch.Tensor
    Tt_w: torch.Tensor

    @staticmethod
    def build(top: Topology, dtype=torch.float64, device=None) -> "NodalConstants":
        act = top.active_bars
        t = lambda x: as_tensor(np.ascontiguousarray(x), dtype, device)  # noqa: E731
        sparse = {}
        for name, M in (("Cst", top.Cs_q.T), ("Cs_q", top.Cs_q), ("Cbt", top.Cb_q[act].T), ("G", top.G),
                        ("Gt", top.G.T), ("Tt", top.T.T)):
            i, w = _gather_form(M)
            sparse[name + "_i"], sparse[name + "_w"] = t(i), t(w)
        return NodalConstants(**sparse,
            T=t(top.T), Tt=t(top.T.T), XcT=t(top.Xc.T), free_idx=t(np.array(top.free_nodes, dtype=np.int64)),
            Cb_q=t(top.Cb_q[act]), Cbt=t(top.Cb_q[act].T), dcT=t(top.d_c[act].T), l2=t(top.bar_lengths[act] ** 2),
            Cs_q=t(top.Cs_q), Cst=t(top.Cs_q.T), scT=t(top.s_c.T), G=t(top.G), Gt=t(top.G.T), Ydir=t(top.Ydir),
            spring=t(top.spring), cord=t(1.0 - top.spring),
            E_q=t(top.E_q), WqT=t(top.W_q.T), gravity=t(top.gravity), bar_nodes=t(top.bar_nodes),
            bar_lengths=t(top.bar_lengths), seg_nodes=t(top.seg_nodes), E=t(top.E), W=t(top.W))


@register_tensor_dataclass
@dataclass(frozen=True)
class Derived:
    """Per-params quantities (no batch dim for unbatched params, else the params batch Bp first).

    EA: (Bp, S) N; zeta: (Bp, S) N s/m; xi00: (Bp, S) m; Y: (Bp, S, A) m/rad; z: (Bp, A) rad;
    kc: (Bp, S) N/m. The stiffness is kappa = EA / xi0 + kc: cord strings have EA = stiffness * xi00 and kc = 0,
    spring strings EA = 0 and kc = stiffness (see :func:`prepare`; every Derived of this engine has kc);
    Mq: (Bp, n_free, n_free) kg; Minv: (Bp, n_free, n_free) 1/kg; Pt: (Bp, nba, n_free) = (C_b T) M_q^-1;
    Gc: (Bp, nba, nba) = (C_b T) M_q^-1 (C_b T)^T; FgT: (Bp, 3, n_free) generalised weight, N.
    """

    EA: torch.Tensor
    zeta: torch.Tensor
    xi00: torch.Tensor
    Y: torch.Tensor
    z: torch.Tensor
    Mq: torch.Tensor
    Minv: torch.Tensor
    Pt: torch.Tensor
    Gc: torch.Tensor
    FgT: torch.Tensor
    #: last and optional so that the spring-rod engine's Derived (which has no stiffness laws: None) still builds
    kc: Optional[torch.Tensor] = None


def reduced_mass_matrix(c: NodalConstants, mass: torch.Tensor) -> torch.Tensor:
    """M_q = T^T (sum_b m_b E_b) T: (..., n_free, n_free) kg from mass (..., n_bars) kg."""
    return torch.einsum("...b,bfg->...fg", mass, c.E_q)


def prepare(c: NodalConstants, p: Params) -> Derived:
    """Quantities that depend on params only (mass matrix inverse, bar coupling G, weights, EA, kc, Y).

    The stiffness law of each string (``String.stiffness_law``) enters as a split of the stiffness parameter
    k into EA = k xi00 (cord) and kc = k (spring) with the constant 0/1 masks, so that everywhere
    kappa = EA / xi0 + kc: one batched, differentiable expression for both laws, and for cord strings
    bit-for-bit the former EA / xi0 (multiplying by 1.0 and adding 0.0 are exact).
    """
    k, zeta, xi00, m = p.stiffness, p.damping, p.rest_length, p.mass
    Mq = reduced_mass_matrix(c, m)
    Minv = torch.linalg.inv(Mq)
    Pt = c.Cb_q @ Minv
    Gc = Pt @ c.Cbt
    FgT = c.gravity.unsqueeze(-1) * (m @ c.WqT).unsqueeze(-2)
    Y = c.Ydir * p.spool_radius.unsqueeze(-2)
    return Derived(EA=k * xi00 * c.cord, zeta=zeta, xi00=xi00, Y=Y, z=p.zero_offset, kc=k * c.spring, Mq=Mq,
                   Minv=Minv, Pt=Pt, Gc=Gc, FgT=FgT)


# =====================================================================================================
# string law (CONTRACTS.md): composite Kelvin-Voigt, pull only, gated on D > 0
# =====================================================================================================
class StringState(NamedTuple):
    """Per composite string: length L (B, S) m, rate L' m/s, rest length xi0 m, xi0' m/s, stretch D m,
    rate D' m/s, stiffness kappa = EA/xi0 + kc N/m (the string's law, see :func:`prepare`), tension (B, S) N;
    per segment: unit vectors e (segment vectors' layout), lengths xi (B, n_seg) m and their rates xi' m/s."""

    L: torch.Tensor
    Ldot: torch.Tensor
    xi0: torch.Tensor
    xi0dot: torch.Tensor
    D: torch.Tensor
    Ddot: torch.Tensor
    kappa: torch.Tensor
    tension: torch.Tensor
    e: torch.Tensor
    xi: torch.Tensor
    xidot: torch.Tensor


def _act(Y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Y (.., S, A) times x (.., A) -> (.., S)."""
    if Y.dim() == 2:
        return x @ Y.T
    return (x.unsqueeze(-2) @ Y.mT).squeeze(-2)


def rest_lengths(der: Derived, u: Optional[torch.Tensor], udot: Optional[torch.Tensor]):
    """xi0 = xi00 + Y (u - z) (.., S) m and xi0' = Y u' m/s (zeros when udot is None)."""
    xi0 = der.xi00
    xi0dot = None
    if u is not None and der.Y.shape[-1] > 0:
        xi0 = xi0 + _act(der.Y, u - der.z)
        if udot is not None:
            xi0dot = _act(der.Y, udot)
    return xi0, xi0dot


def string_law(G: torch.Tensor, s: torch.Tensor, sdot: torch.Tensor, der: Derived, u: Optional[torch.Tensor],
               udot: Optional[torch.Tensor], coord_dim: int = -2, G_gather=None) -> StringState:
    """Composite string tensions from segment vectors.

    G: (n_seg, S) simple-to-composite map. s: segment vectors (second minus first node), m, either
    (B, 3, n_seg) (``coord_dim=-2``, internal layout) or (B, n_seg, 3) (``coord_dim=-1``). sdot: their rates,
    m/s. u: (B, A) motor angles, rad; udot: (B, A) rad/s (or None). G_gather: (idx, w) gather form of G
    (fused products, see :func:`rmul`).
    """
    if G_gather is None:
        xi = torch.linalg.vector_norm(s, dim=coord_dim)             # (B, ns)
    else:
        xi = torch.sqrt((s * s).sum(coord_dim))
    e = s / xi.unsqueeze(coord_dim)
    xidot = (e * sdot).sum(coord_dim)
    fused = G_gather is not None
    gi, gw = G_gather if fused else (None, None)
    L = rmul(xi, G, gi, gw, fused)                                  # (B, S)
    Ldot = rmul(xidot, G, gi, gw, fused)
    xi0, xi0dot = rest_lengths(der, u, udot)
    D = L - xi0
    Ddot = Ldot if xi0dot is None else Ldot - xi0dot
    kappa = der.EA / xi0 + der.kc                                   # cord: EA/xi0 (kc = 0); spring: kc (EA = 0)
    tension = torch.where(D > 0, torch.relu(kappa * D + der.zeta * Ddot), torch.zeros_like(D))
    return StringState(L, Ldot, xi0, torch.zeros_like(xi0) if xi0dot is None else xi0dot, D, Ddot, kappa,
                       tension, e, xi, xidot)


# =====================================================================================================
# dynamics (internal layout: Q, V (B, 3, n_free))
# =====================================================================================================
class Options(NamedTuple):
    """Solver options. baumgarte: (alpha 1/s, beta 1/s) constraint stabilisation in the multiplier equation;
    projection_iters: Gauss-Newton position projections after each step (0: off; velocities are projected
    whenever positions are); solver: 'lapack' | 'unrolled' (see :func:`spd_inverse`); fused: write every
    product as gathers/elementwise ops (see :func:`rmul`; the compiled paths use it)."""

    baumgarte: Tuple[float, float] = (0.0, 0.0)
    projection_iters: int = 2
    solver: str = "lapack"
    fused: bool = False


def generalized_forces(c: NodalConstants, der: Derived, Q, V, u, udot, fext, fused: bool = False,
                       with_strings: bool = False):
    """F_q^T (B, 3, n_free) N: strings + gravity + external (``fext`` already reduced, (B, 3, n_free)).
    ``with_strings``: also return the :class:`StringState` (segment unit vectors in (B, 3, n_seg))."""
    s = rmul(Q, c.Cst, c.Cst_i, c.Cst_w, fused) + c.scT
    sdot = rmul(V, c.Cst, c.Cst_i, c.Cst_w, fused)
    st = string_law(c.G, s, sdot, der, u, udot, G_gather=(c.G_i, c.G_w) if fused else None)
    seg_t = rmul(st.tension, c.Gt, c.Gt_i, c.Gt_w, fused)          # (B, ns)
    F = der.FgT - rmul(seg_t.unsqueeze(-2) * st.e, c.Cs_q, c.Cs_q_i, c.Cs_q_w, fused)
    if fext is not None:
        F = F + fext
    return (F, st) if with_strings else F


def _bars(c: NodalConstants, Q, fused: bool):
    return rmul(Q, c.Cbt, c.Cbt_i, c.Cbt_w, fused)


def _bar_matrix(der: Derived, d, fused: bool):
    """A = G * (D D^T): (B, nba, nba) from bar vectors d (B, 3, nba)."""
    if fused:
        return der.Gc * (d.unsqueeze(-1) * d.unsqueeze(-2)).sum(-3)
    return der.Gc * (d.mT @ d)


def _solve(Ainv, r, fused: bool):
    """A^-1 r: (B, nba, nba) x (B, nba) -> (B, 1, nba)."""
    if fused:
        return (Ainv * r.unsqueeze(-2)).sum(-1).unsqueeze(-2)
    return (Ainv @ r.unsqueeze(-1)).mT


class Constrained(NamedTuple):
    """The constrained acceleration Q'' = a0 + M_q^-1 (C_b T)^T (lambda * d) and what it was built from:
    a, a0 (B, 3, n_free) m/s^2; d, dd (B, 3, nba) bar vectors m and rates m/s; Ainv (B, nba, nba);
    lam (B, nba) bar force densities (None without bars)."""

    a: torch.Tensor
    a0: torch.Tensor
    d: Optional[torch.Tensor]
    dd: Optional[torch.Tensor]
    Ainv: Optional[torch.Tensor]
    lam: Optional[torch.Tensor]


def constrained_accelerations(c: NodalConstants, der: Derived, Q, V, F, opts: Options) -> Constrained:
    """Q'' from the generalised forces F (B, 3, n_free) with the bar-length multipliers solved exactly."""
    fused = opts.fused
    a0 = rmul(F, der.Minv, fused=fused)
    if c.Cb_q.shape[0] == 0:
        return Constrained(a0, a0, None, None, None, None)
    d = _bars(c, Q, fused) + c.dcT                                  # (B, 3, nba)
    dd = _bars(c, V, fused)
    rhs = -(dd * dd).sum(-2) - (d * _bars(c, a0, fused)).sum(-2)   # (B, nba)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        g = 0.5 * ((d * d).sum(-2) - c.l2)
        rhs = rhs - 2.0 * alpha * (d * dd).sum(-2) - beta * beta * g
    Ainv = spd_inverse(_bar_matrix(der, d, fused), opts.solver)
    lam = _solve(Ainv, rhs, fused)                                  # (B, 1, nba)
    return Constrained(a0 + rmul(lam * d, der.Pt, fused=fused), a0, d, dd, Ainv, lam.squeeze(-2))


def accelerations(c: NodalConstants, der: Derived, Q, V, u, udot, fext, opts: Options):
    """Q'' (B, 3, n_free) m/s^2 and A^-1 (B, nba, nba) at the reduced state Q (m), V (m/s)."""
    F = generalized_forces(c, der, Q, V, u, udot, fext, opts.fused)
    out = constrained_accelerations(c, der, Q, V, F, opts)
    return out.a, out.Ainv


def project_positions_once(c: NodalConstants, der: Derived, Q, Ainv, fused: bool = False,
                           with_multiplier: bool = False):
    """One mass-weighted Gauss-Newton step of Q towards |d_b| = l_b with the (chord) matrix A^-1.
    ``with_multiplier``: also the bar vectors d (B, 3, nba) it was taken at and y = A^-1 g (B, nba)."""
    d = _bars(c, Q, fused) + c.dcT
    g = 0.5 * ((d * d).sum(-2) - c.l2)
    y = _solve(Ainv, g, fused)
    Q = Q - rmul(y * d, der.Pt, fused=fused)
    return (Q, d, y.squeeze(-2)) if with_multiplier else Q


def project_velocities(c: NodalConstants, der: Derived, Q, V, Ainv, fused: bool = False,
                       with_multiplier: bool = False):
    """V projected onto d_b . d_b' = 0 at the positions Q (mass-weighted, chord matrix A^-1).
    ``with_multiplier``: also the bar vectors d (B, 3, nba) at Q and nu = A^-1 (d . d') (B, nba)."""
    d = _bars(c, Q, fused) + c.dcT
    nu = _solve(Ainv, (d * _bars(c, V, fused)).sum(-2), fused)
    V = V - rmul(nu * d, der.Pt, fused=fused)
    return (V, d, nu.squeeze(-2)) if with_multiplier else V


def chord_matrix_inverse(c: NodalConstants, der: Derived, Q) -> Optional[torch.Tensor]:
    """A^-1 (B, nba, nba) of the bar constraints at the positions Q, as :meth:`NodalEngine.project` forms it
    (None without bars)."""
    if c.Cb_q.shape[0] == 0:
        return None
    d = Q @ c.Cbt + c.dcT
    return spd_inverse(der.Gc * (d.mT @ d), "lapack")


def project(c: NodalConstants, der: Derived, Q, V, Ainv, iters: int, fused: bool = False):
    """Mass-weighted projection of Q (positions) onto |d_b| = l_b and of V onto d_b . d_b' = 0.

    Gauss-Newton with the (chord) matrix A^-1 (B, nba, nba) of the step: each iteration reduces the error
    by ~|d'| dt / l (~1e-3); two iterations bring it to round-off.
    """
    if iters <= 0 or Ainv is None:
        return Q, V
    for _ in range(iters):
        Q = project_positions_once(c, der, Q, Ainv, fused)
    return Q, project_velocities(c, der, Q, V, Ainv, fused)


def implicit_step(c: NodalConstants, der: Derived, Q, V, u, udot, fext, h: float, opts: Options):
    """Semi-implicit Euler with the string damping taken implicitly (linearised, like MuJoCo's implicitfast).

    With g_c = dL_c/dQ (B, S, 3, n_free) and the strings pulling at the start of the step (a_c = 1):
        (M + h sum_c a_c zeta_c g_c g_c^T) dV = h F(Q, V) + J^T mu,   J V1 = d.d' - h |d'|^2 (per bar),
    solved as one SPD system for the bar impulses mu and the scaled damping impulses nu (w = h zeta a):
        [[J M^-1 J^T, J M^-1 G w^1/2], [., I + w^1/2 G^T M^-1 G w^1/2]] [mu; nu] = [t - J V*; -w^1/2 G^T dV0]
    then V1 = V + dV0 + M^-1 (J^T mu + G w^1/2 nu), Q1 = Q + h V1. Stable for any damping at the step size
    where the undamped system is (the explicit integrators need h zeta / m_node < ~2).
    Returns (Q1, V1, A^-1) with A = J M^-1 J^T for the projection.
    """
    F, st = generalized_forces(c, der, Q, V, u, udot, fext, with_strings=True)
    dV0 = h * (F @ der.Minv)
    # dL_c/dQ: (B, S, 3, n_free)
    g = (c.Gt.unsqueeze(-2) * st.e.unsqueeze(-3)) @ c.Cs_q
    sw = torch.sqrt(h * der.zeta * (st.tension > 0).to(Q.dtype))    # (B, S)
    gw = g * sw.unsqueeze(-1).unsqueeze(-1)
    Mgw = gw @ (der.Minv if der.Minv.dim() == 2 else der.Minv.unsqueeze(-3))  # M^-1 G w^1/2 (B, S, 3, nf)
    nc = gw.shape[-3]
    C = torch.eye(nc, dtype=Q.dtype, device=Q.device) + torch.einsum("...cki,...dki->...cd", gw, Mgw)
    r2 = -torch.einsum("...cki,...ki->...c", gw, dV0)
    Vs = V + dV0
    if c.Cb_q.shape[0] == 0:
        nu = torch.linalg.solve(C, r2.unsqueeze(-1)).squeeze(-1)
        V1 = Vs + torch.einsum("...c,...cki->...ki", nu, Mgw)
        return Q + h * V1, V1, None
    d = Q @ c.Cbt + c.dcT                                           # (B, 3, nb)
    dd = V @ c.Cbt
    A = der.Gc * (d.mT @ d)
    target = (d * dd).sum(-2) - h * (dd * dd).sum(-2)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        g0 = 0.5 * ((d * d).sum(-2) - c.l2)
        target = target - h * (2.0 * alpha * (d * dd).sum(-2) + beta * beta * g0)
    r1 = target - (d * (Vs @ c.Cbt)).sum(-2)
    # J M^-1 G w^1/2: (B, nb, S);  (J M^-1)_b = d_b (x) Pt_b
    Pw = torch.einsum("...kb,...bi,...cki->...bc", d, der.Pt, gw)
    K = torch.cat((torch.cat((A, Pw), -1), torch.cat((Pw.mT, C), -1)), -2)
    L = torch.linalg.cholesky(K)
    sol = torch.cholesky_solve(torch.cat((r1, r2), -1).unsqueeze(-1), L).squeeze(-1)
    nb = A.shape[-1]
    mu, nu = sol[..., :nb], sol[..., nb:]
    V1 = Vs + (mu.unsqueeze(-2) * d) @ der.Pt + torch.einsum("...c,...cki->...ki", nu, Mgw)
    return Q + h * V1, V1, torch.cholesky_inverse(L[..., :nb, :nb])


def step_reduced(c: NodalConstants, der: Derived, Q, V, u, udot, fext, dt: float, integrator: str,
                 opts: Options):
    """One step in reduced coordinates: (Q, V) (B, 3, n_free) -> (Q', V'). Inputs held over the step."""
    if integrator == "implicit":
        Q1, V1, Ainv = implicit_step(c, der, Q, V, u, udot, fext, dt, opts)
    else:
        integrate = integrators.get(integrator)
        Q1, V1, Ainv = integrate(Q, V, lambda q, v: accelerations(c, der, q, v, u, udot, fext, opts), dt)
    return project(c, der, Q1, V1, Ainv, opts.projection_iters, opts.fused)


INTEGRATORS = integrators.INTEGRATORS


def expand(c: NodalConstants, Q: torch.Tensor) -> torch.Tensor:
    """Full node positions (..., N, 3) m from internal Q (..., 3, n_free): X = T Q + X_c."""
    return (Q @ c.Tt + c.XcT).mT


def expand_velocity(c: NodalConstants, V: torch.Tensor) -> torch.Tensor:
    """Full node velocities (..., N, 3) m/s from internal V (..., 3, n_free)."""
    return (V @ c.Tt).mT


def reduce(c: NodalConstants, X: torch.Tensor) -> torch.Tensor:
    """Internal reduced coordinates (..., 3, n_free): the independent nodes' rows of X (..., N, 3)."""
    return X.index_select(-2, c.free_idx).mT.contiguous()


def _inputs_reduced(c: NodalConstants, inputs: Optional[Inputs]):
    if inputs is None:
        return None, None, None
    fq = None
    if inputs.external_forces is not None:
        fq = inputs.external_forces.mT @ c.T                        # (.., 3, n_free)
    return inputs.motor_angles, inputs.motor_velocities, fq


def step(c: NodalConstants, params: Params, state: State, inputs: Optional[Inputs], dt: float,
         integrator: str = "semi_implicit", opts: Options = Options()) -> State:
    """Pure step: (constants, params, state (B, N, 3), inputs, dt s) -> next State."""
    c = convert_like(c, state.positions)
    params = convert_like(params, state.positions)
    inputs = convert_like(inputs, state.positions)
    der = prepare(c, params)
    Q, V = reduce(c, state.positions), reduce(c, state.velocities)
    u, ud, fq = _inputs_reduced(c, inputs)
    Q, V = step_reduced(c, der, Q, V, u, ud, fq, dt, integrator, opts)
    return State(expand(c, Q), expand_velocity(c, V))


def rollout(c: NodalConstants, params: Params, state0: State, inputs: Optional[Inputs], dt: float,
            integrator: str = "semi_implicit", opts: Options = Options(), steps: Optional[int] = None) -> State:
    """T steps; ``inputs`` fields carry a leading time axis T. Returns States stacked on a leading T axis
    (state after each step; state0 excluded). ``steps`` is only needed when ``inputs`` is None."""
    c = convert_like(c, state0.positions)
    params = convert_like(params, state0.positions)
    inputs = convert_like(inputs, state0.positions)
    der = prepare(c, params)
    Q, V = reduce(c, state0.positions), reduce(c, state0.velocities)
    n = _horizon(inputs, steps)
    u_all, ud_all, fq_all = _inputs_reduced(c, inputs)
    Qs, Vs = [], []
    for t in range(n):
        Q, V = step_reduced(c, der, Q, V, None if u_all is None else u_all[t], None if ud_all is None else ud_all[t],
                            None if fq_all is None else fq_all[t], dt, integrator, opts)
        Qs.append(Q)
        Vs.append(V)
    return State(expand(c, torch.stack(Qs)), expand_velocity(c, torch.stack(Vs)))


def _horizon(inputs: Optional[Inputs], steps: Optional[int]) -> int:
    lengths = set()
    if inputs is not None:
        for t in (inputs.motor_angles, inputs.motor_velocities, inputs.external_forces, inputs.control_forces,
                  inputs.control_arms):
            if t is not None:
                lengths.add(int(t.shape[0]))
    if steps is not None:
        lengths.add(int(steps))
    if len(lengths) != 1:
        raise ValueError(f"rollout needs one horizon: inputs with a leading time axis T (or steps=T); got {lengths}")
    return lengths.pop()


# =====================================================================================================
# diagnostics and identification helpers (full node space, (B, N, 3))
# =====================================================================================================
def bar_length_error(c: NodalConstants, positions: torch.Tensor) -> torch.Tensor:
    """(...,) max over bars of | |d_b| / l_b - 1 | for positions (..., N, 3) m."""
    c = convert_like(c, positions)
    if c.bar_nodes.shape[0] == 0:
        return positions.new_zeros(positions.shape[:-2])
    d = positions[..., c.bar_nodes[:, 1], :] - positions[..., c.bar_nodes[:, 0], :]
    return (torch.linalg.vector_norm(d, dim=-1) / c.bar_lengths - 1.0).abs().amax(-1)


def full_string_state(c: NodalConstants, params: Params, positions, velocities, motor_angles=None,
                      motor_velocities=None) -> StringState:
    """String lengths, stretches and tensions for full node positions (B, N, 3) m and velocities m/s."""
    c = convert_like(c, positions)
    der = prepare(c, convert_like(params, positions))
    i, j = c.seg_nodes[:, 0], c.seg_nodes[:, 1]
    s = positions[..., j, :] - positions[..., i, :]
    sd = velocities[..., j, :] - velocities[..., i, :]
    return string_law(c.G, s, sd, der, motor_angles, motor_velocities, coord_dim=-1)


def energy(c: NodalConstants, params: Params, state: State, motor_angles=None) -> torch.Tensor:
    """(...,) total mechanical energy, J: kinetic (consistent bar mass) + gravity + string potential.

    String potential 1/2 kappa D^2 (D > 0) is exact for constant kappa (non-actuated strings, spring-law
    strings, constant u); a moving motor does work on the string, so energy is only conserved without one.
    """
    c = convert_like(c, state.positions)
    X, V = state.positions, state.velocities
    m = params.mass
    ke = 0.5 * torch.einsum("...b,...ni,bnm,...mi->...", m, V, c.E, V)
    pe_g = -torch.einsum("...b,nb,...nk,k->...", m, c.W, X, c.gravity)
    st = full_string_state(c, params, X, V, motor_angles)
    pe_s = (0.5 * st.kappa * torch.relu(st.D) ** 2).sum(-1)
    return ke + pe_g + pe_s


class StringUnitForces(NamedTuple):
    """Linear-in-parameters pieces of the nodal forces (full node space).

    stiffness: (B, S, N, 3) force on each node per unit ``stiffness`` parameter of string c, N/(N/m)
        (cord law: kappa_c = stiffness_c * rest_length_c / xi0_c(t); spring law, and every non-actuated string:
        kappa_c = stiffness_c).
    damping: (B, S, N, 3) force per unit damping zeta_c, N/(N s/m).
    gravity: (N, n_bars, 3) weight per unit bar mass, N/kg.
    active: (B, S) bool, the strings whose pull is on (D > 0 and tension > 0 at the given params).
    So F = sum_c stiffness_c A_c + damping_c B_c + sum_b m_b W_b exactly, for the given state.
    """

    stiffness: torch.Tensor
    damping: torch.Tensor
    gravity: torch.Tensor
    active: torch.Tensor


def string_unit_forces(topology_or_constants, positions: torch.Tensor, velocities: torch.Tensor,
                       motor_angles: Optional[torch.Tensor], params: Params,
                       motor_velocities: Optional[torch.Tensor] = None) -> StringUnitForces:
    """Per-string force contributions per unit stiffness / damping at full node positions (B, N, 3) m,
    velocities (B, N, 3) m/s, motor angles (B, A) rad. ``params`` supplies rest lengths, spool radii, zero
    offsets (and the gate: a string counts as active when it is taut and its tension > 0)."""
    c = topology_or_constants
    if isinstance(c, Topology):
        c = NodalConstants.build(c, positions.dtype, positions.device)
    c = convert_like(c, positions)
    params = convert_like(params, positions)
    st = full_string_state(c, params, positions, velocities, motor_angles, motor_velocities)
    active = st.tension > 0                                         # (B, S)
    N = positions.shape[-2]
    ns = c.seg_nodes.shape[0]
    Cs = torch.zeros(ns, N, dtype=positions.dtype, device=positions.device)
    ar = torch.arange(ns, device=positions.device)
    Cs[ar, c.seg_nodes[:, 0]] = -1.0
    Cs[ar, c.seg_nodes[:, 1]] = 1.0
    # unit-tension nodal force of each composite string: F_n = -sum_s G_sc (C_s)_sn e_s   (B, S, N, 3)
    pattern = -torch.einsum("sc,sn,...sk->...cnk", c.G, Cs, st.e)
    gate = active.to(positions.dtype)
    # kappa per unit stiffness parameter: xi00/xi0 for cord strings, 1 for spring strings (exactly the former
    # xi00/xi0 for cord strings: the masks are 1.0/0.0)
    kscale = params.rest_length * c.cord / st.xi0 + c.spring
    A = (gate * kscale * st.D).unsqueeze(-1).unsqueeze(-1) * pattern
    B = (gate * st.Ddot).unsqueeze(-1).unsqueeze(-1) * pattern
    grav = c.W.unsqueeze(-1) * c.gravity                            # (N, nb, 3)
    return StringUnitForces(A, B, grav, active)


# =====================================================================================================
# engine object
# =====================================================================================================
@dataclass(frozen=True, eq=False)
class NodalEngine:
    """Nodal engine of one structure. Immutable; all methods are pure functions of their arguments.

    Create with :func:`tensegrity_ros.engine.make_engine`.
    """

    topology: Topology
    constants: NodalConstants
    integrator: str = "semi_implicit"
    options: Options = field(default_factory=Options)
    backend: str = "nodal"

    @classmethod
    def create(cls, structure, integrator="semi_implicit", dtype=torch.float64, device=None, **options):
        if integrator not in INTEGRATORS:
            raise ValueError(f"unknown integrator {integrator!r} (valid: {', '.join(INTEGRATORS)})")
        top = build_topology(structure)
        eng = cls(top, NodalConstants.build(top, dtype, device), integrator, Options(**options))
        eng._check_constraints()
        return eng

    @property
    def structure(self):
        return self.topology.structure

    @property
    def dtype(self):
        return self.constants.T.dtype

    @property
    def device(self):
        return self.constants.T.device

    def to(self, dtype=None, device=None) -> "NodalEngine":
        """The same engine with constants in another dtype/device."""
        ref = torch.empty(0, dtype=dtype or self.dtype, device=device or self.device)
        return NodalEngine(self.topology, convert_like(self.constants, ref), self.integrator, self.options)

    def _check_constraints(self) -> None:
        c = self.constants.map(lambda t: t.double() if t.is_floating_point() else t)
        if c.Cb_q.shape[0] == 0:
            return
        der = prepare(c, self.default_params().map(lambda t: t.double()))
        Q = reduce(c, torch.as_tensor(self.topology.X0, dtype=torch.float64, device=c.T.device).unsqueeze(0))
        d = Q @ c.Cbt + c.dcT
        A = der.Gc * (d.mT @ d)
        ev = torch.linalg.eigvalsh(A[0])
        if ev.min() <= 1e-10 * ev.max():
            raise ValueError(f"structure {self.structure.name!r}: the bar-length constraints are redundant "
                             "(singular constraint matrix); remove a redundant bar")

    # ---- API ---------------------------------------------------------------------------------
    def default_params(self, batch: Optional[int] = None) -> Params:
        """Params from the structure file values (``batch``: leading batch dim of copies)."""
        return params_from_structure(self.structure, batch, self.dtype, self.device)

    def initial_state(self, positions: Optional[torch.Tensor] = None, velocities: Optional[torch.Tensor] = None,
                      batch: int = 1) -> State:
        """State from positions (N, 3) or (B, N, 3) m (default: the file's) and velocities m/s (default 0).

        Linear constraints are enforced (X = T Q + X_c from the independent nodes' rows); bar lengths are
        not (use :meth:`project` if the positions come from measurements).
        """
        c = self.constants
        X = torch.as_tensor(self.topology.X0, dtype=self.dtype, device=self.device) if positions is None \
            else torch.as_tensor(positions, dtype=self.dtype, device=self.device)
        X = unsqueeze_batch(X, 2)
        V = torch.zeros_like(X) if velocities is None else unsqueeze_batch(
            torch.as_tensor(velocities, dtype=X.dtype, device=X.device), 2)
        B = max(X.shape[0], V.shape[0], batch)
        X, V = X.expand(B, *X.shape[1:]), V.expand(B, *V.shape[1:])
        c = convert_like(c, X)
        return State(expand(c, reduce(c, X)), expand_velocity(c, reduce(c, V)))

    def step(self, params: Params, state: State, inputs: Optional[Inputs] = None, dt: float = 1e-3) -> State:
        """One step of ``dt`` seconds. state: (B, N, 3); inputs: (B, A) / (B, N, 3) fields (or None)."""
        return step(self.constants, params, state, inputs, dt, self.integrator, self.options)

    def rollout(self, params: Params, state0: State, inputs: Optional[Inputs] = None, dt: float = 1e-3,
                steps: Optional[int] = None, compile: bool = False, chunk: int = 1,
                sub_batch: Optional[int] = None) -> State:
        """T steps; inputs (T, B, ...); returns states (T, B, N, 3) after each step.

        ``compile=True``: the batch-last throughput path (:mod:`.fast`) under torch.compile, ``chunk`` steps
        per compiled call (chunk > 1 cuts the per-call overhead at small batches but compiles a bigger graph;
        every distinct (chunk, batch, dtype) compiles once). Same results (float64: 1e-12), differentiable.
        ``sub_batch``: run a large batch in pieces of at most this size (faster when a piece's working set fits
        the cache; e.g. 128 for the 36-node manipulator on this CPU).
        """
        if not compile:
            return rollout(self.constants, params, state0, inputs, dt, self.integrator, self.options, steps)
        from . import fast
        ref = state0.positions
        c, params, inputs = (convert_like(x, ref) for x in (self.constants, params, inputs))
        n = _horizon(inputs, steps)
        u = ud = fe = None
        if inputs is not None:
            u, ud, fe = inputs.motor_angles, inputs.motor_velocities, inputs.external_forces
        X, V = fast.rollout(c, params, state0.positions, state0.velocities, u, ud, fe, n, dt, self.integrator,
                            self.options, chunk=chunk, sub_batch=sub_batch)
        return State(X, V)

    @property
    def compiled_step(self):
        """``torch.compile``d :meth:`step` (same signature; same results to round-off): one step of the
        compiled batch-last path (the graph of ``rollout(compile=True, chunk=1)``). Cache: build/torchinductor."""
        eng = self

        def compiled(params, state, inputs=None, dt=1e-3):
            inp = None if inputs is None else inputs.map(lambda t: t.unsqueeze(0))
            return eng.rollout(params, state, inp, dt, steps=None if inp is not None else 1, compile=True)[0]

        return compiled

    def project(self, params: Params, state: State, iters: int = 3) -> State:
        """State projected onto the bar lengths (positions, then velocities), mass-weighted."""
        c = convert_like(self.constants, state.positions)
        der = prepare(c, convert_like(params, state.positions))
        Q, V = reduce(c, state.positions), reduce(c, state.velocities)
        for _ in range(iters):
            Q, V = project(c, der, Q, V, chord_matrix_inverse(c, der, Q), 1)
        return State(expand(c, Q), expand_velocity(c, V))

    def bar_length_error(self, state: State) -> torch.Tensor:
        """(B,) (or (T, B) for rollouts) max relative bar-length error."""
        return bar_length_error(self.constants, state.positions)

    def energy(self, params: Params, state: State, motor_angles=None) -> torch.Tensor:
        """(B,) total energy, J (see :func:`energy`)."""
        return energy(self.constants, params, state, motor_angles)

    def string_state(self, params: Params, state: State, inputs: Optional[Inputs] = None) -> StringState:
        """Lengths, stretches and tensions (B, S) of every composite string."""
        u = None if inputs is None else inputs.motor_angles
        ud = None if inputs is None else inputs.motor_velocities
        return full_string_state(self.constants, params, state.positions, state.velocities, u, ud)

    def string_unit_forces(self, params: Params, state: State, inputs: Optional[Inputs] = None) -> StringUnitForces:
        u = None if inputs is None else inputs.motor_angles
        ud = None if inputs is None else inputs.motor_velocities
        return string_unit_forces(self.constants, state.positions, state.velocities, u, params, ud)

    def mass_matrix(self, params: Params, reduced: bool = True) -> torch.Tensor:
        """M_q (..., n_free, n_free) (reduced) or M_full (..., N, N), kg."""
        c = convert_like(self.constants, params.mass)
        if reduced:
            return reduced_mass_matrix(c, params.mass)
        return torch.einsum("...b,bnm->...nm", params.mass, c.E)
