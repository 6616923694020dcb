"""The MuJoCo twin: MJCF from structure files, string law, constraints, equilibrium and energy."""
from __future__ import annotations

from pathlib import Path

import mujoco
import numpy as np
import pytest

from tensegrity_ros.model import load_structure, structure_from_dict
from tensegrity_ros.twin import TwinSim, build_layout, build_mjcf, simulate

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"
REFERENCE = ["spring_rod", "icosahedron", "icosahedron_spread", "stacked_manipulator"]
SEED_AMPLITUDE_RAD = np.array([0.0363] * 3 + [0.0168] * 3) / 0.02
SEED_PHASE = np.array([2 * np.pi / 3, 0.0, -2 * np.pi / 3] * 2)


@pytest.fixture(scope="module")
def manipulator():
    return load_structure(MODELS / "stacked_manipulator.yaml")


def seed_drive(t: float) -> np.ndarray:
    """The seed's drive (period 7 s, phases +-2pi/3), amplitude ramped in over the first period."""
    return min(t / 7.0, 1.0) * SEED_AMPLITUDE_RAD * np.sin(2 * np.pi * t / 7.0 + SEED_PHASE)


@pytest.mark.parametrize("name", REFERENCE)
def test_mjcf_compiles_with_structure_names(name):
    s = load_structure(MODELS / f"{name}.yaml")
    model = mujoco.MjModel.from_xml_string(build_mjcf(s))
    for n in s.node_names:
        assert mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_SITE, n) >= 0
    for st in s.strings:
        assert mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_TENDON, st.name) >= 0
        assert mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_ACTUATOR, st.name) >= 0
    assert model.opt.gravity.tolist() == list(s.gravity)
    sim = TwinSim(s)
    np.testing.assert_allclose(sim.node_positions(), [n.position for n in s.nodes], atol=1e-9)


def test_manipulator_bodies_and_constraints(manipulator):
    lay = build_layout(manipulator)
    names = [b.name for b in lay.bodies]
    assert names == [f"b{i}" for i in range(1, 13)] + ["rigid_b13_b14_b15", "rigid_b16_b17_b18"]
    plate = lay.body("rigid_b13_b14_b15")
    assert plate.mass == pytest.approx(2.7)
    # combined thin-rod inertia of an equilateral triangle of rods (side a, mass m each) about its normal:
    a, m = 0.26 * np.sqrt(3), 0.9
    assert np.linalg.eigvalsh(plate.inertia)[-1] == pytest.approx(3 * (m * a * a / 12 + m * (a / (2 * np.sqrt(3))) ** 2))
    bar = lay.body("b1")
    assert np.diag(bar.inertia)[:2] == pytest.approx([0.29 * 0.95 ** 2 / 12] * 2)
    # 3 fixed + 6 top-node pins (one per top node) + 3 midpoints
    assert len(lay.connects) == 12


def test_manipulator_holds_equilibrium(manipulator):
    sim = TwinSim(manipulator)
    p0 = sim.node_positions()
    drift, gap = 0.0, 0.0
    for _ in range(50):  # 5 s, no actuation
        sim.step(None, n_steps=100)
        drift = max(drift, float(np.abs(sim.node_positions() - p0).max()))
        gap = max(gap, sim.constraint_error())
    assert drift < 1e-3, f"equilibrium drift {drift * 1e3:.3f} mm"
    assert gap < 1e-3
    assert sim.string_tensions().min() > 10.0


def test_constraints_hold_under_actuation(manipulator):
    sim = TwinSim(manipulator)
    gap, tmin = 0.0, np.inf
    while sim.time < 3.0:
        sim.step(seed_drive(sim.time) * 3.0 + 0.0 * sim.time, n_steps=10)  # ramp at 3x speed: full amplitude at 2.3 s
        gap = max(gap, sim.constraint_error())
        tmin = min(tmin, sim.string_tensions().min())
    assert gap < 1e-3, f"constraint gap {gap * 1e3:.3f} mm"
    assert np.isfinite(sim.node_positions()).all() and tmin > 0


def _tiny(damping=0.0, actuated=False):
    d = {"name": "tiny", "gravity": [0, 0, 0],
         "nodes": [{"name": "a", "position": [0, 0, 0], "fixed": True},
                   {"name": "b", "position": [1.1, 0, 0]}, {"name": "c", "position": [2.1, 0, 0]},
                   {"name": "d", "position": [1.6, 1.0, 0], "fixed": True}],
         "bars": [{"name": "rod", "nodes": ["b", "c"], "mass": 1.0}],
         "strings": [{"name": "s1", "nodes": ["a", "b"], "stiffness": 200.0, "damping": damping, "rest_length": 1.0},
                     {"name": "s2", "nodes": ["b", "d", "c"], "stiffness": 300.0, "damping": damping,
                      "rest_length": 2.0, **({"actuator": "m1"} if actuated else {})}]}
    if actuated:
        d["actuators"] = [{"name": "m1", "motor_id": 1, "spool_radius": 0.01, "direction": -1, "zero_offset": 0.5}]
    return structure_from_dict(d)


def test_tension_matches_hand_computed():
    sim = TwinSim(_tiny())
    l2 = 2 * np.hypot(0.5, 1.0)
    expected = np.array([200.0 * 0.1, 300.0 * (l2 - 2.0)])
    np.testing.assert_allclose(sim.string_lengths(), [1.1, l2], rtol=1e-12)
    np.testing.assert_allclose(sim.actuator_tensions(), expected, rtol=0.01)
    np.testing.assert_allclose(sim.string_tensions(), expected, rtol=1e-12)


def test_actuated_string_rest_length_and_stiffness():
    s = _tiny(actuated=True)
    sim = TwinSim(s)
    sim.step([2.5], n_steps=0)
    xi0 = 2.0 - 0.01 * (2.5 - 0.5)  # direction -1
    kappa = 300.0 * 2.0 / xi0  # EA / xi0
    length = 2 * np.hypot(0.5, 1.0)
    assert sim.xi0[1] == pytest.approx(xi0) and sim.kappa[1] == pytest.approx(kappa)
    assert sim.actuator_tensions()[1] == pytest.approx(kappa * (length - xi0), rel=0.01)


def test_damped_tension_matches_law():
    s = _tiny(damping=7.0)
    sim = TwinSim(s)
    p = np.array([n.position for n in s.nodes])
    v = np.zeros_like(p)
    v[1:3, 0] = 0.2  # rod slides along +x: s1 lengthens at 0.2 m/s
    sim.set_node_state(p, v)
    assert sim.data.ten_velocity[0] == pytest.approx(0.2)
    assert sim.actuator_tensions()[0] == pytest.approx(200.0 * 0.1 + 7.0 * 0.2, rel=0.01)
    assert sim.string_tensions()[0] == pytest.approx(200.0 * 0.1 + 7.0 * 0.2, rel=1e-9)


def test_set_node_state_and_velocities_consistent(manipulator):
    sim = TwinSim(manipulator)
    rng = np.random.default_rng(3)
    p0 = sim.node_positions()
    w = rng.normal(0, 0.5, 3)  # a rigid rotation rate about the origin: every body can follow it exactly
    v = np.cross(w, p0)
    sim.set_node_state(p0, v)
    np.testing.assert_allclose(sim.node_positions(), p0, atol=1e-9)
    np.testing.assert_allclose(sim.node_velocities(), v, atol=1e-9)
    q = sim.node_positions()
    sim.step(None, n_steps=1)
    fd = (sim.node_positions() - q) / sim.dt
    assert np.abs(fd - sim.node_velocities()).max() < 0.05


def test_icosahedron_random_trajectories_finite_and_conserve_energy():
    s = load_structure(MODELS / "icosahedron.yaml")
    rng = np.random.default_rng(20240601)
    p = np.array([n.position for n in s.nodes])
    # seed-style sampling: random initial conditions, damping and gravity on -> finite, bounded
    for _ in range(3):
        tr = simulate(s, None, 1.0, record_hz=50, initial_positions=p + rng.normal(0, 0.02, p.shape),
                      initial_velocities=rng.normal(0, 0.5, p.shape), progress=False)
        assert np.isfinite(tr.positions).all() and np.isfinite(tr.velocities).all()
        assert np.abs(tr.positions - tr.positions[:, :1].mean(1, keepdims=True)).max() < 2.0
    # damping and gravity off, RK4: kinetic + string elastic energy conserved to 1e-5 (relative) over 1 s
    sim = TwinSim(s, timestep=0.0005, integrator="RK4", damping=False, gravity=(0, 0, 0))
    sim.set_node_state(p, rng.normal(0, 0.5, p.shape))
    energy = []
    for _ in range(200):
        sim.step(None, n_steps=10)
        energy.append(sim.kinetic_energy() + sim.string_energy())
    energy = np.array(energy)
    assert np.ptp(energy) / energy[0] < 1e-5, f"relative energy drift {np.ptp(energy) / energy[0]:.2e}"


def test_simulate_holds_each_steps_mid_drive(manipulator):
    """MuJoCo holds ctrl over a step, so ``simulate`` must hold the drive's value at the step's middle, with the
    step's mean rate, while it records the drive at the sample times (an encoder's reading). Until stop 40 it held
    the step's END value, running the drive half a step ahead of the angles it recorded."""
    held = []

    class Spy(TwinSim):
        def step(self, motor_angles=None, n_steps=1, motor_velocities=None, observe=True):
            if motor_angles is not None and n_steps == 1:
                held.append((self.time, np.ravel(motor_angles), np.ravel(motor_velocities)))
            return super().step(motor_angles, n_steps, motor_velocities, observe)

    dt = 1e-3
    tr = simulate(manipulator, seed_drive, 0.05, record_hz=100, timestep=dt, progress=False,
                  sim=Spy(manipulator, timestep=dt))
    assert len(held) == 50
    for t, u, ud in held:
        np.testing.assert_allclose(u, seed_drive(t + dt / 2), rtol=0, atol=1e-12)
        np.testing.assert_allclose(ud, (seed_drive(t + dt) - seed_drive(t)) / dt, rtol=0, atol=1e-9)
    np.testing.assert_allclose(tr.motor_angles, [seed_drive(t) for t in tr.times], rtol=0, atol=1e-12)


def test_simulate_and_run(manipulator):
    tr = simulate(manipulator, seed_drive, 0.5, record_hz=120, progress=False)
    assert tr.positions.shape == (61, 36, 3) and tr.motor_angles.shape == (61, 6)
    assert tr.times[-1] == pytest.approx(0.5)
    np.testing.assert_allclose(tr.motor_angles[-1], seed_drive(0.5), atol=1e-9)
    sim = TwinSim(manipulator)
    ticks = []
    factor = sim.run(0.2, realtime_factor=float("inf"), motor_angle_fn=seed_drive, tick_hz=50,
                     on_tick=lambda s: ticks.append(s.time))
    assert len(ticks) == 10 and sim.time == pytest.approx(0.2) and factor > 1.0
    # paced run with a fake clock: sleeps so that sim time = 2 x wall time
    now = [0.0]
    slept = []
    sim.run(0.1, realtime_factor=2.0, tick_hz=100, clock=lambda: now[0],
            sleep=lambda d: (slept.append(d), now.__setitem__(0, now[0] + d)))
    assert sum(slept) == pytest.approx(0.05, abs=1e-6)
