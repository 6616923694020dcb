"""Study (not in `make bench`): the plate controller's closed loop on the twin, from the ideal lock-step loop of
test/test_control_closed_loop.py to a faithful copy of what `tensegrity demo --controller` does, one difference
at a time. docs/control.md, "Measured".

Everything runs in simulated time (lock-step, deterministic apart from BLAS summation order): CPU load does not
change the figures. The pieces, each switchable (``Setup``):

* ``servo``: the emulated Dynamixel (hardware/dynamixel/emulator.py ``EmulatedBus._integrate``, sim_robot's
  ``motor_time_constant_s`` 0.05 s, ``motor_max_speed_rad_s`` 3): the motor angle follows the goal with a
  first-order lag under a speed limit. Off: the motor angle is the goal.
* ``driver``: the 80-Hz driver (hardware/driver_core.py ``DriverCore._plan_target`` + safety.py): every 12.5 ms the
  plan is sampled at now (``Plan.at``: linear, the first point held before it), clamped to the limits and rate
  limited (1.5 rad/s, dynamixel_driver_sim.yaml), and written as the goal, held until the next cycle. The plan as
  published: points step_plan[k] at state stamp + (k+1) dt (plate_controller ``_plan_msg``). Off: the goal is
  the controller's ramp itself, continuous in time.
* ``frames``: the twin stepped at 120 Hz with the motor angle read at each frame (sim_robot ``_loop``: the rate by
  finite difference), node states at those frames only (the controller takes the latest). Off: 1-kHz steps, the
  state at the controller's tick.
* ``noise``: node positions with 0.3 mm marker noise (sim_robot ``marker_noise_m``; the ingest passes the
  labelled positions on unfiltered). Off: exact.
* ``kf``: node velocities from the ingest's constant-velocity Kalman filter on those positions
  (mocap/filtering.py, mocap_ingest.yaml: 0.5 mm, accel_psd 3e-3). Off: exact.
* ``latency``: the state reaches the controller ``state_latency_s`` after its stamp (ingest, DDS), the controller's
  tick is not aligned with the frames, and its plan reaches the driver ``plan_latency_s`` after the tick (solve,
  DDS); until then the driver follows the previous plan. Off: 0, aligned.
* ``lin_age``: the linearisation is the node's (``PlateControllerNode._linearizer``): computed from the state
  available when the previous one finished, along the controller's own plan, ``lin_s`` of compute time, 150 steps
  long, used at the state's offset into it (``Linearization.step_jacobians``), at most one started per
  ``lin_period_s`` (the node's ``relinearize_period_s``), Jacobians every ``jac_stride`` steps, the nominal from
  ``nominal`` (twin | engine). Off: a fresh 50-step linearisation from the cycle's own state.

The MPC call is the node's ``_cycle``: u_now = the node's last plan at the tick, the plan anchored at the state's
stamp, elapsed = the time between the states of two cycles, age = tick - stamp, ``MPCOptions`` defaults unless
``--mpc`` overrides them (``measured_velocity_weight`` 1.0: the controller before the fix, which took the measured
velocities as the state). ``--set "{'assumed_plan_latency_s': 0.02}"`` does what the node's ``keep_applied``
does: the previous plan's commands from the state's stamp until tick + that latency are passed as ``u_applied``.
The target: a 10-mm circle of C2 in C0's x-y plane around the truth's rest pose, one
lap per 10 s (the demo's ``ControlTarget``), after ``--settle-s`` on its start point (not scored), and with
``--tilt-at-s`` the demo's 0.5-deg pitch step that long into the scored window. The truth: the nominal model with
its string stiffnesses and dampings x (1 + e N(0, 1)) (``--model-error`` e, ``--seed``; the demo's true robot has
e = 0.2, so e = 0 stands for the identified model and 0.2 for the nominal one).

Printed per variant (a markdown row): RMSE of C2's position (mm) over the scored cycles, over their second half,
the largest error, the angle RMSE (largest of yaw, pitch, roll per cycle), the share of cycles with a plan on a
limit (and the mean number of limit rows), holds (no
linearisation yet), the median age of the linearisation at the state (ms), the filtered velocities' RMS error
relative to the twin's RMS velocity, wall time.

usage: python bench/study_control_delay.py [--cycles 120] [--settle-s 2] [--model-error 0.2] [--seed 0]
                                           [--mpc "{'measured_velocity_weight': 1.0}"] [--set "{...}"] VARIANT ...
  VARIANT: comma-separated switches, e.g. ideal | servo | servo,driver,frames,kf,latency,lin_age | all
  ("all" = every graph difference)
"""
from __future__ import annotations

import argparse
import ast
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

SWITCHES = ("servo", "driver", "frames", "noise", "kf", "latency", "lin_age")
GRAPH = ("servo", "driver", "frames", "noise", "kf", "latency", "lin_age")


@dataclass
class Setup:
    servo: bool = False
    driver: bool = False
    frames: bool = False
    noise: bool = False
    kf: bool = False
    latency: bool = False
    lin_age: bool = False
    servo_tau_s: float = 0.05       # sim_robot.yaml motor_time_constant_s
    servo_vmax: float = 3.0         # sim_robot.yaml motor_max_speed_rad_s
    driver_hz: float = 80.0
    driver_max_rate: float = 1.5    # dynamixel_driver_sim.yaml max_rate
    frame_hz: float = 120.0
    marker_noise_m: float = 3e-4
    state_latency_s: float = 0.005
    state_latency_jitter_s: float = 0.0   # + uniform(0, this) on a share of the ticks (the graph's backlogs:
    state_latency_jitter_share: float = 1.0   # node states 10-20 ms late p50, 150-250 ms p99, some later)
    plan_latency_s: float = 0.015
    tick_phase_s: float = 0.003
    lin_s: float = 0.1
    lin_steps_extra: int = 100      # nominal_margin_s 1.0 / dt
    lin_period_s: float = 0.0       # shortest time between two linearisations' starts (relinearize_period_s)
    jac_stride: int = 10            # Jacobians every n prediction steps (plate_controller.yaml jac_stride)
    nominal: str = "twin"           # the linearisation's nominal: twin | engine (HorizonPredictor nominal)
    assumed_plan_latency_s: object = None   # keep the previous plan's commands until this after the tick (u_applied)
    model_error: float = 0.0        # truth = nominal with stiffnesses and dampings x (1 + e N(0, 1))
    seed: int = 0
    cycles: int = 120
    settle_s: float = 2.0
    tilt_at_s: float = math.inf     # the demo's 0.5-deg pitch step, this long into the scored window
    mpc: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, **kw) -> "Setup":
        s = cls(**kw)
        for w in filter(None, text.split(",")):
            if w == "ideal":
                continue
            if w == "all":
                for g in GRAPH:
                    setattr(s, g, True)
            elif w in SWITCHES:
                setattr(s, w, True)
            else:
                raise SystemExit(f"unknown switch {w!r} (known: ideal, all, {', '.join(SWITCHES)})")
        return s


class Servo:
    """The emulator's motor (EmulatedBus._integrate): first-order lag tau under a speed limit, exact for a goal
    held between calls; ``on=False``: the angle is the goal."""

    def __init__(self, pos, tau, vmax, on):
        self.pos, self.goal, self.tau, self.vmax, self.on = np.array(pos, float), np.array(pos, float), tau, vmax, on

    def advance(self, dt):
        if not self.on:
            self.pos = self.goal.copy()
            return
        if dt <= 0:
            return
        e = self.goal - self.pos
        sign = np.where(e >= 0, 1.0, -1.0)
        sat = self.vmax * self.tau
        t_sat = np.maximum((np.abs(e) - sat) / self.vmax, 0.0)
        lin = np.minimum(dt, t_sat)
        self.pos = self.pos + sign * self.vmax * lin
        e = self.goal - self.pos
        self.pos = self.goal - e * np.exp(-(dt - lin) / self.tau)


def run(setup: Setup, verbose: bool = False):
    import torch

    from tensegrity_ros import frames as F
    from tensegrity_ros.commands.demo_control import ControlTarget, plan_violations
    from tensegrity_ros.control import MPCOptions, PlateMPC, PlateOutputMap, Status
    from tensegrity_ros.hardware.plan import Plan
    from tensegrity_ros.hardware.safety import clamp_goals, rate_limit
    from tensegrity_ros.mocap.filtering import ConstantVelocityKF, KalmanConfig
    from tensegrity_ros.model import CoincidentConstraint, load_structure
    from tensegrity_ros.model.perturb import perturb_structure
    from tensegrity_ros.paths import CONFIG_DIR
    from tensegrity_ros.predict.horizon import HorizonPredictor
    from tensegrity_ros.predict.motor_future import MotorPlan
    from tensegrity_ros.twin.sim import TwinSim
    from tensegrity_ros.workers import limit_blas_threads

    torch.set_num_threads(1)
    limit_blas_threads(1)
    S = setup
    s = load_structure(CONFIG_DIR / "models" / "stacked_manipulator.yaml")
    core = HorizonPredictor(s, dt=0.01, nominal=S.nominal, jac_stride=S.jac_stride)
    omap = PlateOutputMap.from_structure(s)
    names = s.node_names
    virtual = {c.nodes[1] for c in s.constraints if isinstance(c, CoincidentConstraint)}
    seen = np.array([i for i, n in enumerate(names) if n not in virtual])          # nodes with a marker
    seen_names = tuple(names[i] for i in seen)
    truth = perturb_structure(s, S.model_error, seed=S.seed, kinds=("stiffness", "damping")) \
        if S.model_error else s
    sim = TwinSim(truth, integrator="RK4")           # sim_robot's integrator
    motors = [a.name for a in s.actuators]
    lo = np.array([a.limits[0] for a in s.actuators])
    hi = np.array([a.limits[1] for a in s.actuators])
    u_rest = np.array([a.zero_offset for a in s.actuators])
    sim.step(u_rest, 1)
    sim.settle(3.0)
    center = F.manipulator_relative_poses(sim.node_positions(), names)["0C2"].copy()
    opts = MPCOptions(**S.mpc)
    mpc = PlateMPC.from_structure(s, omap, opts)
    N, dt, blk = opts.horizon_steps, core.dt, opts.block_steps
    period = blk * dt
    params = core.engine.default_params()
    rng = np.random.default_rng(S.seed + 1)
    kf = ConstantVelocityKF(len(seen), KalmanConfig(measurement_std_m=5e-4, accel_psd=3e-3))

    # the demo's target (commands/demo_control.py ControlTarget: circle, 10 s per lap, the pitch step)
    ctarget = ControlTarget(center=center, settle_s=S.settle_s, tilt_at_s=S.tilt_at_s)

    def target_at(t):
        return ctarget.pose(t)

    # ---- timeline -------------------------------------------------------------------------------------
    T_end = S.settle_s + S.cycles * period
    frame_dt = 1.0 / S.frame_hz if S.frames else 1e-3
    phase = S.tick_phase_s if S.latency else 0.0
    lat_state = S.state_latency_s if S.latency else 0.0
    lat_plan = S.plan_latency_s if S.latency else 0.0
    events = [(round(k * frame_dt, 9), 0, "frame") for k in range(1, int(T_end / frame_dt) + 2)]
    if S.driver:
        events += [(round(j / S.driver_hz, 9), 1, "driver") for j in range(0, int(T_end * S.driver_hz) + 2)]
    events += [(round(phase + c * period, 9), 2, "control") for c in range(int(round(T_end / period)) + 1)]
    events.sort()
    sim_t0 = sim.time

    servo = Servo(u_rest, S.servo_tau_s, S.servo_vmax, S.servo)
    t_motor = 0.0
    node_plan = None                       # MotorPlan: what the node believes it commanded (u_now, motor future)
    drv_plan = None                        # hardware Plan the driver follows
    cmd_plan = None                        # without the driver: the node's MotorPlan once it arrived
    pending = []                           # (arrival time, Plan, MotorPlan)
    goal = u_rest.copy()
    states = []                            # (stamp, positions (seen), velocities (seen))
    lin, lin_job = None, None              # available linearisation; (finish time, Linearization) in progress
    lin_started = -math.inf                # when the latest linearisation started (lin_period_s)
    last_stamp = None
    errs, ang_errs, scored, n_hold, n_active, lin_ages, vel_err = [], [], [], 0, [], [], []
    n_viol = 0
    jitter_rng = np.random.default_rng(S.seed + 2)

    def command(t):
        """The goal at t: the driver's held goal, or (no driver) the node's plan itself."""
        if S.driver:
            return goal
        if cmd_plan is None:
            return u_rest
        return cmd_plan.at([t], motors, u_rest)[0]

    def motor_to(t):
        nonlocal t_motor
        while t_motor < t - 1e-12:          # 1-ms substeps (a goal between driver cycles is held exactly)
            h = min(1e-3, t - t_motor)
            servo.goal = command(t_motor + h) if not S.driver else goal
            servo.advance(h)
            t_motor += h
        if not S.servo:
            servo.goal = command(t)
            servo.advance(0.0)

    def state_at(P, V, t):
        Pm, Vm = P[seen], V[seen]
        if S.noise:
            Pm = Pm + rng.normal(0.0, S.marker_noise_m, Pm.shape)
        if S.kf:
            out = kf.update(t, Pm, np.ones(len(seen), bool))
            Vm = np.where(np.isfinite(out.velocities), out.velocities, 0.0)
            if t >= S.settle_s:         # how far the filtered velocities are from the twin's
                vel_err.append((np.sum((Vm - V[seen]) ** 2), np.sum(V[seen] ** 2)))
        return (t, Pm, Vm)

    def linearize(st):
        u0 = node_plan.at([st[0]], motors, u_rest)[0] if node_plan is not None else servo.pos
        x = core.measured_state(seen_names, st[1], st[2], np.ones(len(seen), bool))
        q, v = core.split(x)
        P = core.full_positions(np.where(np.isfinite(q), q, core.X0[core.free]))
        V = core.full_velocities(np.where(np.isfinite(v), v, 0.0))
        steps = N + (S.lin_steps_extra if S.lin_age else 0)
        times = st[0] + dt * np.arange(steps + 1)
        u = node_plan.at(times, motors, u0) if node_plan is not None else np.repeat(u0[None], times.size, 0)
        return core.linearize(params, st[0], P, V, u, steps).expand(N).tabulate_steps()

    t_wall = time.perf_counter()
    for t, _, kind in events:
        if t > T_end + 1e-9:
            break
        # plans that reached the driver by now
        while pending and pending[0][0] <= t + 1e-12:
            _, drv_plan, cmd_plan = pending.pop(0)
        if kind == "frame":
            motor_to(t)
            n = int(round((t - (sim.time - sim_t0)) / sim.dt))
            if n > 0:
                if S.frames:      # sim_robot: the present angles over the frame, their rate by finite difference
                    sim.step(servo.pos.copy(), n)
                else:             # 1 kHz: the angle at the step's end and its exact rate
                    sim.step(servo.pos.copy(), n, (servo.pos - sim.motor_angles) / (n * sim.dt))
            states.append(state_at(sim.node_positions(), sim.node_velocities(), sim.time - sim_t0))
            if len(states) > 400:
                del states[:200]
            if S.lin_age:
                # the node's linearizer: woken by every state, it starts on the latest one whenever it is free
                if lin_job is not None and lin_job[0] <= t + 1e-12:
                    lin, lin_job = lin_job[1], None
                if lin_job is None and t >= lin_started + S.lin_period_s - 1e-12:
                    lin_job, lin_started = (t + S.lin_s, linearize(states[-1])), t
            continue
        if kind == "driver":
            motor_to(t)
            target = drv_plan.at(t) if drv_plan is not None else goal
            g = clamp_goals(target, lo, hi, goal)
            goal = clamp_goals(rate_limit(goal, g, S.driver_max_rate, 1.0 / S.driver_hz), lo, hi, goal)
            servo.goal = goal
            continue
        # ---- the controller's cycle (plate_controller._cycle) ------------------------------------------
        motor_to(t)
        late = lat_state + (jitter_rng.uniform(0.0, S.state_latency_jitter_s)
                            if S.latency and jitter_rng.uniform() < S.state_latency_jitter_share else 0.0)
        avail = [st for st in states if st[0] <= t - late + 1e-12]
        if not avail:
            continue
        st = avail[-1] if last_stamp is None or avail[-1][0] >= last_stamp else st   # never an older one
        if not S.lin_age:
            lin = linearize(st)
        u_now = node_plan.at([t], motors, u_rest)[0] if node_plan is not None else servo.pos.copy()
        i0 = int(round((st[0] - lin.t0) / dt)) if lin is not None else -1
        if lin is None or i0 < 0 or i0 + N > lin.steps + lin.ext_steps:
            res = mpc.hold(u_now, dt, Status.STALE, "no linearisation")
            n_hold += 1
        else:
            x = core.measured_state(seen_names, st[1], st[2], np.ones(len(seen), bool))
            A, B = lin.step_jacobians(i0, N)
            lin_ages.append(st[0] - lin.t0)
            u_applied = None
            if S.assumed_plan_latency_s is not None and node_plan is not None:
                # the previous plan's commands until this plan reaches the driver (assumed latency)
                k_app = min(max(int(math.ceil((t - st[0] + S.assumed_plan_latency_s) / dt - 1e-9)), 0), N - 1)
                if k_app > 0:
                    u_applied = node_plan.at_grid(st[0], dt, k_app + 1, motors, u_now)
            res = mpc.solve(x, lin.xe[i0:], lin.ue[i0:], A, B, target_at(st[0] + dt * np.arange(N + 1)), u_now,
                            dt, age_s=t - st[0], elapsed_s=max(st[0] - last_stamp, 0.0) if last_stamp is not None
                            else 0.0, u_applied=u_applied)
            last_stamp = st[0]
        n_active.append(res.active_limits)
        n_viol += plan_violations(res.step_plan, dt, lo, hi, mpc.opt.max_rate_rad_s)
        t_first = (st[0] if res.ok else t) + dt
        start = u_applied[0] if res.ok and u_applied is not None else u_now
        node_plan = MotorPlan.on_grid(t_first - dt, dt, motors, np.vstack([start[None], res.step_plan]), t)
        pending.append((t + lat_plan, Plan(t_first + dt * np.arange(res.step_plan.shape[0]), res.step_plan, t),
                        node_plan))
        if lat_plan == 0:
            _, drv_plan, cmd_plan = pending.pop()
        y = F.manipulator_relative_poses(sim.node_positions(), names)["0C2"]
        ts = sim.time - sim_t0
        yt = target_at(ts)[0]
        e = float(np.linalg.norm(y[:3] - yt[:3]))
        errs.append(e)
        ang_errs.append(float(np.abs((y[3:] - yt[3:] + np.pi) % (2 * np.pi) - np.pi).max()))
        scored.append(ts >= S.settle_s - 1e-9)
        if verbose and len(errs) % 20 == 0:
            print(f"  t {ts:5.2f} s err {e * 1e3:6.2f} mm {res.status.value} active {res.active_limits}",
                  flush=True)
    e = np.array(errs)[np.array(scored)] * 1e3
    half = e[len(e) // 2:]
    return {"rmse_mm": float(np.sqrt(np.mean(e ** 2))), "last_half_mm": float(np.sqrt(np.mean(half ** 2))),
            "max_mm": float(e.max()), "holds": n_hold, "violations": n_viol,
            "angle_rmse_deg": float(np.degrees(np.sqrt(np.mean(np.array(ang_errs)[np.array(scored)] ** 2)))),
            "active_frac": float(np.mean(np.array(n_active)[np.array(scored)] > 0)),
            "active_mean": float(np.mean(np.array(n_active)[np.array(scored)])),
            "lin_age_ms": float(np.median(lin_ages) * 1e3) if lin_ages else math.nan,
            "vel_err_rel": float(np.sqrt(sum(a for a, _ in vel_err) / sum(b for _, b in vel_err)))
            if vel_err else math.nan, "wall_s": time.perf_counter() - t_wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--cycles", type=int, default=120)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--model-error", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tilt-at-s", type=float, default=math.inf, help="the demo's pitch step, s into the score")
    ap.add_argument("--mpc", default="{}", help="MPCOptions overrides (a Python dict)")
    ap.add_argument("--set", default="{}", help="Setup overrides (a Python dict), e.g. \"{'servo_tau_s': 0.1}\"")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    for v in a.variants:
        setup = Setup.parse(v, cycles=a.cycles, settle_s=a.settle_s, model_error=a.model_error, seed=a.seed,
                            tilt_at_s=a.tilt_at_s, mpc=ast.literal_eval(a.mpc))
        setup = replace(setup, **ast.literal_eval(a.set))
        r = run(setup, a.verbose)
        print(f"| {v} | {a.model_error:g} | {a.mpc if a.mpc != '{}' else ''} {a.set if a.set != '{}' else ''} | "
              f"{r['rmse_mm']:.1f} | {r['last_half_mm']:.1f} | {r['max_mm']:.1f} | {r['angle_rmse_deg']:.2f} deg | "
              f"{100 * r['active_frac']:.0f} % ({r['active_mean']:.0f}) | {r['holds']} | {r['lin_age_ms']:.0f} | "
              f"{r['vel_err_rel']:.2f} | viol {r['violations']} | {r['wall_s']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
