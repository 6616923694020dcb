"""The plate controller's loop on the twin with what the ROS graph feeds it (issue #19's demo limit cycle).

test_control_closed_loop.py hands the MPC the twin's exact state at the tick and moves the motors exactly as
planned. In the graph (``tensegrity demo --controller``) the node states come from the mocap ingest: 120-Hz frames
whose velocities are the ingest's constant-velocity Kalman filter (mocap/filtering.py), which lags the motion,
and the motors are the emulated servos, a first-order lag of 50 ms behind the goal
(hardware/dynamixel/emulator.py). With the measured velocities taken as the state, the MPC's prediction started
from stale velocities, the plans sat on the rate limit in every cycle and the plate limit-cycled
(bench/study_control_delay.py: 19.8 mm RMSE on the demo's circle with every graph difference, 0.0 mm ideal; 1.9
mm with exact velocities). The fix (``MPCOptions.measured_velocity_weight``, default 0.2): the state's velocities
are mostly the model's prediction of now from the previous cycle, corrected by the measured ones (0.5 mm).
Measured here (2026-11-26): 24.6 -> 0.45 mm, no plan on a limit over the last 10 cycles; with weight 1 (before
the fix) up to 30 mm over the last 10 cycles, 28-53 limit rows active in each.

Here: the step of test_control_closed_loop.py (true model) with 120-Hz frames, Kalman-filter velocities and the
servo lag. The plate must settle on the target with the plans off the limits; without the fix it does not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros import frames as F
from tensegrity_ros.control import MPCOptions, PlateMPC, PlateOutputMap
from tensegrity_ros.model import CoincidentConstraint, load_structure

ROOT = Path(__file__).resolve().parents[1]
U_STAR = np.array([0.6, -0.4, 0.2, 0.5, -0.3, 0.0])
CYCLE_S = 0.05
FRAME_S = 1.0 / 120.0           # sim_robot's mocap_rate_hz
SERVO_TAU_S = 0.05              # sim_robot's motor_time_constant_s (the emulator's first-order lag)


@pytest.fixture(scope="module")
def plant():
    import torch

    from tensegrity_ros.predict.horizon import HorizonPredictor
    from tensegrity_ros.workers import limit_blas_threads

    torch.set_num_threads(1)
    limit_blas_threads(1)
    s = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
    return s, HorizonPredictor(s, dt=0.01, nominal="twin", jac_stride=10), PlateOutputMap.from_structure(s)


def settled(structure, u, seconds=3.0):
    from tensegrity_ros.twin.sim import TwinSim

    sim = TwinSim(structure, integrator="RK4")
    sim.step(u, 1)
    sim.settle(seconds)
    return sim


def graph_loop(structure, core, omap, options, cycles):
    """The loop with the graph's node states and servos; returns the plate position errors (m) after each
    cycle and the results."""
    from tensegrity_ros.mocap.filtering import ConstantVelocityKF, KalmanConfig
    from tensegrity_ros.predict.motor_future import MotorPlan

    names = structure.node_names
    virtual = {c.nodes[1] for c in structure.constraints if isinstance(c, CoincidentConstraint)}
    seen = np.array([i for i, n in enumerate(names) if n not in virtual])          # nodes with a marker
    seen_names = tuple(names[i] for i in seen)
    motors = [a.name for a in structure.actuators]
    target = F.manipulator_relative_poses(settled(structure, U_STAR).node_positions(), names)["0C2"]
    sim = settled(structure, np.zeros(6))
    t0 = sim.time
    kf = ConstantVelocityKF(len(seen), KalmanConfig(measurement_std_m=5e-4, accel_psd=3e-3))   # mocap_ingest.yaml
    mpc = PlateMPC.from_structure(structure, omap, options)
    N, dt = options.horizon_steps, core.dt
    params = core.engine.default_params()
    motor = np.zeros(6)               # the servos' angles
    plan = None                       # MotorPlan: the controller's last plan (the servos' goal)
    state = None                      # (stamp, positions, velocities) of the latest frame
    last_stamp = None
    errs, results = [], []
    frame = 0
    for c in range(cycles):
        t_tick = c * CYCLE_S
        # frames up to the tick: the twin stepped with the servo angles read at each frame (sim_robot's loop)
        while (frame + 1) * FRAME_S <= t_tick + 1e-9 or state is None:
            frame += 1
            t = frame * FRAME_S
            n = int(round((t - (sim.time - t0)) / sim.dt))
            for k in range(n):        # the servo, 1-ms steps towards the plan's goal at that time
                tk = sim.time - t0 + (k + 1) * 1e-3
                goal = plan.at([tk], motors, motor)[0] if plan is not None else motor
                motor = goal + (motor - goal) * np.exp(-1e-3 / SERVO_TAU_S)
            sim.step(motor, n)        # the angle read at the frame, held over it (rate: finite difference)
            ts = sim.time - t0
            out = kf.update(ts, sim.node_positions()[seen], np.ones(len(seen), bool))
            state = (ts, sim.node_positions()[seen], np.where(np.isfinite(out.velocities), out.velocities, 0.0))
        stamp, P, V = state
        x = core.measured_state(seen_names, P, V, np.ones(len(seen), bool))
        u_now = plan.at([t_tick], motors, motor)[0] if plan is not None else motor.copy()
        times = stamp + dt * np.arange(N + 1)
        u_nom = plan.at(times, motors, u_now) if plan is not None else np.repeat(u_now[None], N + 1, 0)
        q, v = core.split(x)
        lin = core.linearize(params, stamp, core.full_positions(q), core.full_velocities(v), u_nom, N)
        res = mpc.solve(x, lin.x, lin.u, lin.A, lin.B, target, u_now, dt, age_s=t_tick - stamp,
                        elapsed_s=stamp - last_stamp if last_stamp is not None else 0.0)
        assert res.ok, res.message
        last_stamp = stamp
        results.append(res)
        # the plan as the node publishes it: anchored at the state's stamp, from the present command
        plan = MotorPlan(stamp + dt * np.arange(N + 1), motors, np.vstack([u_now[None], res.step_plan]), t_tick)
        y = F.manipulator_relative_poses(sim.node_positions(), names)["0C2"]
        errs.append(float(np.linalg.norm(y[:3] - target[:3])))
    return np.array(errs), results


def test_step_with_the_graphs_node_states_and_servos(plant):
    s, core, omap = plant
    errs, results = graph_loop(s, core, omap, MPCOptions(), cycles=40)
    active = [r.active_limits for r in results]
    print(f"plate error {errs[0] * 1e3:.1f} -> {errs[-1] * 1e3:.2f} mm (last 10 cycles max "
          f"{errs[-10:].max() * 1e3:.2f} mm); limit rows active in the last 10 cycles: {active[-10:]}")
    assert errs[-10:].max() < 0.1 * errs[0]            # settled on the target, not limit-cycling around it
    assert sum(a > 0 for a in active[-10:]) <= 2       # and the plans are off the rate limit there
