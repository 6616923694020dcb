"""``state_predictor``: at every node-state message, the next ``horizon_s`` of node positions and velocities
for a controller, from the latest identified parameters and the commanded motor trajectory.

How it stays fast (p50 < 5 ms for a 1-s horizon on CPU): a background thread has a worker roll the nonlinear
engine's model (the MuJoCo twin of the current parameters, or ``tensegrity_ros.engine``) out from a recent
measured state over the horizon plus a margin (the *nominal*), and takes the Jacobians A_k = dx_{k+1}/dx_k,
B_k = dx_{k+1}/du_k of one engine step along it with forward-mode autograd (``vmap(jacfwd)`` over time points,
every ``jac_stride`` steps, interpolated in between). Each node-state message then only propagates its
deviation from the nominal through the linear time-varying model,
``x_{k+1} = xbar_{k+1} + A_k (x_k - xbar_k) + B_k (u_k - ubar_k)``: 100 in-place matrix-vector products. When
and how long a nominal is computed, and what a message gets when the next one is late (a prediction along
the current nominal's frozen-Jacobian extension, flagged in the diagnostics, for up to ``extend_max_s``; then
nothing), is the pure :class:`PredictionStream`. The deviation stays small, so the first-order correction is
accurate (checked against full nonlinear rollouts in the tests). The message goes out as pre-serialised CDR
(:func:`~._common.prediction_to_cdr`).

Motor future (``motor_source``): ``plan`` = the last plan from the controller on ``/tensegrity/motor_plan``
(trajectory_msgs/JointTrajectory when installed, else sensor_msgs/JointState with ``position`` = K x A
angles row-major, step ``plan_dt``, header.stamp = time of the first step); ``reference`` = the reference
generator of the driver (``reference_file``), phase-locked to the measured motor angles
(:class:`ReferenceTracker`: the driver's reference clock is not published, and locking to the measured
angles also absorbs the motors' lag); ``hold`` = the last measured angles; ``auto`` (default) = a fresh
plan, else the locked reference, else hold.

Topics: subscribes ``/tensegrity/node_states``, ``/tensegrity/motor_states``,
``/tensegrity/identified_parameters``, ``/tensegrity/motor_plan``; publishes ``/tensegrity/predicted_states``
(PredictedStates: step k at header.stamp + k dt, k = 0..K-1, header.stamp = node-state stamp + dt) and
diagnostics (latency node-state reception -> publish p50/p99, relinearisation time, motor source,
predictions along the extension, skipped messages).
Service ``~/get_linearization`` (GetLinearization): A_k, B_k along the latest predicted horizon, in the
deviation form above; states = the independent nodes' positions then velocities, inputs = motor angles.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..model import Structure, load_structure
from ..predict import RealizedError
from . import _common as C
from ._common import ParamSpec

# =====================================================================================================
# pure core (no rclpy): motor futures and the linearised horizon predictor
# =====================================================================================================


class ReferenceTracker:
    """Phase-locks a reference generator to measured motor angles.

    The driver evaluates its reference at t - t_ref (t_ref = when the reference became active, on the
    driver's clock, not published). Given measured angles u_i at times t_i, this finds the offset c with
    u_i ~ r(t_i - c) (least squares, a global grid search first, then local tracking) and predicts the
    future angles as r(t - c). ``locked`` is False while the robot is at rest at the reference's rest
    angles (before the start or after the end: the future is then "hold") or when the angles do not follow
    the reference (residual above tolerance: another command source is active).

    reference: times (T,) s -> angles (T, A) rad in the motor order of :meth:`observe`; start_s / end_s:
    where the reference moves (end None = never stops); period_s: its period.
    """

    def __init__(self, reference: Callable[[np.ndarray], np.ndarray], start_s: float, end_s: Optional[float],
                 period_s: float, ramp_in_s: float = 0.0, history_s: float = 3.0, samples: int = 40,
                 tolerance_rad: float = 0.03, relative_tolerance: float = 0.15):
        self.reference = reference
        self.start_s, self.end_s, self.period_s, self.ramp_in_s = start_s, end_s, period_s, ramp_in_s
        self.history_s, self.samples = history_s, samples
        self.tolerance_rad, self.relative_tolerance = tolerance_rad, relative_tolerance
        self.rest = np.asarray(reference(np.array([start_s - 1.0])))[0]
        self._hist: deque = deque()
        self.offset: Optional[float] = None
        self.locked = False
        self.moving = False
        self.residual_rad = math.nan

    @classmethod
    def from_reference(cls, ref, actuators, motor_names: Sequence[str], **kw) -> "ReferenceTracker":
        """From a :class:`tensegrity_ros.references.SinusoidReference` and the actuators (angles in
        ``motor_names`` order; motors the reference does not drive stay at their rest angle)."""
        from .. import references as R

        acts = tuple(getattr(actuators, "actuators", actuators))
        names = list(ref.actuator_names) if ref.actuator_names else [a.name for a in acts]
        cols = [names.index(n) if n in names else -1 for n in motor_names]
        by_name = {a.name: a for a in acts}
        rest = np.array([by_name[n].zero_offset if n in by_name else 0.0 for n in motor_names])

        def reference(t):
            u = R.motor_angles(ref, acts, np.asarray(t, dtype=float).reshape(-1), check_limits=False)
            out = np.repeat(rest[None, :], u.shape[0], axis=0)
            for j, c in enumerate(cols):
                if c >= 0:
                    out[:, j] = u[:, c]
            return out

        return cls(reference, ref.start_s, ref.end_s, ref.period_s, ref.ramp_in_s, **kw)

    def observe(self, t: float, angles) -> None:
        self._hist.append((float(t), np.asarray(angles, dtype=float).copy()))
        while self._hist and t - self._hist[0][0] > self.history_s:
            self._hist.popleft()

    def _cost(self, cands: np.ndarray, t: np.ndarray, u: np.ndarray) -> np.ndarray:
        tau = (t[None, :] - cands[:, None]).reshape(-1)
        r = self.reference(tau).reshape(cands.size, t.size, -1)
        return np.sqrt(np.mean((r - u[None]) ** 2, axis=(1, 2)))

    def update(self) -> bool:
        """Re-estimate the offset from the history; returns ``locked``."""
        if len(self._hist) < 5:
            self.locked = False
            return False
        idx = np.linspace(0, len(self._hist) - 1, min(self.samples, len(self._hist))).round().astype(int)
        t = np.array([self._hist[i][0] for i in idx])
        u = np.stack([self._hist[i][1] for i in idx])
        ok = np.all(np.isfinite(u), axis=1)
        t, u = t[ok], u[ok]
        if t.size < 5:
            self.locked = False
            return False
        dev = np.abs(u - self.rest[None, :])
        self.moving = bool(dev.max() > 0.5 * self.tolerance_rad)
        if not self.moving:
            self.locked, self.residual_rad = False, float(np.sqrt(np.mean(dev ** 2)))
            return False
        t_last = t[-1]
        best_c, best = None, math.inf
        if self.offset is not None:   # local tracking keeps the branch (period) found at the ramp in
            cands = self.offset + np.arange(-0.2, 0.2 + 1e-9, 0.005)
            cost = self._cost(cands, t, u)
            k = int(np.argmin(cost))
            best_c, best = cands[k], cost[k]
        tol = max(self.tolerance_rad, self.relative_tolerance * float(np.sqrt(np.mean(dev ** 2))))
        if best > tol:                # global search over where the reference can be
            span_end = self.end_s if self.end_s is not None else self.start_s + self.ramp_in_s + self.period_s
            cands = np.arange(t_last - span_end, t_last - self.start_s + 1e-9, 0.02)
            cost = np.concatenate([self._cost(ch, t, u) for ch in np.array_split(cands, max(1, cands.size // 400))])
            k = int(np.argmin(cost))
            fine = cands[k] + np.arange(-0.03, 0.03 + 1e-9, 0.002)
            fc = self._cost(fine, t, u)
            j = int(np.argmin(fc))
            if fc[j] < best:
                best_c, best = fine[j], fc[j]
        self.residual_rad = float(best)
        self.locked = bool(best <= tol)
        self.offset = float(best_c) if self.locked else None
        return self.locked

    def angles(self, times) -> Optional[np.ndarray]:
        """(T, A) rad at ``times`` (s), or None when not locked."""
        if not self.locked or self.offset is None:
            return None
        return np.asarray(self.reference(np.asarray(times, dtype=float).reshape(-1) - self.offset))


@dataclass(frozen=True)
class MotorPlan:
    """A controller's motor plan: angles (K, A) rad at ``times`` (K,) s, for motors ``names``."""

    times: np.ndarray
    names: Tuple[str, ...]
    angles: np.ndarray
    received: float = 0.0

    def at(self, times, motor_names: Sequence[str], fallback: np.ndarray) -> np.ndarray:
        """(T, A) angles in ``motor_names`` order; linear interpolation, held before/after the plan;
        motors not in the plan take ``fallback`` (A,)."""
        times = np.asarray(times, dtype=float).reshape(-1)
        out = np.repeat(np.asarray(fallback, dtype=float)[None, :], times.size, axis=0)
        for j, n in enumerate(motor_names):
            if n in self.names:
                c = self.names.index(n)
                out[:, j] = np.interp(times, self.times, self.angles[:, c])
        return out


class MotorFuture:
    """The commanded motor trajectory as a function of time: plan | reference | hold (see the module doc).

    ``source``: "auto" | "plan" | "reference" | "hold". Thread-safe.
    """

    def __init__(self, motor_names: Sequence[str], source: str = "auto",
                 tracker: Optional[ReferenceTracker] = None, plan_timeout_s: float = 1.0):
        if source not in ("auto", "plan", "reference", "hold"):
            raise ValueError(f"motor source {source!r} (valid: auto, plan, reference, hold)")
        if source == "reference" and tracker is None:
            raise ValueError("motor source 'reference' needs a reference (reference_file)")
        self.names = tuple(motor_names)
        self.source = source
        self.tracker = tracker
        self.plan: Optional[MotorPlan] = None
        self.plan_timeout_s = plan_timeout_s
        self.last: Optional[np.ndarray] = None
        self.last_t = -math.inf
        self.version = 0
        self.active = "hold"
        self._lock = threading.Lock()

    def observe(self, t: float, names: Sequence[str], angles) -> None:
        """Measured motor angles (any order/subset of names)."""
        a = np.asarray(angles, dtype=float)
        with self._lock:
            if self.last is None:
                self.last = np.full(len(self.names), np.nan)
            for n, v in zip(names, a):
                if n in self.names and math.isfinite(v):
                    self.last[self.names.index(n)] = v
            self.last_t = t
            if self.tracker is not None and not np.any(np.isnan(self.last)):
                self.tracker.observe(t, self.last)

    def set_plan(self, plan: MotorPlan) -> None:
        with self._lock:
            self.plan = plan
            self.version += 1

    def update(self) -> str:
        """Re-lock the reference; returns the active source name."""
        if self.tracker is not None:
            with self._lock:
                self.tracker.update()
        return self._active(time_now=self.last_t)

    def _active(self, time_now: float) -> str:
        plan_ok = self.plan is not None and (self.plan.times[-1] >= time_now or
                                             time_now - self.plan.received <= self.plan_timeout_s)
        if self.source == "plan" or (self.source == "auto" and plan_ok):
            src = "plan" if self.plan is not None else "hold"
        elif self.source in ("reference", "auto") and self.tracker is not None and self.tracker.locked:
            src = "reference"
        else:
            src = "hold"
        self.active = src
        return src

    def angles(self, times) -> Optional[np.ndarray]:
        """(T, A) rad, or None before any motor state (no inputs known)."""
        with self._lock:
            if self.last is None or np.any(np.isnan(self.last)):
                return None
            src = self._active(self.last_t)
            if src == "plan":
                return self.plan.at(times, self.names, self.last)
            if src == "reference":
                u = self.tracker.angles(times)
                if u is not None:
                    return u
            return np.repeat(self.last[None, :], np.size(times), axis=0)


@dataclass
class Linearization:
    """A nominal trajectory and its step Jacobians, sampled every ``dt`` from ``t0``.

    x: (K+1, n) nominal states [free-node positions (nf, 3) flattened, then velocities], m and m/s;
    u: (K+1, A) motor angles held over each step (rad); ks: (P,) steps at which the Jacobians J (P, n, n + A)
    = [A_k | B_k] were taken. :meth:`expand` interpolates them linearly to every step, in float32 (``Jk32``
    (K, n, n + A): what the per-message recurrence streams) and appends the frozen-Jacobian extension of the
    nominal (``xe``, ``ue``: ``ext_steps`` more steps, see :meth:`expand`) -- done where they are used, so a
    worker process ships only the P sampled Jacobians. Float64 Jacobians of chosen steps, for the
    linearisation service: :meth:`jacobians_at` (``A``, ``B``: all steps).
    """

    t0: float
    dt: float
    x: np.ndarray
    u: np.ndarray
    ks: np.ndarray
    J: np.ndarray
    set_id: str
    compute_s: float
    Jk32: Optional[np.ndarray] = None
    xe: Optional[np.ndarray] = None
    ue: Optional[np.ndarray] = None
    ext_steps: int = 0

    @property
    def steps(self) -> int:
        return int(self.x.shape[0] - 1)

    @property
    def t_end(self) -> float:
        return self.t0 + self.steps * self.dt

    def expand(self, extend_steps: int = 0) -> "Linearization":
        """Per-step Jacobians, and the nominal extended by up to ``extend_steps`` steps past its end.

        Interpolation: written segment by segment into one preallocated array (the former fancy-indexed
        ``(1 - w) J[j] + w J[j + 1]`` allocated five K x n x (n+A) temporaries: 0.4 s for a 6-s nominal of
        the manipulator, in the node's process).

        Extension (what a message gets when the next nominal is late, instead of nothing): the nominal is
        continued with the affine model of its last step, x_{K+j+1} = x_K + A_{K-1} (x_{K+j} - x_{K-1})
        + B_{K-1} (u_K - u_{K-1}), the motors held at u_K, and the last step's Jacobians are used along it.
        That is the first-order model the LTV prediction already is, frozen at the last point instead of
        re-taken every ``jac_stride`` steps: for the taut-string oscillations of the robots here it tracks the
        nonlinear rollout to a few mm over a few hundred ms (tested), where holding the state or the last
        prediction would be off by the whole motion. It is not allowed to become garbage: it stops at the
        first step that is not finite or that leaves the nominal's own range of motion over its last horizon
        (positions by more than 50 % of that range + 5 mm, velocities likewise + 50 mm/s) -- an unstable or
        drifting frozen model ends the extension, and messages that would need more are still skipped."""
        if self.Jk32 is None:
            # float32: the per-message recurrence streams K x n x (n+A) of Jacobians (17 MB even so for a 3.5-s
            # nominal of the manipulator: out of cache, memory-bound) and its deviations are mm-scale (7 digits
            # are plenty). Measured: 0.75 -> 0.24 ms per 1-s prediction alone, 1.9 -> 0.43 ms with the caches
            # polluted as in the demo; interpolating straight into float32 also halves this step's writes
            K, ks, J = self.steps, self.ks, self.J
            if ks.size == K:
                Jk = np.ascontiguousarray(J, dtype=np.float32)
            else:
                Jk = np.empty((K,) + J.shape[1:], dtype=np.float32)
                dJ = np.empty(J.shape[1:])
                for j in range(ks.size - 1):
                    k0, k1 = int(ks[j]), (int(ks[j + 1]) if j + 2 < ks.size else K)
                    w = (np.arange(k0, k1) - ks[j]) / (ks[j + 1] - ks[j])
                    np.subtract(J[j + 1], J[j], out=dJ)
                    np.multiply(w[:, None, None], dJ, out=Jk[k0:k1], casting="same_kind")
                    Jk[k0:k1] += J[j].astype(np.float32)
            self.Jk32 = Jk
        if self.xe is None or self.ext_steps < extend_steps:
            self._extend(extend_steps)
        return self

    def _extend(self, E: int) -> None:
        K, n = self.steps, self.x.shape[1]
        x, u = self.x, self.u
        xe = np.empty((K + 1 + E, n))
        ue = np.empty((K + 1 + E, u.shape[1]))
        xe[:K + 1], ue[:K + 1] = x, u
        ue[K + 1:] = u[K]
        ok = 0
        if E > 0 and K >= 2:
            Jl = self.jacobians_at(np.array([K - 1]))[0]
            A, B = Jl[:, :n], Jl[:, n:]
            c = x[K] + B @ (u[K] - u[K - 1]) - A @ x[K - 1]
            npos = n // 2
            tail = x[max(0, K - E):]
            span_p = np.abs(tail[:, :npos] - x[K, :npos]).max(initial=0.0) * 1.5 + 5e-3
            span_v = np.abs(tail[:, npos:]).max(initial=0.0) * 1.5 + 5e-2
            for j in range(E):
                nxt = A @ xe[K + j] + c
                if not (np.all(np.isfinite(nxt)) and np.abs(nxt[:npos] - x[K, :npos]).max() <= span_p
                        and np.abs(nxt[npos:]).max() <= span_v):
                    break
                xe[K + 1 + j] = nxt
                ok += 1
        self.xe, self.ue, self.ext_steps = xe[:K + 1 + ok], ue[:K + 1 + ok], ok

    @property
    def A(self) -> np.ndarray:
        """(K, n, n) step Jacobians dx_{k+1}/dx_k (float64, interpolated: :meth:`jacobians_at`)."""
        return self.jacobians_at(np.arange(self.steps))[:, :, :self.x.shape[1]]

    @property
    def B(self) -> np.ndarray:
        """(K, n, A) step Jacobians dx_{k+1}/du_k (float64, interpolated: :meth:`jacobians_at`)."""
        return self.jacobians_at(np.arange(self.steps))[:, :, self.x.shape[1]:]

    def jacobians_at(self, idx: np.ndarray) -> np.ndarray:
        """(len(idx), n, n + A) float64 [A_k | B_k] at steps ``idx`` (0..K-1), linear between the sampled ones."""
        idx = np.asarray(idx, dtype=float)
        ks = self.ks.astype(float)
        if ks.size == 1:
            return np.repeat(self.J[:1], idx.size, axis=0)
        j = np.clip(np.searchsorted(ks, idx, side="right") - 1, 0, ks.size - 2)
        w = np.clip((idx - ks[j]) / (ks[j + 1] - ks[j]), 0.0, 1.0)[:, None, None]
        return (1.0 - w) * self.J[j] + w * self.J[j + 1]

    def step_jacobians(self, i0: int, steps: int) -> Tuple[np.ndarray, np.ndarray]:
        """A_k, B_k for k = i0 .. i0+steps-1; past the nominal's end: the last step's (the extension's model)."""
        idx = np.minimum(np.arange(i0, i0 + steps), self.steps - 1)
        Jk = self.jacobians_at(idx)
        n = self.x.shape[1]
        return Jk[:, :, :n], Jk[:, :, n:]


class HorizonPredictor:
    """Linearised horizon prediction for one structure. See the module docstring.

    structure: the model; dt: prediction step, s, made of ``substeps`` engine steps (0 = automatic: the
    semi-implicit Euler step is explicit in the string damping and must be short on stiff, damped strings, see
    :meth:`stable_substeps`); integrator: engine integrator;
    nominal: ``twin`` (the nominal rollout runs in the MuJoCo twin built from the current parameters: same
    string law, ~15x cheaper per second of motion than the batch-1 torch engine) or ``engine`` (the torch
    engine itself); the Jacobians always come from the engine's autograd. jac_stride: Jacobians every
    jac_stride prediction steps, interpolated linearly in between; jac_chunk: Jacobian time points per
    batched evaluation (memory bound).
    """

    NOMINALS = ("twin", "engine")

    def __init__(self, structure: Structure, dt: float = 0.01, substeps: int = 0, integrator: str = "semi_implicit",
                 nominal: str = "engine", jac_stride: int = 1, jac_chunk: int = 64, twin_timestep: float = 0.001):
        import torch
        from ..engine import make_engine

        if nominal not in self.NOMINALS:
            raise ValueError(f"nominal {nominal!r} (valid: {', '.join(self.NOMINALS)})")
        self.torch = torch
        self.structure = structure
        self.engine = make_engine(structure, "nodal", integrator, dtype=torch.float64)
        top = self.engine.topology
        self.dt = float(dt)
        self.substeps = max(0, int(substeps))
        self.nominal = nominal
        self.twin_timestep = float(twin_timestep)
        self.node_names = top.node_names
        self.free = np.asarray(top.free_nodes, dtype=int)
        self.free_names = tuple(top.node_names[i] for i in self.free)
        self.nf = len(self.free)
        self.n = 6 * self.nf
        self.actuator_names = top.actuator_names
        self.n_u = len(self.actuator_names)
        self.T = np.asarray(top.T, dtype=float)            # (N, nf)
        self.Xc = np.asarray(top.Xc, dtype=float)          # (N, 3)
        self.X0 = np.asarray(top.X0, dtype=float)
        self.jac_chunk = int(jac_chunk)
        self.jac_stride = max(1, int(jac_stride))
        self.state_names = tuple(f"{n}.{a}" for n in self.free_names for a in "xyz") + \
            tuple(f"{n}.v{a}" for n in self.free_names for a in "xyz")
        self.input_names = tuple(f"{a}.angle" for a in self.actuator_names)
        self._twin = None
        self._twin_key = None
        self._auto_substeps: Dict[tuple, int] = {}
        # 10/s: at 100/s the manipulator got 8 substeps whose Jacobian grows 53/s (rho 1.066 per 1.25-ms substep,
        # 1.66 per 10-ms step: the explicit-damping instability, not physics); 16 give rho 0.997 per step, so the
        # first-order correction of a deviation no longer explodes into the 3x cap (the Jacobians cost the same)
        self.max_growth_per_s = 10.0
        self.capped = 0
        self.last_deviation = 0.0   # largest |measured - nominal| position component of the last prediction, m
        self.last_substeps = self.substeps
        self._name_maps: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}

    # ---- helpers -----------------------------------------------------------------------------------
    def full_positions(self, Q: np.ndarray) -> np.ndarray:
        """(..., nf, 3) free-node positions -> (..., N, 3) all nodes (X = T Q + X_c)."""
        return np.matmul(self.T, Q) + self.Xc

    def full_velocities(self, V: np.ndarray) -> np.ndarray:
        return np.matmul(self.T, V)

    def split(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(..., n) state -> free-node positions, velocities (..., nf, 3)."""
        x = np.asarray(x)
        return x[..., :3 * self.nf].reshape(*x.shape[:-1], self.nf, 3), \
            x[..., 3 * self.nf:].reshape(*x.shape[:-1], self.nf, 3)

    def _step_fn(self, params, n_sub: int):
        """``n_sub`` engine steps of dt / n_sub: f(x (B, n), u, ud (B, A) or None) -> (B, n)."""
        from ..engine.nodal import prepare, step_reduced

        eng = self.engine
        c = eng.constants
        der = prepare(c, params)
        nf, integ, opts = self.nf, eng.integrator, eng.options
        h = self.dt / n_sub

        def f(x, u, ud, steps: int = n_sub):
            B = x.shape[0]
            Q = x[:, :3 * nf].reshape(B, nf, 3).mT
            V = x[:, 3 * nf:].reshape(B, nf, 3).mT
            for _ in range(steps):
                Q, V = step_reduced(c, der, Q, V, u, ud, None, h, integ, opts)
            return self.torch.cat([Q.mT.reshape(B, -1), V.mT.reshape(B, -1)], dim=1)

        return f

    def _substep_jacobians(self, params, n_sub: int, X, Us, Uds, ks: np.ndarray) -> np.ndarray:
        """(len(ks), n, n + A) Jacobians [a | b] of ONE engine substep (dt / n_sub) at the nominal points ks,
        by forward-mode autograd: ``vmap(jacfwd)`` over the points (``jac_chunk`` per call).

        Why vmap and not one big ``jvp`` on a (tangents x points) batch: under a plain forward-mode batch, the
        engine's ``X (B, 3, nf) @ M (nf, k)`` products are not folded into one matrix multiply but run as a
        batched ``bmm`` against an expanded M, one small GEMM per batch row (profiled: ~75 % of the time on
        the manipulator); vmap's batching rules fold them. 2.2x faster, identical to round-off."""
        torch = self.torch
        f = self._step_fn(params, n_sub)
        A_, n = self.n_u, self.n
        if A_:
            jac = torch.func.vmap(torch.func.jacfwd(lambda x, u, ud: f(x[None], u[None], ud[None], 1)[0],
                                                    argnums=(0, 1)))
        else:
            jac = torch.func.vmap(torch.func.jacfwd(lambda x: f(x[None], None, None, 1)[0]))
        Js = np.empty((ks.size, n, n + A_))
        for s in range(0, ks.size, self.jac_chunk):
            kk = torch.as_tensor(ks[s:s + self.jac_chunk])
            if A_:
                Ja, Jb = jac(X[kk], Us[kk], Uds[kk])
                Js[s:s + kk.numel(), :, :n] = Ja.numpy()
                Js[s:s + kk.numel(), :, n:] = Jb.numpy()
            else:
                Js[s:s + kk.numel()] = jac(X[kk]).numpy()
        return Js

    @staticmethod
    def compose(J: np.ndarray, n_sub: int, n: int) -> np.ndarray:
        """[A | B] of ``n_sub`` repetitions of a substep with Jacobian J = [a | b] (..., n, n + A), the input
        held: A = a^n_sub, B = sum_j a^j b (binary exponentiation: (A1, B1) o (A2, B2) = (A1 A2, A1 B2 + B1);
        torch matmul: one thread, no BLAS thread pool spinning next to the graph)."""
        import torch

        Jt = torch.as_tensor(J)
        PA, PB = Jt[..., :n], Jt[..., n:]
        RA = RB = None
        k = int(n_sub)
        while k:
            if k & 1:
                RA, RB = (PA, PB) if RA is None else (PA @ RA, PA @ RB + PB)
            k >>= 1
            if k:
                PA, PB = PA @ PA, PA @ PB + PB
        return torch.cat([RA, RB], dim=-1).numpy()

    def stable_substeps(self, params, X, Us, Uds) -> int:
        """Engine substeps per prediction step: the configured number, or (``substeps=0``) the smallest power
        of two (<= 1024) whose substep Jacobian at the nominal's start is numerically stable (semi-implicit Euler
        is explicit in the string damping: stiff, heavily damped strings need a short step). Stable means a
        spectral radius rho with (rho - 1) / h <= ``max_growth_per_s``: an integrator instability gives
        rho - 1 = O(1), whereas a physical growth rate of the linearisation (a state away from equilibrium)
        gives rho - 1 = O(h) and is not removed by shorter steps. Cached per params."""
        if self.substeps:
            return self.substeps
        key = tuple(float(v) for v in self.torch.cat([getattr(params, k).reshape(-1) for k in params.kinds()]))
        if key in self._auto_substeps:
            return self._auto_substeps[key]
        def stable(n):
            J = self._substep_jacobians(params, n, X, Us, Uds, np.array([0]))[0, :, :self.n]
            rho = np.abs(np.linalg.eigvals(J)).max()
            return (rho - 1.0) * n / self.dt <= self.max_growth_per_s

        n_sub = self.last_substeps or 1     # parameters change a little between sets: start from the last count
        while n_sub < 1024 and not stable(n_sub):
            n_sub *= 2
        while n_sub > 1 and stable(n_sub // 2):
            n_sub //= 2
        self._auto_substeps = {key: n_sub}
        return n_sub

    def initial_state(self, params, positions: np.ndarray, velocities: np.ndarray) -> np.ndarray:
        """(n,) state from full-node positions / velocities (N, 3) (NaN rows: file position / zero),
        projected onto the bar lengths."""
        X = np.where(np.isfinite(positions), positions, self.X0)
        V = np.where(np.isfinite(velocities), velocities, 0.0)
        st = self.engine.initial_state(self.torch.as_tensor(X), self.torch.as_tensor(V))
        st = self.engine.project(params, st)
        q = st.positions[0, self.free].numpy()
        v = st.velocities[0, self.free].numpy()
        return np.concatenate([q.reshape(-1), v.reshape(-1)])

    # ---- the nominal and its Jacobians --------------------------------------------------------------------
    def _motor_inputs(self, u: Optional[np.ndarray], steps: int):
        torch = self.torch
        if not self.n_u:
            return None, None
        if u is None:
            raise ValueError("motor angles are needed for an actuated structure")
        from ..engine import inputs_from_angles
        U = torch.as_tensor(np.asarray(u, dtype=float)[: steps + 1]).unsqueeze(1)              # (K+1, 1, A)
        inp = inputs_from_angles(U, self.dt)
        return inp.motor_angles[:, 0], inp.motor_velocities[:, 0]                                # (K+1, A)

    def _nominal_engine(self, params, x0: np.ndarray, Us, Uds, steps: int, n_sub: int):
        torch = self.torch
        f = self._step_fn(params, n_sub)
        with torch.no_grad():
            xs = [torch.as_tensor(x0).unsqueeze(0)]
            for k in range(steps):
                xs.append(f(xs[-1], None if Us is None else Us[k:k + 1], None if Uds is None else Uds[k:k + 1]))
        return torch.cat(xs)

    def _nominal_twin(self, params, P: np.ndarray, V: np.ndarray, Us, Uds, steps: int):
        """The nominal from the MuJoCo twin of the current parameters. Returns states (K+1, n)."""
        from ..engine import apply_to_structure
        from ..twin.sim import TwinSim

        key = tuple(float(v) for v in self.torch.cat([getattr(params, k).reshape(-1) for k in params.kinds()]))
        if self._twin is None or key != self._twin_key:
            # ungated (one MuJoCo call per chunk instead of a Python loop per millisecond): the gate only
            # matters for slack strings that lengthen fast (docs/CONTRACTS.md)
            self._twin = TwinSim(apply_to_structure(self.structure, params), timestep=self.twin_timestep,
                                 gate_slack=False)
            self._twin_key = key
        sim = self._twin
        sim.reset()
        sim.set_node_state(P, V)
        import mujoco
        bad = (mujoco.mjtWarning.mjWARN_BADQACC, mujoco.mjtWarning.mjWARN_BADQVEL, mujoco.mjtWarning.mjWARN_BADQPOS)
        warnings0 = [int(sim.data.warning[w].number) for w in bad]
        n_sub = max(1, int(round(self.dt / sim.dt)))
        u = None if Us is None else Us.numpy()
        ud = None if Uds is None else Uds.numpy()
        out = np.empty((steps + 1, self.n))
        P1, V1 = sim.node_positions(), sim.node_velocities()
        out[0] = np.concatenate([P1[self.free].reshape(-1), V1[self.free].reshape(-1)])
        chunks = max(1, min(n_sub, int(round(self.dt / 0.005))))   # motor angles refreshed every ~5 ms
        bounds = np.linspace(0, n_sub, chunks + 1).round().astype(int)
        for k in range(steps):
            for c in range(chunks):
                if u is None:
                    sim.step(None, int(bounds[c + 1] - bounds[c]))
                else:   # linear between the prediction steps (the motors move continuously)
                    w = bounds[c] / n_sub
                    sim.step((1 - w) * u[k] + w * u[k + 1], int(bounds[c + 1] - bounds[c]),
                             (1 - w) * ud[k] + w * ud[k + 1])
            P1, V1 = sim.node_positions(), sim.node_velocities()
            out[k + 1] = np.concatenate([P1[self.free].reshape(-1), V1[self.free].reshape(-1)])
        if [int(sim.data.warning[w].number) for w in bad] != warnings0:
            raise FloatingPointError("the twin nominal went unstable (MuJoCo reset it); parameters implausible?")
        return self.torch.as_tensor(out)

    def linearize(self, params, t0: float, positions: np.ndarray, velocities: np.ndarray, u: Optional[np.ndarray],
                  steps: int, set_id: str = "") -> Linearization:
        """The nominal over ``steps`` prediction steps from full-node positions / velocities (N, 3) at t0
        (consistent with the linear constraints, e.g. from :meth:`full_positions`) with motor angles u
        (steps+1, A) (None without actuators), then A_k, B_k of the engine step by forward-mode autograd,
        batched over time points and tangents."""
        torch = self.torch
        t_start = time.perf_counter()
        Us, Uds = self._motor_inputs(u, steps)
        A_ = self.n_u
        if self.nominal == "twin":
            X = self._nominal_twin(params, positions, velocities, Us, Uds, steps)
            n_sub = self.stable_substeps(params, X, Us, Uds)
        else:
            x0 = self.initial_state(params, positions, velocities)
            n_sub = self.stable_substeps(params, torch.as_tensor(x0).unsqueeze(0), Us, Uds)
            X = self._nominal_engine(params, x0, Us, Uds, steps, n_sub)
        if not torch.all(torch.isfinite(X)):
            raise FloatingPointError("nominal rollout diverged (non-finite states)")
        # Jacobians of ONE engine substep at every jac_stride-th prediction step (and the last), composed over
        # the substeps of a prediction step (the substep Jacobian varies little within one prediction step)
        # and interpolated linearly between those time points
        ks = np.unique(np.r_[np.arange(0, steps, self.jac_stride), steps - 1])
        Js = self.compose(self._substep_jacobians(params, n_sub, X, Us, Uds, ks), n_sub, self.n)
        self.last_substeps = n_sub
        Un = Us.numpy() if A_ else np.zeros((steps + 1, 0))
        return Linearization(t0=float(t0), dt=self.dt, x=X.numpy(), u=Un, ks=ks, J=Js, set_id=set_id,
                             compute_s=time.perf_counter() - t_start)

    # ---- per message ----------------------------------------------------------------------------------------
    def covers(self, lin: Linearization, t: float, steps: int, extended: bool = False) -> bool:
        """Whether ``lin`` holds t and ``steps`` steps after it (``extended``: counting the nominal's
        extension, see :meth:`Linearization.expand`)."""
        i = (t - lin.t0) / lin.dt
        end = lin.steps + (lin.ext_steps if extended else 0)
        return i >= -1e-9 and math.floor(i + 1e-9) + steps + 1 <= end

    def predict(self, lin: Linearization, t: float, x_meas: np.ndarray, steps: int,
                u_future: Optional[np.ndarray] = None, extended: bool = False) -> Tuple[np.ndarray, np.ndarray, int]:
        """States at t + k dt, k = 1..steps, from the measured state x_meas (n,) at t (NaN entries: no
        measurement, the nominal is used there). u_future: (steps, A) motor angles over the steps (None:
        the nominal's). ``extended``: steps past the nominal's end may use its extension
        (:meth:`Linearization.expand`). Returns free-node positions (steps, nf, 3), velocities (steps, nf, 3)
        and the nominal index of t (for :meth:`Linearization.step_jacobians`)."""
        lin.expand()
        i = (t - lin.t0) / lin.dt
        i0 = int(math.floor(i + 1e-9))
        f = min(max(i - i0, 0.0), 1.0)
        if not self.covers(lin, t, steps, extended):
            raise ValueError(f"the nominal [{lin.t0:.3f}, {lin.t_end:.3f}] s (+{lin.ext_steps if extended else 0} "
                             f"extension steps) does not cover t = {t:.3f} s + {steps} steps")
        X, U, Jk, K = lin.xe, lin.ue, lin.Jk32, lin.steps
        n, A_ = self.n, self.n_u
        xb = (1 - f) * X[i0] + f * X[i0 + 1]
        # Z[k] = [x_k - xbar_k | u_k - ubar_k]: one (n, n + A) matrix-vector product per step gives the next
        # deviation, written in place (no per-step temporaries)
        Z = np.zeros((steps + 1, n + A_), dtype=np.float32)
        d = Z[0, :n]
        np.subtract(x_meas, xb, out=d)
        d[~np.isfinite(d)] = 0.0
        if A_ and u_future is not None:
            du = np.asarray(u_future, dtype=float)[:steps] - ((1 - f) * U[i0:i0 + steps] + f * U[i0 + 1:i0 + steps + 1])
            if np.all(np.isfinite(du)):
                Z[:steps, n:] = du
        out = (1 - f) * X[i0 + 1:i0 + steps + 1]
        out += f * X[i0 + 2:i0 + steps + 2]
        last = K - 1
        for k in range(steps):           # the recurrence: one matrix-vector product per step (the hot loop)
            np.matmul(Jk[min(i0 + k, last)], Z[k], out=Z[k + 1, :n])
        D = Z[1:, :n]
        # the correction is first order: bounded to 3x the initial deviation (min 5 mm, 50 mm/s), so a
        # linearisation about a far-off nominal (wrong parameters, a violent transient) cannot blow up
        npos = 3 * self.nf
        self.last_deviation = float(np.abs(d[:npos]).max(initial=0.0))
        cap_p = max(3.0 * self.last_deviation, 5e-3)
        cap_v = max(3.0 * float(np.abs(d[npos:]).max(initial=0.0)), 5e-2)
        peak_p, peak_v = np.abs(D[:, :npos]).max(axis=1), np.abs(D[:, npos:]).max(axis=1)
        over = ~((peak_p <= cap_p) & (peak_v <= cap_v))          # NaN compares False: over
        if over.any():
            # each step's correction is scaled back to the bound, and a step that is not finite contributes
            # nothing. Not rare: with the demo's 20 %-off nominal most messages hit the bound until the first
            # set is accepted. (This was a second, step-by-step recurrence with the bound inside, holding the
            # GIL for ~3x the prediction's own time: 16 % of the graph process's GIL samples, py-spy --gil.)
            self.capped += 1
            bad = ~(np.isfinite(peak_p) & np.isfinite(peak_v))
            D[bad] = 0.0
            D[:, :npos] *= np.minimum(1.0, cap_p / np.maximum(np.where(bad, 1.0, peak_p), 1e-300))[:, None]
            D[:, npos:] *= np.minimum(1.0, cap_v / np.maximum(np.where(bad, 1.0, peak_v), 1e-300))[:, None]
        out += D
        nf = self.nf
        return out[:, :3 * nf].reshape(steps, nf, 3), out[:, 3 * nf:].reshape(steps, nf, 3), i0

    def measured_state(self, names: Sequence[str], positions: np.ndarray, velocities: np.ndarray,
                       valid: np.ndarray) -> np.ndarray:
        """(n,) state of the free nodes from a node-state record (NaN where unknown)."""
        names = tuple(names)
        m = self._name_maps.get(names)
        if m is None:                    # once per node-name list (the stream's names never change)
            idx = {nm: i for i, nm in enumerate(names)}
            dst = np.array([j for j, nm in enumerate(self.free_names) if nm in idx], dtype=int)
            src = np.array([idx[self.free_names[j]] for j in dst], dtype=int)
            m = self._name_maps[names] = (src, dst)
        src, dst = m
        q = np.full((self.nf, 3), np.nan)
        v = np.full((self.nf, 3), np.nan)
        ok = np.asarray(valid, dtype=bool)[src]
        q[dst[ok]] = positions[src[ok]]
        v[dst[ok]] = velocities[src[ok]]
        return np.concatenate([q.reshape(-1), v.reshape(-1)])


class PredictionStream:
    """The node's decisions without ROS: when to compute a new nominal and how long it must be, and the
    prediction for each node-state message (the node = this + message conversion + the worker). Stamps are
    message times (s); ``now`` (s, monotonic) only paces relinearisations.

    Schedule: a new nominal is started from the latest message when the current one will not cover the
    messages that arrive while the next is computed (``lookahead_s``: 1.5 x the 90th percentile of recent
    relinearisation wall times + 0.1 s), when the parameters or the motor plan change (``version``), and at
    most every ``period_s`` when it is ``max_age_s`` old or a message was ``deviation_m`` off it. Its length
    (automatic ``margin_s`` = 0) is the horizon + min(period, max age) + the lookahead + 0.2 s: enough to
    bridge to the next one, and no more, since the cost of a relinearisation is proportional to it (the
    former margin of max age + 1.5 x the relinearisation time fed back on itself on a loaded CPU: 6-s
    nominals that took 6 s to compute and so never covered the present).

    Messages the nominal does not cover get the prediction along its frozen-Jacobian extension
    (:meth:`Linearization.expand`, up to ``extend_s``) and count in ``extended``; only those beyond that
    (or before the nominal) are skipped (``skipped_uncovered``).
    """

    def __init__(self, core: HorizonPredictor, horizon_steps: int, period_s: float = 1.0, max_age_s: float = 3.0,
                 deviation_m: float = 0.005, margin_s: float = 0.0, extend_s: float = 0.25):
        self.core = core
        self.steps = int(horizon_steps)
        self.period_s, self.max_age_s, self.deviation_m, self.margin = period_s, max_age_s, deviation_m, margin_s
        self.extend_steps = max(0, int(round(extend_s / core.dt)))
        self.lin: Optional[Linearization] = None
        self.lin_times: deque = deque(maxlen=20)   # wall s of the recent relinearisations
        self.predictions = 0
        self.extended = 0
        self.skipped_uncovered = 0
        self.last_extended = False
        self._next_due = -math.inf
        self._version = None

    # ---- schedule --------------------------------------------------------------------------------------
    def lin_time_s(self) -> float:
        """90th percentile of the recent relinearisation wall times (0.6 s before the first)."""
        return float(np.percentile(self.lin_times, 90)) if self.lin_times else 0.6

    def lookahead_s(self) -> float:
        return 1.5 * self.lin_time_s() + 0.1

    def margin_s(self) -> float:
        if self.margin > 0:
            return self.margin
        return min(min(self.period_s, self.max_age_s) + self.lookahead_s() + 0.2, self.max_age_s + 2.0)

    def nominal_steps(self) -> int:
        """Prediction steps of the next nominal: the horizon + the margin."""
        return self.steps + max(2, int(math.ceil(self.margin_s() / self.core.dt)))

    def wants_relinearization(self, stamp: float, now: float, version=None) -> bool:
        lin = self.lin
        if lin is None or version != self._version:
            return True
        if not self.core.covers(lin, stamp + self.lookahead_s(), self.steps):
            return True
        return now >= self._next_due and (stamp - lin.t0 >= self.max_age_s or
                                          self.core.last_deviation > self.deviation_m)

    def started(self, now: float, version=None) -> None:
        """A relinearisation was started at ``now`` for inputs ``version``."""
        self._version = version
        self._next_due = now + self.period_s

    def install(self, lin: Linearization, wall_s: Optional[float] = None) -> Linearization:
        """Make ``lin`` current (interpolating and extending it first: call from the background thread)."""
        lin.expand(self.extend_steps)
        self.lin = lin
        self.lin_times.append(lin.compute_s if wall_s is None else wall_s)
        return lin

    # ---- per message ------------------------------------------------------------------------------------
    def predict(self, stamp: float, x: np.ndarray, u_future: Optional[np.ndarray]):
        """(q, v, i0, lin, extended) for the message at ``stamp`` with measured state x (n,), or None
        (no nominal yet, or not covered even by the extension)."""
        lin = self.lin
        if lin is None:
            return None
        core, K = self.core, self.steps
        ext = not core.covers(lin, stamp, K)
        if ext and not core.covers(lin, stamp, K, extended=True):
            self.skipped_uncovered += 1
            return None
        q, v, i0 = core.predict(lin, stamp, x, K, u_future, extended=ext)
        self.predictions += 1
        self.extended += ext
        self.last_extended = ext
        return q, v, i0, lin, ext


# =====================================================================================================
# the relinearisation job (runs in the worker: a spawned process by default)
# =====================================================================================================
_WORKER_CORES: Dict[int, HorizonPredictor] = {}


def core_job(key: int, structure: Structure, options: Dict[str, object]) -> int:
    """Build the worker's predictor core ahead of the first relinearisation; returns the worker's pid."""
    import os
    if key not in _WORKER_CORES:
        core = _WORKER_CORES[key] = HorizonPredictor(structure, **options)
        # warm up: torch's first calls of each op and the stable substep count of the nominal parameters
        n_u = core.n_u
        core.linearize(core.engine.default_params(), 0.0, core.X0, np.zeros_like(core.X0),
                       np.repeat(np.array([[a.zero_offset for a in structure.actuators]]), 12, axis=0) if n_u else None,
                       11)
    return os.getpid()


def relinearize_job(key: int, structure: Structure, options: Dict[str, object], values: Dict[str, float], t0: float,
                    P: np.ndarray, V: np.ndarray, u: Optional[np.ndarray], steps: int, set_id: str) -> Linearization:
    """Nominal + Jacobians from full-node positions / velocities (N, 3) at t0 with parameter values by name.
    The predictor core (``HorizonPredictor(structure, **options)``) is built once per worker (``key``)."""
    core = _WORKER_CORES.get(key)
    if core is None:
        core = _WORKER_CORES[key] = HorizonPredictor(structure, **options)
    params = core.engine.default_params().with_values(values)
    return core.linearize(params, t0, P, V, u, steps, set_id)


# =====================================================================================================
# the node
# =====================================================================================================
PARAMS = (
    ParamSpec("model_file", "", "structure YAML (nominal model; identified values replace its parameters)",
              check=C.required_file, read_only=True),
    ParamSpec("integrator", "semi_implicit", "engine integrator", choices=("semi_implicit", "rk4"), read_only=True),
    ParamSpec("horizon_s", 1.0, "prediction horizon [s]", range=(0.01, 10.0), read_only=True),
    ParamSpec("dt", 0.01, "prediction step [s]", range=(1e-4, 0.1), read_only=True),
    ParamSpec("relinearize_period_s", 1.0, "shortest time between two relinearisations [s]", range=(0.02, 60.0)),
    ParamSpec("relinearize_max_age_s", 3.0, "relinearise when the nominal is this old [s]", range=(0.05, 600.0)),
    ParamSpec("relinearize_deviation_m", 0.005, "relinearise (after relinearize_period_s) when a measured state is "
              "this far from the nominal [m]", range=(0.0, 10.0)),
    ParamSpec("nominal_margin_s", 0.0, "nominal horizon beyond horizon_s [s]; 0 = automatic: min(relinearize_period_s, "
              "relinearize_max_age_s) + 1.5 x the relinearisation time (p90) + 0.3 s", range=(0.0, 60.0)),
    ParamSpec("extend_max_s", 0.25, "when the next nominal is late, predict along the current one's frozen-Jacobian "
              "extension for up to this long past its end [s] (0 = skip those messages)", range=(0.0, 10.0),
              read_only=True),
    ParamSpec("substeps", 0, "engine steps per prediction step for the Jacobians (0 = automatic: the shortest "
              "power of two that is stable)", range=(0, 4096), read_only=True),
    ParamSpec("nominal", "twin", "nominal rollout: twin (MuJoCo model of the current parameters) | engine",
              choices=HorizonPredictor.NOMINALS, read_only=True),
    ParamSpec("jac_stride", 10, "Jacobians every n prediction steps, interpolated in between", range=(1, 100),
              read_only=True),
    ParamSpec("motor_source", "auto", "future motor angles: auto | plan | reference | hold",
              choices=("auto", "plan", "reference", "hold")),
    ParamSpec("reference_file", "", "reference YAML the driver runs (for motor_source reference/auto)",
              check=C.file_exists, read_only=True),
    ParamSpec("plan_dt", 0.01, "step of a JointState motor plan [s]", range=(1e-4, 1.0)),
    ParamSpec("plan_timeout_s", 1.0, "a plan older than this (and ended) is ignored [s]", range=(0.0, 3600.0)),
    ParamSpec("output_nodes", [], "nodes to publish ([] = those of the node-state messages)", read_only=True,
              type_="string_array"),
    ParamSpec("publish_every", 1, "predict at every n-th node-state message", range=(1, 1000)),
    ParamSpec("torch_threads", 1, "torch intra-op threads (process-wide)", range=(1, 256), read_only=True),
    ParamSpec("worker", "process", "where relinearisations run: process (a spawned child: never holds the "
              "callbacks' GIL) | thread", choices=C.WORKER_KINDS, read_only=True),
    ParamSpec("worker_nice", 5, "niceness of the worker process (raise it to favour the per-message path; "
              "0 = the node's own)",
              range=(0, 19), read_only=True),
    ParamSpec("realized_every", 24, "score every n-th published prediction against the node states that arrive "
              "later (the realized error in /diagnostics and in each prediction's realized_error)",
              range=(1, 100000), read_only=True),
    ParamSpec("realized_memory_s", 10.0, "memory (time constant) of the realized error [s]", range=(0.1, 3600.0),
              read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)


class StatePredictorNode(C.GraphNode):
    DEFAULT_NAME = "state_predictor"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        import torch
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates
        from tensegrity_ros.srv import GetLinearization

        p = self.p
        torch.set_num_threads(p["torch_threads"])
        self.structure = load_structure(p["model_file"])
        self.core_options = {"dt": p["dt"], "substeps": p["substeps"], "integrator": p["integrator"],
                             "nominal": p["nominal"], "jac_stride": p["jac_stride"]}
        self.core = HorizonPredictor(self.structure, **self.core_options)
        self.steps = max(1, int(round(p["horizon_s"] / p["dt"])))
        self.params = self.core.engine.default_params()
        self.set_id = "nominal"
        self._params_version = 0
        tracker = None
        if p["reference_file"]:
            from ..references import load_reference
            ref = load_reference(p["reference_file"], self.structure.actuators)
            tracker = ReferenceTracker.from_reference(ref, self.structure.actuators, self.core.actuator_names)
        if p["motor_source"] == "reference" and tracker is None:
            raise C.ParameterError("motor_source 'reference' needs reference_file")
        self.future = MotorFuture(self.core.actuator_names, p["motor_source"], tracker, p["plan_timeout_s"])

        self.stream = PredictionStream(self.core, self.steps, p["relinearize_period_s"], p["relinearize_max_age_s"],
                                       p["relinearize_deviation_m"], p["nominal_margin_s"],
                                       p["extend_max_s"])
        self._k_dt = self.core.dt * np.arange(self.steps)
        # each prediction scored against the node states that arrive later (predict/realized.py)
        self.realized = RealizedError(self.steps, self.core.dt, p["realized_memory_s"])
        self._out_maps: Dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self._latest = None              # latest node-state record
        self._last_i0 = 0
        self._last_pred_t = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._msg_count = 0
        self.due = 0                     # node-state messages due a prediction once the first nominal exists
        self.seq = C.SequenceMonitor()
        self.latency = C.RollingStats(20000)      # reception -> publish, s
        self.compute = C.RollingStats(20000)      # callback entry -> publish, s
        self.lin_time = C.RollingStats(200)
        self.lin_failures = 0
        self.last_error = ""
        self.output_names: Optional[Tuple[str, ...]] = tuple(p["output_nodes"]) or None
        bad = [n for n in (self.output_names or ()) if n not in self.core.node_names]
        if bad:
            raise C.ParameterError(f"output_nodes {bad} are not nodes of {self.structure.name}")

        self.pub = self.counting_publisher(PredictedStates, C.TOPICS["predicted_states"], C.PREDICTION_QOS)
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._on_node_states, C.STREAM_QOS, raw=True)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._on_motor_states, C.STREAM_QOS, raw=True)
        self.subscribe(IdentifiedParameters, C.TOPICS["identified_parameters"], self._on_parameters, C.LATCHED_QOS,
                       info=False)
        self._plan_type = "JointState"
        try:
            from trajectory_msgs.msg import JointTrajectory
            self.subscribe(JointTrajectory, C.TOPICS["motor_plan"], self._on_trajectory_plan, 10, info=False)
            self._plan_type = "JointTrajectory"
        except ImportError:
            self.subscribe(JointState, C.TOPICS["motor_plan"], self._on_joint_state_plan, 10, info=False)
        self.srv = self.create_service(GetLinearization, "~/get_linearization", self._on_get_linearization)
        self.timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        self._pool = C.make_worker(p["worker"], C.worker_init,
                                   (p["torch_threads"], p["worker_nice"] if p["worker"] == "process" else 0))
        self._key = id(self)
        self.worker_pid = self._pool.submit(core_job, self._key, self.structure, self.core_options).result()
        self._thread = threading.Thread(target=self._linearizer, name="state-predictor-linearizer", daemon=True)
        self._thread.start()

    # ---- inputs -------------------------------------------------------------------------------------------
    def _on_motor_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["motor_states"], info)
        r = C.joint_state_from_cdr(data)
        self.future.observe(r.stamp, r.names, r.position)

    def _on_parameters(self, msg) -> None:
        try:
            ps = C.parameter_set_from_msg(msg)
            params = C.params_with_set(self.core.engine.default_params(), ps)
        except (ValueError, RuntimeError) as e:
            self.get_logger().error(f"identified parameters not usable: {e}")
            return
        with self._lock:
            self.params, self.set_id = params, ps.set_id
            self._params_version += 1
        self._wake.set()

    def _on_joint_state_plan(self, msg) -> None:
        A = len(msg.name)
        pos = np.asarray(msg.position, dtype=float)
        if A == 0 or pos.size == 0 or pos.size % A:
            self.get_logger().warn(f"motor plan: {pos.size} positions for {A} names (need K x A)",
                                   throttle_duration_sec=5.0)
            return
        K = pos.size // A
        t0 = C.stamp_to_sec(msg.header.stamp)
        self._set_plan(MotorPlan(t0 + self.p["plan_dt"] * np.arange(K), tuple(msg.name), pos.reshape(K, A),
                                 self.now_s()))

    def _on_trajectory_plan(self, msg) -> None:  # pragma: no cover - needs trajectory_msgs
        t0 = C.stamp_to_sec(msg.header.stamp)
        times = np.array([t0 + p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points])
        angles = np.array([list(p.positions) for p in msg.points], dtype=float)
        if times.size == 0 or angles.shape[1] != len(msg.joint_names):
            return
        self._set_plan(MotorPlan(times, tuple(msg.joint_names), angles, self.now_s()))

    def _set_plan(self, plan: MotorPlan) -> None:
        self.future.set_plan(plan)
        self._wake.set()

    # ---- the nominal (background thread) -------------------------------------------------------------------
    @property
    def predictions(self) -> int:
        return self.stream.predictions

    @property
    def skipped_uncovered(self) -> int:
        return self.stream.skipped_uncovered

    def predictions_per_node_state(self) -> float:
        """Predictions published per node-state message due one (every ``publish_every``-th with valid nodes,
        from the first nominal on); NaN before any was due."""
        return self.pub.count / self.due if self.due else math.nan

    def _linearizer(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.02)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._lock:
                rec = self._latest
                params, set_id, pv = self.params, self.set_id, self._params_version
            if rec is None:
                continue
            now = time.monotonic()
            version = (pv, self.future.version)
            if not self.stream.wants_relinearization(rec.stamp, now, version):
                continue
            self.stream.started(now, version)
            try:
                self._relinearize(rec, params, set_id)
            except Exception as e:   # keep predicting with the previous nominal; say why
                if self._stop.is_set():   # the worker was shut down under a running relinearisation
                    break
                self.lin_failures += 1
                self.last_error = f"relinearisation failed: {type(e).__name__}: {e}"
                self.get_logger().error(self.last_error, throttle_duration_sec=5.0)

    def _relinearize(self, rec, params, set_id: str) -> None:
        core = self.core
        self.future.update()
        t0 = rec.stamp
        x = core.measured_state(rec.names, rec.positions, rec.velocities, rec.valid)
        lin = self.stream.lin
        if lin is not None and core.covers(lin, t0, 0, extended=True):   # unseen nodes: from the current nominal
            i = min(int(round((t0 - lin.t0) / lin.dt)), lin.xe.shape[0] - 1)
            x = np.where(np.isfinite(x), x, lin.xe[i])
        q, v = core.split(x)
        q = np.where(np.isfinite(q), q, core.X0[core.free])
        v = np.where(np.isfinite(v), v, 0.0)
        P, V = core.full_positions(q), core.full_velocities(v)   # dependent nodes from the free ones
        K = self.stream.nominal_steps()
        u = self.future.angles(t0 + core.dt * np.arange(K + 1)) if core.n_u else None
        if core.n_u and u is None:
            return   # no motor state yet
        t_start = time.perf_counter()
        values = {n: float(v) for n, v in params.named().items()}
        new = self._pool.submit(relinearize_job, self._key, self.structure, self.core_options, values, t0, P, V, u,
                                K, set_id).result()
        wall = time.perf_counter() - t_start
        self.stream.install(new, wall)   # interpolated and extended here, before the callbacks use it
        self.lin_time.add(wall)

    # ---- per message ---------------------------------------------------------------------------------------
    def _on_node_states(self, data: bytes, info=None) -> None:
        t_in = time.perf_counter()
        t_rx_ns = time.time_ns()
        if info is not None and info.get("received_timestamp"):
            t_rx_ns = int(info["received_timestamp"])
        self.seq.update_info(C.TOPICS["node_states"], info)
        rec = C.node_states_from_cdr(data)
        # every message: subsampled in step with the scored predictions, some horizon steps were never scored
        self.realized.add_measurement(rec.stamp, rec.names, rec.positions, rec.valid)
        with self._lock:
            first = self._latest is None
            self._latest = rec
        if first:
            self._wake.set()
        self._msg_count += 1
        if (self._msg_count - 1) % self.p["publish_every"]:
            return
        if self.stream.lin is None or not rec.valid.any():
            return
        self.due += 1                    # a message that should get a prediction (health: predictions per due)
        core = self.core
        x = core.measured_state(rec.names, rec.positions, rec.velocities, rec.valid)
        u_future = self.future.angles(rec.stamp + self._k_dt) if core.n_u else None
        res = self.stream.predict(rec.stamp, x, u_future)
        if res is None or res[4]:
            self._wake.set()             # late nominal: make sure the background thread looks now
        if res is None:
            return
        q, v, i0, lin, _ = res
        m = self._out_maps.get(rec.names)
        if m is None:                    # once per node-name list: output rows of X = T Q + X_c
            names = self.output_names or rec.names
            idx = [core.node_names.index(n) for n in names if n in core.node_names]
            m = self._out_maps[rec.names] = (tuple(core.node_names[i] for i in idx), core.T[idx], core.Xc[idx])
        out_names, T_out, Xc_out = m
        P = np.matmul(T_out, q)
        P += Xc_out
        pred = C.Prediction(rec.stamp + core.dt, core.dt, out_names, P, np.matmul(T_out, v), lin.set_id,
                            rec.frame_id or "structure", self.realized.per_step())
        self.pub.publish(C.prediction_to_cdr(pred))
        if self.stream.predictions % self.p["realized_every"] == 0:
            self.realized.add_prediction(pred.stamp, out_names, P)
        self._last_i0, self._last_pred_t, self._last_lin = i0, rec.stamp, lin
        self.compute.add(time.perf_counter() - t_in)
        self.latency.add((time.time_ns() - t_rx_ns) * 1e-9)

    # ---- service -------------------------------------------------------------------------------------------
    def _on_get_linearization(self, request, response):
        lin = getattr(self, "_last_lin", None)
        if lin is None:
            response.success, response.message = False, "no prediction yet (waiting for node states / motor states)"
            return response
        i0 = self._last_i0
        K = self.steps if request.max_steps == 0 else min(int(request.max_steps), self.steps)
        A, B = lin.step_jacobians(i0, K)
        response.success = True
        response.message = (f"deviation form about the nominal of set {lin.set_id!r} from t = {self._last_pred_t:.3f} s: "
                            "dx[k+1] = A[k] dx[k] + B[k] du[k]")
        response.horizon_steps = int(A.shape[0])
        response.state_dim, response.input_dim = self.core.n, self.core.n_u
        response.dt = lin.dt
        response.a_matrices = A.reshape(-1).tolist()
        response.b_matrices = B.reshape(-1).tolist()
        response.state_names = list(self.core.state_names)
        response.input_names = list(self.core.input_names)
        return response

    # ---- diagnostics -------------------------------------------------------------------------------------
    def _diagnostics(self) -> None:
        vals: Dict[str, object] = {"predictions": self.predictions, "parameter_set_id": self.set_id,
                                   "horizon_steps": self.steps, "dt_s": self.core.dt,
                                   "motor_source": self.future.active, "plan_type": self._plan_type,
                                   "input_dropped": self.seq.total_dropped,
                                   "skipped_uncovered": self.skipped_uncovered,
                                   "predictions_extended": self.stream.extended,
                                   "predictions_capped": self.core.capped,
                                   "last_prediction_extended": self.stream.last_extended,
                                   "nominal_steps": self.stream.nominal_steps(),
                                   "relinearize_failures": self.lin_failures}
        vals.update(self.latency.summary(1e3, "latency_ms_"))
        vals.update(self.compute.summary(1e3, "compute_ms_"))
        vals.update(self.lin_time.summary(1e3, "relinearize_ms_"))
        for ahead in (0.1, 0.5, self.steps * self.core.dt):   # what the predictions turned out to be worth
            vals[f"realized_error_mm_at_{ahead:.2g}s"] = self.realized.at(ahead) * 1e3
        vals["realized_scored"] = self.realized.scored
        tr = self.future.tracker
        if tr is not None:
            vals["reference_locked"] = tr.locked
            vals["reference_residual_rad"] = tr.residual_rad
        if self.predictions == 0:
            level, message = "warn", self.last_error or "waiting for node states and motor states"
        elif self.lin_failures and self.last_error:
            level, message = "warn", self.last_error
        else:
            p50, p99 = self.latency.percentile(50) * 1e3, self.latency.percentile(99) * 1e3
            level, message = "ok", f"latency p50 {p50:.2f} ms, p99 {p99:.2f} ms"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: state predictor", level, message, vals,
                                                self.structure.name)])

    def destroy_node(self):
        self._stop.set()
        self._wake.set()
        C.stop_worker(self._pool)       # settles a relinearisation in flight (WorkerStopped): the thread ends
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        return super().destroy_node()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(StatePredictorNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
