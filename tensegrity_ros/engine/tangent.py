"""Tangent-linear model of the nodal engine's semi-implicit step: exact forward sensitivities of a rollout
in many directions at once, for Gauss-Newton identification.

A rollout's Jacobian with respect to P parameters and the 6 n_free start-state coordinates can be had by
rolling out one copy of the engine per direction (finite differences or dual numbers). Each copy then
repeats the whole step, including the bar-constraint matrix inverse, and the work is thousands of tiny
element-wise operations. Here the primal is stepped ONCE per window, and every direction is pushed through
the step's linearisation, built per window and step as a few dense (3 n_free)^2 matrices and applied to all
directions with batched matrix products:

    M_q Q'' = F(Q, V) + J(Q)^T lambda,   J(Q) Q'' = -|d'|^2            (nodal.py; J rows: d_b (x) C_b T)
    dQ'' = P M^-1 (dF + dJ^T lambda) - M^-1 J^T A^-1 (2 d'.dd' + dJ Q'')     P = I - M^-1 J^T A^-1 J
    dF   = -sum_c g_c (kappa_c g_c + zeta_c h_c)^T dq - zeta_c g_c g_c^T dv
           - sum_s (t_s/xi_s) (c_s c_s^T) (x) (I - e_s e_s^T) dq
    mass directions: dQ'' = P M^-1 (dF_gravity - dM_q Q'');   string directions: dF = -g_c dT_c
    T_c = (EA_c / xi0_c + kc_c) D_c + zeta_c D'_c,  D_c = L_c - xi0_c   (the string's law, nodal.prepare):
    dT_c = (D_c / xi0_c) dEA_c + D_c dkc_c + D'_c dzeta_c - (EA_c (D_c / xi0_c + 1) / xi0_c + kc_c) dxi0_c
           - zeta_c dxi0'_c      (cord strings: kc = 0; spring strings: EA = 0, so kappa ignores xi0)

(g_c = dL_c/dq the composite string's unit force pattern, h_c = dL'_c/dq, t_s, xi_s, e_s a segment's
tension, length and unit vector, c_s its row of C_s T). The step is then differentiated exactly as the engine
takes it: semi-implicit Euler, then the chord Gauss-Newton projection with the step's A^-1, including that
matrix's dependence on the step-start state and on the masses. Without those terms the tangents drifted 1e-6
per step; with them they equal jacfwd through the engine to round-off (test_engine_tangent.py). The step's
maps compose into one transition matrix Phi (2n x 2n) and a parameter forcing Psi per window.

Only the ``semi_implicit`` integrator without Baumgarte terms is covered (what identification uses);
:func:`supports` says whether an engine is.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from ._common import convert_like, differentiated
from .graphs import for_identification
from .blas import match_threads, matmul as mm
from .nodal import (Derived, NodalConstants, Options, chord_matrix_inverse, constrained_accelerations,
                    generalized_forces, project_positions_once, project_velocities)


class ParamTangents(NamedTuple):
    """Derivatives of the per-params quantities along P directions (the last axis):
    EA, zeta, xi00: (S, P); Y: (S, A, P); z: (A, P); mass: (n_bars, P); kc: (S, P) (the spring-law stiffness,
    see :func:`.nodal.prepare`)."""

    EA: torch.Tensor
    zeta: torch.Tensor
    xi00: torch.Tensor
    Y: torch.Tensor
    z: torch.Tensor
    mass: torch.Tensor
    kc: torch.Tensor


def supports(engine) -> bool:
    """Whether :func:`rollout_tangents` linearises this engine's step exactly."""
    opts = getattr(engine, "options", None)
    return (getattr(engine, "backend", None) == "nodal" and engine.integrator == "semi_implicit"
            and opts is not None and not any(opts.baumgarte))


def param_tangents(c: NodalConstants, fn, w: torch.Tensor) -> ParamTangents:
    """ParamTangents at ``w`` (n,) along its n coordinates. ``fn(W) -> Params`` maps a batch W (k, n) to params
    batched (k,). Copy b of the batch carries direction b, and each derived constant x (n, ...) gives its column
    b = dx[b] / dW[b, b] by reverse over reverse: g = J^T u for a dummy u, then d(sum_b g[b, b]) / du.

    Not forward mode (dual numbers), which gives the same columns to the bit: its first call in a process imports
    torch._dynamo and the forward-mode decompositions, 1.0-1.5 s on this project's 2-core machine, paid by every
    ``identify`` (in the parent, whose forked window workers then inherit it). This takes 4 ms on its first call
    and imports nothing (measured on the manipulator, 2026-12-04)."""
    from .nodal import prepare
    n = w.numel()
    with torch.enable_grad():
        W = w.detach().reshape(1, n).expand(n, n).clone().requires_grad_(True)
        p = fn(W)
        der = prepare(c, p)
        out = []
        for x in (der.EA, der.zeta, der.xi00, der.Y, der.z, p.mass, der.kc):
            t = None
            if x.requires_grad:
                u = torch.zeros_like(x, requires_grad=True)
                # (x u).sum() rather than grad_outputs=u: torch.autograd.grad imports torch.fx's symbolic shapes
                # (0.4 s) on its first call with grad_outputs, in every forked window worker
                g, = torch.autograd.grad((x * u).sum(), W, create_graph=True)
                if g.requires_grad:
                    t, = torch.autograd.grad(g.diagonal().sum(), u, allow_unused=True)
            out.append(torch.zeros_like(x) if t is None else t)
    return ParamTangents(*(x.detach().movedim(0, -1).contiguous() for x in out))


def _kron_cols(x: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """(B, 3, m) x (nf, m) or (B, nf, m) -> (B, 3 nf, m): column j is x[:, :, j] (x) M[:, j]
    (coordinate-major vec)."""
    B, _, m = x.shape
    M = M.unsqueeze(-3) if M.dim() == 3 else M
    return (x.unsqueeze(2) * M).reshape(B, 3 * M.shape[-2], m)


def _add_block_diag(K: torch.Tensor, M: torch.Tensor, nf: int) -> None:
    """K (B, 3 nf, 3 nf) (a view is fine) += I_3 (x) M, M (B, nf, nf) or (nf, nf), in place."""
    for k in range(3):
        K[:, k * nf:(k + 1) * nf, k * nf:(k + 1) * nf] += M


class _Linearised(NamedTuple):
    """One step's linearisation; tangent quantities in the tangent dtype, ``a`` and ``Ainv`` in the primal's."""

    Aq: torch.Tensor      # (B, n, n)  dQ''/dq
    Av: torch.Tensor      # (B, n, n)  dQ''/dv
    Ap: torch.Tensor      # (B, n, P)  dQ''/dtheta (None when P = 0)
    a: torch.Tensor       # (B, 3, nf) the primal acceleration
    Ainv: Optional[torch.Tensor]   # (B, nba, nba) the start's constraint matrix inverse (the projection's chord)
    d_t: Optional[torch.Tensor]    # (B, 3, nba) bar vectors at the step start
    Ainv_t: Optional[torch.Tensor]


class _MassTangents(NamedTuple):
    """Derivatives of the mass-derived constants along the P directions (once per rollout): Mq (P, nf, nf),
    the generalised weights Fg (3 nf, P), Pt (P, nba, nf), Gc (P, nba, nba)."""

    Mq: torch.Tensor
    Fg: torch.Tensor
    Pt: torch.Tensor
    Gc: torch.Tensor


def _mass_tangents(c: NodalConstants, der: Derived, dth: ParamTangents) -> _MassTangents:
    dMq = torch.einsum("bp,bij->pij", dth.mass, c.E_q)
    dFg = c.gravity.reshape(3, 1, 1) * (c.WqT.mT @ dth.mass).unsqueeze(0)        # (3, nf, P)
    dPt = c.Cb_q @ (-der.Minv @ dMq @ der.Minv)
    return _MassTangents(dMq, dFg.reshape(-1, dMq.shape[0]), dPt, dPt @ c.Cbt)


def _linearise(c: NodalConstants, der: Derived, dth: Optional[ParamTangents], mt: Optional[_MassTangents], Q, V,
               u, ud, du, dud, fq, opts: Options, ct: NodalConstants, dert: Derived) -> _Linearised:
    """The primal from (c, der) in the state's dtype; the matrices from (ct, dert, dth, mt) in theirs."""
    B, _, nf = Q.shape
    n = 3 * nf
    F, st = generalized_forces(c, der, Q, V, u, ud, fq, with_strings=True)
    ca = constrained_accelerations(c, der, Q, V, F, opts)
    tdt = ct.T.dtype
    # per segment: h_s = (I - e e^T) s' / xi (the rate of e . s' with the segment's direction)
    e, xi = st.e, st.xi
    hseg = ((V @ c.Cst - e * st.xidot.unsqueeze(-2)) / xi.unsqueeze(-2)).to(tdt)
    w = (st.tension @ c.Gt / xi).to(tdt)                                  # segment tension / length
    act = (st.tension > 0).to(tdt)                                        # (B, S)
    e = e.to(tdt)
    u, ud, du, dud = (None if x is None else x.to(tdt) for x in (u, ud, du, dud))
    c, der = ct, dert
    Ew = _kron_cols(e, c.Cst)                                             # (B, n, ns)
    Gm = Ew @ c.G                                                         # (B, n, S)  g_c
    Hm = _kron_cols(hseg, c.Cst) @ c.G                                    # (B, n, S)  h_c
    kap = act * st.kappa.to(tdt)
    zet = act * der.zeta
    # [Kq | Kv] = -[g k g^T + g z h^T - e w e^T | g z g^T] in one product
    left = torch.cat([Gm * kap.unsqueeze(-2), Gm * zet.unsqueeze(-2), Ew * w.unsqueeze(-2)], -1)
    Z = torch.zeros_like(Gm)
    right = torch.cat([torch.cat([-Gm, -Hm, Ew], -1), torch.cat([Z, -Gm, torch.zeros_like(Ew)], -1)], -2)
    K = mm(left, right.mT)                                                   # (B, n, 2n)
    geo = (c.Cst * w.unsqueeze(-2)) @ c.Cs_q                              # (B, nf, nf)
    Minv = der.Minv
    # parameter directions: dF (B, n, P) = -g_c dT_c (+ weights), then through the constrained solve
    Fp = None
    if dth is not None and dth.EA.shape[-1] > 0:
        xi0, D, Dd = st.xi0.to(tdt), st.D.to(tdt), st.Ddot.to(tdt)
        dxi0 = dth.xi00.unsqueeze(0)
        dxi0d = torch.zeros_like(dxi0)
        if u is not None and der.Y.shape[-1] > 0:
            S_, A_, P_ = dth.Y.shape
            dYf = dth.Y.transpose(0, 1).reshape(A_, S_ * P_)
            dxi0 = dxi0 + ((u - der.z) @ dYf).reshape(-1, S_, P_) - der.Y @ dth.z
            if ud is not None:
                dxi0d = (ud @ dYf).reshape(-1, S_, P_)
            if du is not None:
                dxi0 = dxi0 + der.Y @ du
            if dud is not None:
                dxi0d = dxi0d + der.Y @ dud
        EA = der.EA
        # dT of T = (EA / xi0 + kc) D + zeta D' (module docstring); the kc terms are exact zeros for cord strings
        dT = act.unsqueeze(-1) * ((D / xi0).unsqueeze(-1) * dth.EA + Dd.unsqueeze(-1) * dth.zeta
                                  - (EA * (D / xi0 + 1.0) / xi0 + der.kc).unsqueeze(-1) * dxi0
                                  - der.zeta.unsqueeze(-1) * dxi0d + D.unsqueeze(-1) * dth.kc)   # (B, S, P)
        P_ = dT.shape[-1]
        Ma = mm(ca.a.to(tdt).reshape(B * 3, nf), mt.Mq.permute(2, 1, 0).reshape(nf, nf * P_))   # dM_q Q''
        Fp = mt.Fg - mm(Gm, dT) - Ma.reshape(B, n, P_)
    if ca.Ainv is None:
        _add_block_diag(K[..., :n], -geo, nf)
        MinvB = _block_diag3(Minv.expand(B, nf, nf), nf)
        MK = mm(MinvB, K if Fp is None else torch.cat([K, Fp], -1))
        return _Linearised(MK[..., :n], MK[..., n:2 * n], MK[..., 2 * n:] if Fp is not None else None, ca.a,
                           None, None, None)
    d, dd, Ainv, lam = (x.to(tdt) for x in (ca.d, ca.dd, ca.Ainv, ca.lam))
    MJ = _kron_cols(d, der.Pt.mT)                                         # (B, n, nba) = M^-1 J^T
    MJA = mm(MJ, Ainv)
    Pi = -mm(MJA, MJ.mT)                                                   # P M^-1 = M^-1 - M^-1 J^T A^-1 J M^-1
    _add_block_diag(Pi, Minv, nf)
    _add_block_diag(K[..., :n], (c.Cbt * lam.unsqueeze(-2)) @ c.Cb_q - geo, nf)   # + dJ^T lambda, - geometric
    # rows of dJ Q'' and of 2 d' . dd'
    R = torch.cat([_kron_cols(ca.a.to(tdt) @ c.Cbt, c.Cbt), _kron_cols(2.0 * dd, c.Cbt)], -2)
    PK = mm(Pi, K if Fp is None else torch.cat([K, Fp], -1))
    PK[..., :2 * n] -= mm(MJA, R.mT)
    return _Linearised(PK[..., :n], PK[..., n:2 * n], PK[..., 2 * n:] if Fp is not None else None, ca.a, ca.Ainv,
                       d, Ainv)


def _block_diag3(M: torch.Tensor, nf: int) -> torch.Tensor:
    """I_3 (x) M: (B, 3 nf, 3 nf) from M (B, nf, nf)."""
    out = M.new_zeros(M.shape[0], 3 * nf, 3 * nf)
    _add_block_diag(out, M, nf)
    return out


def _chord_maps(x: torch.Tensor, d: torch.Tensor, d0: torch.Tensor, c: NodalConstants, der: Derived,
                mt: Optional[_MassTangents], Ainv: torch.Tensor, Vb: Optional[torch.Tensor] = None):
    """Row-form tangent maps of one chord correction Y' = Y - M^-1 J(Q)^T x, x = A0^-1 viol, with J at the bar
    vectors d and A0 = G_c o (d0^T d0) formed at the step start (Q0):

        dY' = dY T + dQ W + dQ0 U (+ E for the P mass directions)
        positions: Y = Q, viol = g(Q) (dviol = J dQ; then dQ' = dQ (T + W) + ...);
        velocities: Y = V, viol = J(Q) V (Vb = V C_b^T: dviol = J dV + dJ V, the dQ part going into W)
        (dA0 x)_b = dd0_b . sum_g Gc_bg x_g d0_g + d0_b . sum_g Gc_bg x_g dd0_g (+ dGc along mass directions)

    T = I - J^T AM (AM = A0^-1 (M^-1 J^T)^T), W = -(I_3 (x) C_b^T diag(x) Pt) [- dJ(V)^T AM],
    U = K AM with dA0 x = dQ0 K; E (B, P, n) or None."""
    B, _, nba = d.shape
    nf = c.Cbt.shape[0]
    n = 3 * nf
    AM = mm(Ainv, _kron_cols(d, der.Pt.mT).mT)
    T = -mm(_kron_cols(d, c.Cbt), AM)
    T.diagonal(dim1=-2, dim2=-1).add_(1.0)
    W = -_block_diag3((c.Cbt * x.unsqueeze(-2)) @ der.Pt, nf)
    if Vb is not None:
        W -= mm(_kron_cols(Vb, c.Cbt), AM)
    K = (_kron_cols((d0 * x.unsqueeze(-2)) @ der.Gc, c.Cbt)
         + _kron_cols(d0, (c.Cbt * x.unsqueeze(-2)) @ der.Gc))
    E = None
    if mt is not None:
        P = mt.Gc.shape[0]
        Y = (d0.mT @ d0) * x.unsqueeze(-2)                                # (B, nba, nba)
        mGc = (Y.transpose(0, 1) @ mt.Gc.permute(1, 2, 0)).permute(1, 2, 0)      # sum_g dGc_pbg Y_bg
        dP = (mm((d * x.unsqueeze(-2)).reshape(B * 3, nba), mt.Pt.transpose(0, 1).reshape(nba, P * nf)))
        E = mm(mGc, AM) - dP.reshape(B, 3, P, nf).transpose(1, 2).reshape(B, P, n)
    return T, W, mm(K, AM), E


def _step(c: NodalConstants, der: Derived, dth: Optional[ParamTangents], mt: Optional[_MassTangents], Q, V,
          u, ud, du, dud, fq, h: float, opts: Options, ct: NodalConstants, dert: Derived):
    """One engine step and its tangent map in row form: [dQ1 dV1] = [dQ dV] Phi (+ Psi for the P parameter
    directions). Returns Q1, V1 (primal dtype), Phi (B, 2n, 2n), Psi (B, P, 2n) or None (ct's dtype)."""
    lin = _linearise(c, der, dth, mt, Q, V, u, ud, du, dud, fq, opts, ct, dert)
    B, _, nf = Q.shape
    n = 3 * nf
    tdt = ct.T.dtype
    # semi-implicit Euler: V1 = V + h a(Q, V), Q1 = Q + h V1. Phi's column blocks: [coefficients of Q1 | of V1]
    Yv = h * lin.Av.mT
    Yv.diagonal(dim1=-2, dim2=-1).add_(1.0)
    Phi = torch.empty(B, 2 * n, 2 * n, dtype=tdt, device=Q.device)
    Phi[:, :n, n:] = h * lin.Aq.mT
    Phi[:, n:, n:] = Yv
    Phi[:, :, :n] = h * Phi[:, :, n:]
    Phi[:, :n, :n].diagonal(dim1=-2, dim2=-1).add_(1.0)
    Psi = None
    if lin.Ap is not None:
        Pv = h * lin.Ap.mT
        Psi = torch.cat([h * Pv, Pv], -1)
    V = V + h * lin.a
    Q = Q + h * V
    if lin.Ainv is not None and opts.projection_iters > 0:
        Ainv, d0, Ainv_t = lin.Ainv, lin.d_t, lin.Ainv_t
        for _ in range(opts.projection_iters):
            Q, d, y = project_positions_once(c, der, Q, Ainv, with_multiplier=True)
            T, W, U, E = _chord_maps(y.to(tdt), d.to(tdt), d0, ct, dert, mt, Ainv_t)
            T = T + W                                                     # Y = Q
            Phi[:, :, :n] = mm(Phi[:, :, :n], T)
            Phi[:, :n, :n] += U
            if Psi is not None:
                Psi[..., :n] = mm(Psi[..., :n], T) + E
        Vb = (V @ c.Cbt).to(tdt)
        V, d, nu = project_velocities(c, der, Q, V, Ainv, with_multiplier=True)
        T, W, U, E = _chord_maps(nu.to(tdt), d.to(tdt), d0, ct, dert, mt, Ainv_t, Vb)
        WT = torch.cat([W, T], -2)                                        # rows: from Q's, from V's tangent
        Phi[:, :, n:] = mm(Phi, WT)
        Phi[:, :n, n:] += U
        if Psi is not None:
            Psi[..., n:] = mm(Psi, WT) + E
    return Q, V, Phi, Psi


def step_jacobians(c: NodalConstants, der: Derived, Q, V, u, ud, h: float, opts: Options):
    """The exact Jacobians of ONE engine step (``nodal.step_reduced``, semi-implicit) at B points, in column form:
    [Q1; V1] = A [Q; V] + B u to first order, states vec'd coordinate-major as the engine holds them ((3, nf) ->
    3 nf: x, y, z rows of every free node). Q, V (B, 3, nf); u, ud (B, A) or None (held over the step, as the
    engine holds them). Returns A (B, 2n, 2n) and B (B, 2n, A) (None without actuators).

    What the predictor and the controller linearise about their nominals: one pass of :func:`_step` with the
    motor angles as its parameter directions (dxi0 = Y du), the same algebra the identification's tangents use,
    instead of forward-mode AD through the step (114 dual copies of the manipulator's step: ~7x the time)."""
    dth = mt = du = None
    A_ = 0 if u is None else u.shape[-1]
    if A_:
        S_, nb = der.EA.shape[-1], c.E_q.shape[0]
        z = lambda *shape: Q.new_zeros(*shape)      # noqa: E731  the parameters themselves do not move
        dth = ParamTangents(EA=z(S_, A_), zeta=z(S_, A_), xi00=z(S_, A_), Y=z(S_, A_, A_), z=z(A_, A_),
                            mass=z(nb, A_), kc=z(S_, A_))
        mt = _mass_tangents(c, der, dth)
        du = torch.eye(A_, dtype=Q.dtype, device=Q.device).expand(Q.shape[0], A_, A_)
    _, _, Phi, Psi = _step(c, der, dth, mt, Q, V, u, ud, du, None, None, float(h), opts, c, der)
    return Phi.mT, (None if Psi is None else Psi.mT)


def project_with_tangents(c: NodalConstants, der: Derived, dth: Optional[ParamTangents], Q, V, SQ, SV,
                          iters: int):
    """:meth:`NodalEngine.project` (``iters`` times: A formed at the positions, one position step, then the
    velocities) with its exact tangent. Q, V (B, 3, nf); SQ, SV (B, C, 3, nf), the first P directions those
    of ``dth``. Returns Q, V, SQ, SV."""
    B, C, _, nf = SQ.shape
    n = 3 * nf
    P = 0 if dth is None else dth.EA.shape[-1]
    mt = _mass_tangents(c, der, dth) if P else None
    Sq, Sv = SQ.reshape(B, C, n), SV.reshape(B, C, n)
    for _ in range(iters if c.Cb_q.shape[0] else 0):
        Ainv = chord_matrix_inverse(c, der, Q)
        Q1, d0, y = project_positions_once(c, der, Q, Ainv, with_multiplier=True)
        T, W, U, E = _chord_maps(y, d0, d0, c, der, mt, Ainv)
        Sq_new = mm(Sq, T + W + U)                                         # A formed here: dA0 uses Sq itself
        if E is not None:
            Sq_new[:, :P] += E
        Vb = V @ c.Cbt
        V, d, nu = project_velocities(c, der, Q1, V, Ainv, with_multiplier=True)
        T, W, U, E = _chord_maps(nu, d, d0, c, der, mt, Ainv, Vb)
        Sv = mm(Sv, T) + mm(Sq_new, W) + mm(Sq, U)
        if E is not None:
            Sv[:, :P] += E
        Q, Sq = Q1, Sq_new
    return Q, V, Sq.reshape(B, C, 3, nf), Sv.reshape(B, C, 3, nf)


#: rows (windows x steps) linearised in one batched pass of :func:`_step` by :func:`rollout_tangents`. Why: once
#: the primal states are known, the steps' linearisations are independent of each other, so they are built for
#: many steps at once; one pass's ~900 tensor operations then serve this many rows instead of B (a few windows).
#: Measured on this project's 2-core CPU, one thread (2026-12-01, docs/identification.md, "The tangent step's
#: speed"): a Jacobian of 4 one-second windows 4.55 s instead of 7.48 s (median of 3); 64 rows and more ran no
#: faster than 16 (the batched products are compute-bound at these sizes and leave the caches).
LINEARISE_ROWS = 16
#: the same on a CUDA device, where each of a pass's operations is a kernel launch whatever its size, so the
#: fewer passes the better while the rows fit the device (4096 rows of the manipulator's step: ~2 GB in float64).
#: Not measured yet: no GPU has been lent since the change; ``bench/bench_gpu.py``'s tangent part compares 1, 16
#: and 4096 rows on the next.
LINEARISE_ROWS_CUDA = 4096


def sample_brackets(sample_steps: torch.Tensor, n_steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where samples at fractional step indices ``sample_steps`` (in [0, n_steps]) read a rollout: the state after
    step k0 (long, in [0, n_steps - 1]) and after k0 + 1, mixed with weight w on the second, ``(1 - w) x[k0] +
    w x[k0 + 1]`` (the convention of ``RefineProblem.simulate`` and both tangent rollouts). Returns (k0, w)."""
    k0 = torch.clamp(torch.floor(sample_steps + 1e-9), 0, max(n_steps - 1, 0)).long()
    return k0, (sample_steps - k0.to(sample_steps.dtype)).clamp(0.0, 1.0)


def linearise_rows(device: torch.device) -> int:
    """:func:`rollout_tangents`' default ``rows`` on ``device``."""
    return LINEARISE_ROWS_CUDA if torch.device(device).type == "cuda" else LINEARISE_ROWS


def rollout_tangents(c: NodalConstants, der: Derived, dth: Optional[ParamTangents], Q0, V0, SQ0, SV0,
                     u, ud, du, fq, dt: float, n_steps: int, opts: Options, sample_steps: torch.Tensor,
                     dtype: Optional[torch.dtype] = None, dud=None, rows: Optional[int] = None,
                     primal: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
    """``n_steps`` semi-implicit steps of B windows with C tangent directions, sampled at fractional steps.

    Q0, V0: (B, 3, nf) reduced start state; SQ0, SV0: (B, C, 3, nf) its tangents; the first P directions
    are the parameter directions of ``dth`` (P = 0 when None). u, ud: (n_steps, B, A) motor angles and
    rates or None; du, dud: (n_steps, B, A, P) motor-angle and motor-rate tangents or None (a rate that depends
    on a parameter: the motor-to-mocap delay shifts a curved input); fq: (n_steps, B, 3, nf) reduced
    external forces or None. sample_steps: (B, H) fractional step index of each sample in [0, n_steps]
    (linear interpolation between the states after steps k and k + 1, as ``RefineProblem.simulate``).
    dtype: of the tangents (default: the state's). float32 halves the cost of the matrix products; the
    primal stays in the state's dtype, so the positions are the engine's to round-off either way.
    rows: how many (step, window) rows are linearised together (None: :func:`linearise_rows` of the device).
    primal: the states (Qs, Vs) (n_steps + 1, B, 3, nf) of this very rollout, start first, when the caller has
    them (the residual rollout at the same point: ``RefineProblem`` keeps its last few); the primal is then not
    stepped again. The engine's step is deterministic, so the tangents are the same.
    Returns positions Q (B, H, 3, nf) and tangents (B, H, C, 3, nf) at the samples.

    In chunks of ``rows // B`` steps: the engine's own step takes the primal through the chunk (step by step,
    as a rollout must), then ONE pass of :func:`_step` linearises all of the chunk's steps from their start
    states, batched over (step, window), and the directions are pushed through the chunk's transition
    matrices, one batched product per step. Each step's linearisation depends only on its start state and
    inputs, so this is the same map as linearising step by step, to round-off.
    """
    from .nodal import step_reduced
    match_threads()
    tdt = dtype or Q0.dtype
    ref = torch.empty(0, dtype=tdt, device=Q0.device)
    ct, dert = convert_like(c, ref), convert_like(der, ref)
    if dth is not None:
        dth = ParamTangents(*(x.to(tdt) for x in dth))
    B, _, nf = Q0.shape
    C = SQ0.shape[1]
    n = 3 * nf
    P = 0 if dth is None else dth.EA.shape[-1]
    k0, wgt = sample_brackets(sample_steps, n_steps)
    H = sample_steps.shape[1]
    outQ = Q0.new_zeros(B, H, 3, nf)
    outS = Q0.new_zeros(B, H, C, n, dtype=tdt)
    bidx = torch.arange(B, device=Q0.device).unsqueeze(1).expand(B, H)
    hidx = torch.arange(H, device=Q0.device).unsqueeze(0).expand(B, H)
    reads = {}                    # step k -> the (window, sample, weight) triples that read the state after it
    for kk, ww in ((k0, 1.0 - wgt), (k0 + 1, wgt)):
        for k in torch.unique(kk).tolist():
            m = kk == k
            reads.setdefault(k, []).append((bidx[m], hidx[m], ww[m].reshape(-1, 1, 1)))

    def record_Q(k, Q):
        for bi, hi, ww in reads.get(k, ()):
            outQ.index_put_((bi, hi), ww * Q[bi], accumulate=True)

    def record_S(k, S):
        for bi, hi, ww in reads.get(k, ()):
            outS.index_put_((bi, hi), ww.to(tdt) * S[bi], accumulate=True)

    def rows_of(x, a, b):                 # (n_steps, B, ...) -> the steps a..b-1 as (T B, ...) rows, or None
        return None if x is None else x[a:b].reshape((b - a) * B, *x.shape[2:])

    mt = _mass_tangents(ct, dert, dth) if P else None
    if primal is not None and tuple(primal[0].shape) != (n_steps + 1, *Q0.shape):
        raise ValueError(f"rollout_tangents: primal states {tuple(primal[0].shape)}, expected "
                         f"{(n_steps + 1, *Q0.shape)} (n_steps + 1 states of the B windows)")
    if primal is None and for_identification(Q0.device, differentiated(Q0, V0, u, ud, fq)):
        # on CUDA the eager primal's launches cost more than the tangents' products (.graphs)
        from .nodal import steps_captured
        Qs, Vs = steps_captured(c, der, Q0, V0, u, ud, fq, float(dt), "semi_implicit", opts, n_steps)
        primal = torch.cat((Q0.unsqueeze(0), Qs)), torch.cat((V0.unsqueeze(0), Vs))
    Q, V = (Q0, V0) if primal is None else (primal[0][0], primal[1][0])
    S = torch.cat([SQ0.reshape(B, C, n), SV0.reshape(B, C, n)], -1).to(tdt)   # (B, C, 2n)
    record_Q(0, Q)
    record_S(0, S[..., :n])
    chunk = max(1, int(linearise_rows(Q0.device) if rows is None else rows) // max(B, 1))
    for a in range(0, n_steps, chunk):
        b = min(a + chunk, n_steps)
        starts_Q, starts_V = [], []
        for k in range(a, b):                      # the primal, step by step (or the caller's states of it)
            starts_Q.append(Q)
            starts_V.append(V)
            if primal is None:
                Q, V = step_reduced(c, der, Q, V, None if u is None else u[k], None if ud is None else ud[k],
                                    None if fq is None else fq[k], float(dt), "semi_implicit", opts)
            else:
                Q, V = primal[0][k + 1], primal[1][k + 1]
            record_Q(k + 1, Q)
        # every step of the chunk linearised at once, rows ordered (step, window)
        _, _, Phi, Psi = _step(c, der, dth, mt, torch.cat(starts_Q), torch.cat(starts_V), rows_of(u, a, b),
                               rows_of(ud, a, b), rows_of(du, a, b), rows_of(dud, a, b), rows_of(fq, a, b),
                               float(dt), opts, ct, dert)
        Phi = Phi.reshape(b - a, B, 2 * n, 2 * n)
        Psi = None if Psi is None else Psi.reshape(b - a, B, P, 2 * n)
        for j in range(b - a):
            S = mm(S, Phi[j])
            if Psi is not None:
                S[:, :P] += Psi[j]
            record_S(a + j + 1, S[..., :n])
    return outQ, outS.reshape(B, H, C, 3, nf)
