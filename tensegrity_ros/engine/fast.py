"""Throughput path of the nodal engine: the same equations as :mod:`.nodal`, in a batch-LAST layout.

Every quantity carries the batch as its last axis (Q: (3, n_free, B), bar matrices (nba, nba, B)) and every
product with a constant matrix is written as a gather or an elementwise product and sum. Under
``torch.compile`` (inductor, CPU) that becomes a handful of loops vectorised over the batch, instead of
many tiny matrix multiplies (the reference layout of :mod:`.nodal` vectorises over 3..12-long axes).
The bar-constraint matrix is inverted by unrolled Gauss-Jordan elimination (SPD, no pivoting).

Used by ``NodalEngine.rollout(..., compile=True)`` and ``NodalEngine.compiled_step``; tested equal to the
reference implementation (float64: 1e-12).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import integrators
from ._common import register_tensor_dataclass
from .nodal import NodalConstants, Options
from .params import Params


@register_tensor_dataclass
@dataclass(frozen=True)
class FastDerived:
    """Per-params quantities, batch last (Bp = 1 for unbatched params).

    EA, zeta, xi00, kc: (S, Bp) (kappa = EA / xi0 + kc, see :func:`.nodal.prepare`); Y: (S, A, Bp); z: (A, Bp);
    Minv: (n_free, n_free, Bp); Pt: (nba, n_free, Bp); Gc: (nba, nba, Bp); FgT: (3, n_free, Bp);
    Hs: (n_seg, n_seg, Bp) = C_s T M_q^-1 T^T C_s^T;
    Hbs: (nba, n_seg, Bp) = C_b T M_q^-1 T^T C_s^T (the implicit integrator's constant couplings).
    """

    EA: torch.Tensor
    zeta: torch.Tensor
    xi00: torch.Tensor
    Y: torch.Tensor
    z: torch.Tensor
    kc: torch.Tensor
    Minv: torch.Tensor
    Pt: torch.Tensor
    Gc: torch.Tensor
    FgT: torch.Tensor
    Hs: torch.Tensor
    Hbs: torch.Tensor


def _last(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(Bp, *shape) or (*shape) -> (*shape, Bp) with Bp = 1 when unbatched."""
    if t.dim() == ndim:
        return t.unsqueeze(-1)
    return t.movedim(0, -1)


def prepare_fast(c: NodalConstants, p: Params) -> FastDerived:
    from .nodal import prepare
    d = prepare(c, p)
    MCs = d.Minv @ c.Cs_q.T                                                   # (Bp, nf, ns)
    return FastDerived(EA=_last(d.EA, 1), zeta=_last(d.zeta, 1), xi00=_last(d.xi00, 1), Y=_last(d.Y, 2),
                       z=_last(d.z, 1), kc=_last(d.kc, 1), Minv=_last(d.Minv, 2), Pt=_last(d.Pt, 2),
                       Gc=_last(d.Gc, 2), FgT=_last(d.FgT, 2), Hs=_last(c.Cs_q @ MCs, 2), Hbs=_last(c.Cb_q @ MCs, 2))


def _gather(X: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """X (..., k_in, B) @ M in gather form -> (..., k_out, B)."""
    return (X[..., idx, :] * w.unsqueeze(-1)).sum(-2)


def _dense(X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """X (..., k_in, B) times M (k_in, k_out, Bp) -> (..., k_out, B)."""
    return (X.unsqueeze(-2) * M).sum(-3)


def _inverse(A: torch.Tensor) -> torch.Tensor:
    """Gauss-Jordan inverse of SPD matrices A (n, n, B) (no pivoting)."""
    n = A.shape[0]
    eye = torch.eye(n, dtype=A.dtype, device=A.device)
    M = torch.cat([A, eye.unsqueeze(-1).expand(n, n, A.shape[-1])], dim=1)     # (n, 2n, B)
    for k in range(n):
        piv = M[k:k + 1] / M[k:k + 1, k:k + 1]                                   # (1, 2n, B)
        col = M[:, k:k + 1] - eye[:, k:k + 1].unsqueeze(-1)                      # (n, 1, B)
        M = M - col * piv
    return M[:, n:]


def forces(c: NodalConstants, der: FastDerived, Q, V, u, udot, fext, with_strings: bool = False):
    """Generalised forces (3, n_free, B), N (string law of CONTRACTS.md, as :func:`.nodal.string_law`);
    ``with_strings``: also the segment unit vectors e (3, n_seg, B) and the tensions (S, B)."""
    s = _gather(Q, c.Cst_i, c.Cst_w) + c.scT.unsqueeze(-1)                    # (3, ns, B)
    sd = _gather(V, c.Cst_i, c.Cst_w)
    xi = torch.sqrt((s * s).sum(0))                                           # (ns, B)
    e = s / xi
    xid = (e * sd).sum(0)
    L = _gather(xi, c.G_i, c.G_w)                                             # (S, B)
    Ld = _gather(xid, c.G_i, c.G_w)
    xi0 = der.xi00
    D = L - xi0
    Dd = Ld
    if u is not None and der.Y.shape[1] > 0:
        xi0 = xi0 + (der.Y * (u - der.z).unsqueeze(0)).sum(1)
        D = L - xi0
        if udot is not None:
            Dd = Ld - (der.Y * udot.unsqueeze(0)).sum(1)
    kappa = der.EA / xi0 + der.kc                                             # the string's law (nodal.prepare)
    tension = torch.where(D > 0, torch.relu(kappa * D + der.zeta * Dd), torch.zeros_like(D))
    seg_t = _gather(tension, c.Gt_i, c.Gt_w)                                  # (ns, B)
    F = der.FgT - _gather(seg_t * e, c.Cs_q_i, c.Cs_q_w)
    if fext is not None:
        F = F + fext
    return (F, e, tension) if with_strings else F


def accelerations(c: NodalConstants, der: FastDerived, Q, V, u, udot, fext, opts: Options):
    F = forces(c, der, Q, V, u, udot, fext)
    a0 = _dense(F, der.Minv)
    if c.Cb_q.shape[0] == 0:
        return a0, None
    dcT = c.dcT.unsqueeze(-1)
    d = _gather(Q, c.Cbt_i, c.Cbt_w) + dcT                                   # (3, nb, B)
    dd = _gather(V, c.Cbt_i, c.Cbt_w)
    rhs = -(dd * dd).sum(0) - (d * _gather(a0, c.Cbt_i, c.Cbt_w)).sum(0)    # (nb, B)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        g = 0.5 * ((d * d).sum(0) - c.l2.unsqueeze(-1))
        rhs = rhs - 2.0 * alpha * (d * dd).sum(0) - beta * beta * g
    A = der.Gc * (d.unsqueeze(2) * d.unsqueeze(1)).sum(0)                     # (nb, nb, B)
    Ainv = _inverse(A)
    lam = (Ainv * rhs.unsqueeze(0)).sum(1)                                    # (nb, B)
    return a0 + _dense(lam * d, der.Pt), Ainv


def project(c: NodalConstants, der: FastDerived, Q, V, Asolve, iters: int):
    """As :func:`.nodal.project`; ``Asolve(r)`` applies the chord A^-1 to (nba, B) vectors (None: no bars)."""
    if iters <= 0 or Asolve is None:
        return Q, V
    dcT, l2 = c.dcT.unsqueeze(-1), c.l2.unsqueeze(-1)
    for _ in range(iters):
        d = _gather(Q, c.Cbt_i, c.Cbt_w) + dcT
        g = 0.5 * ((d * d).sum(0) - l2)
        Q = Q - _dense(Asolve(g) * d, der.Pt)
    d = _gather(Q, c.Cbt_i, c.Cbt_w) + dcT
    r = (d * _gather(V, c.Cbt_i, c.Cbt_w)).sum(0)
    V = V - _dense(Asolve(r) * d, der.Pt)
    return Q, V


def _cholesky(K: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor L (n, n, B) of SPD matrices K (n, n, B): left-looking, one fused column update
    per (j, k) pair, no growing concatenations (they defeat inductor's fusion)."""
    n = K.shape[0]
    rows = torch.arange(n, device=K.device).unsqueeze(-1)
    cols = []
    for j in range(n):
        v = K[:, j]                                                           # (n, B)
        for k in range(j):
            v = v - cols[k] * cols[k][j:j + 1]
        col = v / torch.sqrt(v[j:j + 1])
        cols.append(torch.where(rows >= j, col, torch.zeros_like(col)))
    return torch.stack(cols, 1)


def _chol_solve(L: torch.Tensor, r: torch.Tensor, n: Optional[int] = None) -> torch.Tensor:
    """Solve (L L^T) x = r with the leading n x n block of the Cholesky factor L (N, N, B); r: (n, B)."""
    n = L.shape[0] if n is None else n
    if n == 0:
        return r
    L = L[:n, :n]
    y = []
    for i in range(n):                                                         # L y = r
        acc = r[i]
        for k in range(i):
            acc = acc - L[i, k] * y[k]
        y.append(acc / L[i, i])
    x = [None] * n
    for i in reversed(range(n)):                                               # L^T x = y
        acc = y[i]
        for k in range(i + 1, n):
            acc = acc - L[k, i] * x[k]
        x[i] = acc / L[i, i]
    return torch.stack(x, 0)


def _matvec(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """M (n, m, B) x (m, B) -> (n, B)."""
    return (M * x.unsqueeze(0)).sum(1)


def implicit_step(c: NodalConstants, der: FastDerived, Q, V, u, udot, fext, h: float, opts: Options):
    """:func:`.nodal.implicit_step` in batch-last form. The couplings g_c^T M^-1 g_d and J_b M^-1 g_c come
    from the constant H_s, H_bs and the segment directions (g_c = sum over its segments of e_s (x) C_s T)."""
    F, e, tension = forces(c, der, Q, V, u, udot, fext, with_strings=True)
    dV0 = h * _dense(F, der.Minv)
    sw = torch.sqrt(h * der.zeta * (tension > 0).to(Q.dtype))                 # (S, B)
    ee = (e.unsqueeze(2) * e.unsqueeze(1)).sum(0)                              # (ns, ns, B)
    S_ = _gather(_gather(der.Hs * ee, c.G_i, c.G_w).transpose(0, 1), c.G_i, c.G_w)   # (S, S, B)
    nc = S_.shape[0]
    C = torch.eye(nc, dtype=Q.dtype, device=Q.device).unsqueeze(-1) + sw.unsqueeze(1) * S_ * sw.unsqueeze(0)
    dvs = _gather(dV0, c.Cst_i, c.Cst_w)                                      # (3, ns, B)
    r2 = -sw * _gather((e * dvs).sum(0), c.G_i, c.G_w)
    Vs = V + dV0
    if c.Cb_q.shape[0] == 0:
        nu = _chol_solve(_cholesky(C), r2)
        seg = _gather(sw * nu, c.Gt_i, c.Gt_w)
        V1 = Vs + _dense(_gather(seg * e, c.Cs_q_i, c.Cs_q_w), der.Minv)
        return Q + h * V1, V1, None
    dcT = c.dcT.unsqueeze(-1)
    d = _gather(Q, c.Cbt_i, c.Cbt_w) + dcT                                   # (3, nb, B)
    dd = _gather(V, c.Cbt_i, c.Cbt_w)
    A = der.Gc * (d.unsqueeze(2) * d.unsqueeze(1)).sum(0)                     # (nb, nb, B)
    target = (d * dd).sum(0) - h * (dd * dd).sum(0)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        g0 = 0.5 * ((d * d).sum(0) - c.l2.unsqueeze(-1))
        target = target - h * (2.0 * alpha * (d * dd).sum(0) + beta * beta * g0)
    r1 = target - (d * _gather(Vs, c.Cbt_i, c.Cbt_w)).sum(0)
    de = (d.unsqueeze(2) * e.unsqueeze(1)).sum(0)                              # (nb, ns, B)
    Pw = _gather(der.Hbs * de, c.G_i, c.G_w) * sw.unsqueeze(0)                # (nb, S, B)
    K = torch.cat((torch.cat((A, Pw), 1), torch.cat((Pw.transpose(0, 1), C), 1)), 0)
    L = _cholesky(K)
    sol = _chol_solve(L, torch.cat((r1, r2), 0))
    nb = A.shape[0]
    mu, nu = sol[:nb], sol[nb:]
    seg = _gather(sw * nu, c.Gt_i, c.Gt_w)                                    # (ns, B)
    V1 = Vs + _dense(mu * d, der.Pt) + _dense(_gather(seg * e, c.Cs_q_i, c.Cs_q_w), der.Minv)
    return Q + h * V1, V1, (lambda r: _chol_solve(L, r, nb))


def step(c: NodalConstants, der: FastDerived, Q, V, u, udot, fext, dt: float, integrator: str, opts: Options):
    """One step, batch last: Q, V (3, n_free, B); u, udot (A, B); fext (3, n_free, B) or None."""
    if integrator == "implicit":
        Q1, V1, Ainv = implicit_step(c, der, Q, V, u, udot, fext, dt, opts)
    else:
        integrate = integrators.get(integrator)
        Q1, V1, Ainv = integrate(Q, V, lambda q, v: accelerations(c, der, q, v, u, udot, fext, opts), dt)
        Ainv = None if Ainv is None else (lambda r, M=Ainv: _matvec(M, r))
    return project(c, der, Q1, V1, Ainv, opts.projection_iters)


def steps(c: NodalConstants, der: FastDerived, Q, V, u, udot, fext, dt: float, integrator: str, opts: Options,
          K: int):
    """K steps (the graph torch.compile sees, one per chunk length K). u, udot: (K, A, B) or None; fext:
    (K, 3, n_free, B) or None. Returns Qs, Vs (K, 3, n_free, B)."""
    Qs, Vs = [], []
    for k in range(K):
        Q, V = step(c, der, Q, V, None if u is None else u[k], None if udot is None else udot[k],
                    None if fext is None else fext[k], dt, integrator, opts)
        Qs.append(Q)
        Vs.append(V)
    return torch.stack(Qs), torch.stack(Vs)


_COMPILED = {}


def compiled(name: str):
    """The torch.compile'd version of :func:`steps` (memoised; dynamo guards on shapes, dtype and K)."""
    fn = _COMPILED.get(name)
    if fn is None:
        from ._common import setup_compile
        setup_compile()
        fn = torch.compile({"steps": steps}[name], dynamic=False)
        _COMPILED[name] = fn
    return fn


def rollout(c: NodalConstants, params: Params, X0: torch.Tensor, V0: torch.Tensor, u, udot, fext, n: int,
            dt: float, integrator: str, opts: Options, chunk: int = 1, compile: bool = True,
            sub_batch: Optional[int] = None):
    """n steps from full node positions/velocities (B, N, 3); inputs time-major (T, B, ...) or None.
    Returns positions, velocities (n, B, N, 3). Runs ``chunk`` steps per compiled call; ``sub_batch`` splits a
    large batch into pieces of at most that size run one after the other (keeps the working set in cache)."""
    B = max(X0.shape[0], params.mass.shape[0] if params.mass.dim() == 2 else 1)
    X0, V0 = X0.expand(B, *X0.shape[1:]), V0.expand(B, *V0.shape[1:])
    if sub_batch is not None and B > sub_batch:
        def part(x, sl, dim):
            return x if x is None or x.dim() <= dim or x.shape[dim] != B else x[(slice(None),) * dim + (sl,)]
        outs = []
        for b0 in range(0, B, sub_batch):
            sl = slice(b0, min(B, b0 + sub_batch))
            p = params.map(lambda t: t[sl] if t.dim() >= 1 and params.mass.dim() == 2 and t.shape[0] == B else t)
            outs.append(rollout(c, p, X0[sl], V0[sl], part(u, sl, 1), part(udot, sl, 1), part(fext, sl, 1), n, dt,
                                integrator, opts, chunk, compile))
        return torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
    der = prepare_fast(c, params)
    Q, V = to_fast(c, X0), to_fast(c, V0)
    u, udot, fq = inputs_to_fast(c, u, udot, fext, B)
    K = max(1, min(chunk, n))
    pad = (-n) % K

    def padded(x):
        if x is None or pad == 0:
            return x
        return torch.cat((x, x[-1:].expand(pad, *x.shape[1:])))

    u, udot, fq = padded(u), padded(udot), padded(fq)
    fn = compiled("steps") if compile else steps
    Qs, Vs = [], []
    for k0 in range(0, n + pad, K):
        sl = slice(k0, k0 + K)
        q, v = fn(c, der, Q, V, None if u is None else u[sl], None if udot is None else udot[sl],
                  None if fq is None else fq[sl], dt, integrator, opts, K)
        Q, V = q[-1], v[-1]
        Qs.append(q)
        Vs.append(v)
    Qs, Vs = torch.cat(Qs)[:n], torch.cat(Vs)[:n]
    return from_fast_positions(c, Qs), from_fast_velocities(c, Vs)


# ---- layout conversion -------------------------------------------------------------------------------
def to_fast(c: NodalConstants, X: torch.Tensor) -> torch.Tensor:
    """(B, N, 3) full node array -> (3, n_free, B) reduced, batch last."""
    return X.index_select(-2, c.free_idx).permute(2, 1, 0).contiguous()


def from_fast_positions(c: NodalConstants, Q: torch.Tensor) -> torch.Tensor:
    """(..., 3, n_free, B) -> full positions (..., B, N, 3)."""
    X = _gather(Q, c.Tt_i, c.Tt_w) + c.XcT.unsqueeze(-1)                      # (..., 3, N, B)
    return X.movedim(-1, -3).transpose(-1, -2)


def from_fast_velocities(c: NodalConstants, V: torch.Tensor) -> torch.Tensor:
    X = _gather(V, c.Tt_i, c.Tt_w)
    return X.movedim(-1, -3).transpose(-1, -2)


def inputs_to_fast(c: NodalConstants, u: Optional[torch.Tensor], ud: Optional[torch.Tensor],
                   fext: Optional[torch.Tensor], B: int):
    """Time-major inputs (T, B, A) / (T, B, N, 3) (batch dim optional) -> (T, A, B) / (T, 3, n_free, B)."""
    def t_ab(x):
        if x is None:
            return None
        if x.dim() == 2:
            x = x.unsqueeze(1)
        return x.expand(x.shape[0], B, x.shape[-1]).transpose(1, 2).contiguous()

    fq = None
    if fext is not None:
        if fext.dim() == 3:
            fext = fext.unsqueeze(1)
        fq = (fext.transpose(-1, -2) @ c.T)                                   # (T, B, 3, nf)
        fq = fq.expand(fq.shape[0], B, *fq.shape[2:]).permute(0, 2, 3, 1).contiguous()
    return t_ab(u), t_ab(ud), fq
