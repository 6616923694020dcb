"""Synthetic identification data from the engines (tests, benchmarks) and small example structures.

Ground truth for the benchmarks comes from the MuJoCo twin (see bench/bench_identification.py); these
helpers make engine-generated data, where the model is exact, for unit tests.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from ..engine import Inputs, Params, make_engine
from ..model import Structure, structure_from_dict
from .data import Dataset, make_dataset

__all__ = ["actuated_pendulum", "pendulum_drive", "random_initial_state", "simulate_dataset", "perturb",
           "twin_dataset", "perturbed_twin_recording"]


def actuated_pendulum(delay_free: bool = True) -> Structure:
    """A 1 m, 1 kg rod hung from four fixed anchors by four strings, two of them actuated (m1 on s1, m2 on
    s2; spool radius 10 mm), with gravity: the smallest actuated example (rest lengths, spool radii and
    a motor delay are identifiable from its motion)."""
    d = {
        "name": "actuated_pendulum",
        "description": "1 m rod hung by two actuated vertical strings and two lateral strings (test example).",
        "gravity": [0.0, 0.0, -9.81],
        "nodes": [
            {"name": "a1", "position": [0.0, 0.0, 1.0], "fixed": True},
            {"name": "a2", "position": [1.0, 0.0, 1.0], "fixed": True},
            {"name": "a3", "position": [0.5, 1.0, 0.0], "fixed": True},
            {"name": "a4", "position": [0.5, -1.0, 0.0], "fixed": True},
            {"name": "n1", "position": [0.0, 0.0, 0.0]},
            {"name": "n2", "position": [1.0, 0.0, 0.0]},
        ],
        "bars": [{"name": "rod", "nodes": ["n1", "n2"], "mass": 1.0, "radius": 0.01}],
        "actuators": [
            {"name": "m1", "motor_id": 1, "spool_radius": 0.01, "direction": 1, "zero_offset": 0.0},
            {"name": "m2", "motor_id": 2, "spool_radius": 0.01, "direction": 1, "zero_offset": 0.0},
        ],
        "strings": [
            {"name": "s1", "nodes": ["a1", "n1"], "stiffness": 200.0, "damping": 2.0, "rest_length": 0.95,
             "actuator": "m1"},
            {"name": "s2", "nodes": ["a2", "n2"], "stiffness": 200.0, "damping": 2.0, "rest_length": 0.95,
             "actuator": "m2"},
            {"name": "s3", "nodes": ["a3", "n2"], "stiffness": 100.0, "damping": 1.0, "rest_length": 1.08},
            {"name": "s4", "nodes": ["a4", "n1"], "stiffness": 100.0, "damping": 1.0, "rest_length": 1.08},
        ],
    }
    return structure_from_dict(d)


def pendulum_drive(t) -> np.ndarray:
    """(T, 2) motor angles (rad) at times t (T,) s that excite :func:`actuated_pendulum`: two sinusoids of 2 rad
    at 1.3 Hz and 0.9 Hz (phase 1 rad), incommensurate so every rest length and spool radius is seen."""
    t = np.asarray(t, dtype=float)
    return np.stack([2.0 * np.sin(2 * np.pi * 1.3 * t), 2.0 * np.sin(2 * np.pi * 0.9 * t + 1.0)], axis=1)


def random_initial_state(structure: Structure, rng: np.random.Generator, pos_std: float = 0.05,
                         vel_std: float = 0.3, params: Optional[Params] = None, backend: str = "nodal"
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """Random node positions/velocities (N, 3) near the file geometry, consistent with the bar lengths."""
    eng = make_engine(structure, backend=backend)
    X0 = eng.topology.X0.copy()
    free = ~np.array([n.fixed for n in structure.nodes])
    X = X0 + np.where(free[:, None], rng.normal(0.0, pos_std, X0.shape), 0.0)
    V = np.where(free[:, None], rng.normal(0.0, vel_std, X0.shape), 0.0)
    p = params if params is not None else eng.default_params()
    st = eng.initial_state(torch.as_tensor(X), torch.as_tensor(V))
    if hasattr(eng, "project"):
        st = eng.project(p, st)
    return st.positions[0].numpy(), st.velocities[0].numpy()


def simulate_dataset(structure: Structure, params: Params, X0: np.ndarray, V0: np.ndarray, *, dt: float,
                     steps: int, every: int = 1, motor_fn: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                     motor_delay_s: float = 0.0, control_forces: Optional[np.ndarray] = None,
                     control_arms: Optional[np.ndarray] = None, backend: str = "nodal",
                     integrator: str = "semi_implicit") -> Dataset:
    """Roll the engine out from (X0, V0) for ``steps`` steps of ``dt`` and record every ``every``-th state.

    motor_fn(t (T,)) -> (T, A) motor angles (rad); the engine sees u(t - motor_delay_s) at the start of
    each step while the dataset records u(t) (a motor-to-mocap delay). control_forces: (steps, R, 3) N
    (spring_rod backend). The recorded sample 0 is the initial state.
    """
    eng = make_engine(structure, backend=backend, integrator=integrator)
    st = eng.initial_state(torch.as_tensor(X0), torch.as_tensor(V0))
    t_steps = np.arange(steps) * dt
    kw = {}
    if motor_fn is not None:
        u = np.asarray(motor_fn(t_steps - motor_delay_s), dtype=np.float64)
        un = np.asarray(motor_fn(t_steps + dt - motor_delay_s), dtype=np.float64)
        kw["motor_angles"] = torch.as_tensor(u)[:, None]
        kw["motor_velocities"] = torch.as_tensor((un - u) / dt)[:, None]
    if control_forces is not None:
        kw["control_forces"] = torch.as_tensor(control_forces)[:, None]
        if control_arms is not None:
            kw["control_arms"] = torch.as_tensor(control_arms)[:, None]
    with torch.no_grad():
        out = eng.rollout(params.map(lambda t: t.double()), st, Inputs(**kw) if kw else None, dt=dt,
                          steps=None if kw else steps)
    X = np.concatenate([st.positions.numpy(), out.positions[:, 0].numpy()])[::every]
    V = np.concatenate([st.velocities.numpy(), out.velocities[:, 0].numpy()])[::every]
    t = np.arange(steps + 1)[::every] * dt
    U = None
    if motor_fn is not None:
        U = np.asarray(motor_fn(t), dtype=np.float64)
    Fc = Arm = None
    if control_forces is not None:
        Fc = np.concatenate([control_forces, control_forces[-1:]])[::every]
        if control_arms is not None:
            Arm = np.concatenate([control_arms, control_arms[-1:]])[::every]
    return make_dataset(t, X, None, U, velocities=V, control_forces=Fc, control_arms=Arm,
                        node_names=structure.node_names, actuator_names=tuple(a.name for a in structure.actuators),
                        name=structure.name, dt=dt * every)


def perturb(params: Params, names: Sequence[str], rng: np.random.Generator, rel: float = 0.2) -> Params:
    """Multiply the named values by independent factors exp(N(0, rel)) clipped to [1 - 2 rel, 1 + 2 rel]."""
    vals = params.named()
    f = np.clip(np.exp(rng.normal(0.0, rel, len(names))), 1 - 2 * rel, 1 + 2 * rel)
    return params.with_values({n: float(vals[n]) * float(k) for n, k in zip(names, f)})


def twin_dataset(structure: Structure, motor_fn: Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]], *,
                 seconds: float, rng: np.random.Generator, noise_std_m: float = 1e-3, timestep: float = 1e-3,
                 every: int = 8, vel_std: float = 0.3, integrator: str = "RK4") -> Dataset:
    """A recording of ``structure``'s MuJoCo twin (its own string laws, capsule bars): the free nodes start
    at the file pose (projected on the bar lengths) with random velocities (std ``vel_std`` m/s), the motors
    follow motor_fn(t (T,)) -> (angles (T, A) rad, rates (T, A) rad/s), and every ``every``-th step is recorded
    with white noise ``noise_std_m`` on the free nodes (the exact motor angles beside them)."""
    from ..twin import TwinSim                           # mujoco only when called
    n = int(round(seconds / timestep))
    t = timestep * np.arange(n)
    u, ud = motor_fn(t)
    # MuJoCo holds ctrl over a step: holding the drive's mid-step value makes the held staircase a second-order
    # approximation of the continuous drive instead of a half-step (0.5-ms) lag behind the angles recorded. On the
    # test hoist, the engine's 0.5-s predictions from the twin's states (0.25-ms engine steps) were 0.56 mm RMS off
    # the 1-ms twin held at the step's start and ungated, 0.07 mm off it held at mid-step and gated (docs/twin.md)
    um, udm = motor_fn(t + 0.5 * timestep)
    eng = make_engine(structure)
    p = eng.default_params()
    st = eng.project(p, eng.initial_state())
    free = ~np.array([nd.fixed for nd in structure.nodes])
    X0 = st.positions[0].numpy()
    V0 = np.where(free[:, None], rng.normal(0.0, vel_std, X0.shape), 0.0)
    st = eng.project(p, eng.initial_state(torch.as_tensor(X0)[None], torch.as_tensor(V0)[None]))
    sim = TwinSim(structure, timestep=timestep, integrator=integrator)
    sim.set_node_state(st.positions[0].numpy(), st.velocities[0].numpy())
    keep = np.arange(0, n, every)
    X = np.empty((keep.size,) + X0.shape)
    j = 0
    for k in range(n):
        if k % every == 0:
            X[j] = sim.node_positions()
            j += 1
        sim.step(um[k], 1, motor_velocities=udm[k])
    X[:, free] += rng.normal(0.0, noise_std_m, X[:, free].shape)
    return make_dataset(t[keep], X, None, np.asarray(u)[keep] if structure.actuators else None,
                        node_names=structure.node_names, actuator_names=tuple(a.name for a in structure.actuators),
                        name=f"{structure.name} (MuJoCo twin)")


def perturbed_twin_recording(nominal: Structure, seconds: float, *, fraction: float = 0.2, seed: int = 0,
                             kinds: Sequence[str] = ("stiffness", "damping"), noise_std_m: float = 3e-4,
                             reference: str = "seed_sinusoids_continuous") -> Tuple[Structure, Dataset]:
    """What the simulated robot of the demo hands the online identifier: the true robot is ``nominal`` with
    ``kinds`` scaled by 1 + ``fraction`` N(0, 1) (seeded; ``sim_robot``'s defaults), driven by the shipped
    reference ``config/references/<reference>.yaml`` through its MuJoCo twin (RK4), recorded at 120 Hz with
    white marker noise ``noise_std_m`` (m). Returns (the true structure, the recording). One recipe for the
    online identifier's convergence test and the GPU bench's update."""
    from ..model.perturb import perturb_structure
    from ..paths import CONFIG_DIR
    from ..references import load_reference, motor_angles
    from ..twin import simulate                         # mujoco only when called
    from .data import add_marker_noise
    true = perturb_structure(nominal, fraction, seed, kinds=tuple(kinds))
    ref = load_reference(CONFIG_DIR / "references" / f"{reference}.yaml")
    traj = simulate(true, lambda t: motor_angles(ref, true.actuators, t), seconds, record_hz=120.0, progress=False,
                    integrator="RK4")
    ds = add_marker_noise(make_dataset(traj.times, traj.positions, None, traj.motor_angles), noise_std_m,
                          np.random.default_rng(seed))
    return true, ds
