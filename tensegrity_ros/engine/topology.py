"""Constant matrices of a structure (built once, in numpy float64; no torch state).

Notation follows the nodal-dynamics seed (stacked-tensegrity-manipulator-dynamics, Sec. II), but node
positions are stored row-wise: ``X`` is (N, 3) = the seed's N^T.

* Reduced coordinates: the LINEAR nodal constraints (fixed nodes, coincident and midpoint constraints) are
  eliminated exactly. Every node position is ``X = T Q + X_c`` with ``Q`` (n_free, 3) the independent
  ("free") nodes, ``T`` (N, n_free) a constant node-level matrix (free node: unit row; coincident: the
  parent's row; midpoint: the mean of the parents' rows; fixed: zero row and ``X_c`` = its position;
  chains resolved) and ``X_c`` (N, 3) constant. This replaces the seed's multipliers Omega for N P = Lambda.
* Bars: ``C_b`` (n_bars, N) with +1 at the bar's second node, -1 at its first (bar vector d = C_b X).
* Simple strings (segments): ``C_s`` (n_seg, N) likewise; ``G`` (n_seg, n_strings) the seed's
  simple-to-composite map (G[i, c] = 1 when segment i belongs to composite string c).
* Mass: ``M_full = sum_b m_b E_b`` with ``E_b`` (N, N) = 1/6 [[2, 1], [1, 2]] on the bar's two nodes
  (seed eq. 1, which equals 1/12 (C_b^T m C_b + 3 C_r^T m C_r)); reduced ``M_q = T^T M_full T``.
* Gravity: each bar puts m_b g / 2 on each end node: ``F_g = W m g^T`` with ``W`` (N, n_bars).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from ..model import CoincidentConstraint, MidpointConstraint, Structure


@dataclass(frozen=True, eq=False)
class Topology:
    """Constant index sets and matrices of one :class:`~tensegrity_ros.model.Structure` (numpy, SI units)."""

    structure: Structure
    node_names: Tuple[str, ...]
    bar_names: Tuple[str, ...]
    string_names: Tuple[str, ...]
    actuator_names: Tuple[str, ...]
    #: (N, 3) node positions in the structure file, m.
    X0: np.ndarray
    #: indices (into nodes) of the independent nodes, length n_free.
    free_nodes: Tuple[int, ...]
    #: (N, n_free) node-level map X = T Q + X_c.
    T: np.ndarray
    #: (N, 3) constant part of X, m.
    Xc: np.ndarray
    #: (n_bars, 2) node indices of each bar (first, second).
    bar_nodes: np.ndarray
    #: (n_bars,) bar lengths from the file positions, m.
    bar_lengths: np.ndarray
    #: (n_bars,) bar radii, m (only used by the spring-rod inertia).
    bar_radius: np.ndarray
    #: (n_bars, N) bar connectivity C_b.
    Cb: np.ndarray
    #: (n_seg, 2) node indices of each simple string (segment).
    seg_nodes: np.ndarray
    #: (n_seg,) composite string of each segment.
    seg_string: np.ndarray
    #: (n_seg, N) simple-string connectivity C_s.
    Cs: np.ndarray
    #: (n_seg, n_strings) simple-to-composite map G.
    G: np.ndarray
    #: (n_strings, A) actuator direction (+1/-1) where string c is driven by actuator a, else 0.
    Ydir: np.ndarray
    #: (n_strings,) 1.0 for strings of the ``spring`` stiffness law (kappa = stiffness, constant), 0.0 for
    #: ``cord`` strings (kappa = stiffness * rest_length / xi0); a float mask so the law stays one batched,
    #: differentiable expression in the engine (see :func:`tensegrity_ros.engine.nodal.prepare`).
    spring: np.ndarray
    #: (N, n_bars) share of each bar's weight on each node (1/2 on each end).
    W: np.ndarray
    #: (n_bars, N, N) per-unit-mass consistent mass matrices E_b.
    E: np.ndarray
    #: (3,) gravity, m/s^2.
    gravity: np.ndarray
    #: nominal values from the file (kind -> array)
    nominal: Dict[str, np.ndarray]

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    @property
    def n_free(self) -> int:
        return len(self.free_nodes)

    @property
    def n_bars(self) -> int:
        return len(self.bar_names)

    @property
    def n_strings(self) -> int:
        return len(self.string_names)

    @property
    def n_segments(self) -> int:
        return int(self.seg_nodes.shape[0])

    @property
    def n_actuators(self) -> int:
        return len(self.actuator_names)

    # ---- derived reduced-coordinate matrices --------------------------------------------------
    @property
    def Cb_q(self) -> np.ndarray:
        """(n_bars, n_free) = C_b T: bar vectors d = C_b_q Q + d_c."""
        return self.Cb @ self.T

    @property
    def d_c(self) -> np.ndarray:
        """(n_bars, 3) constant part of the bar vectors (non-zero for bars touching fixed nodes), m."""
        return self.Cb @ self.Xc

    @property
    def Cs_q(self) -> np.ndarray:
        """(n_seg, n_free) = C_s T: segment vectors s = C_s_q Q + s_c."""
        return self.Cs @ self.T

    @property
    def s_c(self) -> np.ndarray:
        """(n_seg, 3) constant part of the segment vectors, m."""
        return self.Cs @ self.Xc

    @property
    def E_q(self) -> np.ndarray:
        """(n_bars, n_free, n_free) per-unit-mass reduced mass matrices T^T E_b T."""
        return np.einsum("nf,bnm,mg->bfg", self.T, self.E, self.T)

    @property
    def W_q(self) -> np.ndarray:
        """(n_free, n_bars) = T^T W: generalised weight per unit bar mass and unit gravity."""
        return self.T.T @ self.W

    @property
    def active_bars(self) -> np.ndarray:
        """Indices of bars whose length constraint involves a free node (others are welded to the world)."""
        return np.flatnonzero(np.abs(self.Cb_q).sum(axis=1) > 0)

    @property
    def chord_blocks(self) -> Tuple[np.ndarray, ...]:
        """The bar-constraint (chord) matrix's diagonal blocks: the active bars (indices into
        :attr:`active_bars`) grouped so that no two groups couple.

        The chord matrix A = (C_b T) M_q^-1 (C_b T)^T * (D^T D) couples two bars only through M_q^-1, and M_q^-1
        is block-diagonal over the connected components of M_q's pattern (free nodes joined by a bar's mass or
        by one bar's constraint). So the bars that touch one such component form one block of A, and A^-1 is
        the block-diagonal of the blocks' inverses (the manipulator's 18 bars: blocks of 9, 6, 1, 1 and 1; the
        icosahedron's 6 bars: six of one). Found from the patterns alone (no mass values), so it holds for
        every parameter set. Ordered by bar index within a block and by first bar across blocks."""
        from scipy.sparse.csgraph import connected_components
        Cb = np.abs(self.Cb_q[self.active_bars]) > 0                      # (nba, n_free)
        if Cb.shape[0] == 0:
            return ()
        adj = (np.abs(self.E_q).sum(axis=0) > 0) | ((Cb.T.astype(int) @ Cb.astype(int)) > 0)
        _, node_label = connected_components(adj, directed=False)
        bar_label = node_label[Cb.argmax(axis=1)]                           # a bar's free nodes share a label
        _, first = np.unique(bar_label, return_index=True)
        return tuple(np.flatnonzero(bar_label == bar_label[b]) for b in sorted(first))


def _resolve_nodes(s: Structure):
    """Express every node as (coefficients over free nodes, constant position)."""
    names = s.node_names
    index = {n: i for i, n in enumerate(names)}
    parents: Dict[str, Tuple[str, ...]] = {}
    for con in s.constraints:
        if isinstance(con, CoincidentConstraint):
            parents[con.nodes[1]] = (con.nodes[0],)
        elif isinstance(con, MidpointConstraint):
            parents[con.node] = tuple(con.between)
        else:  # pragma: no cover - the loader only makes these two
            raise ValueError(f"unknown constraint {con!r}")
    fixed = {n.name for n in s.nodes if n.fixed}
    free = [i for i, n in enumerate(names) if n not in fixed and n not in parents]
    col = {names[i]: k for k, i in enumerate(free)}
    N, nf = len(names), len(free)
    T = np.zeros((N, nf))
    Xc = np.zeros((N, 3))
    done: Dict[str, bool] = {}

    def resolve(n: str) -> None:
        if done.get(n):
            return
        i = index[n]
        if n in fixed:
            Xc[i] = s.nodes[i].position
        elif n in parents:
            ps = parents[n]
            for p in ps:
                resolve(p)
                T[i] += T[index[p]] / len(ps)
                Xc[i] += Xc[index[p]] / len(ps)
        else:
            T[i, col[n]] = 1.0
        done[n] = True

    for n in names:
        resolve(n)
    return tuple(free), T, Xc


def build_topology(s: Structure) -> Topology:
    """Build the constant matrices of ``s`` (see the module docstring)."""
    names = s.node_names
    index = {n: i for i, n in enumerate(names)}
    N = len(names)
    free, T, Xc = _resolve_nodes(s)
    X0 = np.array([n.position for n in s.nodes], dtype=np.float64).reshape(N, 3)

    nb = len(s.bars)
    bar_nodes = np.array([[index[b.nodes[0]], index[b.nodes[1]]] for b in s.bars], dtype=np.int64).reshape(nb, 2)
    Cb = np.zeros((nb, N))
    E = np.zeros((nb, N, N))
    W = np.zeros((N, nb))
    for k, (i, j) in enumerate(bar_nodes):
        Cb[k, i], Cb[k, j] = -1.0, 1.0
        # rho = I / (m L^2): 1/12 gives the thin rod's consistent mass matrix 1/6 [[2, 1], [1, 2]]
        rho = s.bar_inertia_ratio(s.bars[k])
        E[k, i, i] = E[k, j, j] = 0.25 + rho
        E[k, i, j] = E[k, j, i] = 0.25 - rho
        W[i, k] += 0.5
        W[j, k] += 0.5
    bar_lengths = np.array([s.bar_length(b) for b in s.bars], dtype=np.float64)

    segs, seg_string = [], []
    for c, st in enumerate(s.strings):
        for a, b in st.segments:
            segs.append((index[a], index[b]))
            seg_string.append(c)
    ns, nc = len(segs), len(s.strings)
    seg_nodes = np.array(segs, dtype=np.int64).reshape(ns, 2)
    Cs = np.zeros((ns, N))
    G = np.zeros((ns, nc))
    for k, ((i, j), c) in enumerate(zip(segs, seg_string)):
        Cs[k, i] -= 1.0
        Cs[k, j] += 1.0
        G[k, c] = 1.0

    act_index = {a.name: k for k, a in enumerate(s.actuators)}
    Ydir = np.zeros((nc, len(s.actuators)))
    for c, st in enumerate(s.strings):
        if st.actuator:
            a = act_index[st.actuator]
            Ydir[c, a] = float(s.actuators[a].direction)
    spring = np.array([float(st.stiffness_law == "spring") for st in s.strings], dtype=np.float64)

    nominal = {
        "stiffness": np.array([st.stiffness for st in s.strings], dtype=np.float64),
        "damping": np.array([st.damping for st in s.strings], dtype=np.float64),
        "rest_length": np.array([st.rest_length for st in s.strings], dtype=np.float64),
        "mass": np.array([b.mass for b in s.bars], dtype=np.float64),
        "spool_radius": np.array([a.spool_radius for a in s.actuators], dtype=np.float64),
        "zero_offset": np.array([a.zero_offset for a in s.actuators], dtype=np.float64),
    }
    return Topology(
        structure=s, node_names=names, bar_names=tuple(b.name for b in s.bars),
        string_names=tuple(st.name for st in s.strings), actuator_names=tuple(a.name for a in s.actuators),
        X0=X0, free_nodes=free, T=T, Xc=Xc, bar_nodes=bar_nodes, bar_lengths=bar_lengths,
        bar_radius=np.array([b.radius for b in s.bars], dtype=np.float64), Cb=Cb, seg_nodes=seg_nodes,
        seg_string=np.array(seg_string, dtype=np.int64), Cs=Cs, G=G, Ydir=Ydir, spring=spring, W=W, E=E,
        gravity=np.array(s.gravity, dtype=np.float64), nominal=nominal)
