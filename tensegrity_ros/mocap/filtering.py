"""Velocity estimation from marker positions: filtering, never raw differences.

* :class:`ConstantVelocityKF` — online, one constant-velocity Kalman filter per node (the three axes share
  one 2x2 covariance, so the filter is rotation-invariant). Irregular stamps are handled by using the real
  dt in the transition and the process noise; invalid samples do not update (the node's state stays at its
  last update, and a prediction is extrapolated from it at most ``max_extrapolation_s``); a gap longer than
  ``reset_after_s`` re-initialises the node. Used by the labeller (for gates) and by the ingest (output
  velocities).
* :func:`kalman_velocities` — the same filter over a whole recording (function form of the class).
* :func:`smooth_derivatives` — offline: local weighted polynomial fits (a Savitzky-Golay filter that
  works on irregular stamps and skips invalid samples) give positions, velocities and accelerations for
  identification, without the filter's lag.

Units: positions m, times s, velocities m/s, accelerations m/s^2.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import numpy as np
from scipy.linalg import solve_discrete_are

__all__ = ["KalmanConfig", "KFOutput", "ConstantVelocityKF", "kalman_velocities", "Derivatives", "smooth_derivatives"]


@dataclass(frozen=True)
class KalmanConfig:
    """Constant-velocity Kalman filter settings.

    measurement_std_m: marker position noise (1 sigma) [m].
    accel_psd: spectral density of the white-noise acceleration that drives the model [m^2/s^3]; larger
        follows faster motion with less lag but passes more noise into the velocity.
    init_velocity_std_mps: velocity uncertainty of a freshly (re)initialised node [m/s].
    reset_after_s: a node unseen for longer than this is re-initialised at its next measurement [s].
    max_extrapolation_s: predictions extrapolate the velocity at most this long past the last update [s].
    velocity_converged_factor: a velocity is reported (``velocity_ok``) only once its 1-sigma uncertainty
        is below this factor times the filter's steady-state value at the current sample interval (a
        freshly initialised node needs a few samples).
    """

    measurement_std_m: float = 0.5e-3
    accel_psd: float = 3e-3
    init_velocity_std_mps: float = 1.0
    reset_after_s: float = 0.25
    max_extrapolation_s: float = 0.1
    velocity_converged_factor: float = 2.0

    def __post_init__(self):
        for k in ("measurement_std_m", "accel_psd", "init_velocity_std_mps", "reset_after_s",
                  "max_extrapolation_s", "velocity_converged_factor"):
            v = getattr(self, k)
            if not (np.isfinite(v) and v >= 0) or (k == "measurement_std_m" and v == 0):
                raise ValueError(f"KalmanConfig.{k} = {v!r}: must be a finite number > 0")


@lru_cache(maxsize=256)
def _steady_velocity_std(q: float, r: float, dt: float) -> float:
    """Steady-state 1-sigma velocity uncertainty (after an update) of the filter sampled every dt s."""
    if not dt > 0:
        return np.inf
    F = np.array([[1.0, dt], [0.0, 1.0]])
    Q = q * np.array([[dt ** 3 / 3, dt ** 2 / 2], [dt ** 2 / 2, dt]]) + 1e-18 * np.eye(2)
    P = solve_discrete_are(F.T, np.array([[1.0], [0.0]]), Q, np.array([[r]]))  # prior covariance
    K = P[:, 0] / (P[0, 0] + r)
    return float(np.sqrt(max(P[1, 1] - K[1] * P[0, 1], 0.0)))


class KFOutput(NamedTuple):
    """One filter update: positions (N, 3) m, velocities (N, 3) m/s, position_ok (N,), velocity_ok (N,)."""

    positions: np.ndarray
    velocities: np.ndarray
    position_ok: np.ndarray
    velocity_ok: np.ndarray


class ConstantVelocityKF:
    """A bank of N independent constant-velocity Kalman filters (one per node, 3-D)."""

    def __init__(self, n_nodes: int, config: KalmanConfig = KalmanConfig()):
        self.config = config
        self.n = int(n_nodes)
        self.reset()

    def reset(self, mask: Optional[np.ndarray] = None) -> None:
        """Forget the state of all nodes (or of ``mask`` (N,) bool)."""
        if mask is None:
            self.pos = np.full((self.n, 3), np.nan)
            self.vel = np.full((self.n, 3), np.nan)
            self.P = np.zeros((self.n, 2, 2))
            self.t_last = np.full(self.n, np.nan)
            self._dt_ref: Optional[float] = None
        else:
            mask = np.asarray(mask, dtype=bool)
            self.pos[mask] = np.nan
            self.vel[mask] = np.nan
            self.P[mask] = 0.0
            self.t_last[mask] = np.nan

    @property
    def initialized(self) -> np.ndarray:
        """(N,) bool: nodes with a state."""
        return np.isfinite(self.t_last)

    def _propagate(self, dt: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Covariance after dt (N,) s of prediction, as its entries p00, p01, p11 (each (N,)): built as
        components, not (N, 2, 2) stacks, because this runs twice per mocap frame (labeller and ingest)."""
        q = self.config.accel_psd
        P = self.P
        a, b, c = P[:, 0, 0], P[:, 0, 1], P[:, 1, 1]
        p00 = a + 2 * dt * b + dt * dt * c + q * dt ** 3 / 3
        p01 = b + dt * c + q * dt * dt / 2
        p11 = c + q * dt
        return p00, p01, p11

    def predict(self, t: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Predicted state at t without changing the filter.

        Returns positions (N, 3) m (velocity extrapolated at most ``max_extrapolation_s``), velocities (N, 3)
        m/s and position standard deviations (N,) m; NaN for nodes without a state.
        """
        dt = np.maximum(t - self.t_last, 0.0)
        dte = np.minimum(dt, self.config.max_extrapolation_s)
        pos = self.pos + self.vel * dte[:, None]
        p00, _, _ = self._propagate(np.where(np.isfinite(dt), dt, 0.0))
        std = np.where(self.initialized, np.sqrt(np.maximum(p00, 0.0)), np.nan)
        return pos, self.vel.copy(), std

    def update(self, t: float, z, valid) -> "KFOutput":
        """Fuse measurements z (N, 3) m taken at t s for the nodes where valid (N,) is true.

        Returns :class:`KFOutput`: filtered positions (N, 3) where ``position_ok`` (this call updated the
        node), velocities (N, 3) where ``velocity_ok`` (updated and converged); NaN elsewhere. A sample older
        than the node's last update is ignored.
        """
        cfg = self.config
        z = np.asarray(z, dtype=float).reshape(self.n, 3)
        valid = np.asarray(valid, dtype=bool).reshape(self.n) & np.all(np.isfinite(z), axis=1)
        dt = t - self.t_last
        fresh = valid & (~self.initialized | (dt > cfg.reset_after_s))
        step = valid & ~fresh & (dt >= 0)
        r = cfg.measurement_std_m ** 2
        if fresh.any():
            self.pos[fresh] = z[fresh]
            self.vel[fresh] = 0.0
            self.P[fresh] = np.diag([r, cfg.init_velocity_std_mps ** 2])
            self.t_last[fresh] = t
        any_step = bool(step.any())
        if any_step:
            d = dt[step]
            p00, p01, p11 = (v[step] for v in self._propagate(np.where(step, dt, 0.0)))
            pos = self.pos[step] + self.vel[step] * d[:, None]
            vel = self.vel[step]
            S = p00 + r
            k0, k1 = p00 / S, p01 / S    # the Kalman gain (position, velocity)
            innov = z[step] - pos
            self.pos[step] = pos + k0[:, None] * innov
            self.vel[step] = vel + k1[:, None] * innov
            # P - K H P with H = [1 0]: the posterior stays symmetric
            Pn = np.empty((d.size, 2, 2))
            Pn[:, 0, 0] = p00 - k0 * p00
            Pn[:, 0, 1] = Pn[:, 1, 0] = p01 - k0 * p01
            Pn[:, 1, 1] = p11 - k1 * p01
            self.P[step] = Pn
            self.t_last[step] = t
        ok = fresh | step
        if any_step:  # typical sample interval (running median-ish), for the convergence test
            d = float(np.median(d))
            self._dt_ref = d if self._dt_ref is None else 0.95 * self._dt_ref + 0.05 * d
        steady = _steady_velocity_std(cfg.accel_psd, r, float(f"{self._dt_ref:.2g}")) if self._dt_ref else np.inf
        vok = ok & (np.sqrt(np.maximum(self.P[:, 1, 1], 0.0)) <= cfg.velocity_converged_factor * steady)
        return KFOutput(np.where(ok[:, None], self.pos, np.nan), np.where(vok[:, None], self.vel, np.nan), ok, vok)

    def transform(self, A: np.ndarray, b: np.ndarray) -> None:
        """Re-express the state after a change of frame x' = A x + b (A a rotation)."""
        self.pos = self.pos @ A.T + b
        self.vel = self.vel @ A.T


def kalman_velocities(t, x, valid=None, config: KalmanConfig = KalmanConfig()):
    """Run :class:`ConstantVelocityKF` over a recording.

    t: (T,) s increasing; x: (T, N, 3) m; valid: (T, N) bool or None (all finite samples).
    Returns :class:`KFOutput` with a leading time axis: positions (T, N, 3), velocities (T, N, 3),
    position_ok (T, N), velocity_ok (T, N); NaN where not ok.
    """
    t = np.asarray(t, dtype=float)
    x = np.asarray(x, dtype=float)
    if x.ndim != 3 or x.shape[0] != t.shape[0] or x.shape[2] != 3:
        raise ValueError(f"kalman_velocities: x must be (T, N, 3) with T = len(t) = {t.shape[0]}, got {x.shape}")
    valid = np.all(np.isfinite(x), axis=2) if valid is None else np.asarray(valid, dtype=bool)
    kf = ConstantVelocityKF(x.shape[1], config)
    P, V = np.empty_like(x), np.empty_like(x)
    OK, VOK = np.zeros(valid.shape, dtype=bool), np.zeros(valid.shape, dtype=bool)
    for k in range(t.shape[0]):
        P[k], V[k], OK[k], VOK[k] = kf.update(t[k], x[k], valid[k])
    return KFOutput(P, V, OK, VOK)


class Derivatives(NamedTuple):
    """Output of :func:`smooth_derivatives`: arrays shaped like the input x; valid shaped like the input's."""

    positions: np.ndarray
    velocities: np.ndarray
    accelerations: np.ndarray
    valid: np.ndarray


#: elements of one chunk's gathered windows in :func:`smooth_derivatives` (~32 MB of float64)
_CHUNK_ELEMENTS = 4_000_000


def smooth_derivatives(t, x, valid=None, *, window_s: float = 0.2, order: int = 2,
                       min_samples: Optional[int] = None, fill_gaps: bool = False) -> Derivatives:
    """Local weighted polynomial fits (irregular-stamp Savitzky-Golay) for offline identification.

    For each sample i with a valid value, a polynomial of degree ``order`` in (t - t_i) is fitted by
    tricube-weighted least squares to the valid samples within +-window_s/2 and its value, first and
    second derivative at t_i are returned. Invalid samples are never used, and by default never filled: their
    outputs are NaN and ``valid`` is False, as for samples with fewer than ``min_samples`` (default order + 3)
    valid neighbours or without a valid neighbour on both sides when inside the record.

    ``fill_gaps``: invalid samples are estimated too, from the same fit of their valid neighbours, where those
    meet the same conditions (enough of them, on both sides); ``valid`` then marks those estimates as well, and
    the caller's own mask says which samples were measured. (What a multiple-shooting window needs at its start:
    a state estimate, which is fitted afterwards anyway.)

    t: (T,) s, strictly increasing; x: (T, ...) (e.g. (T, N, 3) m or (T, D)); valid: None, (T,) or the
    leading dims of x without the last one (e.g. (T, N)), bool.
    """
    t = np.asarray(t, dtype=float)
    x = np.asarray(x, dtype=float)
    if t.ndim != 1 or x.shape[0] != t.shape[0]:
        raise ValueError(f"smooth_derivatives: t must be (T,) and x (T, ...); got {t.shape} and {x.shape}")
    if t.size > 1 and np.any(np.diff(t) <= 0):
        raise ValueError("smooth_derivatives: t must be strictly increasing")
    if order < 1:
        raise ValueError("smooth_derivatives: order must be >= 1")
    min_samples = order + 3 if min_samples is None else int(min_samples)
    T = t.shape[0]
    X = x.reshape(T, -1, x.shape[-1]) if x.ndim >= 2 else x.reshape(T, 1, 1)  # (T, K, D)
    K = X.shape[1]
    finite = np.all(np.isfinite(X), axis=2)
    if valid is None:
        V = finite
    else:
        valid = np.asarray(valid, dtype=bool)
        if valid.shape == (T,):
            V = np.repeat(valid[:, None], K, axis=1)
        else:
            V = valid.reshape(T, K)
        V = V & finite
    Xz = np.where(V[:, :, None], X, 0.0)
    h = window_s / 2.0
    lo = np.searchsorted(t, t - h, side="left")
    hi = np.searchsorted(t, t + h, side="right")
    p = order + 1
    pos = np.full(X.shape, np.nan)
    vel = np.full(X.shape, np.nan)
    acc = np.full(X.shape, np.nan)
    ok = np.zeros((T, K), dtype=bool)
    powers = np.arange(p)
    Wm = int((hi - lo).max()) if T else 0
    # every sample's window padded to the widest one, a chunk of samples at a time (a Python loop per sample
    # was 0.13 s for a 7-s window of the manipulator, paid by every online update, twice)
    chunk = max(1, int(_CHUNK_ELEMENTS // max(1, Wm * K * X.shape[2])))
    for c0 in range(0, T, chunk):
        rows = np.arange(c0, min(T, c0 + chunk))
        idx = lo[rows, None] + np.arange(Wm)[None, :]                  # (n, Wm)
        inside = idx < hi[rows, None]
        idx = np.minimum(idx, T - 1)
        s = np.where(inside, (t[idx] - t[rows, None]) / h, 0.0)       # in [-1, 1]
        w = np.where(inside, (1 - np.abs(s) ** 3) ** 3 + 1e-3, 0.0)   # tricube, never exactly zero inside
        m = V[idx] & inside[:, :, None]                               # (n, Wm, K)
        if not fill_gaps:
            m &= V[rows][:, None, :]
        cnt = m.sum(axis=1)
        before = (m & (s < 0)[:, :, None]).any(axis=1)
        after = (m & (s > 0)[:, :, None]).any(axis=1)
        edge = ((lo[rows] > 0) & (hi[rows] < T))[:, None]
        # a filled sample needs valid neighbours on both sides even at the record's ends (no extrapolation)
        interior = np.where(edge | ~V[rows], before & after, before | after)
        good = (cnt >= min_samples) & interior                        # (n, K)
        if not fill_gaps:
            good &= V[rows]
        if not good.any():
            continue
        A = s[:, :, None] ** powers                                   # (n, Wm, p)
        Wt = w[:, :, None] * m                                        # (n, Wm, K)
        n, D = rows.size, X.shape[2]
        # the normal equations as batched matrix products (a three-operand einsum runs unoptimised, no BLAS)
        G = (Wt.transpose(0, 2, 1) @ (A[:, :, :, None] * A[:, :, None, :]).reshape(n, Wm, p * p))
        G = G.reshape(n, K, p, p)[good]
        WX = (Wt[:, :, :, None] * Xz[idx]).reshape(n, Wm, K * D)
        b = (A.transpose(0, 2, 1) @ WX).reshape(n, p, K, D).transpose(0, 2, 1, 3)[good]
        G += 1e-12 * np.eye(p)[None]
        cf = np.linalg.solve(G, b)                                    # (g, p, D)
        gi, gk = np.nonzero(good)
        gi = rows[gi]
        pos[gi, gk] = cf[:, 0]
        vel[gi, gk] = cf[:, 1] / h
        acc[gi, gk] = 2.0 * cf[:, 2] / h ** 2 if order >= 2 else 0.0
        ok[gi, gk] = True
    shape_valid = (T,) + x.shape[1:-1] if x.ndim >= 2 else (T,)
    return Derivatives(pos.reshape(x.shape), vel.reshape(x.shape), acc.reshape(x.shape), ok.reshape(shape_valid))
