"""What RViz shows of a tensegrity, without rclpy: structure + node positions + parameters -> a list of plain
marker descriptions (:class:`MarkerSpec`: type, pose, scale, points, colours), which the ``visualizer`` node
copies into a ``visualization_msgs/MarkerArray`` and :mod:`.render` draws with matplotlib (docs/viz.md).

* bars: one cylinder each (namespace ``bars``, id = bar index), diameter twice the bar's radius;
* nodes: one sphere list of the nodes whose position is known (``nodes``, id 0): an occluded node is absent;
* strings: one line strip per composite string along its segments (``strings``, id = string index), coloured by
  its tension (:data:`TENSION_COLORS`, 0 N to ``scale``; a slack string grey), tension from the engine's string
  law (:func:`tensegrity_ros.engine.nodal.full_string_state`) at the current state with the given parameters;
* the predicted horizon as a faded ghost: the bars at ``ghost_steps`` steps of the horizon as line lists
  (``ghost``, id j; the further ahead the fainter) and every node's predicted path (``ghost_paths``, id 0).

Arrays are in the structure frame, SI: positions (N, 3) m, velocities m/s, tensions (S,) N. Unknown node
positions are NaN; an element with an unknown node is left out of the list (the node deletes its marker).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..model import Structure

RGBA = Tuple[float, float, float, float]

#: (fraction of the colour scale, RGB): blue (slack side) -> violet -> orange -> red (the scale's top). Red rises
#: and blue falls monotonically, so a string's colour orders like its tension.
TENSION_COLORS: Tuple[Tuple[float, Tuple[float, float, float]], ...] = (
    (0.0, (0.13, 0.33, 0.85)), (0.35, (0.50, 0.22, 0.70)), (0.70, (0.93, 0.45, 0.13)), (1.0, (0.98, 0.10, 0.05)))
SLACK_COLOR: RGBA = (0.55, 0.55, 0.55, 0.8)
BAR_COLOR: RGBA = (0.78, 0.78, 0.80, 1.0)
NODE_COLOR: RGBA = (0.15, 0.15, 0.15, 1.0)
GHOST_COLOR: Tuple[float, float, float] = (0.40, 0.72, 1.0)

#: marker types used here (the node maps them onto visualization_msgs/Marker constants)
TYPES = ("cylinder", "line_strip", "line_list", "sphere_list")


@dataclass(frozen=True)
class MarkerStyle:
    """Sizes (m), the colour scale and the ghost.

    tension_scale_n: tension at the top of the colour scale, N (0 = automatic: 1.5 x the largest tension at the
    model's rest positions with the current parameters). ghost_steps: how many horizon steps are drawn as
    ghosts (0 = none); ghost_alpha: opacity of the nearest one (the last has a quarter of it); path_samples:
    points along each node's predicted path.
    """

    min_bar_diameter_m: float = 0.008
    string_width_m: float = 0.006
    node_diameter_m: float = 0.025
    tension_scale_n: float = 0.0
    ghost_steps: int = 3
    ghost_alpha: float = 0.45
    ghost_width_m: float = 0.008
    path_width_m: float = 0.003
    path_samples: int = 10


@dataclass(frozen=True)
class MarkerSpec:
    """One marker, free of any message type.

    ns, id: its key (RViz replaces a marker with the same key). type: one of :data:`TYPES`. position (3,) m and
    orientation (x, y, z, w): its pose (cylinders; identity for point lists). scale: cylinder (diameter, diameter,
    length) m; lines (width, 0, 0); sphere list (diameter, diameter, diameter). color: RGBA in [0, 1].
    points: (P, 3) m (line and sphere lists). name: the element (bar or string name); value: the string's
    tension, N (NaN elsewhere).
    """

    ns: str
    id: int
    type: str
    color: RGBA
    scale: Tuple[float, float, float]
    position: Tuple[float, float, float] = (0.0, 0.0, 0.0)
    orientation: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0)
    points: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    name: str = ""
    value: float = math.nan

    @property
    def key(self) -> Tuple[str, int]:
        return self.ns, self.id


def tension_color(tension: float, scale: float, alpha: float = 1.0) -> RGBA:
    """The colour of a string under ``tension`` N on a 0..``scale`` N scale (slack, i.e. 0 N or less: grey)."""
    if not math.isfinite(tension) or tension <= 0.0:
        return SLACK_COLOR
    u = min(max(tension / scale, 0.0), 1.0) if scale > 0 else 1.0
    xs = [x for x, _ in TENSION_COLORS]
    rgb = tuple(float(np.interp(u, xs, [c[i] for _, c in TENSION_COLORS])) for i in range(3))
    return rgb + (float(alpha),)


def cylinder_pose(a: np.ndarray, b: np.ndarray) -> Tuple[Tuple[float, ...], Tuple[float, ...], float]:
    """(centre (3,), quaternion (x, y, z, w) turning +z onto b - a, length m) of a cylinder from a to b."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = b - a
    length = float(np.linalg.norm(d))
    centre = tuple(float(x) for x in 0.5 * (a + b))
    if length == 0.0:
        return centre, (0.0, 0.0, 0.0, 1.0), 0.0
    u = d / length
    w = 1.0 + u[2]                                # q = (z x u, 1 + z . u), normalised
    if w < 1e-9:                                  # u = -z: half a turn about x
        return centre, (1.0, 0.0, 0.0, 0.0), length
    q = np.array([-u[1], u[0], 0.0, w])
    q /= np.linalg.norm(q)
    return centre, tuple(float(x) for x in q), length


class MarkerScene:
    """The markers of one structure (topology built once; the engine's constants on first use of tensions).

    structure: the model; style: :class:`MarkerStyle`.
    """

    def __init__(self, structure: Structure, style: MarkerStyle = MarkerStyle()):
        from ..engine.topology import build_topology

        self.structure = structure
        self.style = style
        self.topology = top = build_topology(structure)
        self.node_names = top.node_names
        self.string_names = top.string_names
        self.bar_names = top.bar_names
        self.actuator_names = top.actuator_names
        self._index = {n: i for i, n in enumerate(top.node_names)}
        self._T = np.asarray(top.T, dtype=float)             # (N, nf)
        self._Tnz = np.abs(self._T) > 0
        self._Xc = np.asarray(top.Xc, dtype=float)
        self._free = np.asarray(top.free_nodes, dtype=int)
        self._bar_nodes = np.asarray(top.bar_nodes, dtype=int)
        self._bar_diam = np.maximum(2.0 * np.asarray(top.bar_radius, dtype=float), style.min_bar_diameter_m)
        self._paths = [np.array([self._index[n] for n in (s.nodes + (s.nodes[:1] if s.closed else ()))], dtype=int)
                       for s in structure.strings]
        self._constants = None

    # ---- positions --------------------------------------------------------------------------------------
    def full_positions(self, names: Sequence[str], positions, valid=None) -> np.ndarray:
        """(..., N, 3) all nodes from (..., N', 3) positions of the nodes ``names`` (valid (N',) bool, or NaN
        rows, marks the unknown ones): given nodes as given, the others from the structure's linear constraints
        (fixed, coincident, midpoint: X = T Q + X_c) where the free nodes they depend on are known, else NaN."""
        return self._fill(names, positions, valid, self._Xc)

    def full_velocities(self, names: Sequence[str], velocities, valid=None) -> np.ndarray:
        """(..., N, 3) m/s like :meth:`full_positions` (V = T Q'); unknown velocities: 0 (they only enter the
        strings' damping term)."""
        V = self._fill(names, velocities, valid, np.zeros_like(self._Xc))
        return np.where(np.isfinite(V), V, 0.0)

    def _fill(self, names: Sequence[str], values, valid, offset: np.ndarray) -> np.ndarray:
        P = np.asarray(values, dtype=float)
        ok = np.all(np.isfinite(P), axis=-1)
        if valid is not None:
            ok &= np.asarray(valid, dtype=bool)
        src = np.array([i for i, n in enumerate(names) if n in self._index], dtype=int)
        dst = np.array([self._index[names[i]] for i in src], dtype=int)
        X = np.full(P.shape[:-2] + (len(self.node_names), 3), np.nan)
        X[..., dst, :] = np.where(ok[..., src, None], P[..., src, :], np.nan)
        Q = X[..., self._free, :]                                     # (..., nf, 3)
        unknown = ~np.all(np.isfinite(Q), axis=-1)                    # (..., nf)
        derived = self._T @ np.where(unknown[..., None], 0.0, Q) + offset
        bad = (unknown.astype(float) @ self._Tnz.T.astype(float)) > 0  # (..., N): needs an unknown free node
        derived[bad] = np.nan
        return np.where(np.isfinite(X), X, derived)

    # ---- tensions ----------------------------------------------------------------------------------------
    def tensions(self, params, positions: np.ndarray, velocities: Optional[np.ndarray] = None,
                 motor_angles: Optional[np.ndarray] = None,
                 motor_velocities: Optional[np.ndarray] = None) -> np.ndarray:
        """(S,) string tensions, N, from the engine's string law at full node positions (N, 3) m, velocities
        (N, 3) m/s (None: 0), motor angles (A,) rad in ``actuator_names`` order (None: at the zero offsets) and
        their rates rad/s, with engine ``params`` (:class:`tensegrity_ros.engine.Params`). NaN where a string
        has an unknown node."""
        import torch

        from ..engine.nodal import NodalConstants, full_string_state

        if self._constants is None:
            self._constants = NodalConstants.build(self.topology, torch.float64)
        X = np.asarray(positions, dtype=float)
        known = np.all(np.isfinite(X), axis=-1)
        Xt = torch.as_tensor(np.where(known[:, None], X, self._Xc), dtype=torch.float64)[None]
        V = np.zeros_like(X) if velocities is None else np.nan_to_num(np.asarray(velocities, dtype=float))
        Vt = torch.as_tensor(V, dtype=torch.float64)[None]

        def vec(a):
            if a is None or len(self.actuator_names) == 0:
                return None
            a = np.asarray(a, dtype=float).reshape(-1)
            return None if not np.all(np.isfinite(a)) else torch.as_tensor(a, dtype=torch.float64)[None]

        with torch.no_grad():
            st = full_string_state(self._constants, params, Xt, Vt, vec(motor_angles), vec(motor_velocities))
        t = st.tension[0].numpy().astype(float)
        t[[not known[p].all() for p in self._paths]] = np.nan
        return t

    def rest_tension_scale(self, params) -> float:
        """1.5 x the largest tension at the model's rest positions (motors at their zero offsets), N."""
        t = self.tensions(params, np.asarray(self.topology.X0, dtype=float))
        top = float(np.nanmax(t)) if np.isfinite(t).any() else 0.0
        return 1.5 * top if top > 0 else 1.0

    # ---- markers -----------------------------------------------------------------------------------------
    def bar_markers(self, X: np.ndarray) -> List[MarkerSpec]:
        out = []
        for b, (i, j) in enumerate(self._bar_nodes):
            if not (np.isfinite(X[i]).all() and np.isfinite(X[j]).all()):
                continue
            centre, q, length = cylinder_pose(X[i], X[j])
            d = float(self._bar_diam[b])
            out.append(MarkerSpec("bars", b, "cylinder", BAR_COLOR, (d, d, length), centre, q, name=self.bar_names[b]))
        return out

    def node_marker(self, X: np.ndarray) -> Optional[MarkerSpec]:
        P = X[np.all(np.isfinite(X), axis=1)]
        if not len(P):
            return None
        d = self.style.node_diameter_m
        return MarkerSpec("nodes", 0, "sphere_list", NODE_COLOR, (d, d, d), points=P)

    def string_markers(self, X: np.ndarray, tensions: np.ndarray, scale: float) -> List[MarkerSpec]:
        out = []
        w = self.style.string_width_m
        for s, path in enumerate(self._paths):
            P = X[path]
            if not np.isfinite(P).all():
                continue
            t = float(tensions[s])
            out.append(MarkerSpec("strings", s, "line_strip", tension_color(t, scale), (w, 0.0, 0.0), points=P,
                                  name=self.string_names[s], value=t))
        return out

    def ghost_markers(self, names: Sequence[str], positions: np.ndarray) -> List[MarkerSpec]:
        """The predicted horizon: positions (K, N', 3) m of the nodes ``names`` at steps 0..K-1."""
        st = self.style
        P = np.asarray(positions, dtype=float)
        K = P.shape[0]
        if K == 0 or st.ghost_steps <= 0:
            return []
        X = self.full_positions(names, P)                            # (K, N, 3)
        out = []
        G = st.ghost_steps
        steps = sorted({int(round((j + 1) * (K - 1) / G)) for j in range(G)})
        for j, k in enumerate(steps):
            seg = X[k][self._bar_nodes]                               # (n_bars, 2, 3)
            seg = seg[np.all(np.isfinite(seg), axis=(1, 2))]
            if not len(seg):
                continue
            alpha = st.ghost_alpha * (1.0 - 0.75 * j / max(len(steps) - 1, 1))
            out.append(MarkerSpec("ghost", j, "line_list", GHOST_COLOR + (alpha,), (st.ghost_width_m, 0.0, 0.0),
                                  points=seg.reshape(-1, 3), name=f"step {k}"))
        ks = np.unique(np.linspace(0, K - 1, min(K, max(st.path_samples, 2))).round().astype(int))
        given = sorted({self._index[n] for n in names if n in self._index})   # not their virtual duplicates
        Y = X[ks][:, given]
        Y = Y[:, np.all(np.isfinite(Y), axis=(0, 2))]                 # (k, n, 3) nodes known along the path
        if len(ks) >= 2 and Y.shape[1]:
            pairs = np.stack([Y[:-1], Y[1:]], axis=2).transpose(1, 0, 2, 3).reshape(-1, 3)
            out.append(MarkerSpec("ghost_paths", 0, "line_list", GHOST_COLOR + (0.35 * st.ghost_alpha + 0.1,),
                                  (st.path_width_m, 0.0, 0.0), points=pairs))
        return out

    def markers(self, X: np.ndarray, tensions: Optional[np.ndarray] = None, scale: float = 0.0,
                ghost: Optional[Tuple[Sequence[str], np.ndarray]] = None) -> List[MarkerSpec]:
        """Every marker of the scene: bars, nodes, strings (coloured by ``tensions`` (S,) N on 0..``scale`` N;
        None: all slack-grey) and, with ``ghost`` = (names (N',), positions (K, N', 3)), the predicted horizon."""
        X = np.asarray(X, dtype=float)
        out = self.bar_markers(X)
        nodes = self.node_marker(X)
        if nodes is not None:
            out.append(nodes)
        t = np.full(len(self.string_names), np.nan) if tensions is None else np.asarray(tensions, dtype=float)
        out += self.string_markers(X, t, scale if scale > 0 else 1.0)
        if ghost is not None:
            out += self.ghost_markers(*ghost)
        return out
