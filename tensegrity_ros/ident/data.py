"""Identification data: a :class:`Dataset` record over arrays, windows and derivative estimates.

A dataset is one contiguous recording (mocap times ``t`` (T,) s, strictly increasing):

* ``positions`` (T, N, 3) m: positions of ALL structure nodes (structure order, structure frame). Virtual
  and fixed nodes may be NaN / invalid: the regression and the refinement only use the independent
  ("free") nodes and rebuild the others through the structure's linear constraints.
* ``valid`` (T, N) bool: which samples are measurements (NaN positions are never valid).
* ``motor_angles`` (T, A) rad or None, aligned to the mocap time (the motor-to-mocap delay is a parameter
  of the refinement, not of the data).
* ``external_forces`` (T, N, 3) N or None: known external forces (nodal engine); ``control_forces``
  (T, R, 3) N and ``control_arms`` (T, R, 3) m (spring-rod engine, scaled by ``control_force_scalar``).
* ``dt`` s: the nominal sampling period (median of the stamps' differences).

All functions are pure; nothing here imports torch or ROS.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .errors import DataError

__all__ = ["DataError", "Dataset", "Window", "Derivatives", "ScreenReport", "make_dataset", "derivatives",
           "cut_windows", "screen_dataset", "add_marker_noise", "drop_frames", "resample_motor_angles"]


def resample_motor_angles(t_query: np.ndarray, times: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Motor angles (S, A) sampled at ``times`` (S,), resampled at ``t_query`` (T,) by a cubic spline through the
    samples (linear with fewer than 4, or where a sample is not finite: a NaN reading then stays NaN around it, so
    the data are refused downstream, never repaired; repeated stamps keep their first sample).

    Why not linear: motor states come at 80 Hz and node states at 120 Hz, and the engine interpolates the 120-Hz
    values again between its steps. A straight line between samples cuts the peaks of a fast drive (by up to
    (omega dt)^2 / 8: 6 % for a 9-Hz family at 80 Hz), a systematic input error the fit absorbs into stiffnesses
    and rest lengths. Measured on the generality suite (seed 0, `tensegrity identify` with the lab's flags, linear
    -> cubic): prism 86 -> 93 % of the truths inside +-2 sigma (seed 1: 71 -> 82 %, stiffness 5.4 -> 4.7 %),
    tower 2.2 -> 1.9 % stiffness, 0.8 -> 0.5 % mass, 98 -> 100 %; icosahedron 1.6 -> 1.9 % stiffness, 19.4 ->
    18.0 % damping, 96 % either way."""
    t = np.asarray(times, dtype=float)
    y = np.asarray(angles, dtype=float)
    tq = np.asarray(t_query, dtype=float)
    t, first = np.unique(t, return_index=True)
    y = y[first]
    if y.ndim == 1:
        y = y[:, None]
    if t.size < 4 or not np.all(np.isfinite(y)):
        return np.stack([np.interp(tq, t, y[:, j]) for j in range(y.shape[1])], axis=1)
    from scipy.interpolate import CubicSpline
    return CubicSpline(t, y, axis=0, extrapolate=False)(np.clip(tq, t[0], t[-1]))


@dataclass(frozen=True)
class Dataset:
    """One contiguous recording (see the module docstring for shapes and units)."""

    times: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    dt: float
    motor_angles: Optional[np.ndarray] = None
    external_forces: Optional[np.ndarray] = None
    control_forces: Optional[np.ndarray] = None
    control_arms: Optional[np.ndarray] = None
    #: optional exact velocities (T, N, 3) m/s (simulated data); never required
    velocities: Optional[np.ndarray] = None
    node_names: Tuple[str, ...] = ()
    actuator_names: Tuple[str, ...] = ()
    name: str = ""

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        return int(self.times.shape[0])

    @property
    def n_nodes(self) -> int:
        return int(self.positions.shape[1])

    @property
    def duration(self) -> float:
        return float(self.times[-1] - self.times[0]) if self.n_samples else 0.0

    def slice(self, start: int, stop: int) -> "Dataset":
        """Samples [start, stop) as a new dataset (arrays are views)."""
        kw = {}
        for f in ("times", "positions", "valid", "motor_angles", "external_forces", "control_forces",
                  "control_arms", "velocities"):
            v = getattr(self, f)
            kw[f] = None if v is None else v[start:stop]
        return dataclasses.replace(self, **kw)

    def subsample(self, every: int) -> "Dataset":
        """Every ``every``-th sample (e.g. a 1 kHz simulation seen at a lower rate)."""
        kw = {}
        for f in ("times", "positions", "valid", "motor_angles", "external_forces", "control_forces",
                  "control_arms", "velocities"):
            v = getattr(self, f)
            kw[f] = None if v is None else v[::every]
        return dataclasses.replace(self, dt=self.dt * every, **kw)


@dataclass(frozen=True)
class Window:
    """A window of a dataset: ``data`` = samples [start, stop) of ``source`` (index ``index`` in a cut)."""

    data: Dataset
    start: int
    stop: int
    index: int = 0


def make_dataset(times, positions, valid=None, motor_angles=None, *, external_forces=None, control_forces=None,
                 control_arms=None, velocities=None, node_names=(), actuator_names=(), name="",
                 dt: Optional[float] = None) -> Dataset:
    """Validate and assemble a :class:`Dataset` (copies to float64 / bool; NaN positions become invalid).

    Raises :class:`DataError` on wrong shapes, non-increasing or non-finite stamps.
    """
    t = np.asarray(times, dtype=np.float64).reshape(-1)
    X = np.asarray(positions, dtype=np.float64)
    if X.ndim != 3 or X.shape[2] != 3 or X.shape[0] != t.shape[0]:
        raise DataError(f"positions must be (T, N, 3) with T = len(times) = {t.shape[0]}; got {X.shape}")
    if not np.all(np.isfinite(t)):
        raise DataError("times contain non-finite values")
    if t.size > 1 and np.any(np.diff(t) <= 0):
        raise DataError("times must be strictly increasing")
    finite = np.all(np.isfinite(X), axis=2)
    if valid is None:
        V = finite
    else:
        V = np.asarray(valid, dtype=bool)
        if V.shape != X.shape[:2]:
            raise DataError(f"valid must be (T, N) = {X.shape[:2]}; got {V.shape}")
        V = V & finite

    def opt(a, shape_tail, what):
        if a is None:
            return None
        a = np.asarray(a, dtype=np.float64)
        if a.shape[0] != t.shape[0] or (shape_tail is not None and a.shape[1:] != shape_tail):
            raise DataError(f"{what} must have shape (T, ...) with T = {t.shape[0]}; got {a.shape}")
        return a

    U = opt(motor_angles, None, "motor_angles")
    if U is not None:
        if U.ndim == 1:
            U = U[:, None]
        if not np.all(np.isfinite(U)):
            raise DataError("motor_angles contain non-finite values (interpolate or cut the window)")
    if dt is None:
        dt = float(np.median(np.diff(t))) if t.size > 1 else 0.0
    return Dataset(times=t, positions=X, valid=V, dt=float(dt), motor_angles=U,
                   external_forces=opt(external_forces, X.shape[1:], "external_forces"),
                   control_forces=opt(control_forces, None, "control_forces"),
                   control_arms=opt(control_arms, None, "control_arms"),
                   velocities=opt(velocities, X.shape[1:], "velocities"),
                   node_names=tuple(node_names), actuator_names=tuple(actuator_names), name=name)


def cut_windows(data: Dataset, length: int, stride: Optional[int] = None, *, min_valid_fraction: float = 0.5,
                nodes: Optional[Sequence[int]] = None) -> List[Window]:
    """Windows of ``length`` samples every ``stride`` samples (default: ``length``, contiguous).

    A window is kept when at least ``min_valid_fraction`` of its (sample, node) entries over ``nodes``
    (default: all nodes) are valid and its first sample is valid for all those nodes (a window start is
    initialised from a measured state).
    """
    stride = length if stride is None else int(stride)
    if length < 2 or stride < 1:
        raise ValueError("cut_windows: length must be >= 2 and stride >= 1")
    idx = np.arange(data.n_nodes) if nodes is None else np.asarray(nodes, dtype=int)
    out: List[Window] = []
    for k, s in enumerate(range(0, data.n_samples - length + 1, stride)):
        v = data.valid[s:s + length][:, idx]
        if not v[0].all() or v.mean() < min_valid_fraction:
            continue
        out.append(Window(data.slice(s, s + length), s, s + length, len(out)))
    return out


class Derivatives(NamedTuple):
    """Positions, velocities, accelerations (T, N, 3) (m, m/s, m/s^2) and ok (T, N) bool."""

    positions: np.ndarray
    velocities: np.ndarray
    accelerations: np.ndarray
    ok: np.ndarray


#: the last few :func:`derivatives` results, by a digest of the data's arrays and the arguments
_DERIVATIVES: "collections.OrderedDict[tuple, Derivatives]" = collections.OrderedDict()
_DERIVATIVES_KEPT = 8
_DERIVATIVES_LOCK = threading.Lock()


def derivatives(data: Dataset, method: str = "auto", *, window_s: Optional[float] = None,
                order: int = 2, fill_gaps: bool = False) -> Derivatives:
    """Velocity and acceleration estimates from the positions (see :func:`_derivatives`); the result's arrays are
    read-only.

    The last few results are kept, by a digest of what they are computed from (the step, times, positions,
    valid flags and any simulator velocities; not the arrays' identities: a caller may change an array in place
    between calls). ``identify`` builds a stage-2 problem from the same recording for every rung and every check,
    and each smoothed its window starts' derivatives again (1.5 s of the parent's time on the README's 16-s bag,
    py-spy, 2026-12-04) while the window workers waited. The digest costs ~1 ms there."""
    digest = hashlib.blake2b(repr(data.dt).encode(), digest_size=16)
    for a in (data.times, data.positions, data.valid, data.velocities):
        if a is None:
            digest.update(b"none")
            continue
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.data)
    key = (digest.digest(), method, window_s, order, fill_gaps)
    with _DERIVATIVES_LOCK:
        hit = _DERIVATIVES.get(key)
        if hit is not None:
            _DERIVATIVES.move_to_end(key)
            return hit
    out = _derivatives(data, method, window_s=window_s, order=order, fill_gaps=fill_gaps)
    for a in out:
        a.setflags(write=False)
    with _DERIVATIVES_LOCK:
        _DERIVATIVES[key] = out
        while len(_DERIVATIVES) > _DERIVATIVES_KEPT:
            _DERIVATIVES.popitem(last=False)
    return out


def _derivatives(data: Dataset, method: str = "auto", *, window_s: Optional[float] = None,
                 order: int = 2, fill_gaps: bool = False) -> Derivatives:
    """Velocity and acceleration estimates from the positions.

    method:
      ``semi_implicit``: exact for data made by a semi-implicit (symplectic) Euler integrator sampled at
        every step: v_t = (x_t - x_{t-1}) / h, a_t = (x_{t+1} - 2 x_t + x_{t-1}) / h^2 (needs uniform stamps);
        with the simulator's velocities in the dataset: v_t = those, a_t = (v_{t+1} - v_t) / h (exact
        also when the simulator projects onto constraints after each step);
      ``central``: v_t = (x_{t+1} - x_{t-1}) / 2h, same a_t (second order for smooth data);
      ``smooth``: local weighted polynomial fits over ``window_s`` (default 0.2 s; see
        :func:`tensegrity_ros.mocap.filtering.smooth_derivatives`) -- for noisy or gappy data;
      ``auto``: ``smooth`` when any sample is invalid or the stamps are irregular, else ``central``.
    ``ok`` marks samples whose estimates used only valid samples.
    ``fill_gaps`` (``smooth`` only): unmeasured samples between measured ones are estimated too, and marked in
    ``ok`` (:func:`~tensegrity_ros.mocap.filtering.smooth_derivatives`); ``data.valid`` still says which were
    measured. For window starts, never for the regression's samples.
    """
    t, X, V = data.times, data.positions, data.valid
    T = data.n_samples
    if T < 3:
        raise DataError(f"derivatives need at least 3 samples, got {T}")
    d = np.diff(t)
    uniform = bool(np.all(np.abs(d - data.dt) <= 1e-6 * max(data.dt, 1e-12)))
    if method == "auto":
        method = "central" if (uniform and V.all()) else "smooth"
    if method in ("semi_implicit", "central"):
        if not uniform:
            raise DataError(f"method {method!r} needs uniform stamps; use 'smooth'")
        h = data.dt
        Xz = np.where(V[..., None], X, 0.0)
        vel = np.full_like(X, np.nan)
        acc = np.full_like(X, np.nan)
        ok = np.zeros(V.shape, dtype=bool)
        if method == "semi_implicit" and data.velocities is not None:
            # exact simulator velocities: a_t = (v_{t+1} - v_t) / h inverts v_{t+1} = v_t + h a(x_t, v_t)
            # (also exact when the simulator projects positions onto constraints after each step)
            Vz = np.where(V[..., None], data.velocities, 0.0)
            vel[:] = Vz
            acc[:-1] = (Vz[1:] - Vz[:-1]) / h
            ok[:-1] = V[1:] & V[:-1]
        else:
            acc[1:-1] = (Xz[2:] - 2 * Xz[1:-1] + Xz[:-2]) / h ** 2
            if method == "semi_implicit":
                vel[1:] = (Xz[1:] - Xz[:-1]) / h
            else:
                vel[1:-1] = (Xz[2:] - Xz[:-2]) / (2 * h)
            ok[1:-1] = V[2:] & V[1:-1] & V[:-2]
        vel = np.where(ok[..., None], vel, np.nan)
        acc = np.where(ok[..., None], acc, np.nan)
        pos = np.where(V[..., None], X, np.nan)
        return Derivatives(pos, vel, acc, ok)
    if method == "smooth":
        from ..mocap.filtering import smooth_derivatives
        w = 0.2 if window_s is None else float(window_s)
        r = smooth_derivatives(t, X, V, window_s=w, order=max(2, order), fill_gaps=fill_gaps)
        return Derivatives(r.positions, r.velocities, r.accelerations, r.valid)
    raise ValueError(f"unknown derivative method {method!r} (valid: auto, semi_implicit, central, smooth)")


# ---- synthetic measurement effects (benchmarks, tests) ------------------------------------------------
def add_marker_noise(data: Dataset, std_m: float, rng: np.random.Generator) -> Dataset:
    """Isotropic Gaussian noise of ``std_m`` (m, per axis) on every position."""
    X = data.positions + rng.normal(0.0, std_m, size=data.positions.shape)
    return dataclasses.replace(data, positions=X, velocities=None)


def drop_frames(data: Dataset, fraction: float, rng: np.random.Generator, *, per_node: bool = False,
                keep_first: bool = True) -> Dataset:
    """Mark ``fraction`` of the frames (whole frames, or (frame, node) entries if ``per_node``) invalid and
    NaN. ``keep_first`` keeps sample 0 (a window start needs a measured state)."""
    T, N = data.valid.shape
    if per_node:
        drop = rng.random((T, N)) < fraction
    else:
        drop = np.repeat((rng.random(T) < fraction)[:, None], N, axis=1)
    if keep_first:
        drop[0] = False
    V = data.valid & ~drop
    X = np.where(V[..., None], data.positions, np.nan)
    return dataclasses.replace(data, positions=X, valid=V, velocities=None)


# ---- screening (poisoned data) ------------------------------------------------------------------------
class ScreenReport(NamedTuple):
    """What :func:`screen_dataset` rejected: counts of (sample, node) entries."""

    non_finite: int
    bar_length: int
    spikes: int
    valid_fraction: float


def _nanmedian_last(a: np.ndarray) -> np.ndarray:
    """``np.nanmedian(a, axis=-1)`` (NaN where a row has no number), by one sort: numpy's takes a slow path for
    many short rows (0.58 s of the screening's sliding windows on the README's 16-s bag, 2026-12-04)."""
    s = np.sort(a, axis=-1)                                            # NaN sorts last
    n = (~np.isnan(a)).sum(axis=-1)
    lo = np.take_along_axis(s, np.maximum((n - 1) // 2, 0)[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(s, (n // 2)[..., None].clip(max=a.shape[-1] - 1), axis=-1)[..., 0]
    return np.where(n > 0, (lo + hi) / 2, np.nan)


def screen_dataset(data: Dataset, bar_nodes: np.ndarray, bar_lengths: np.ndarray, *, bar_tol: float = 0.05,
                   spike_window: int = 3, spike_threshold: float = 8.0, spike_floor_m: float = 0.005,
                   nodes: Optional[Sequence[int]] = None) -> Tuple[Dataset, ScreenReport]:
    """Mark implausible samples invalid (never modifies valid values).

    * non-finite positions;
    * bar-length violations: both ends of a bar measured but |length / nominal - 1| > ``bar_tol``
      (a swapped or ghost marker) -> both ends invalid at that sample;
    * spikes (Hampel filter per node and axis over +-``spike_window`` samples): |x - median| >
      max(``spike_threshold`` * 1.4826 MAD, ``spike_floor_m``).
    ``valid_fraction`` is reported over ``nodes`` (default all).
    """
    X = data.positions
    V = data.valid & np.all(np.isfinite(X), axis=2)
    n_nf = int((data.valid & ~V).sum())
    n_bar = 0
    if bar_nodes.size:
        a, b = bar_nodes[:, 0], bar_nodes[:, 1]
        both = V[:, a] & V[:, b]
        L = np.linalg.norm(np.where(both[..., None], X[:, b] - X[:, a], 0.0), axis=-1)
        bad = both & (np.abs(L / bar_lengths[None, :] - 1.0) > bar_tol)
        if bad.any():
            inv = np.zeros_like(V)
            for k in range(bar_nodes.shape[0]):
                inv[bad[:, k], a[k]] = True
                inv[bad[:, k], b[k]] = True
            n_bar = int((inv & V).sum())
            V = V & ~inv
    n_sp = 0
    T = X.shape[0]
    w = int(spike_window)
    if w >= 1 and T >= 2 * w + 1:
        from numpy.lib.stride_tricks import sliding_window_view
        Xn = np.where(V[..., None], X, np.nan)
        pad = np.concatenate([np.repeat(Xn[:1], w, 0) * np.nan, Xn, np.repeat(Xn[-1:], w, 0) * np.nan])
        win = sliding_window_view(pad, 2 * w + 1, axis=0)            # (T, N, 3, 2w+1)
        with np.errstate(all="ignore"):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                med = _nanmedian_last(win)
                mad = 1.4826 * _nanmedian_last(np.abs(win - med[..., None]))
        thr = np.maximum(spike_threshold * np.nan_to_num(mad, nan=np.inf), spike_floor_m)
        dev = np.abs(np.nan_to_num(Xn - med, nan=0.0))
        spike = V & np.any(dev > thr, axis=2)
        n_sp = int(spike.sum())
        V = V & ~spike
    idx = np.arange(V.shape[1]) if nodes is None else np.asarray(nodes, dtype=int)
    frac = float(V[:, idx].mean()) if V.size else 0.0
    Xo = np.where(V[..., None], X, np.nan)
    return dataclasses.replace(data, positions=Xo, valid=V), ScreenReport(n_nf, n_bar, n_sp, frac)
