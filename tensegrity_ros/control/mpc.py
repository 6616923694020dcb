"""Linear time-varying MPC of the plate pose on the predictor's linearisation, solved by OSQP.

Model (the predictor's deviation form, ``nodes/state_predictor.py`` ``Linearization``): along a nominal
(xbar_k, ubar_k), k = 0..N,

    x_{k+1} = xbar_{k+1} + A_k (x_k - xbar_k) + B_k (e_k - ebar_k) + d,    y_k = h(x_k) ~ h(xbar_k) + C_k (x_k - xbar_k)

with x the free-node positions and velocities (m, m/s), e_k the effective motor input over step k (rad, below),
d the disturbance estimate, y what is tracked (the plate pose 0C2 and chosen node positions, :mod:`.outputs`)
and C_k = dh/dx at xbar_k.

Decision variables: the plan's knots v = (v_0 .. v_{M-1}), motor angles (rad) every ``block_steps`` prediction
steps (move blocking: the QP has M x A variables, not N x (n + A); the states are eliminated, a dense
"condensed" QP). ``input_model="ramp"`` (default): the motors run linearly from the present command through knot
b at (b+1) block_steps dt, as the driver's rate-limited goals move them; over step k the angle goes from a_k to
a_{k+1} and e_k = (a_k + a_{k+1}) / 2 + tau (a_{k+1} - a_k) / dt, tau = damping / stiffness of the actuated string
(the string force is kappa (l - xi0) + zeta (l' - xi0'): a rest-length rate acts as a rest-length offset of
tau xi0'). On the manipulator's twin the one-cycle prediction of the node velocities was off by 3-17 cm/s with
step-driven motors and the hold model, by 0.2-26 mm/s with ramps and this model. ``input_model="hold"``: e_k = the knot of step k's
block (zero-order hold, what LQR assumes). Cost, each term a sum of squares in stated units:

    sum_{k=1..N} w_k |(y_k - r_k) / tol|^2                      tracking; w_N = terminal_factor, else 1
  + sum_{k=1..N} |z_k / (tol T_i)|^2                             integral action (below)
  + sum_b |(v_b - v_{b-1}) / (T_b rate_scale_rad_s)|^2          smooth plans (v_{-1} = the present command)
  + sum_b |(v_b - u_rest) / effort_scale_rad|^2                 stay near the rest angles when free to

Optional, off by default (docs/control.md, "Model"): ``actuator_lag_s`` makes the motor angle a first-order lag
of the commanded ramp (the servo state carried from the previous cycle's plan), and ``solve(u_applied=...)``
keeps the commands already sent for the first steps (the plan's ramp starts after them).

Constraints (OSQP rows, exact after a final projection): lower <= v_b <= upper (the structure's actuator
limits, less ``limit_margin_rad``) and |v_b - v_{b-1}| <= max_rate_rad_s T_b, with T_b = block_steps dt.

The initial state: positions as measured, velocities ``measured_velocity_weight`` x measured + the rest x the
previous cycle's prediction of now under the plan it sent (``_blend_velocities``; 1 = as measured, the first
cycle and after a hold always). The graph's node velocities come from the ingest's constant-velocity Kalman
filter at 120 Hz (mocap/filtering.py), which lags the robot's motion (its error: ~70 % of the RMS node velocity
on the demo's circle); taken as the state, they started every prediction from stale velocities, and with the
graph's other delays (servo lag, frames, linearisation age) the loop limit-cycled on the rate limit
(bench/study_control_delay.py, true model, the demo's 10-mm circle: 19.8 mm RMSE, a plan on a limit in every
cycle; exact velocities instead: 2.2 mm). Blended: weight 0.1 / 0.2 (default) / 0.3: 0.7 / 0.5 / 0.6 mm, 0: 1.3
mm, 0.5: 10.7 mm (the limit cycle again). The prediction is the model's and carries its error: the measured
share keeps the state anchored. The state's second half must be velocities (the predictor's [positions,
velocities]); for other states set 1.

Steady model error, two mechanisms (docs/control.md):

* DISTURBANCE ESTIMATE (default, ``disturbance="velocity"``): the model is x_{k+1} = ... + d with d a constant
  per-step disturbance of the velocities (a generalised force the model lacks, e.g. from stiffnesses that are
  off). Each cycle compares the measured state with what the previous cycle predicted for now under the plan it
  sent, e = x_meas - xhat_j (j = elapsed steps), and corrects d by ``disturbance_gain`` times the least-squares
  d-increment that explains e (through the exact sensitivity Psi_j = sum_i A_{j-1}..A_{i+1} of x_j to a constant
  d). At a steady state the corrected model predicts the robot stays where it is, so its equilibria, and the
  plan, are offset free. Without it, a 20 % stiffness error on the manipulator makes the model predict a large
  drift from every measured state and the loop chases it (measured: tracking error 17 -> 35-46 mm; with the
  estimate it falls to 8 mm (ramp) / 3 mm (hold), test_control_closed_loop.py).
  ``disturbance="state"`` estimates all components (systems without a position/velocity split).
* INTEGRAL ACTION (optional, ``integral_time_s`` > 0): z is the integral of the measured tracking error,
  z <- z + elapsed (y(x_meas) - r_now), updated before each solve (``elapsed_s``); over the horizon the QP
  continues it with the predicted errors, z_k = z + dt sum_{i<=k} (y_i - r_i), and penalises it. Anti-windup: z
  is not integrated after a plan that was not ``solved`` (limits active, stale, failed), and is clamped to
  +-integral_max_tol_s x tol.

Warm start: the OSQP problem is set up once; every cycle updates P's values (same dense upper-triangular
pattern), q, l and u, and starts from the previous plan shifted by the blocks that elapsed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

import numpy as np

from .outputs import wrap_angle


class Status(str, Enum):
    SOLVED = "solved"                               # optimal; no limit active
    BEST_EFFORT = "infeasible_best_effort"          # optimal under active actuator / rate limits: the target is
                                                    # not reachable within them, this is the closest plan that is
    INACCURATE = "inaccurate"                       # the solver stopped early (iterations, time); plan projected
    STALE = "stale"                                 # inputs older than max_input_age_s: hold the present command
    FAILED = "failed"                               # non-finite inputs or no solver answer: hold


DISTURBANCES = ("velocity", "state", "none")   # not "off": YAML 1.1 reads a bare off as false
INPUT_MODELS = ("ramp", "hold")


@dataclass(frozen=True)
class MPCOptions:
    """Controller options (units in the names; defaults for the stacked manipulator at 20 Hz).

    horizon_steps: prediction steps N (of the linearisation's dt; 50 x 10 ms = 0.5 s);
    block_steps: prediction steps per plan block (the plan changes every block_steps x dt = 50 ms);
    position_tol_m / angle_tol_rad / node_tol_m: the plate position, plate angle and tracked-node errors that cost
    1 per step (the tracking weights are 1 / tol^2);
    terminal_factor: weight multiple of the last step's tracking error;
    rate_scale_rad_s: a plan block moving at this speed costs 1 (inf: no rate cost);
    effort_scale_rad: an angle this far from the rest angle costs 1 per block (inf: no cost);
    disturbance: "velocity" | "state" | "none", which state components carry the estimated constant disturbance;
    disturbance_gain: fraction (0..1] of each cycle's disturbance correction applied (1: dead-beat, lower filters
    measurement noise); disturbance_rcond: relative singular-value cut-off of its least squares;
    input_model: "ramp" (the motors move linearly between the plan's knots, the driver's rate-limited goals; the
    rest-length rate's damping force is modelled through ``rate_gain_s``) | "hold" (each block's angle held over
    its steps, zero-order hold: what textbook LQR assumes);
    integral_time_s: integral action time T_i (0: off); integral_max_tol_s: clamp of the integral, in
    tolerance-seconds;
    max_rate_rad_s: hard rate limit of the plan (keep <= the driver's max_rate);
    measured_velocity_weight: share of the measured velocities in the initial state, the rest the previous
    cycle's prediction of now (1: as measured; the state's second half must be velocities unless 1);
    actuator_lag_s: the servos' first-order lag behind the commanded angle (s; 0: the motors are where they are
    commanded), modelled in the effective input, the servo state carried over from the previous cycle's plan;
    limit_margin_rad: the plan keeps this far inside the structure's actuator limits;
    max_input_age_s: an older state or linearisation makes the answer ``stale`` (hold);
    active_tol_rad: a plan within this of a limit counts as saturated;
    output_jac_stride: the output map's Jacobian C_k is evaluated every this many steps and interpolated linearly
    in between (the plate's pose Jacobian changes little over a horizon; 1 = every step);
    eps_abs, eps_rel, max_iter, time_limit_s (0: none), polishing: OSQP settings.
    """

    horizon_steps: int = 50
    block_steps: int = 5
    position_tol_m: float = 0.002
    angle_tol_rad: float = math.radians(1.0)
    node_tol_m: float = 0.005
    terminal_factor: float = 5.0
    rate_scale_rad_s: float = 2.0
    effort_scale_rad: float = 5.0
    disturbance: str = "velocity"
    disturbance_gain: float = 0.5
    disturbance_rcond: float = 1e-2
    input_model: str = "ramp"
    integral_time_s: float = 0.0
    integral_max_tol_s: float = 20.0
    max_rate_rad_s: float = 1.0
    measured_velocity_weight: float = 0.2
    actuator_lag_s: float = 0.0
    limit_margin_rad: float = 0.0
    max_input_age_s: float = 0.25
    active_tol_rad: float = 1e-5
    output_jac_stride: int = 10
    eps_abs: float = 1e-6
    eps_rel: float = 1e-6
    max_iter: int = 4000
    time_limit_s: float = 0.0
    polishing: bool = False

    def __post_init__(self):
        if self.horizon_steps < 1 or self.block_steps < 1 or self.output_jac_stride < 1:
            raise ValueError("horizon_steps, block_steps and output_jac_stride must be >= 1")
        for k in ("position_tol_m", "angle_tol_rad", "node_tol_m", "rate_scale_rad_s", "effort_scale_rad",
                  "max_rate_rad_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"{k} must be > 0 (got {getattr(self, k)})")
        if self.disturbance not in DISTURBANCES:
            raise ValueError(f"disturbance {self.disturbance!r} (valid: {', '.join(DISTURBANCES)})")
        if self.input_model not in INPUT_MODELS:
            raise ValueError(f"input_model {self.input_model!r} (valid: {', '.join(INPUT_MODELS)})")
        if not 0 < self.disturbance_gain <= 1:
            raise ValueError("disturbance_gain must be in (0, 1]")
        if not 0 <= self.measured_velocity_weight <= 1:
            raise ValueError("measured_velocity_weight must be in [0, 1]")
        if not (math.isfinite(self.actuator_lag_s) and self.actuator_lag_s >= 0):
            raise ValueError("actuator_lag_s must be >= 0")
        if self.terminal_factor < 0 or self.integral_time_s < 0 or self.limit_margin_rad < 0:
            raise ValueError("terminal_factor, integral_time_s and limit_margin_rad must be >= 0")

    @property
    def blocks(self) -> int:
        return -(-self.horizon_steps // self.block_steps)


@dataclass(frozen=True)
class MPCResult:
    """One cycle's answer.

    plan: (M, A) motor angles (rad): input_model "ramp": knot b is reached at (b+1) x plan_dt after the state's
    time, the motors moving linearly from the present command through the knots; "hold": block b held from
    b x plan_dt to (b+1) x plan_dt; step_plan: (N, A) the angles at the end of each prediction step (ramp) or over
    it (hold); predicted: (N, ny) outputs at steps 1..N under the plan (the
    linear model); target: (N, ny) the targets used (angles unwrapped next to the nominal); error_now: (ny,)
    measured output - target now (angles wrapped); status; message; solve_s: wall time of the whole call (s);
    qp_s: OSQP's own time (s); iterations; active_limits: constraint rows at a bound; projection_rad: largest
    change of the solver's plan by the final projection onto the limits (solver tolerance); integral: (ny,);
    disturbance: (n,) the per-step state disturbance estimate used (m, m/s per step); innovation: largest
    |x_meas - predicted| of this cycle's disturbance update (state units; nan: no update); state: (n,) the initial
    state used (measured positions, blended velocities: ``measured_velocity_weight``); motor: (A,) the motor
    angles assumed at the state's time (``actuator_lag_s``: the servos' state; else the start command);
    plan_offset_steps: K0 of ``u_applied`` (the knots are reached K0 steps later than said above, and step_plan's
    first K0 rows are the applied angles).
    """

    plan: np.ndarray
    plan_dt: float
    step_plan: np.ndarray
    status: Status
    message: str = ""
    predicted: Optional[np.ndarray] = None
    target: Optional[np.ndarray] = None
    error_now: Optional[np.ndarray] = None
    solve_s: float = 0.0
    qp_s: float = 0.0
    iterations: int = 0
    active_limits: int = 0
    projection_rad: float = 0.0
    integral: Optional[np.ndarray] = None
    cost: float = math.nan
    disturbance: Optional[np.ndarray] = None
    innovation: float = math.nan
    state: Optional[np.ndarray] = None
    motor: Optional[np.ndarray] = None
    plan_offset_steps: int = 0

    @property
    def ok(self) -> bool:
        """A plan computed this cycle (solved or best effort) rather than a hold."""
        return self.status in (Status.SOLVED, Status.BEST_EFFORT, Status.INACCURATE)


def output_tolerances(output_map, options: MPCOptions) -> np.ndarray:
    """(ny,) tolerances: angular outputs angle_tol_rad, ``plate.*`` positions position_tol_m, others node_tol_m."""
    names = tuple(output_map.names)
    ang = np.asarray(output_map.angular, dtype=bool)
    return np.array([options.angle_tol_rad if a else (options.position_tol_m if n.startswith("plate.")
                                                      else options.node_tol_m) for n, a in zip(names, ang)])


def project_plan(v: np.ndarray, u_prev: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                 max_step: float) -> np.ndarray:
    """(M, A) plan clipped block by block into the box and the rate limit relative to the block before
    (``u_prev`` (A,) inside the box): always possible, so the result honours both exactly."""
    out = np.empty_like(v)
    p = np.clip(u_prev, lower, upper)
    for b in range(v.shape[0]):
        p = np.clip(np.clip(v[b], p - max_step, p + max_step), lower, upper)
        out[b] = p
    return out


class PlateMPC:
    """The controller core (no ROS): :meth:`solve` once per cycle. See the module docstring.

    output_map: an :mod:`.outputs` map (``names``, ``angular``, ``value``, ``jacobian``); lower, upper: (A,) motor
    limits (rad); options: :class:`MPCOptions`; rest: (A,) rest angles for the effort cost (default: 0);
    tolerances: (ny,) per-output tolerances overriding :func:`output_tolerances`; rate_gain_s: (A,) damping /
    stiffness of each actuated string (s): the effective rest-length offset of a motor speed (input_model ramp).
    """

    def __init__(self, output_map, lower: Sequence[float], upper: Sequence[float],
                 options: MPCOptions = MPCOptions(), rest: Optional[Sequence[float]] = None,
                 tolerances: Optional[Sequence[float]] = None, motor_names: Sequence[str] = (),
                 rate_gain_s: Optional[Sequence[float]] = None):
        self.out = output_map
        self.opt = options
        m = options.limit_margin_rad
        self.lower = np.asarray(lower, dtype=float) + m
        self.upper = np.asarray(upper, dtype=float) - m
        if self.lower.shape != self.upper.shape or np.any(self.lower > self.upper):
            raise ValueError(f"limits {lower} .. {upper} (margin {m} rad) leave no room")
        self.n_u = self.lower.size
        self.motor_names = tuple(motor_names) or tuple(f"m{i + 1}" for i in range(self.n_u))
        self.rest = np.zeros(self.n_u) if rest is None else np.asarray(rest, dtype=float)
        # the string force is kappa (l - xi0) + zeta (l' - xi0'): a rest-length rate acts like a rest-length
        # offset of (zeta / kappa) xi0', so B_k diag(rate_gain_s) is the response to a motor speed (s)
        self.rate_gain = np.zeros(self.n_u) if rate_gain_s is None else np.asarray(rate_gain_s, dtype=float)
        self.tol = output_tolerances(output_map, options) if tolerances is None else \
            np.asarray(tolerances, dtype=float)
        self.ny = len(output_map.names)
        if self.tol.shape != (self.ny,) or np.any(~(self.tol > 0)):
            raise ValueError(f"tolerances must be {self.ny} positive values")
        self.integral = np.zeros(self.ny)
        self.last: Optional[MPCResult] = None
        self._solver = None
        self._key = None
        self._prev_v: Optional[np.ndarray] = None
        self.dist: Optional[np.ndarray] = None            # (n,) per-step state disturbance estimate
        self._pred = None                                  # (xhat (N, n) at steps 1..N, A (N, n, n), dt)
        self._motor_pred = None                            # (N, A) motor angles at steps 1..N under the plan

    @classmethod
    def from_structure(cls, structure, output_map, options: MPCOptions = MPCOptions(), **kw) -> "PlateMPC":
        """Limits, rest angles (zero offsets) and motor names from the structure file's actuators."""
        acts = structure.actuators
        by_act = {st.actuator: st for st in structure.strings if getattr(st, "actuator", None)}
        tau = [by_act[a.name].damping / by_act[a.name].stiffness if a.name in by_act else 0.0 for a in acts]
        kw.setdefault("rate_gain_s", tau)
        return cls(output_map, [a.limits[0] for a in acts], [a.limits[1] for a in acts], options,
                   rest=[a.zero_offset for a in acts], motor_names=[a.name for a in acts], **kw)

    def reset(self) -> None:
        """Forget the integral and the previous plan (e.g. a new target source)."""
        self.integral[:] = 0.0
        self._prev_v = None
        self.last = None
        self.dist = None
        self._pred = None
        self._motor_pred = None

    # ---- results that are not a solve ------------------------------------------------------------------
    def hold(self, u_prev, dt: float, status: Status, message: str, t_start: Optional[float] = None) -> MPCResult:
        """A plan that holds ``u_prev`` (clipped into the limits) over the horizon."""
        o = self.opt
        u = np.clip(np.asarray(u_prev, dtype=float), self.lower, self.upper)
        res = MPCResult(plan=np.repeat(u[None], o.blocks, 0), plan_dt=o.block_steps * dt,
                        step_plan=np.repeat(u[None], o.horizon_steps, 0), status=status, message=message,
                        solve_s=0.0 if t_start is None else time.perf_counter() - t_start,
                        integral=self.integral.copy())
        self.last = res
        self._pred = None           # the robot does not follow a predicted plan: no disturbance update next
        return res

    # ---- the cycle --------------------------------------------------------------------------------------
    def solve(self, x0, xbar, ubar, A, B, target, u_prev, dt: float, age_s: float = 0.0,
              elapsed_s: float = 0.0, u_applied=None) -> MPCResult:
        """One MPC cycle.

        x0: (n,) measured state at step 0 (NaN entries: no measurement, the nominal is used); xbar: (>=N+1, n)
        nominal states from step 0; ubar: (>=N, A) nominal motor angles at steps 0..N (rad; the predictor's
        ``Linearization.u``; with N rows the last is held); A: (>=N, n,
        n), B: (>=N, n, A) the step Jacobians; target: (ny,) constant or (>=N+1, ny) at steps 0..N (NaN: not
        tracked); u_prev: (A,) the motor angles commanded now (rad); dt: prediction step (s); age_s: age of the
        oldest input (state or linearisation) now (s); elapsed_s: time since the previous cycle's measurement
        (s; integrates the measured error, 0 = no integration); u_applied: (K0+1, A) the angles commanded at steps
        0..K0 that this plan can no longer change (the previous plan, which the driver follows until this one
        reaches it; 0 <= K0 < N): the plan's ramp starts from u_applied[K0] at step K0 (None: from u_prev at 0).
        """
        t_start = time.perf_counter()
        o = self.opt
        N, s, M, nu, ny = o.horizon_steps, o.block_steps, o.blocks, self.n_u, self.ny
        u_prev = np.asarray(u_prev, dtype=float).reshape(nu)
        if not np.all(np.isfinite(u_prev)):
            return self.hold(np.where(np.isfinite(u_prev), u_prev, self.rest), dt, Status.FAILED,
                             "present motor command not finite", t_start)
        if not (age_s <= o.max_input_age_s):
            return self.hold(u_prev, dt, Status.STALE,
                             f"inputs {age_s:.3f} s old (max_input_age_s {o.max_input_age_s} s): holding", t_start)
        xbar = np.asarray(xbar, dtype=float)
        ubar = np.asarray(ubar, dtype=float)
        A = np.asarray(A, dtype=float)
        B = np.asarray(B, dtype=float)
        n = xbar.shape[1]
        if ubar.ndim == 2 and ubar.shape[0] == N:          # the angle after the last step: held
            ubar = np.vstack([ubar, ubar[-1:]])
        if xbar.shape[0] < N + 1 or ubar.shape[0] < N or A.shape[0] < N or B.shape[0] < N:
            raise ValueError(f"the linearisation covers {min(xbar.shape[0] - 1, ubar.shape[0], A.shape[0], B.shape[0])}"
                             f" steps, the horizon needs {N}")
        if A.shape[1:] != (n, n) or B.shape[1:] != (n, nu) or ubar.shape[1] != nu:
            raise ValueError(f"shapes: xbar {xbar.shape}, ubar {ubar.shape}, A {A.shape}, B {B.shape} (A = {nu})")
        xbar, ubar, A, B = xbar[:N + 1], ubar[:N + 1], A[:N], B[:N]
        if not (np.all(np.isfinite(xbar)) and np.all(np.isfinite(ubar)) and np.all(np.isfinite(A))
                and np.all(np.isfinite(B))):
            return self.hold(u_prev, dt, Status.FAILED, "linearisation not finite: holding", t_start)
        x0 = self._blend_velocities(np.asarray(x0, dtype=float).reshape(n), elapsed_s, n)
        dx0 = x0 - xbar[0]
        dx0 = np.where(np.isfinite(dx0), dx0, 0.0)
        innovation = self._update_disturbance(xbar[0] + dx0, elapsed_s, n)
        d = np.zeros(n) if self.dist is None else self.dist

        # ---- targets: (N+1, ny), angles unwrapped next to the nominal outputs --------------------------------
        ybar = self.out.value(xbar)                                   # (N+1, ny)
        r = np.asarray(target, dtype=float)
        r = np.broadcast_to(r, (N + 1, ny)) if r.shape == (ny,) else r[:N + 1]
        if r.shape != (N + 1, ny):
            raise ValueError(f"target must be ({ny},) or (>= {N + 1}, {ny}); got {np.shape(target)}")
        tracked = np.isfinite(r)
        r = np.where(tracked, r, ybar)
        ang = self.out.angular
        r[:, ang] = ybar[:, ang] + wrap_angle(r[:, ang] - ybar[:, ang])

        # ---- integral of the measured error (conditional: anti-windup) ------------------------------------
        y0 = self.out.value(np.where(np.isfinite(np.asarray(x0, dtype=float)), x0, xbar[0]))
        e0 = np.where(tracked[0], y0 - r[0], 0.0)
        e0[ang] = wrap_angle(e0[ang])
        use_int = o.integral_time_s > 0
        if use_int and elapsed_s > 0 and (self.last is None or self.last.status == Status.SOLVED):
            zmax = o.integral_max_tol_s * self.tol
            self.integral = np.clip(self.integral + elapsed_s * e0, -zmax, zmax)
        self.integral[~tracked[0]] = 0.0

        # ---- condensed prediction: delta x_k = S_k [v; 1] -----------------------------------------------
        C = self._output_jacobians(xbar[1:])                          # (N, ny, n)
        u_now = np.clip(u_prev, self.lower, self.upper)
        k0, applied = 0, None
        if u_applied is not None:
            applied = np.asarray(u_applied, dtype=float)
            if applied.ndim != 2 or applied.shape[1] != nu or not 1 <= applied.shape[0] <= N:
                raise ValueError(f"u_applied must be (K0+1, {nu}) with 0 <= K0 < {N}; got {applied.shape}")
            if not np.all(np.isfinite(applied)):
                return self.hold(u_prev, dt, Status.FAILED, "applied motor commands not finite: holding", t_start)
            applied = np.clip(applied, self.lower, self.upper)
            k0 = applied.shape[0] - 1
        start = applied[k0] if applied is not None else u_now
        motor_now = self._motor_estimate(applied[0] if applied is not None else u_now, elapsed_s)
        Weff, ebar, motors = self._input_weights(N, s, M, dt, ubar, start, k0, applied, motor_now)
        # each step's input term, for all steps at once: B_k [W_k,0 diag .. W_k,M-1 diag] (N, n, M nu) and its
        # constant part B_k ebar_k + d (N, n); then the recurrence is one (n, n) x (n, M nu) product per step
        # (this was a Python loop over the knots of each step with an np.any per knot: 4 ms of the 15-ms cycle,
        # measured 2026-11-26). Only the (step, block) pairs with a weight are written: a step's input depends on
        # the two or three blocks its ramp runs between (without actuator_lag_s), and the dense broadcast product
        # over all M blocks, even written in place, was a tenth of the cycle (0.8 of 7.6 ms alone, 2026-11-27)
        used = np.any(Weff != 0.0, axis=2)                                            # (N, M)
        BW = np.zeros((N, n, M, nu))
        ks, bs = np.nonzero(used)
        BW[ks, :, bs, :] = B[ks] * Weff[ks, bs][:, None, :]
        BW = BW.reshape(N, n, M * nu)
        Bc = np.einsum("knu,ku->kn", B, ebar) + d
        # A block's columns of S stay zero until its ramp begins (the plan is causal), so each step multiplies
        # only the prefix of blocks that have entered (55 % of the columns on average over the default horizon)
        entered = np.logical_or.accumulate(used, axis=0)                              # (N, M)
        width = nu * np.where(entered.any(1), M - np.argmax(entered[:, ::-1], axis=1), 0)
        S = np.zeros((n, M * nu))
        s_c = dx0.copy()                                              # the constant column
        Sk = np.zeros((N, n, M * nu + 1))
        for k in range(N):
            w = int(width[k])
            S[:, :w] = A[k] @ S[:, :w] + BW[k, :, :w]
            s_c = A[k] @ s_c + Bc[k]
            Sk[k, :, :w] = S[:, :w]
            Sk[k, :, -1] = s_c
        G = C @ Sk                                                    # (N, ny, M nu + 1)
        # y_k - r_k = G_k[:, :-1] v + g_k
        Gv = G[:, :, :-1]
        g = G[:, :, -1] + ybar[1:] - r[1:]

        # ---- least squares F v + e, weighted ----------------------------------------------------------------
        wk = np.ones(N)
        wk[-1] = o.terminal_factor
        sw = np.sqrt(wk)[:, None] / self.tol[None, :] * tracked[1:]  # (N, ny)
        rows_F = [(sw[:, :, None] * Gv).reshape(N * ny, M * nu)]
        rows_e = [(sw * g).reshape(-1)]
        if use_int:
            si = tracked[1:] / (self.tol[None, :] * o.integral_time_s)
            Fi = dt * np.cumsum(Gv, axis=0)
            ei = self.integral[None, :] + dt * np.cumsum(g, axis=0)
            rows_F.append((si[:, :, None] * Fi).reshape(N * ny, M * nu))
            rows_e.append((si * ei).reshape(-1))
        Tb = s * dt
        D = np.eye(M * nu) - np.eye(M * nu, k=-nu)                    # v_b - v_{b-1}; row block 0: v_0
        d0 = np.zeros(M * nu)
        d0[:nu] = start
        if math.isfinite(o.rate_scale_rad_s):
            c = 1.0 / (Tb * o.rate_scale_rad_s)
            rows_F.append(c * D)
            rows_e.append(-c * d0)
        if math.isfinite(o.effort_scale_rad):
            c = 1.0 / o.effort_scale_rad
            rows_F.append(c * np.eye(M * nu))
            rows_e.append(-c * np.tile(self.rest, M))
        F = np.vstack(rows_F)
        e = np.concatenate(rows_e)
        H = F.T @ F
        f = F.T @ e
        scale = 1.0 / max(float(np.max(np.diag(H))), 1e-300)         # O(1) numbers for OSQP's tolerances
        P, q = 2.0 * scale * H, 2.0 * scale * f

        # ---- constraints: box and rate, the same matrix every cycle -----------------------------------------
        step = o.max_rate_rad_s * Tb
        l = np.concatenate([np.tile(self.lower, M), np.full(M * nu, -step)])
        u = np.concatenate([np.tile(self.upper, M), np.full(M * nu, step)])
        l[M * nu:M * nu + nu] += start
        u[M * nu:M * nu + nu] += start

        # ---- solve (warm) ---------------------------------------------------------------------------------
        res, qp_s = self._osqp(P, q, D, l, u, M, nu, elapsed_s, Tb)
        v_raw = None if res is None or res.x is None else np.asarray(res.x, dtype=float)
        if v_raw is None or not np.all(np.isfinite(v_raw)):
            msg = "no solver answer" if res is None else f"solver: {res.info.status}"
            return self.hold(u_prev, dt, Status.FAILED, msg + ": holding", t_start)
        v_raw = v_raw.reshape(M, nu)
        v = project_plan(v_raw, start, self.lower, self.upper, step)
        self._prev_v = v.reshape(-1).copy()
        proj = float(np.max(np.abs(v - v_raw)))
        vf = v.reshape(-1)
        Av = np.concatenate([vf, D @ vf])
        active = int(np.count_nonzero((Av - l <= o.active_tol_rad) | (u - Av <= o.active_tol_rad)))
        import osqp
        sv = res.info.status_val
        if sv == osqp.SolverStatus.OSQP_SOLVED:
            status = Status.BEST_EFFORT if active else Status.SOLVED
            msg = f"{active} limit rows active: target not reachable within the limits" if active else "solved"
        else:
            status, msg = Status.INACCURATE, f"solver: {res.info.status} after {res.info.iter} iterations"
        pred = (Gv.reshape(N * ny, M * nu) @ vf).reshape(N, ny) + g + r[1:]
        # the states this plan leads to (for the next cycle's disturbance update)
        self._pred = (xbar[1:] + Sk[:, :, :-1] @ vf + Sk[:, :, -1], A, dt)
        self._motor_pred = (motors[0] + motors[1] @ v)[1:]
        step_plan = self._step_angles(v, start, N, s, k0, applied)
        resid = F @ vf + e
        out = MPCResult(plan=v, plan_dt=Tb, step_plan=step_plan, status=status, message=msg, predicted=pred,
                        target=r[1:].copy(), error_now=e0, solve_s=time.perf_counter() - t_start, qp_s=qp_s,
                        iterations=int(res.info.iter), active_limits=active, projection_rad=proj,
                        integral=self.integral.copy(), cost=float(resid @ resid), disturbance=d.copy(),
                        innovation=innovation, state=xbar[0] + dx0, motor=motors[0][0] + 0.0,
                        plan_offset_steps=k0)
        self.last = out
        return out

    def _points(self, N: int, s: int, M: int, k0: int):
        """Per time point k = 0..N: None when the commanded angle a_k is the applied one (k < k0), else
        [(knot, weight)]: knot 0 = the start (the applied angle at k0, or the present command), knot b+1 = plan
        block b. Ramp: linear between knots at k0, k0 + s, k0 + 2s, ... steps; hold: a_k = block (k - k0) // s."""
        out = []
        for k in range(N + 1):
            if k < k0:
                out.append(None)
                continue
            kk = k - k0
            if self.opt.input_model == "hold":
                out.append([(1 + min(kk // s, M - 1), 1.0)])
                continue
            i, w = min(kk // s, M), (kk % s) / s
            out.append([(i, 1.0 - w)] + ([(i + 1, w)] if w > 0 and i + 1 <= M else []))
        return out

    def _commands(self, N, s, M, start, k0, applied):
        """The commanded angle at the points k = 0..N as constants c (N+1, A) + weights W (N+1, M) on the
        plan's blocks."""
        pts = self._points(N, s, M, k0)
        c, W = np.zeros((N + 1, self.n_u)), np.zeros((N + 1, M))
        for k, p in enumerate(pts):
            if p is None:
                c[k] = applied[k]
                continue
            for j, w in p:
                if j == 0:
                    c[k] += w * start
                else:
                    W[k, j - 1] += w
        return c, W

    def _input_weights(self, N, s, M, dt, ubar, start, k0=0, applied=None, motor_now=None):
        """The effective input of each step k as a linear function of the plan: Weff (N, M, A), the weight of
        block b's angle of motor a in step k's input of motor a, and ebar[k] (A,) = its constant part minus the
        nominal's (rad); and the motor angles at the points as (constants (N+1, A), weights (N+1, M)).

        Ramp: over step k the motor angle runs from m_k to m_{k+1}: effective input (m_k + m_{k+1}) / 2 +
        rate_gain (m_{k+1} - m_k) / dt. Hold: m_k. The motor angle is the command, or with ``actuator_lag_s``
        the servo's first-order lag of it from ``motor_now``: m_{k+1} = a m_k + (1 - b) c_{k+1} + (b - a) c_k,
        a = exp(-dt / lag), b = lag (1 - a) / dt (exact for a command linear over the step); hold: m_{k+1} =
        a m_k + (1 - a) c_k, the step's input (m_k + m_{k+1}) / 2."""
        c, W = self._commands(N, s, M, start, k0, applied)
        ramp = self.opt.input_model == "ramp"
        lag = self.opt.actuator_lag_s
        if lag > 0:
            a = math.exp(-dt / lag)
            b = lag * (1.0 - a) / dt
            cm, Wm = np.zeros_like(c), np.zeros_like(W)
            cm[0] = start if motor_now is None else motor_now
            for k in range(N):
                if ramp:
                    cm[k + 1] = a * cm[k] + (1.0 - b) * c[k + 1] + (b - a) * c[k]
                    Wm[k + 1] = a * Wm[k] + (1.0 - b) * W[k + 1] + (b - a) * W[k]
                else:
                    cm[k + 1] = a * cm[k] + (1.0 - a) * c[k]
                    Wm[k + 1] = a * Wm[k] + (1.0 - a) * W[k]
        else:
            cm, Wm = c, W
        g = self.rate_gain
        ub = ubar[:N + 1]
        if ramp:
            const = 0.5 * (cm[:-1] + cm[1:]) + g * (cm[1:] - cm[:-1]) / dt
            Weff = 0.5 * (Wm[:-1] + Wm[1:])[:, :, None] + ((Wm[1:] - Wm[:-1]) / dt)[:, :, None] * g[None, None, :]
            nominal = 0.5 * (ub[:-1] + ub[1:]) + g * (ub[1:] - ub[:-1]) / dt
        else:
            if lag > 0:
                const, wv = 0.5 * (cm[:-1] + cm[1:]), 0.5 * (Wm[:-1] + Wm[1:])
            else:
                const, wv = cm[:-1], Wm[:-1]
            Weff = np.repeat(wv[:, :, None], self.n_u, 2)
            nominal = ub[:-1]
        return Weff, const - nominal, (cm, Wm)

    def _step_angles(self, v, start, N, s, k0=0, applied=None):
        """(N, A) commanded angles at the end of each step (ramp) or over it (hold) for the plan v (M, A)."""
        c, W = self._commands(N, s, v.shape[0], start, k0, applied)
        ang = c + W @ v
        return ang[1:] if self.opt.input_model == "ramp" else ang[:N]

    def _prediction_step(self, table: Optional[np.ndarray], elapsed_s: float, width: int) -> Optional[int]:
        """j such that ``table[j - 1]`` is the previous cycle's prediction for now, ``elapsed_s`` after that cycle's
        state (``table``: its rows at steps 1..N, ``self._motor_pred`` or the states of ``self._pred``; j counts
        the prediction's own steps); None when there is no prediction, it does not reach now, or its rows are
        not ``width`` wide (the problem changed size)."""
        if self._pred is None or table is None or not elapsed_s > 0:
            return None
        j = int(round(elapsed_s / self._pred[2]))
        if j < 1 or j > table.shape[0] or table.shape[1] != width:
            return None
        return j

    def _state_prediction_step(self, elapsed_s: float, n: int) -> Optional[int]:
        """:meth:`_prediction_step` on the previous cycle's predicted states (``self._pred``)."""
        return self._prediction_step(None if self._pred is None else self._pred[0], elapsed_s, n)

    def _motor_estimate(self, start: np.ndarray, elapsed_s: float) -> np.ndarray:
        """The servos' angles at the state's time (``actuator_lag_s``): what the previous cycle predicted under
        the plan it sent; without that prediction (first cycle, after a hold) the start command."""
        j = self._prediction_step(self._motor_pred, elapsed_s, start.size) if self.opt.actuator_lag_s > 0 else None
        return start.copy() if j is None else self._motor_pred[j - 1].copy()

    def _output_jacobians(self, xs: np.ndarray) -> np.ndarray:
        """(K, ny, n) C_k at the states xs (K, n): every ``output_jac_stride`` steps, linear in between."""
        K, st = xs.shape[0], self.opt.output_jac_stride
        if st == 1 or K <= 2:
            return self.out.jacobian(xs)
        ks = np.unique(np.r_[np.arange(0, K, st), K - 1])
        Cs = self.out.jacobian(xs[ks])
        j = np.clip(np.searchsorted(ks, np.arange(K), side="right") - 1, 0, ks.size - 2)
        w = ((np.arange(K) - ks[j]) / (ks[j + 1] - ks[j]))[:, None, None]
        return (1.0 - w) * Cs[j] + w * Cs[j + 1]

    def _blend_velocities(self, x_meas: np.ndarray, elapsed_s: float, n: int) -> np.ndarray:
        """The initial state (module docstring): the measured positions; velocities blended with what the
        previous cycle predicted for now (``elapsed_s`` after its state) under the plan it sent. Without that
        prediction (first cycle, after a hold or a failed solve) or with weight 1: as measured."""
        w = self.opt.measured_velocity_weight
        j = self._state_prediction_step(elapsed_s, n) if w < 1.0 else None
        if j is None:
            return x_meas
        xhat = self._pred[0]
        out = x_meas.copy()
        v = slice(n // 2, n)
        out[v] = np.where(np.isfinite(x_meas[v]), w * x_meas[v] + (1.0 - w) * xhat[j - 1, v], xhat[j - 1, v])
        return out

    def _disturbance_columns(self, n: int) -> np.ndarray:
        mode = self.opt.disturbance
        return np.arange(n // 2, n) if mode == "velocity" else np.arange(n) if mode == "state" else np.arange(0)

    def _update_disturbance(self, x_meas: np.ndarray, elapsed_s: float, n: int) -> float:
        """Correct the disturbance estimate from what the previous cycle predicted for now (see the module
        docstring). Returns the largest innovation |x_meas - xhat_j| (nan: no update this cycle)."""
        cols = self._disturbance_columns(n)
        if self.dist is None or self.dist.size != n:
            self.dist = np.zeros(n)
        j = self._state_prediction_step(elapsed_s, n) if cols.size else None
        if j is None:
            return math.nan             # no previous plan, or it did not reach now: nothing to compare with
        xhat, A, _ = self._pred
        e = x_meas - xhat[j - 1]
        ok = np.isfinite(e)
        if not np.any(ok):
            return math.nan
        # x_j's sensitivity to a constant per-step d on the estimated columns: Psi_{k+1} = A_k Psi_k + I[:, cols]
        # (only those columns: the full (n, n) recurrence cost twice as much for the same answer)
        Psi = np.zeros((n, cols.size))
        unit = (cols, np.arange(cols.size))
        for k in range(j):
            Psi = A[k] @ Psi
            Psi[unit] += 1.0
        # truncated least squares: the bar-length constraints make some directions of d invisible (tiny
        # singular values); the full pseudo-inverse blew the estimate up to 1e5 m/s along them. Through the
        # small normal matrix (cols x cols) rather than an SVD of the tall Psi: the same minimiser (singular
        # values below rcond x the largest dropped = eigenvalues below rcond^2 x the largest): a cycle 6.02 -> 5.84 ms
        P = Psi[ok]
        lam, V = np.linalg.eigh(P.T @ P)
        keep = lam > self.opt.disturbance_rcond ** 2 * lam[-1]
        Vk = V[:, keep]
        inc = Vk @ ((Vk.T @ (P.T @ e[ok])) / lam[keep])
        self.dist[cols] += self.opt.disturbance_gain * inc
        return float(np.max(np.abs(e[ok])))

    def _osqp(self, P, q, D, l, u, M, nu, elapsed_s, Tb):
        """Set up once per problem size, then update the values (warm start). Returns (result, seconds)."""
        import osqp
        import scipy.sparse as sp

        o = self.opt
        nv = M * nu
        rows, cols = np.triu_indices(nv)
        order = np.lexsort((rows, cols))                              # CSC order: by column, then row
        rows, cols = rows[order], cols[order]
        Px = P[rows, cols]
        key = (nv, nu)
        if self._solver is None or self._key != key:
            # built from (data, indices, indptr) so that entries that happen to be 0 now stay in the pattern
            indptr = np.concatenate([[0], np.cumsum(np.arange(1, nv + 1))])
            Pm = sp.csc_matrix((Px, rows, indptr), shape=(nv, nv))
            Am = sp.csc_matrix(np.vstack([np.eye(nv), D]))
            solver = osqp.OSQP()
            settings = dict(verbose=False, eps_abs=o.eps_abs, eps_rel=o.eps_rel, max_iter=o.max_iter,
                            polishing=o.polishing, warm_starting=True)
            if o.time_limit_s > 0:
                settings["time_limit"] = o.time_limit_s
            solver.setup(Pm, q, Am, l, u, **settings)
            self._solver, self._key = solver, key
        else:
            # the explicit (column-major, upper) pattern never changes, so P's values are updated in place
            self._solver.update(Px=Px, q=q, l=l, u=u)
            if self._prev_v is not None and self._prev_v.size == nv:
                shift = min(M - 1, int(round(elapsed_s / Tb))) if elapsed_s > 0 else 0
                prev = self._prev_v.reshape(M, nu)
                warm = np.concatenate([prev[shift:], np.repeat(prev[-1:], shift, 0)]).reshape(-1)
                self._solver.warm_start(x=warm)
        # statuses are read from res.info (a failure is a status here, not an exception)
        res = self._solver.solve(raise_error=False)
        return res, float(res.info.run_time)
