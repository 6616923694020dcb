"""Reference trajectories for the actuated strings: the seed's phase-shifted sinusoids.

Pure functions, no ROS. The seed (stacked manipulator paper, Sec. III-C) drives the three actuated strings
of each stage with sinusoidal string displacements phase-shifted by +2pi/3, 0, -2pi/3, period 7 s,
amplitudes 36.3 mm (Stage 1) and 16.8 mm (Stage 2). Here the whole displacement (offset included) is
multiplied by a raised-cosine envelope so it starts and ends at exactly zero with zero rate:

    d_a(t) = e(t) * (offset_a + amplitude_a * sin(2 pi (t - start) / period + phase_a))

    e(t) = 0                                       t < start
         = (1 - cos(pi tau / ramp_in)) / 2          0 <= tau < ramp_in          (tau = t - start)
         = 1                                        (steady part)
         = (1 + cos(pi (tau - D + ramp_out) / ramp_out)) / 2    D - ramp_out <= tau <= D
         = 0                                        tau > D  (D = duration; no ramp out if None)

e and de/dt are continuous (C1), so d and d' are continuous, and d = d' = 0 at both ends.

A positive displacement lengthens the string's rest length. With the string law of CONTRACTS.md,
``xi0 = xi00 + direction * spool_radius * (u - zero_offset)``, the motor angle that produces displacement
``d`` is ``u = zero_offset + d / (direction * spool_radius)``.

Reference files (``config/references/*.yaml``)::

    name: seed_sinusoids
    period_s: 7.0
    ramp_in_s: 2.0          # optional, default 2.0
    ramp_out_s: 2.0         # optional, default 2.0
    start_s: 0.0            # optional, default 0.0
    duration_s: 42.0        # optional; null / absent = runs forever (no ramp out)
    stages:
      - name: stage1        # optional
        actuators: [m1, m2, m3]
        amplitude_m: 0.0363           # one number for the stage, or one per actuator
        phases_deg: [120, 0, -120]    # or phases_rad: [...]
        offsets_m: 0.0                # optional, default 0
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import yaml

__all__ = ["SinusoidReference", "ReferenceConfigError", "ReferenceLimitError", "seed_reference",
           "envelope", "envelope_rate", "string_displacement", "string_velocity", "motor_angles",
           "motor_velocities", "displacement_from_motor_angles", "select_actuators", "load_reference",
           "reference_from_dict",
           "SEED_PERIOD_S", "SEED_AMPLITUDES_M", "SEED_PHASES_RAD"]

#: Seed values (stacked manipulator paper, Sec. III-C).
SEED_PERIOD_S = 7.0
SEED_AMPLITUDES_M = (0.0363, 0.0168)  # Stage 1, Stage 2
SEED_PHASES_RAD = (2.0 * math.pi / 3.0, 0.0, -2.0 * math.pi / 3.0)
DEFAULT_RAMP_S = 2.0


class ReferenceConfigError(ValueError):
    """A reference file (or dict) that is not usable. ``str(err)``: ``FILE: KEY = VALUE: problem``."""

    def __init__(self, source: str, key: str, value: Any, problem: str):
        self.source, self.key, self.value, self.problem = source, key, value, problem
        super().__init__(f"{source}: {key} = {value!r}: {problem}")


class ReferenceLimitError(ReferenceConfigError):
    """The reference would drive a motor outside its angle limits."""


@dataclass(frozen=True)
class SinusoidReference:
    """Phase-shifted sinusoidal string displacements for A actuated strings.

    period_s: common period [s]; amplitudes_m, phases_rad, offsets_m: (A,) per actuator [m], [rad], [m];
    ramp_in_s / ramp_out_s: raised-cosine envelope lengths [s]; start_s: time the ramp in starts [s];
    duration_s: total length including both ramps [s], or None for no end (and no ramp out);
    actuator_names: (A,) names the columns belong to ("" entries allowed only when unnamed).
    """

    period_s: float
    amplitudes_m: Tuple[float, ...]
    phases_rad: Tuple[float, ...]
    offsets_m: Tuple[float, ...]
    ramp_in_s: float = DEFAULT_RAMP_S
    ramp_out_s: float = DEFAULT_RAMP_S
    start_s: float = 0.0
    duration_s: Optional[float] = None
    actuator_names: Tuple[str, ...] = ()
    name: str = "sinusoids"

    def __post_init__(self):
        # Normalise array-likes to tuples so the dataclass stays hashable and immutable.
        for f in ("amplitudes_m", "phases_rad", "offsets_m"):
            object.__setattr__(self, f, tuple(float(v) for v in np.atleast_1d(getattr(self, f))))
        object.__setattr__(self, "actuator_names", tuple(str(n) for n in self.actuator_names))
        _check_reference(self, "<SinusoidReference>")

    @property
    def n_actuators(self) -> int:
        return len(self.amplitudes_m)

    @property
    def end_s(self) -> Optional[float]:
        """Time the reference is back at zero for good, or None."""
        return None if self.duration_s is None else self.start_s + self.duration_s


def _check_reference(ref: SinusoidReference, source: str) -> None:
    def fail(key, value, problem):
        raise ReferenceConfigError(source, key, value, problem)

    A = len(ref.amplitudes_m)
    if A == 0:
        fail("amplitudes_m", ref.amplitudes_m, "need at least one actuator")
    for key in ("phases_rad", "offsets_m"):
        if len(getattr(ref, key)) != A:
            fail(key, getattr(ref, key), f"expected {A} values (one per amplitude)")
    if ref.actuator_names and len(ref.actuator_names) != A:
        fail("actuator_names", ref.actuator_names, f"expected {A} names (one per amplitude)")
    if len(set(ref.actuator_names)) != len(ref.actuator_names):
        fail("actuator_names", ref.actuator_names, "duplicate actuator name")
    for key in ("amplitudes_m", "phases_rad", "offsets_m"):
        if not all(math.isfinite(v) for v in getattr(ref, key)):
            fail(key, getattr(ref, key), "expected finite numbers")
    if any(a < 0 for a in ref.amplitudes_m):
        fail("amplitudes_m", ref.amplitudes_m, "amplitudes must be >= 0 (use the phase for sign)")
    if not (math.isfinite(ref.period_s) and ref.period_s > 0):
        fail("period_s", ref.period_s, "must be a finite number > 0")
    for key in ("ramp_in_s", "ramp_out_s"):
        v = getattr(ref, key)
        if not (math.isfinite(v) and v >= 0):
            fail(key, v, "must be a finite number >= 0")
    if not math.isfinite(ref.start_s):
        fail("start_s", ref.start_s, "must be finite")
    if ref.duration_s is not None:
        if not (math.isfinite(ref.duration_s) and ref.duration_s > 0):
            fail("duration_s", ref.duration_s, "must be a finite number > 0 (or null for no end)")
        if ref.ramp_in_s + ref.ramp_out_s > ref.duration_s:
            fail("duration_s", ref.duration_s,
                 f"shorter than ramp_in_s + ramp_out_s = {ref.ramp_in_s + ref.ramp_out_s:g} s")


# ---- envelope ------------------------------------------------------------------------------------------
def envelope(ref: SinusoidReference, t) -> np.ndarray:
    """Raised-cosine envelope e(t) in [0, 1]; t: (T,) s -> (T,)."""
    return _envelope(ref, np.asarray(t, dtype=float))[0]


def envelope_rate(ref: SinusoidReference, t) -> np.ndarray:
    """de/dt [1/s]; t: (T,) s -> (T,)."""
    return _envelope(ref, np.asarray(t, dtype=float))[1]


def _envelope(ref: SinusoidReference, t: np.ndarray):
    tau = t - ref.start_s
    e = np.where(tau >= 0.0, 1.0, 0.0)
    de = np.zeros_like(tau)
    if ref.ramp_in_s > 0:
        r = ref.ramp_in_s
        m = (tau >= 0) & (tau < r)
        e = np.where(m, 0.5 * (1 - np.cos(np.pi * tau / r)), e)
        de = np.where(m, 0.5 * np.pi / r * np.sin(np.pi * tau / r), de)
    if ref.duration_s is not None:
        D = ref.duration_s
        if ref.ramp_out_s > 0:
            r = ref.ramp_out_s
            s = tau - (D - r)
            m = (s >= 0) & (tau <= D)
            e = np.where(m, 0.5 * (1 + np.cos(np.pi * s / r)), e)
            de = np.where(m, -0.5 * np.pi / r * np.sin(np.pi * s / r), de)
        e = np.where(tau > D, 0.0, e)
        de = np.where(tau > D, 0.0, de)
    return e, de


# ---- displacements -------------------------------------------------------------------------------------
def _carrier(ref: SinusoidReference, t: np.ndarray):
    w = 2.0 * np.pi / ref.period_s
    arg = w * (t[:, None] - ref.start_s) + np.asarray(ref.phases_rad)[None, :]
    amp = np.asarray(ref.amplitudes_m)[None, :]
    c = np.asarray(ref.offsets_m)[None, :] + amp * np.sin(arg)
    dc = amp * w * np.cos(arg)
    return c, dc


def _times(t) -> np.ndarray:
    t = np.atleast_1d(np.asarray(t, dtype=float))
    if t.ndim != 1:
        raise ValueError(f"t: expected a (T,) array of times in s, got shape {t.shape}")
    return t


def string_displacement(ref: SinusoidReference, t) -> np.ndarray:
    """String rest-length displacements d(t); t: (T,) s -> (T, A) m (positive lengthens)."""
    t = _times(t)
    e, _ = _envelope(ref, t)
    c, _ = _carrier(ref, t)
    return e[:, None] * c


def string_velocity(ref: SinusoidReference, t) -> np.ndarray:
    """Exact time derivative of :func:`string_displacement`; t: (T,) s -> (T, A) m/s."""
    t = _times(t)
    e, de = _envelope(ref, t)
    c, dc = _carrier(ref, t)
    return de[:, None] * c + e[:, None] * dc


# ---- motor angles --------------------------------------------------------------------------------------
def _ordered_actuators(ref: SinusoidReference, actuators) -> tuple:
    """Actuators (model ``Actuator`` records, or a Structure) in the reference's column order."""
    acts = tuple(getattr(actuators, "actuators", actuators))
    if not ref.actuator_names:
        if len(acts) != ref.n_actuators:
            raise ValueError(f"reference {ref.name!r} has {ref.n_actuators} unnamed columns but "
                             f"{len(acts)} actuators were given")
        return acts
    by_name = {a.name: a for a in acts}
    missing = [n for n in ref.actuator_names if n not in by_name]
    if missing:
        raise ReferenceConfigError(ref.name, "actuators", missing,
                                   f"not among the model's actuators ({', '.join(by_name) or 'none'})")
    return tuple(by_name[n] for n in ref.actuator_names)


def _gains(acts) -> Tuple[np.ndarray, np.ndarray]:
    g = np.array([a.direction * a.spool_radius for a in acts], dtype=float)  # m/rad
    z = np.array([a.zero_offset for a in acts], dtype=float)
    if np.any(g == 0):
        raise ValueError("actuator with zero spool_radius or direction: cannot convert displacement to angle")
    return g, z


def motor_angles(ref: SinusoidReference, actuators, t, *, check_limits: bool = True) -> np.ndarray:
    """Motor angles that realise the reference: u = zero_offset + d / (direction * spool_radius).

    actuators: model ``Actuator`` records (or a ``Structure``); matched to the reference's columns by
    name when the reference names them, else by position. t: (T,) s -> (T, A) rad.
    ``check_limits`` raises :class:`ReferenceLimitError` if any angle leaves the actuator's limits.
    """
    acts = _ordered_actuators(ref, actuators)
    g, z = _gains(acts)
    u = z[None, :] + string_displacement(ref, t) / g[None, :]
    if check_limits:
        _check_limits(ref, acts, u)
    return u


def motor_velocities(ref: SinusoidReference, actuators, t) -> np.ndarray:
    """Motor angular velocities du/dt = d'(t) / (direction * spool_radius); (T,) s -> (T, A) rad/s."""
    acts = _ordered_actuators(ref, actuators)
    g, _ = _gains(acts)
    return string_velocity(ref, t) / g[None, :]


def displacement_from_motor_angles(actuators, angles) -> np.ndarray:
    """Inverse of :func:`motor_angles`: d = direction * spool_radius * (u - zero_offset); (T, A) -> (T, A) m."""
    acts = tuple(getattr(actuators, "actuators", actuators))
    g, z = _gains(acts)
    return (np.asarray(angles, dtype=float) - z[None, :]) * g[None, :]


def _check_limits(ref: SinusoidReference, acts, u: np.ndarray) -> None:
    for j, a in enumerate(acts):
        lo, hi = a.limits
        col = u[:, j]
        if col.size and (col.min() < lo or col.max() > hi):
            bad = col.min() if col.min() < lo else col.max()
            raise ReferenceLimitError(ref.name, f"actuators.{a.name}", float(bad),
                                      f"motor angle outside limits [{lo:g}, {hi:g}] rad "
                                      f"(spool_radius {a.spool_radius:g} m, zero_offset {a.zero_offset:g} rad)")


def _peak_angles(ref: SinusoidReference, acts) -> np.ndarray:
    """Extreme angles the reference can reach (exact bound, envelope <= 1): (2, A)."""
    g, z = _gains(acts)
    off, amp = np.asarray(ref.offsets_m), np.asarray(ref.amplitudes_m)
    d = np.stack([np.minimum(0.0, off - amp), np.maximum(0.0, off + amp)])  # envelope scales toward 0
    u = z[None, :] + d / g[None, :]
    return np.sort(u, axis=0)


def select_actuators(ref: SinusoidReference, names: Sequence[str]) -> SinusoidReference:
    """The same reference restricted to (and ordered as) ``names`` (e.g. a driver that owns only Stage 1)."""
    if not ref.actuator_names:
        raise ReferenceConfigError(ref.name, "actuator_names", (), "the reference does not name its actuators")
    missing = [n for n in names if n not in ref.actuator_names]
    if missing:
        raise ReferenceConfigError(ref.name, "actuators", missing,
                                   f"not in the reference ({', '.join(ref.actuator_names)})")
    idx = [ref.actuator_names.index(n) for n in names]
    pick = lambda v: tuple(v[i] for i in idx)  # noqa: E731
    return replace(ref, amplitudes_m=pick(ref.amplitudes_m), phases_rad=pick(ref.phases_rad),
                   offsets_m=pick(ref.offsets_m), actuator_names=tuple(names))


# ---- construction --------------------------------------------------------------------------------------
def seed_reference(*, ramp_s: float = DEFAULT_RAMP_S, duration_s: Optional[float] = None,
                   start_s: float = 0.0,
                   actuator_names: Sequence[str] = ("m1", "m2", "m3", "m4", "m5", "m6")) -> SinusoidReference:
    """The seed drive: Stage 1 (first three names) 36.3 mm, Stage 2 (last three) 16.8 mm, 7 s period."""
    return SinusoidReference(
        period_s=SEED_PERIOD_S,
        amplitudes_m=(SEED_AMPLITUDES_M[0],) * 3 + (SEED_AMPLITUDES_M[1],) * 3,
        phases_rad=SEED_PHASES_RAD * 2, offsets_m=(0.0,) * 6, ramp_in_s=ramp_s, ramp_out_s=ramp_s,
        start_s=start_s, duration_s=duration_s, actuator_names=tuple(actuator_names), name="seed_sinusoids")


_TOP_KEYS = {"name", "description", "period_s", "ramp_in_s", "ramp_out_s", "ramp_s", "start_s",
             "duration_s", "stages"}
_STAGE_KEYS = {"name", "actuators", "amplitude_m", "phases_rad", "phases_deg", "offsets_m"}


def _num(source, key, v, *, positive=False, nonneg=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ReferenceConfigError(source, key, v, "expected a finite number")
    if positive and v <= 0:
        raise ReferenceConfigError(source, key, v, "must be > 0")
    if nonneg and v < 0:
        raise ReferenceConfigError(source, key, v, "must be >= 0")
    return float(v)


def _per_actuator(source, key, v, n, **kw):
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ReferenceConfigError(source, key, v, f"expected {n} values (one per actuator) or one number")
        return [_num(source, f"{key}[{i}]", x, **kw) for i, x in enumerate(v)]
    return [_num(source, key, v, **kw)] * n


def reference_from_dict(data: Mapping[str, Any], source: str = "<dict>", actuators=None) -> SinusoidReference:
    """Validate a parsed reference file; see the module docstring for the format.

    actuators: optional model actuators (or Structure): every name must exist there, and the reference's
    extreme angles must stay inside each actuator's limits.
    """
    def fail(key, value, problem):
        raise ReferenceConfigError(source, key, value, problem)

    if not isinstance(data, Mapping):
        fail("<top>", data, "expected a mapping")
    for k in data:
        if k not in _TOP_KEYS:
            fail(k, data[k], f"unknown key (valid keys: {', '.join(sorted(_TOP_KEYS))})")
    if "period_s" not in data:
        fail("period_s", None, "required key is missing")
    period = _num(source, "period_s", data["period_s"], positive=True)
    if "ramp_s" in data and ("ramp_in_s" in data or "ramp_out_s" in data):
        fail("ramp_s", data["ramp_s"], "give either ramp_s or ramp_in_s/ramp_out_s, not both")
    ramp = _num(source, "ramp_s", data.get("ramp_s", DEFAULT_RAMP_S), nonneg=True)
    ramp_in = _num(source, "ramp_in_s", data.get("ramp_in_s", ramp), nonneg=True)
    ramp_out = _num(source, "ramp_out_s", data.get("ramp_out_s", ramp), nonneg=True)
    start = _num(source, "start_s", data.get("start_s", 0.0))
    duration = data.get("duration_s")
    if duration is not None:
        duration = _num(source, "duration_s", duration, positive=True)
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        fail("stages", stages, "expected a non-empty list of stages")
    names, amps, phases, offsets = [], [], [], []
    for i, st in enumerate(stages):
        key = f"stages[{i}]"
        if not isinstance(st, Mapping):
            fail(key, st, "expected a mapping")
        for k in st:
            if k not in _STAGE_KEYS:
                fail(f"{key}.{k}", st[k], f"unknown key (valid keys: {', '.join(sorted(_STAGE_KEYS))})")
        acts = st.get("actuators")
        if not isinstance(acts, list) or not acts or not all(isinstance(a, str) and a for a in acts):
            fail(f"{key}.actuators", acts, "expected a non-empty list of actuator names")
        for j, a in enumerate(acts):
            if a in names:
                fail(f"{key}.actuators[{j}]", a, "actuator listed twice")
            names.append(a)
        n = len(acts)
        if "amplitude_m" not in st:
            fail(f"{key}.amplitude_m", None, "required key is missing")
        amps += _per_actuator(source, f"{key}.amplitude_m", st["amplitude_m"], n, nonneg=True)
        if ("phases_rad" in st) == ("phases_deg" in st):
            fail(f"{key}.phases_rad", st.get("phases_rad"), "give exactly one of phases_rad or phases_deg")
        if "phases_rad" in st:
            phases += _per_actuator(source, f"{key}.phases_rad", st["phases_rad"], n)
        else:
            phases += [math.radians(p) for p in _per_actuator(source, f"{key}.phases_deg", st["phases_deg"], n)]
        offsets += _per_actuator(source, f"{key}.offsets_m", st.get("offsets_m", 0.0), n)
    name = data.get("name", Path(source).stem if source not in ("<dict>", "") else "sinusoids")
    if duration is not None and ramp_in + ramp_out > duration:
        fail("duration_s", duration, f"shorter than ramp_in_s + ramp_out_s = {ramp_in + ramp_out:g} s")
    try:
        ref = SinusoidReference(period_s=period, amplitudes_m=tuple(amps), phases_rad=tuple(phases),
                                offsets_m=tuple(offsets), ramp_in_s=ramp_in, ramp_out_s=ramp_out, start_s=start,
                                duration_s=duration, actuator_names=tuple(names), name=str(name))
    except ReferenceConfigError as err:  # re-label with the file name
        raise ReferenceConfigError(source, err.key, err.value, err.problem) from None
    if actuators is not None:
        acts = tuple(getattr(actuators, "actuators", actuators))
        known = [a.name for a in acts]
        for i, st in enumerate(stages):
            for j, a in enumerate(st["actuators"]):
                if a not in known:
                    fail(f"stages[{i}].actuators[{j}]", a,
                         f"not an actuator of the model (model actuators: {', '.join(known) or 'none'})")
        ordered = _ordered_actuators(ref, acts)
        peaks = _peak_angles(ref, ordered)
        for j, a in enumerate(ordered):
            lo, hi = a.limits
            if peaks[0, j] < lo or peaks[1, j] > hi:
                bad = float(peaks[0, j] if peaks[0, j] < lo else peaks[1, j])
                raise ReferenceLimitError(source, f"actuators.{a.name}", bad,
                                          f"peak motor angle outside limits [{lo:g}, {hi:g}] rad "
                                          f"(spool_radius {a.spool_radius:g} m); reduce amplitude/offset")
    return ref


def load_reference(path_or_dict: Union[str, Path, Mapping[str, Any]], actuators=None) -> SinusoidReference:
    """Load and validate a reference YAML file (or an already parsed dict); see :func:`reference_from_dict`."""
    if isinstance(path_or_dict, Mapping):
        return reference_from_dict(path_or_dict, "<dict>", actuators)
    path = Path(path_or_dict)
    try:
        text = path.read_text()
    except OSError as err:
        raise ReferenceConfigError(str(path), "<file>", None, f"cannot read file ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ReferenceConfigError(str(path), "<yaml>", None, f"not valid YAML: {err}") from None
    return reference_from_dict(data, str(path), actuators)
