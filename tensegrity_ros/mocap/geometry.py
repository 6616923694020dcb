"""Small geometry helpers for the mocap pipeline: rigid fits and the structure's marker topology.

``fit_rigid_transform`` is :func:`tensegrity_ros.frames.fit_rigid_transform` (one Kabsch for the package).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..frames import fit_rigid_transform  # noqa: F401  (re-exported: the labeller's Kabsch)
from ..model import CoincidentConstraint, MidpointConstraint, Structure




def rotation_angle(R: np.ndarray) -> float:
    """Angle of a rotation matrix, rad in [0, pi]."""
    return float(np.arccos(np.clip((np.trace(R) - 1.0) / 2.0, -1.0, 1.0)))


def same_transform(a: Optional[Tuple[np.ndarray, np.ndarray]], b: Optional[Tuple[np.ndarray, np.ndarray]]) -> bool:
    """Whether two mocap->structure transforms (R, t) are the same one, bit for bit (a re-fit always moves them);
    False when either is None."""
    return a is not None and b is not None and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def transform_change(old: Tuple[np.ndarray, np.ndarray], new: Tuple[np.ndarray, np.ndarray]):
    """(A, b) with x_new = A x_old + b for two mocap->structure transforms (R, t) of the same mocap points
    (p_structure = R p_mocap + t): A = R_new R_old^T, b = t_new - A t_old. Velocities map by A alone."""
    A = new[0] @ old[0].T
    return A, new[1] - A @ old[1]


def as_transform(value) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(R, t) from None, a 4x4 homogeneous matrix or an (R, t) pair."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        R, t = np.asarray(value[0], dtype=float), np.asarray(value[1], dtype=float)
    else:
        T = np.asarray(value, dtype=float)
        if T.shape != (4, 4):
            raise ValueError(f"transform: expected (R, t) or a 4x4 matrix, got shape {T.shape}")
        R, t = T[:3, :3], T[:3, 3]
    if R.shape != (3, 3) or t.shape != (3,):
        raise ValueError(f"transform: R must be (3, 3) and t (3,), got {R.shape} and {t.shape}")
    if not np.allclose(R @ R.T, np.eye(3), atol=1e-6) or np.linalg.det(R) < 0:
        raise ValueError("transform: R is not a proper rotation matrix")
    return R.copy(), t.copy()


def virtual_nodes(structure: Structure) -> Dict[str, str]:
    """virtual node -> physical node it duplicates (coincident constraints, chains resolved)."""
    parent = {c.nodes[1]: c.nodes[0] for c in structure.constraints if isinstance(c, CoincidentConstraint)}

    def root(n):
        seen = set()
        while n in parent and n not in seen:
            seen.add(n)
            n = parent[n]
        return n
    return {v: root(v) for v in parent}


def physical_nodes(structure: Structure) -> Tuple[str, ...]:
    """Nodes that carry a marker: every node that is not a coincident duplicate, in file order."""
    virt = virtual_nodes(structure)
    return tuple(n for n in structure.node_names if n not in virt)


@dataclass(frozen=True)
class MarkerTopology:
    """What the labeller knows about the marker nodes (all positions in the structure frame, m).

    names: (N,) marker node names; nominal: (N, 3) their file positions; fixed: (N,) bool;
    rigid_pairs: (P, 2) node indices whose distance is constant (bars, plate edges from virtual bars,
    midpoint-to-edge-end distances); rigid_lengths: (P,) those distances; adjacency: (N, N) bool, nodes
    joined by a bar, a string segment or a rigid pair.
    """

    names: Tuple[str, ...]
    nominal: np.ndarray
    fixed: np.ndarray
    rigid_pairs: np.ndarray
    rigid_lengths: np.ndarray
    adjacency: np.ndarray

    @property
    def partners(self) -> Tuple[Tuple[Tuple[int, float], ...], ...]:
        """Per node: ((partner index, distance), ...)."""
        out = [[] for _ in self.names]
        for (a, b), L in zip(self.rigid_pairs, self.rigid_lengths):
            out[a].append((int(b), float(L)))
            out[b].append((int(a), float(L)))
        return tuple(tuple(p) for p in out)


def marker_topology(structure: Structure, marker_nodes: Optional[Sequence[str]] = None) -> MarkerTopology:
    """Build :class:`MarkerTopology` for ``marker_nodes`` (default: :func:`physical_nodes`)."""
    virt = virtual_nodes(structure)
    names = tuple(marker_nodes) if marker_nodes is not None else physical_nodes(structure)
    unknown = [n for n in names if n not in structure.node_names]
    if unknown:
        raise ValueError(f"marker_nodes: {unknown} are not nodes of structure {structure.name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"marker_nodes: duplicate names in {names}")
    idx = {n: i for i, n in enumerate(names)}
    pos = {n.name: np.asarray(n.position, dtype=float) for n in structure.nodes}
    nominal = np.stack([pos[n] for n in names])
    fixed = np.array([structure.nodes[structure.node_index(n)].fixed for n in names], dtype=bool)

    pairs: Dict[Tuple[int, int], float] = {}

    def add(a: str, b: str):
        a, b = virt.get(a, a), virt.get(b, b)
        if a in idx and b in idx and a != b:
            key = tuple(sorted((idx[a], idx[b])))
            pairs[key] = float(np.linalg.norm(pos[a] - pos[b]))
    for bar in structure.bars:
        add(*bar.nodes)
    for c in structure.constraints:
        if isinstance(c, MidpointConstraint):  # on a rigid edge: fixed distance to both ends
            a, b = (virt.get(x, x) for x in c.between)
            if tuple(sorted((a, b))) in {tuple(sorted((virt.get(p, p), virt.get(q, q))))
                                         for p, q in (bar.nodes for bar in structure.bars)}:
                add(c.node, a)
                add(c.node, b)
    keys = sorted(pairs)
    adjacency = np.zeros((len(names), len(names)), dtype=bool)
    links = [bar.nodes for bar in structure.bars] + [seg for st in structure.strings for seg in st.segments]
    for a, b in links:
        a, b = virt.get(a, a), virt.get(b, b)
        if a in idx and b in idx and a != b:
            adjacency[idx[a], idx[b]] = adjacency[idx[b], idx[a]] = True
    for a, b in keys:
        adjacency[a, b] = adjacency[b, a] = True
    return MarkerTopology(names=names, nominal=nominal, fixed=fixed,
                          rigid_pairs=np.array(keys, dtype=int).reshape(-1, 2),
                          rigid_lengths=np.array([pairs[k] for k in keys], dtype=float), adjacency=adjacency)
