"""The nodal engine's physics, written once for both of its layouts.

The nodal engine keeps its reduced state in two layouts: the reference layout of :mod:`.nodal` (batch
FIRST, Q (B, 3, n_free): every constant matrix multiplies from the right and batched products fold into one
matrix multiply) and the throughput layout of :mod:`.fast` (batch LAST, Q (3, n_free, B): under
torch.compile every product becomes a loop vectorised over the batch). Both run the equations of this
module; each layout only says how to multiply and solve (a :class:`Layout`).

Shared here (one definition each):

* the constants of a structure (:class:`NodalConstants`) and the per-params quantities (:class:`Derived`,
  one :func:`prepare`: M_q^-1, G, weights, the stiffness law's split kappa = EA / xi0 + kc, Y, and the
  implicit step's couplings H_s, H_bs); the batch-last path moves the same tensors' params batch last
  (:meth:`Derived.batch_last`);
* the string law of CONTRACTS.md: rest lengths from the actuators (:func:`rest_lengths`: xi0 = xi00 +
  Y (u - z), Y = spool radius x direction), the stiffness (:func:`string_stiffness`, cord EA / xi0 vs
  spring kc), the Kelvin-Voigt tension with its tension-only clamp (:func:`string_tension`) and the string
  state from segment vectors (:func:`string_law`);
* the dynamics: generalised forces, the bar-constraint multipliers with Baumgarte terms
  (:func:`constrained_accelerations`), the mass-weighted projection, the implicit step, one step and n
  steps (:func:`step`, :func:`steps`).

Layout-specific (the :class:`Layout` methods, in :mod:`.nodal` and :mod:`.fast`): where the batch axis is,
how a constant matrix multiplies (``mul``: a matrix multiply, or a gather over its nonzeros), products with
per-params matrices (``dense``), Gram matrices of 3-vectors (``gram``), matrix-vector products, and the SPD
solvers (``inverse``, ``cholesky``, ``chol_solve``). The reference uses LAPACK; the compiled path unrolls
Gauss-Jordan and Cholesky into elementwise updates over the batch axis, which inductor fuses into a few CPU
loops (a LAPACK call per batch item, or small batched matrix multiplies, do not fuse).

Layout conventions: a "vector" over entities (strings, segments, bars, motors) has its entity axis at
``L.ent`` (reference -1: (B, n); batch-last -2: (n, B)); a coordinate array has 3 coordinates just before
it ((B, 3, n) / (3, n, B)); a matrix over entities has its rows just before it ((B, n, m) / (n, m, B)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import integrators
from ._common import as_tensor, register_tensor_dataclass
from .params import Params
from .topology import Topology


# =====================================================================================================
# constants and per-params derived quantities
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


def _chord_block_indices(blocks, nba: int):
    """(groups, assemble) of :class:`NodalConstants` from the chord matrix's blocks (index arrays over the nba
    active bars): blocks of equal size stacked, and each (i, j) entry's place among the stacked blocks'
    inverses flattened in that order (nba * nba: the one past them where i and j lie in different blocks)."""
    by_size = {}
    for b in blocks:
        by_size.setdefault(len(b), []).append(b)
    groups = [np.stack(by_size[m]) for m in sorted(by_size)]
    total = sum(g.size * g.shape[1] for g in groups)
    assemble = np.full((nba, nba), total, dtype=np.int64)
    offset = 0
    for g in groups:
        n_blocks, m = g.shape
        for k in range(n_blocks):
            assemble[np.ix_(g[k], g[k])] = offset + k * m * m + np.arange(m * m).reshape(m, m)
        offset += n_blocks * m * m
    return groups, assemble.reshape(-1)


#: the constant matrices also kept in gather form (``NodalConstants.*_i`` / ``*_w``), as (matrix, its transpose)
#: pairs: both of a pair are there, so a gather's derivative is a gather of the other (engine/fast.py)
GATHER_PAIRS = (("Cs_q", "Cst"), ("Cb_q", "Cbt"), ("G", "Gt"), ("T", "Tt"))
#: each gather-form matrix's name -> its transpose's
GATHER_TRANSPOSE = {**dict(GATHER_PAIRS), **{t: m for m, t in GATHER_PAIRS}}


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
    ``*_i`` / ``*_w``: the same constant matrices in gather form: for ``X @ M``, output column o is
    sum_k w[o, k] X[..., i[o, k]] (padded with zero weights); each one's transpose is in gather form too
    (:data:`GATHER_TRANSPOSE`), so a gather's derivative is a gather, not a scatter.
    chord_groups: the chord matrix's diagonal blocks (:attr:`.topology.Topology.chord_blocks`), those of one
    size m stacked as one (n_blocks, m) long tensor of active-bar indices; chord_assemble: (nba * nba,) long,
    where entry (i, j) of A^-1 lies in the blocks' inverses flattened one after the other, or the index one past
    them (a zero) outside every block (:func:`chord_inverse`).
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
    Cb_q_i: torch.Tensor
    Cb_q_w: torch.Tensor
    T_i: torch.Tensor
    T_w: torch.Tensor
    chord_groups: Tuple[torch.Tensor, ...]
    chord_assemble: torch.Tensor

    @staticmethod
    def build(top: Topology, dtype=torch.float64, device=None) -> "NodalConstants":
        act = top.active_bars
        t = lambda x: as_tensor(np.ascontiguousarray(x), dtype, device)  # noqa: E731
        sparse = {}
        dense = {"Cs_q": top.Cs_q, "Cb_q": top.Cb_q[act], "G": top.G, "T": top.T}
        for name, name_t in GATHER_PAIRS:
            for n, M in ((name, dense[name]), (name_t, dense[name].T)):
                i, w = _gather_form(M)
                sparse[n + "_i"], sparse[n + "_w"] = t(i), t(w)
        groups, assemble = _chord_block_indices(top.chord_blocks, len(act))
        return NodalConstants(**sparse, chord_groups=tuple(t(g) for g in groups), chord_assemble=t(assemble),
            T=t(top.T), Tt=t(top.T.T), XcT=t(top.Xc.T), free_idx=t(np.array(top.free_nodes, dtype=np.int64)),
            Cb_q=t(top.Cb_q[act]), Cbt=t(top.Cb_q[act].T), dcT=t(top.d_c[act].T), l2=t(top.bar_lengths[act] ** 2),
            Cs_q=t(top.Cs_q), Cst=t(top.Cs_q.T), scT=t(top.s_c.T), G=t(top.G), Gt=t(top.G.T), Ydir=t(top.Ydir),
            spring=t(top.spring), cord=t(1.0 - top.spring),
            E_q=t(top.E_q), WqT=t(top.W_q.T), gravity=t(top.gravity), bar_nodes=t(top.bar_nodes),
            bar_lengths=t(top.bar_lengths), seg_nodes=t(top.seg_nodes), E=t(top.E), W=t(top.W))


@register_tensor_dataclass
@dataclass(frozen=True)
class Derived:
    """Per-params quantities (no batch dim for unbatched params, else the params batch Bp first; see
    :meth:`batch_last` for the batch-last layout).

    EA: (Bp, S) N; zeta: (Bp, S) N s/m; xi00: (Bp, S) m; Y: (Bp, S, A) m/rad; z: (Bp, A) rad;
    kc: (Bp, S) N/m. The stiffness is kappa = EA / xi0 + kc: cord strings have EA = stiffness * xi00 and kc = 0,
    spring strings EA = 0 and kc = stiffness (see :func:`prepare`; every Derived of this engine has kc);
    Mq: (Bp, n_free, n_free) kg; Minv: (Bp, n_free, n_free) 1/kg; Pt: (Bp, nba, n_free) = (C_b T) M_q^-1;
    Gc: (Bp, nba, nba) = (C_b T) M_q^-1 (C_b T)^T; FgT: (Bp, 3, n_free) generalised weight, N;
    Hs: (Bp, n_seg, n_seg) = C_s T M_q^-1 T^T C_s^T; Hbs: (Bp, nba, n_seg) = C_b T M_q^-1 T^T C_s^T (the
    implicit step's constant couplings).
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
    #: last and optional so that the spring-rod engine's Derived (which has no stiffness laws and no bars:
    #: None) still builds
    kc: Optional[torch.Tensor] = None
    Hs: Optional[torch.Tensor] = None
    Hbs: Optional[torch.Tensor] = None

    #: each field's number of dims without the params batch
    RANKS: ClassVar[dict] = dict(EA=1, zeta=1, xi00=1, Y=2, z=1, Mq=2, Minv=2, Pt=2, Gc=2, FgT=2, kc=1, Hs=2, Hbs=2)

    def batch_last(self) -> "Derived":
        """The same quantities with the params batch as their last axis (Bp = 1 for unbatched params):
        EA (S, Bp), Y (S, A, Bp), Minv (n_free, n_free, Bp), ... (the layout of :mod:`.fast`)."""
        def last(name):
            t = getattr(self, name)
            if t is None:
                return None
            return t.unsqueeze(-1) if t.dim() == self.RANKS[name] else t.movedim(0, -1)
        return Derived(**{name: last(name) for name in self.RANKS})


def reduced_mass_matrix(c: NodalConstants, mass: torch.Tensor) -> torch.Tensor:
    """M_q = T^T (sum_b m_b E_b) T: (..., n_free, n_free) kg from mass (..., n_bars) kg."""
    return torch.einsum("...b,bfg->...fg", mass, c.E_q)


def split_stiffness(c: NodalConstants, k: torch.Tensor, xi00: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(EA, kc) (.., S): the stiffness parameter k (.., S) split by each string's law, EA = k xi00 (cord, with
    the rest length xi00) and kc = k (spring), with the constant 0/1 masks, so that everywhere
    kappa = EA / xi0 + kc (:func:`string_stiffness`)."""
    return k * xi00 * c.cord, k * c.spring


def prepare(c: NodalConstants, p: Params) -> Derived:
    """Quantities that depend on params only (mass matrix inverse, bar coupling G, weights, EA, kc, Y, H_s, H_bs).

    The stiffness law of each string (``String.stiffness_law``) enters as a split of the stiffness parameter
    k into EA = k xi00 (cord) and kc = k (spring) with the constant 0/1 masks, so that everywhere
    kappa = EA / xi0 + kc: one batched, differentiable expression for both laws, and for cord strings
    bit-for-bit the former EA / xi0 (multiplying by 1.0 and adding 0.0 are exact).
    """
    m = p.mass
    Mq = reduced_mass_matrix(c, m)
    Minv = torch.linalg.inv(Mq)
    Pt = c.Cb_q @ Minv
    Gc = Pt @ c.Cbt
    FgT = c.gravity.unsqueeze(-1) * (m @ c.WqT).unsqueeze(-2)
    Y = c.Ydir * p.spool_radius.unsqueeze(-2)
    EA, kc = split_stiffness(c, p.stiffness, p.rest_length)
    MCs = Minv @ c.Cs_q.T                                          # (Bp, n_free, n_seg)
    return Derived(EA=EA, zeta=p.damping, xi00=p.rest_length, Y=Y, z=p.zero_offset, kc=kc, Mq=Mq, Minv=Minv,
                   Pt=Pt, Gc=Gc, FgT=FgT, Hs=c.Cs_q @ MCs, Hbs=c.Cb_q @ MCs)


class Options(NamedTuple):
    """Solver options. baumgarte: (alpha 1/s, beta 1/s) constraint stabilisation in the multiplier equation;
    projection_iters: Gauss-Newton position projections after each step (0: off; velocities are projected
    whenever positions are); solver: 'lapack' | 'unrolled' (see :func:`._common.spd_inverse`; the reference
    layout's bar-matrix inverse); fused: write every product of the reference layout as gathers/elementwise
    ops (see :func:`.nodal.rmul`). The batch-last path always uses its unrolled, fused kernels."""

    baumgarte: Tuple[float, float] = (0.0, 0.0)
    projection_iters: int = 2
    solver: str = "lapack"
    fused: bool = False


# =====================================================================================================
# layouts: the only layout-specific code (products and solves)
# =====================================================================================================
class Layout:
    """How one layout multiplies and solves. ``ent``: the entity axis of vectors (see the module docstring);
    the helpers below follow from it, the products and solvers are each layout's own."""

    ent: int = -1

    # ---- axis bookkeeping (generic) ----
    def const(self, t: torch.Tensor) -> torch.Tensor:
        """A batch-free constant (.., n) broadcast against this layout's batched tensors."""
        return t.reshape(t.shape + (1,) * (-1 - self.ent))

    def csum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the coordinate axis: (.., 3, n) -> (.., n)."""
        return x.sum(self.ent - 1)

    def row(self, t: torch.Tensor) -> torch.Tensor:
        """A vector (.., n) as a row against (.., 3, n) coordinate arrays or (.., m, n) matrices."""
        return t.unsqueeze(self.ent - 1)

    def col(self, t: torch.Tensor) -> torch.Tensor:
        """A vector (.., n) as a column against (.., n, m) matrices."""
        return t.unsqueeze(self.ent)

    def swap(self, M: torch.Tensor) -> torch.Tensor:
        """Matrix transpose (.., n, m) -> (.., m, n)."""
        return M.transpose(self.ent - 1, self.ent)

    def eye(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return self.const(torch.eye(n, dtype=like.dtype, device=like.device))

    def cat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Vectors (.., n), (.., m) -> (.., n + m)."""
        return torch.cat((a, b), self.ent)

    def head(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.narrow(self.ent, 0, n)

    def tail(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.narrow(self.ent, n, x.shape[self.ent] - n)

    def blocks(self, A: torch.Tensor, P: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
        """The symmetric block matrix [[A, P], [P^T, C]]."""
        return torch.cat((torch.cat((A, P), self.ent), torch.cat((self.swap(P), C), self.ent)), self.ent - 1)

    # ---- products and solvers (layout-specific) ----
    def mul(self, X: torch.Tensor, c: NodalConstants, name: str) -> torch.Tensor:
        """X (.., k_in) times the constant matrix ``c.<name>`` (k_in, k_out) over the entity axis."""
        raise NotImplementedError

    def dense(self, X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
        """X (.., 3, k_in) times a per-params matrix M (k_in, k_out) -> (.., 3, k_out)."""
        raise NotImplementedError

    def motor(self, Y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Y (S, A) times motor vectors x (.., A) -> (.., S)."""
        raise NotImplementedError

    def norm(self, s: torch.Tensor) -> torch.Tensor:
        """Lengths (.., n) of coordinate arrays (.., 3, n)."""
        return torch.sqrt(self.csum(s * s))

    def gram(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(.., n, m) dot products a_i . b_j of coordinate arrays a (.., 3, n), b (.., 3, m)."""
        raise NotImplementedError

    def matvec(self, M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """M (.., n, m) x (.., m) -> (.., n)."""
        raise NotImplementedError

    def inverse(self, A: torch.Tensor) -> torch.Tensor:
        """Inverse of SPD matrices (.., n, n)."""
        raise NotImplementedError

    def block_inverse(self, A: torch.Tensor, groups: Tuple[torch.Tensor, ...],
                      assemble: torch.Tensor) -> torch.Tensor:
        """Inverse of SPD matrices A (.., n, n) that are block-diagonal over ``groups`` (each (n_blocks, m): the
        rows and columns of its blocks), assembled with ``assemble`` (see :class:`NodalConstants`)."""
        raise NotImplementedError

    def cholesky(self, K: torch.Tensor) -> torch.Tensor:
        """Lower Cholesky factor of SPD matrices (.., n, n)."""
        raise NotImplementedError

    def chol_solve(self, L: torch.Tensor, r: torch.Tensor, n: Optional[int] = None) -> torch.Tensor:
        """x with (L L^T) x = r, using the leading n x n block of L (default all); r: (.., n)."""
        raise NotImplementedError


# =====================================================================================================
# string law (CONTRACTS.md): composite Kelvin-Voigt, pull only, gated on D > 0
# =====================================================================================================
class StringState(NamedTuple):
    """Per composite string: length L (B, S) m, rate L' m/s, rest length xi0 m, xi0' m/s, stretch D m,
    rate D' m/s, stiffness kappa = EA/xi0 + kc N/m (the string's law, see :func:`prepare`), tension (B, S) N;
    per segment: unit vectors e (segment vectors' layout), lengths xi (B, n_seg) m and their rates xi' m/s.
    (Shapes of the reference layout; the batch-last layout has the batch last.)"""

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


def rest_lengths(L: Layout, der: Derived, u: Optional[torch.Tensor], udot: Optional[torch.Tensor]):
    """xi0 = xi00 + Y (u - z) (.., S) m and xi0' = Y u' m/s (None when udot is None)."""
    xi0 = der.xi00
    xi0dot = None
    if u is not None and der.Y.shape[L.ent] > 0:
        xi0 = xi0 + L.motor(der.Y, u - der.z)
        if udot is not None:
            xi0dot = L.motor(der.Y, udot)
    return xi0, xi0dot


def string_stiffness(EA: torch.Tensor, kc: torch.Tensor, xi0: torch.Tensor) -> torch.Tensor:
    """kappa = EA / xi0 + kc, N/m: cord strings EA / xi0 (kc = 0), spring strings kc (EA = 0)."""
    return EA / xi0 + kc


def string_tension(kappa: torch.Tensor, zeta: torch.Tensor, D: torch.Tensor, Ddot: torch.Tensor) -> torch.Tensor:
    """Kelvin-Voigt tension kappa D + zeta D', pull only (clamped at 0) and gated on a taut string (D > 0)."""
    return torch.where(D > 0, torch.relu(kappa * D + zeta * Ddot), torch.zeros_like(D))


def string_law(L: Layout, c: NodalConstants, s: torch.Tensor, sdot: torch.Tensor, der: Derived,
               u: Optional[torch.Tensor], udot: Optional[torch.Tensor]) -> StringState:
    """Composite string tensions from segment vectors s (.., 3, n_seg) (second minus first node), m, and
    their rates sdot, m/s; u: (.., A) motor angles, rad; udot: rad/s (or None)."""
    xi = L.norm(s)                                                  # (.., ns)
    e = s / L.row(xi)
    xidot = L.csum(e * sdot)
    length = L.mul(xi, c, "G")                                      # (.., S)
    Ldot = L.mul(xidot, c, "G")
    xi0, xi0dot = rest_lengths(L, der, u, udot)
    D = length - xi0
    Ddot = Ldot if xi0dot is None else Ldot - xi0dot
    kappa = string_stiffness(der.EA, der.kc, xi0)
    tension = string_tension(kappa, der.zeta, D, Ddot)
    return StringState(length, Ldot, xi0, torch.zeros_like(xi0) if xi0dot is None else xi0dot, D, Ddot, kappa,
                       tension, e, xi, xidot)


# =====================================================================================================
# dynamics in reduced coordinates (Q, V: coordinate arrays over the free nodes)
# =====================================================================================================
def generalized_forces(L: Layout, c: NodalConstants, der: Derived, Q, V, u, udot, fext, with_strings: bool = False):
    """F_q^T (.., 3, n_free) N: strings + gravity + external (``fext`` already reduced).
    ``with_strings``: also return the :class:`StringState`."""
    s = L.mul(Q, c, "Cst") + L.const(c.scT)
    sdot = L.mul(V, c, "Cst")
    st = string_law(L, c, s, sdot, der, u, udot)
    seg_t = L.mul(st.tension, c, "Gt")                              # (.., ns)
    F = der.FgT - L.mul(L.row(seg_t) * st.e, c, "Cs_q")
    if fext is not None:
        F = F + fext
    return (F, st) if with_strings else F


def bar_vectors(L: Layout, c: NodalConstants, Q) -> torch.Tensor:
    """d (.., 3, nba): the bars' vectors (second minus first node), m."""
    return L.mul(Q, c, "Cbt") + L.const(c.dcT)


def bar_gap(L: Layout, c: NodalConstants, d) -> torch.Tensor:
    """g = (|d|^2 - l^2) / 2 (.., nba), m^2: the bar-length constraint's residual."""
    return 0.5 * (L.csum(d * d) - L.const(c.l2))


def chord_matrix(L: Layout, der: Derived, d) -> torch.Tensor:
    """A = G * (D D^T) (.., nba, nba) at the bar vectors d."""
    return der.Gc * L.gram(d, d)


def chord_inverse(L: Layout, c: NodalConstants, A: torch.Tensor) -> torch.Tensor:
    """A^-1 of the chord matrix, one diagonal block at a time (:attr:`.topology.Topology.chord_blocks`). The
    manipulator's 18 x 18 matrix has blocks of 9, 6, 1, 1 and 1 bars: ~1/6 of a dense elimination's work, which
    was ~40 % of its compiled step's time (one thread: 188 k -> 306 k item-steps/s; docs/engine.md)."""
    return L.block_inverse(A, c.chord_groups, c.chord_assemble)


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


def constrained_accelerations(L: Layout, c: NodalConstants, der: Derived, Q, V, F, opts: Options) -> Constrained:
    """Q'' from the generalised forces F with the bar-length multipliers solved exactly (see :mod:`.nodal`)."""
    a0 = L.dense(F, der.Minv)
    if c.Cb_q.shape[0] == 0:
        return Constrained(a0, a0, None, None, None, None)
    d = bar_vectors(L, c, Q)
    dd = L.mul(V, c, "Cbt")
    rhs = -L.csum(dd * dd) - L.csum(d * L.mul(a0, c, "Cbt"))      # (.., nba)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        rhs = rhs - 2.0 * alpha * L.csum(d * dd) - beta * beta * bar_gap(L, c, d)
    Ainv = chord_inverse(L, c, chord_matrix(L, der, d))
    lam = L.matvec(Ainv, rhs)                                       # (.., nba)
    return Constrained(a0 + L.dense(L.row(lam) * d, der.Pt), a0, d, dd, Ainv, lam)


def accelerations(L: Layout, c: NodalConstants, der: Derived, Q, V, u, udot, fext, opts: Options):
    """Q'' m/s^2 and A^-1 at the reduced state Q (m), V (m/s)."""
    out = constrained_accelerations(L, c, der, Q, V, generalized_forces(L, c, der, Q, V, u, udot, fext), opts)
    return out.a, out.Ainv


#: a solver for the chord matrix: r (.., nba) -> A^-1 r
Solve = Callable[[torch.Tensor], torch.Tensor]


def project_positions_once(L: Layout, c: NodalConstants, der: Derived, Q, Asolve: Solve,
                           with_multiplier: bool = False):
    """One mass-weighted Gauss-Newton step of Q towards |d_b| = l_b with the (chord) solver A^-1.
    ``with_multiplier``: also the bar vectors d it was taken at and y = A^-1 g (.., nba)."""
    d = bar_vectors(L, c, Q)
    y = Asolve(bar_gap(L, c, d))
    Q = Q - L.dense(L.row(y) * d, der.Pt)
    return (Q, d, y) if with_multiplier else Q


def project_velocities(L: Layout, c: NodalConstants, der: Derived, Q, V, Asolve: Solve,
                       with_multiplier: bool = False):
    """V projected onto d_b . d_b' = 0 at the positions Q (mass-weighted, chord solver A^-1).
    ``with_multiplier``: also the bar vectors d at Q and nu = A^-1 (d . d') (.., nba)."""
    d = bar_vectors(L, c, Q)
    nu = Asolve(L.csum(d * L.mul(V, c, "Cbt")))
    V = V - L.dense(L.row(nu) * d, der.Pt)
    return (V, d, nu) if with_multiplier else V


def project(L: Layout, c: NodalConstants, der: Derived, Q, V, Asolve: Optional[Solve], iters: int):
    """Mass-weighted projection of Q (positions) onto |d_b| = l_b and of V onto d_b . d_b' = 0.

    Gauss-Newton with the (chord) matrix A^-1 of the step (``Asolve``; None: no bars): each iteration reduces
    the error by ~|d'| dt / l (~1e-3); two iterations bring it to round-off.
    """
    if iters <= 0 or Asolve is None:
        return Q, V
    for _ in range(iters):
        Q = project_positions_once(L, c, der, Q, Asolve)
    return Q, project_velocities(L, c, der, Q, V, Asolve)


def implicit_step(L: Layout, c: NodalConstants, der: Derived, Q, V, u, udot, fext, h: float, opts: Options):
    """Semi-implicit Euler with the string damping taken implicitly (linearised, like MuJoCo's implicitfast).

    With g_c = dL_c/dQ (the composite string's unit force pattern) and the strings pulling at the start of the
    step (a_c = 1):
        (M + h sum_c a_c zeta_c g_c g_c^T) dV = h F(Q, V) + J^T mu,   J V1 = d.d' - h |d'|^2 (per bar),
    solved as one SPD system for the bar impulses mu and the scaled damping impulses nu (w = h zeta a):
        [[J M^-1 J^T, J M^-1 G w^1/2], [., I + w^1/2 G^T M^-1 G w^1/2]] [mu; nu] = [t - J V*; -w^1/2 G^T dV0]
    then V1 = V + dV0 + M^-1 (J^T mu + G w^1/2 nu), Q1 = Q + h V1. Stable for any damping at the step size
    where the undamped system is (the explicit integrators need h zeta / m_node < ~2). The couplings
    g_c^T M^-1 g_d and J_b M^-1 g_c come from the constant H_s, H_bs (:func:`prepare`) and the segment
    directions (g_c = sum over its segments of e_s (x) C_s T).
    Returns (Q1, V1, A^-1 solver) with A = J M^-1 J^T for the projection (None without bars).
    """
    F, st = generalized_forces(L, c, der, Q, V, u, udot, fext, with_strings=True)
    e = st.e
    dV0 = h * L.dense(F, der.Minv)
    sw = torch.sqrt(h * der.zeta * (st.tension > 0).to(Q.dtype))    # (.., S)
    S_ = L.mul(L.swap(L.mul(der.Hs * L.gram(e, e), c, "G")), c, "G")  # g_c^T M^-1 g_d (.., S, S)
    C = L.eye(S_.shape[L.ent], Q) + L.col(sw) * S_ * L.row(sw)
    r2 = -sw * L.mul(L.csum(e * L.mul(dV0, c, "Cst")), c, "G")
    Vs = V + dV0

    def strings_dv(nu):                                             # M^-1 G w^1/2 nu
        return L.dense(L.mul(L.row(L.mul(sw * nu, c, "Gt")) * e, c, "Cs_q"), der.Minv)

    if c.Cb_q.shape[0] == 0:
        V1 = Vs + strings_dv(L.chol_solve(L.cholesky(C), r2))
        return Q + h * V1, V1, None
    d = bar_vectors(L, c, Q)
    dd = L.mul(V, c, "Cbt")
    A = chord_matrix(L, der, d)
    target = L.csum(d * dd) - h * L.csum(dd * dd)
    alpha, beta = opts.baumgarte
    if alpha or beta:
        target = target - h * (2.0 * alpha * L.csum(d * dd) + beta * beta * bar_gap(L, c, d))
    r1 = target - L.csum(d * L.mul(Vs, c, "Cbt"))
    Pw = L.mul(der.Hbs * L.gram(d, e), c, "G") * L.row(sw)          # J M^-1 G w^1/2 (.., nba, S)
    Lf = L.cholesky(L.blocks(A, Pw, C))
    sol = L.chol_solve(Lf, L.cat(r1, r2))
    nb = A.shape[L.ent]
    mu, nu = L.head(sol, nb), L.tail(sol, nb)
    V1 = Vs + L.dense(L.row(mu) * d, der.Pt) + strings_dv(nu)
    return Q + h * V1, V1, (lambda r: L.chol_solve(Lf, r, nb))


def step(L: Layout, c: NodalConstants, der: Derived, Q, V, u, udot, fext, dt: float, integrator: str,
         opts: Options):
    """One step in reduced coordinates: (Q, V) -> (Q', V'), then the projection. Inputs held over the step."""
    if integrator == "implicit":
        Q1, V1, Asolve = implicit_step(L, c, der, Q, V, u, udot, fext, dt, opts)
    else:
        integrate = integrators.get(integrator)
        Q1, V1, Ainv = integrate(Q, V, lambda q, v: accelerations(L, c, der, q, v, u, udot, fext, opts), dt)
        Asolve = None if Ainv is None else (lambda r: L.matvec(Ainv, r))
    return project(L, c, der, Q1, V1, Asolve, opts.projection_iters)


def steps(L: Layout, c: NodalConstants, der: Derived, Q, V, u, udot, fext, dt: float, integrator: str,
          opts: Options, n: int):
    """n steps; u, udot, fext carry a leading time axis (or are None). Returns the states after each step,
    stacked on a leading axis: Qs, Vs (n, ...)."""
    Qs, Vs = [], []
    for k in range(n):
        Q, V = step(L, c, der, Q, V, None if u is None else u[k], None if udot is None else udot[k],
                    None if fext is None else fext[k], dt, integrator, opts)
        Qs.append(Q)
        Vs.append(V)
    return torch.stack(Qs), torch.stack(Vs)
