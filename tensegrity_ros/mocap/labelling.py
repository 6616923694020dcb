"""Label unlabelled mocap markers with the structure's node names, frame by frame.

Markers arrive as an unordered (M, 3) cloud in the mocap frame (any axes, e.g. Y-up, any origin), some
missing (occlusion), possibly with extras (reflections). :class:`MarkerLabeller` turns each cloud into node
positions in the *structure frame* (the frame of the structure file: for the manipulator the ground frame
fixed by n1..n3), one row per marker node in :attr:`MarkerLabeller.names` order, with a validity flag. An
occluded node is marked invalid; its position is never invented (NaN).

Registration (first frame in which every marker node is visible):
  1. An anchor triangle is taken from the structure: its fixed nodes when it has >= 3 (the manipulator's
     n1..n3); otherwise a bar plus a third node (large, preferably scalene triangle).
  2. Every ordered triple of markers whose pairwise distances match the anchor's (within
     ``anchor_tolerance_m``, or ``free_anchor_tolerance_m`` without fixed nodes) gives a candidate rigid
     transform (Kabsch). The triangle's own symmetry (e.g. an equilateral ground triangle) yields up to
     six candidates per triple; all are kept.
  3. Each candidate maps all markers into the structure frame; a Hungarian assignment against the
     nominal node positions scores it (RMS distance). The best candidates are refined (fixed nodes:
     Kabsch on all fixed nodes; free structures: a few ICP iterations over all nodes).
  4. The best labelling is accepted if its RMS and worst residual are small and every rigid pair (bar,
     plate edge) measures its model length within ``bar_tolerance_m``. If another, different labelling
     fits as well (a symmetric structure: the 3-fold manipulator, the icosahedron), the geometry alone
     cannot tell which node is which: the candidate closest to ``initial_transform`` (a rough guess of the
     mocap->structure transform) is taken, and without a guess :class:`AmbiguousMatchError` is raised.
     With a guess, only the labellings whose rotation lies within ``initial_transform_tolerance_deg`` of it
     compete (when any passes the RMS limits): the robot is never exactly in its file's shape, and a
     symmetric labelling can fit a sagging or moving structure better than the right one (the suite's
     icosahedron, fixed at an equilateral face: 9.2 mm RMS for a labelling turned 120 deg against 14.6 mm for the
     right one; the whole recording then came out turned, 12-35 mm off at every node).

Tracking (every later frame):
  * markers are mapped into the structure frame; each node's position is predicted by a constant-velocity
    Kalman filter (velocity extrapolated at most ``kalman.max_extrapolation_s``); fixed nodes are predicted
    at their file position;
  * pass 1: nodes seen in the previous frame are matched to markers by a Hungarian assignment on the
    distance to their prediction, gated by ``gate_m``;
  * pass 2 (re-acquisition): a node that was occluded is predicted by moving its last seen position with
    the rigid motion that its visible neighbours (nodes joined to it by a bar or string, or else all
    visible nodes) made since then; it gets one of the remaining markers within a radius that grows with
    the time it was unseen (``max_speed_mps``), capped by ``reacquire_gate_m``, and only where the marker
    agrees with every rigid partner (bar mate, plate neighbours) matched in this frame
    (``|distance - length| < bar_tolerance_m``); a node with no partner matched has the smaller cap
    ``reacquire_gate_unconstrained_m``;
  * topology check: every rigid pair with both ends labelled must keep its length within
    ``bar_tolerance_m``; otherwise the less certain label is dropped (re-acquired before tracked, then
    the larger residual relative to its gate);
  * fixed-node marker positions are kept over ``transform_window`` frames; :meth:`refresh_transform`
    re-fits the transform on their means: automatically at every frame until ``auto_refresh_frames`` frames
    (with >= 3 fixed nodes), then on request. Why every frame: the registration is made on ONE frame, and at
    1 mm of marker noise a small fixed triangle puts it 3-11 mrad off (the generality suite's recordings: nodes
    up to 1.9-5.9 mm off). Re-fitted only once, after 120 frames (until stop 36), the whole first second of node
    states sat in that transform. Replayed on 4 twin recordings of the manipulator (0.3 mm), the online
    identifier's first update, which fits that second, ended at 7.45 / 8.59 / 6.17 / 3.28 % median stiffness
    error; with the re-fit at every frame 7.54 / 8.06 / 4.58 / 2.41 %, and with every frame in the final transform
    (what :func:`~.ingest.ingest_markers` returns offline) 7.21 / 8.07 / 5.09 / 2.49 %. The transform's error
    then falls as its mean's does, as 1 / sqrt(frames).
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist

from ..model import Structure
from .filtering import ConstantVelocityKF, KalmanConfig
from .geometry import (MarkerTopology, as_transform, fit_rigid_transform, marker_topology, rotation_angle,
                       transform_change)

__all__ = ["LabellerConfig", "LabelledFrame", "MarkerLabeller", "MocapError", "NoMatchError",
           "AmbiguousMatchError", "Registration", "register_markers"]

_BIG = 1e6


class MocapError(Exception):
    """Base class of the mocap pipeline's errors."""


class NoMatchError(MocapError):
    """The markers do not match the structure (what was expected vs what was seen is in the message)."""


class AmbiguousMatchError(NoMatchError):
    """Several different labellings fit the markers equally well (a symmetric structure) and no
    ``initial_transform`` guess was given to choose between them."""


@dataclass(frozen=True)
class LabellerConfig:
    """Tolerances of :class:`MarkerLabeller` (m, s, m/s). See the module docstring for their roles."""

    gate_m: float = 0.03
    bar_tolerance_m: float = 0.015
    reacquire_gate_m: float = 0.5
    reacquire_gate_unconstrained_m: float = 0.1
    max_speed_mps: float = 0.5
    anchor_tolerance_m: float = 0.01
    free_anchor_tolerance_m: float = 0.05
    registration_rms_m: float = 0.05
    registration_max_residual_m: float = 0.10
    ambiguity_margin_m: float = 0.005
    registration_timeout_s: float = 1.0
    #: Rough mocap->structure transform ((R, t) or 4x4): picks one labelling of a symmetric structure.
    initial_transform: Any = field(default=None, compare=False)
    #: how far the guess's rotation may be off [deg]; below half the smallest angle between two labellings of a
    #: symmetric structure (90 deg for 4-fold symmetry, 120 for 3-fold)
    initial_transform_tolerance_deg: float = 45.0
    #: Nodes that carry a marker; default: all nodes except coincident (virtual) duplicates.
    marker_nodes: Optional[Tuple[str, ...]] = None
    transform_window: int = 240
    #: re-fit the transform on the fixed nodes' mean positions at every frame until this many (None: never)
    auto_refresh_frames: Optional[int] = 120
    max_candidates: int = 5000
    kalman: KalmanConfig = KalmanConfig(accel_psd=5.0, max_extrapolation_s=0.1, reset_after_s=0.2)

    def __post_init__(self):
        for k in ("gate_m", "bar_tolerance_m", "reacquire_gate_m", "reacquire_gate_unconstrained_m", "max_speed_mps",
                  "anchor_tolerance_m",
                  "free_anchor_tolerance_m", "registration_rms_m", "registration_max_residual_m",
                  "ambiguity_margin_m", "registration_timeout_s", "initial_transform_tolerance_deg"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"LabellerConfig.{k} = {v!r}: must be a finite number >= 0")
        if self.transform_window < 1 or self.max_candidates < 1:
            raise ValueError("LabellerConfig: transform_window and max_candidates must be >= 1")
        as_transform(self.initial_transform)  # validates


@dataclass(frozen=True)
class LabelledFrame:
    """One labelled mocap frame, in the structure frame.

    names: (N,) marker node names; positions: (N, 3) m, NaN where not valid; valid: (N,) bool;
    residuals: (N,) m, distance of the matched marker from the node's predicted position (NaN if invalid);
    marker_index: (N,) index of the matched row in the markers given to ``add_frame`` (-1 if invalid);
    registered: False while no registration has succeeded (then nothing is valid).
    """

    stamp: float
    names: Tuple[str, ...]
    positions: np.ndarray
    valid: np.ndarray
    residuals: np.ndarray
    marker_index: np.ndarray
    registered: bool
    n_markers: int
    n_unassigned: int


@dataclass(frozen=True)
class Registration:
    """Result of :func:`register_markers`: mocap->structure (R, t), marker index per node (N,), residuals."""

    R: np.ndarray
    t: np.ndarray
    assignment: np.ndarray
    residuals: np.ndarray
    rms: float
    n_candidates: int
    n_equivalent: int


# ---- registration --------------------------------------------------------------------------------------
def _tri_area(p) -> float:
    return 0.5 * float(np.linalg.norm(np.cross(p[1] - p[0], p[2] - p[0])))


def _anchor(topo: MarkerTopology, cfg: LabellerConfig):
    """(anchor node indices (3,), side tolerance, uses fixed nodes)."""
    X = topo.nominal
    fixed = np.flatnonzero(topo.fixed)
    if fixed.size >= 3:
        tri = max(itertools.combinations(fixed, 3), key=lambda c: _tri_area(X[list(c)]))
        if _tri_area(X[list(tri)]) > 1e-4:
            return np.array(tri), cfg.anchor_tolerance_m, True
    pairs = [tuple(p) for p in topo.rigid_pairs] or list(itertools.combinations(range(len(X)), 2))
    best, best_score = None, -1.0
    for a, b in pairs:
        for c in range(len(X)):
            if c in (a, b):
                continue
            tri = (a, b, c)
            d = np.array([np.linalg.norm(X[a] - X[b]), np.linalg.norm(X[a] - X[c]), np.linalg.norm(X[b] - X[c])])
            scalene = np.min(np.abs(np.diff(np.sort(d)))) / max(d.max(), 1e-9)
            score = _tri_area(X[list(tri)]) * (1.0 + 4.0 * scalene)
            if score > best_score:
                best, best_score = tri, score
    if best is None or _tri_area(X[list(best)]) < 1e-6:
        raise NoMatchError(f"cannot register: the {len(X)} marker nodes have no non-degenerate triangle")
    return np.array(best), cfg.free_anchor_tolerance_m, False


def _candidates(P: np.ndarray, A: np.ndarray, tol: float, cap: int) -> np.ndarray:
    """Ordered marker triples (n, 3) whose side lengths match anchor points A (3, 3)."""
    D = cdist(P, P)
    d01, d02, d12 = (np.linalg.norm(A[i] - A[j]) for i, j in ((0, 1), (0, 2), (1, 2)))
    np.fill_diagonal(D, np.inf)
    ij = np.argwhere(np.abs(D - d01) < tol)
    if ij.size == 0:
        return np.zeros((0, 3), dtype=int)
    mk = (np.abs(D[ij[:, 0]] - d02) < tol) & (np.abs(D[ij[:, 1]] - d12) < tol)  # (n_ij, M)
    r, k = np.nonzero(mk)
    out = np.column_stack([ij[r], k])
    return out[:cap]


def _assign(nominal: np.ndarray, Q: np.ndarray):
    C = cdist(nominal, Q)
    rows, cols = linear_sum_assignment(C)
    res = C[rows, cols]
    assignment = np.full(len(nominal), -1)
    assignment[rows] = cols
    return assignment, C[np.arange(len(nominal)), assignment]


def register_markers(markers, topo: MarkerTopology, cfg: LabellerConfig = LabellerConfig(),
                     structure_name: str = "structure") -> Registration:
    """Find the mocap->structure transform and which marker is which node, from one complete frame.

    markers: (M, 3) in the mocap frame, M >= N (every marker node visible; extras allowed).
    Raises :class:`NoMatchError` (or :class:`AmbiguousMatchError`) with what was expected vs seen.
    """
    P = np.asarray(markers, dtype=float)
    P = P[np.all(np.isfinite(P), axis=1)]
    N, M = len(topo.names), len(P)
    X = topo.nominal
    shown = ", ".join(topo.names[:6]) + (", ..." if N > 6 else "")
    expect = f"structure {structure_name!r} with {N} marker nodes ({shown})"
    if M < N:
        raise NoMatchError(f"registration needs every marker node visible: expected >= {N} markers for {expect}, "
                           f"saw {M}")
    anchor, tol, use_fixed = _anchor(topo, cfg)
    A = X[anchor]
    cand = _candidates(P, A, tol, cfg.max_candidates)
    sides = ", ".join(f"{np.linalg.norm(A[i] - A[j]):.3f}" for i, j in ((0, 1), (0, 2), (1, 2)))
    what = "fixed nodes" if use_fixed else "anchor nodes"
    if len(cand) == 0:
        raise NoMatchError(f"no three markers form the {what} {', '.join(topo.names[i] for i in anchor)} "
                           f"(sides {sides} m, tolerance {tol * 1e3:.0f} mm) of {expect}; saw {M} markers")
    # score every candidate: transform, lower bound by nearest markers, then Hungarian on the promising ones
    scored = []
    for tri in cand:
        R, t = fit_rigid_transform(P[tri], A)
        Q = P @ R.T + t
        C = cdist(X, Q)
        lb = float(np.sqrt(np.mean(C.min(axis=1) ** 2)))
        if lb > 3 * cfg.registration_rms_m + tol:
            continue
        rows, cols = linear_sum_assignment(C)
        scored.append((float(np.sqrt(np.mean(C[rows, cols] ** 2))), R, t))
    if not scored:
        raise NoMatchError(f"markers do not match {expect}: {len(cand)} marker triples look like the {what} "
                           f"(sides {sides} m) but no placement brings the other nodes within "
                           f"{3 * cfg.registration_rms_m * 1e3:.0f} mm RMS of their file positions; saw {M} markers")
    scored.sort(key=lambda s: s[0])
    fixed = np.flatnonzero(topo.fixed)
    refined = {}
    for _, R, t in scored[:50]:
        for _ in range(1 if use_fixed else 4):
            assignment, res = _assign(X, P @ R.T + t)
            idx = fixed if use_fixed else np.arange(N)
            R, t = fit_rigid_transform(P[assignment[idx]], X[idx])
        assignment, res = _assign(X, P @ R.T + t)
        rms = float(np.sqrt(np.mean(res ** 2)))
        key = tuple(assignment)
        if key not in refined or rms < refined[key][0]:
            refined[key] = (rms, R, t, assignment, res)
    ranked = sorted(refined.values(), key=lambda r: r[0])

    def passes(r) -> bool:
        """The labelling (rms, R, t, assignment, residuals) within the acceptance limits."""
        return r[0] <= cfg.registration_rms_m and r[4].max() <= cfg.registration_max_residual_m

    guess = as_transform(cfg.initial_transform)

    def off_guess(r) -> float:
        """The labelling's rotation away from the guess [rad] (only asked with a guess)."""
        return rotation_angle(r[1] @ guess[0].T)

    if guess is not None:
        # the stated guess decides between labellings that pass the limits, not only between equal fits
        tol = math.radians(cfg.initial_transform_tolerance_deg)
        ranked = [r for r in ranked if off_guess(r) <= tol and passes(r)] or ranked
    best = ranked[0]
    limit = best[0] + max(cfg.ambiguity_margin_m, 0.5 * best[0])
    equivalent = [r for r in ranked if r[0] <= limit]
    if len(equivalent) > 1:
        if guess is None:
            raise AmbiguousMatchError(
                f"{len(equivalent)} different labellings of {expect} fit the markers equally well (RMS "
                f"{', '.join(f'{r[0] * 1e3:.1f}' for r in equivalent[:6])} mm): the structure is symmetric, so "
                f"geometry alone cannot tell its nodes apart. Give LabellerConfig.initial_transform, a rough "
                f"mocap->structure transform ((R, t) or 4x4, within about 30 deg), to pick one")
        best = min(equivalent, key=off_guess)
    rms, R, t, assignment, res = best
    if not passes(best):
        worst = int(np.argmax(res))
        raise NoMatchError(f"markers do not match {expect}: best placement leaves RMS {rms * 1e3:.1f} mm "
                           f"(limit {cfg.registration_rms_m * 1e3:.0f} mm), worst node {topo.names[worst]} "
                           f"{res[worst] * 1e3:.1f} mm off (limit {cfg.registration_max_residual_m * 1e3:.0f} mm); "
                           f"saw {M} markers")
    Pm = P[assignment]
    for (a, b), L in zip(topo.rigid_pairs, topo.rigid_lengths):
        d = float(np.linalg.norm(Pm[a] - Pm[b]))
        if abs(d - L) > cfg.bar_tolerance_m:
            raise NoMatchError(f"markers do not match {expect}: the markers labelled {topo.names[a]} and "
                               f"{topo.names[b]} are {d:.3f} m apart but that rigid pair is {L:.3f} m long "
                               f"(tolerance {cfg.bar_tolerance_m * 1e3:.0f} mm)")
    return Registration(R=R, t=t, assignment=assignment, residuals=res, rms=rms, n_candidates=len(cand),
                        n_equivalent=len(equivalent))


# ---- the labeller --------------------------------------------------------------------------------------
class MarkerLabeller:
    """Stateful labeller: ``add_frame(stamp, markers) -> LabelledFrame``. See the module docstring."""

    def __init__(self, structure: Structure, config: LabellerConfig = LabellerConfig()):
        self.structure = structure
        self.config = config
        self.topology = marker_topology(structure, config.marker_nodes)
        self._partners = self.topology.partners
        self.reset()

    # ---- public state --------------------------------------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        """Marker node names, the row order of every output."""
        return self.topology.names

    @property
    def registered(self) -> bool:
        return self._R is not None

    @property
    def transform(self) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Current mocap->structure transform (R (3, 3), t (3,)): p_structure = R p_mocap + t; None before
        registration."""
        return None if self._R is None else (self._R.copy(), self._t.copy())

    @property
    def registration(self) -> Optional[Registration]:
        return self._registration

    def reset(self) -> None:
        """Forget the registration and all tracks (the next frames register again)."""
        N = len(self.names)
        self._R: Optional[np.ndarray] = None
        self._t: Optional[np.ndarray] = None
        self._registration: Optional[Registration] = None
        self._kf = ConstantVelocityKF(N, self.config.kalman)
        self._prev_ok = np.zeros(N, dtype=bool)
        self._last_seen = np.full(N, -np.inf)
        #: _snapshot[i] = all node positions (structure frame, NaN = unseen) in the frame node i was last seen
        self._snapshot = np.full((N, N, 3), np.nan)
        self._first_attempt: Optional[float] = None
        self._last_error: Optional[NoMatchError] = None
        self._fixed_idx = np.flatnonzero(self.topology.fixed)
        self._fixed_hist: deque = deque(maxlen=self.config.transform_window)
        self._frames = 0
        self._refresh_due = False
        self._last_stamp: Optional[float] = None
        self._last_mocap: Optional[np.ndarray] = None

    # ---- frames --------------------------------------------------------------------------------------
    def add_frame(self, stamp: float, markers) -> LabelledFrame:
        """Label one frame. stamp: s; markers: (M, 3) m in the mocap frame, any order (NaN rows ignored)."""
        stamp = float(stamp)
        raw = np.asarray(markers, dtype=float).reshape(-1, 3) if np.size(markers) else np.zeros((0, 3))
        keep = np.flatnonzero(np.all(np.isfinite(raw), axis=1))
        Pm = raw[keep]
        if self._last_stamp is not None and stamp < self._last_stamp:
            raise ValueError(f"add_frame: stamp {stamp:.6f} s is older than the previous frame "
                             f"({self._last_stamp:.6f} s); frames must come in time order")
        if not self.registered:
            return self._register(stamp, Pm, keep)
        self._last_stamp = stamp
        return self._track(stamp, Pm, keep)

    def _empty(self, stamp, n_markers) -> LabelledFrame:
        N = len(self.names)
        return LabelledFrame(stamp, self.names, np.full((N, 3), np.nan), np.zeros(N, dtype=bool),
                             np.full(N, np.nan), np.full(N, -1), False, n_markers, n_markers)

    def _register(self, stamp, Pm, keep) -> LabelledFrame:
        if self._first_attempt is None:
            self._first_attempt = stamp
        try:
            reg = register_markers(Pm, self.topology, self.config, self.structure.name)
        except AmbiguousMatchError:
            raise
        except NoMatchError as err:
            self._last_error = err
            waited = stamp - self._first_attempt
            if waited >= self.config.registration_timeout_s:
                raise NoMatchError(f"no frame in {waited:.2f} s matched the structure (timeout "
                                   f"{self.config.registration_timeout_s:g} s); last attempt: {err}") from None
            return self._empty(stamp, len(Pm))
        self._registration = reg
        self._R, self._t = reg.R, reg.t
        self._last_stamp = stamp
        N = len(self.names)
        Q = Pm @ reg.R.T + reg.t
        pos = Q[reg.assignment]
        valid = np.ones(N, dtype=bool)
        self._kf.update(stamp, pos, valid)
        self._prev_ok[:] = True
        self._last_seen[:] = stamp
        self._snapshot[:] = pos[None]
        self._remember(Pm, reg.assignment, valid)
        return LabelledFrame(stamp, self.names, pos, valid, reg.residuals.copy(), keep[reg.assignment], True,
                             len(Pm), len(Pm) - N)

    def _remember(self, Pm, assignment, valid) -> None:
        """Keep fixed-node mocap positions (for refresh_transform) and the last labelled mocap positions."""
        N = len(self.names)
        last = np.full((N, 3), np.nan)
        last[valid] = Pm[assignment[valid]]
        self._last_mocap = last
        if self._fixed_idx.size:
            self._fixed_hist.append(last[self._fixed_idx])
        self._frames += 1
        # done at the start of the next frame, so that each frame is labelled in one transform
        self._refresh_due = bool(self.config.auto_refresh_frames and self._frames <= self.config.auto_refresh_frames
                                 and self._fixed_idx.size >= 3)

    def _track(self, stamp, Pm, keep) -> LabelledFrame:
        cfg, topo = self.config, self.topology
        if self._refresh_due:
            self._refresh_due = False
            self.refresh_transform()
        N, M = len(self.names), len(Pm)
        Q = Pm @ self._R.T + self._t  # markers in the structure frame
        pred, _, _ = self._kf.predict(stamp)
        if self._fixed_idx.size:
            pred[self._fixed_idx] = topo.nominal[self._fixed_idx]
        unseen = np.maximum(stamp - self._last_seen, 0.0)
        assignment = np.full(N, -1)
        residual = np.full(N, np.nan)
        stage = np.zeros(N, dtype=int)  # 1 = tracked, 2 = re-acquired
        gate = np.full(N, cfg.gate_m)
        free_markers = np.ones(M, dtype=bool)
        D = cdist(pred, Q) if M else np.zeros((N, 0))

        # pass 1: nodes seen in the previous frame
        tracked = np.flatnonzero(self._prev_ok)
        if tracked.size and M:
            C = D[tracked]
            C = np.where(C <= cfg.gate_m, C, _BIG)
            rows, cols = linear_sum_assignment(C)
            ok = C[rows, cols] < _BIG
            for r, c in zip(rows[ok], cols[ok]):
                i = tracked[r]
                assignment[i], residual[i], stage[i] = c, D[i, c], 1
                free_markers[c] = False

        # pass 2: re-acquire nodes that were occluded, constrained by their rigid partners
        lost = np.flatnonzero(~self._prev_ok)
        avail = np.flatnonzero(free_markers)
        if lost.size and avail.size:
            C = np.full((lost.size, avail.size), _BIG)
            for r, i in enumerate(lost):
                g = cfg.gate_m + cfg.max_speed_mps * unseen[i]
                matched = [(p, L) for p, L in self._partners[i] if assignment[p] >= 0]
                g = min(g, cfg.reacquire_gate_m if matched else cfg.reacquire_gate_unconstrained_m)
                gate[i] = g
                p_i = None if topo.fixed[i] else self._neighbour_prediction(i, Q, assignment)
                if p_i is not None:
                    pred[i] = p_i
                d = np.linalg.norm(Q[avail] - pred[i], axis=1)
                feasible = d <= g
                for p, L in matched:
                    feasible &= np.abs(np.linalg.norm(Q[avail] - Q[assignment[p]], axis=1) - L) <= cfg.bar_tolerance_m
                C[r] = np.where(feasible, d, _BIG)
            rows, cols = linear_sum_assignment(C)
            ok = C[rows, cols] < _BIG
            for r, c in zip(rows[ok], cols[ok]):
                i, j = lost[r], avail[c]
                assignment[i], residual[i], stage[i] = j, C[r, c], 2
                free_markers[j] = False

        # topology check: rigid pairs keep their length; drop the less certain label of a violating pair
        if topo.rigid_pairs.size:
            a, b = topo.rigid_pairs[:, 0], topo.rigid_pairs[:, 1]
            both = (assignment[a] >= 0) & (assignment[b] >= 0)
            err = np.full(len(a), 0.0)
            err[both] = np.abs(np.linalg.norm(Q[assignment[a[both]]] - Q[assignment[b[both]]], axis=1)
                               - topo.rigid_lengths[both])
            for k in np.argsort(-err):
                if err[k] <= cfg.bar_tolerance_m:
                    break
                i, j = a[k], b[k]
                if assignment[i] < 0 or assignment[j] < 0:
                    continue

                def doubt(n):
                    return (0 if topo.fixed[n] else 1, stage[n], residual[n] / max(gate[n], 1e-9))
                drop = i if doubt(i) > doubt(j) else j
                free_markers[assignment[drop]] = True
                assignment[drop], residual[drop], stage[drop] = -1, np.nan, 0

        valid = assignment >= 0
        pos = np.full((N, 3), np.nan)
        pos[valid] = Q[assignment[valid]]
        self._kf.update(stamp, pos, valid)
        self._prev_ok = valid.copy()
        self._last_seen[valid] = stamp
        self._snapshot[valid] = pos[None]
        self._remember(Pm, assignment, valid)
        idx = np.where(valid, keep[np.maximum(assignment, 0)] if M else -1, -1)
        return LabelledFrame(stamp, self.names, pos, valid, residual, idx, True, M, int(free_markers.sum()))

    def _neighbour_prediction(self, i: int, Q: np.ndarray, assignment: np.ndarray) -> Optional[np.ndarray]:
        """Last seen position of node i moved by the rigid motion its visible neighbours made since then."""
        snap = self._snapshot[i]
        now = assignment >= 0
        common = now & np.all(np.isfinite(snap), axis=1)
        common[i] = False
        for mask in (common & self.topology.adjacency[i], common):
            k = np.flatnonzero(mask)
            if k.size >= 3:
                src, dst = snap[k], Q[assignment[k]]
                if np.linalg.matrix_rank(src - src.mean(axis=0), tol=1e-3) >= 2:
                    R, t = fit_rigid_transform(src, dst)
                    return R @ snap[i] + t
        return None

    # ---- transform -----------------------------------------------------------------------------------
    def refresh_transform(self) -> Tuple[np.ndarray, np.ndarray]:
        """Re-fit the mocap->structure transform; returns the change (A, b) applied to structure-frame
        states (x' = A x + b) so callers holding such states can follow.

        With >= 3 fixed nodes: Kabsch from the mean of their markers over the last ``transform_window``
        frames to their file positions. Without: Kabsch from the last frame's labelled markers to the file
        positions, i.e. the structure frame is moved onto the current pose (use it at rest). Labels and
        tracks are kept.
        """
        if not self.registered:
            raise MocapError("refresh_transform: not registered yet (no frame has matched the structure)")
        X = self.topology.nominal
        if self._fixed_idx.size >= 3:
            hist = np.stack(list(self._fixed_hist))  # (K, F, 3)
            seen = np.all(np.isfinite(hist), axis=2)
            if not np.all(seen.any(axis=0)):
                missing = [self.names[self._fixed_idx[k]] for k in np.flatnonzero(~seen.any(axis=0))]
                raise MocapError(f"refresh_transform: fixed nodes {missing} were not seen in the last "
                                 f"{len(hist)} frames")
            src, dst = np.nanmean(hist, axis=0), X[self._fixed_idx]
        else:
            ok = np.all(np.isfinite(self._last_mocap), axis=1)
            if ok.sum() < 3:
                raise MocapError(f"refresh_transform: only {int(ok.sum())} nodes visible in the last frame "
                                 f"(need 3)")
            src, dst = self._last_mocap[ok], X[ok]
        R, t = fit_rigid_transform(src, dst)
        A, b = transform_change((self._R, self._t), (R, t))
        self._kf.transform(A, b)
        self._snapshot = self._snapshot @ A.T + b
        self._R, self._t = R, t
        return A, b
