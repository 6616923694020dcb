"""The torch engines against the MuJoCo twin (tensegrity_ros.twin), node by node.

Integrator pairing: where strings go slack (icosahedron with random velocities) the twin must apply the
contract's D > 0 gate, which it can only do with its Euler-type integrators (``implicitfast``); the spring-rod
uses MuJoCo's implicitfast too. The manipulator (all strings taut): engine ``implicit`` at 1 ms vs MuJoCo RK4
at 0.25 ms substeps (see docs/engine.md for the convergence study).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import Inputs, make_engine
from tensegrity_ros.model import load_structure

twin = pytest.importorskip("tensegrity_ros.twin")
MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mujoco(structure, X0, V0, n, integrator, u=None, ud=None, substeps=1):
    """n steps of 1 ms (each ``substeps`` MuJoCo steps, inputs held), node positions after each."""
    sim = twin.TwinSim(structure, timestep=1e-3 / substeps, integrator=integrator)
    assert abs(sim.dt * substeps - 1e-3) < 1e-12
    sim.set_node_state(X0, V0)
    out = np.empty((n, len(structure.nodes), 3))
    for k in range(n):
        if u is None:
            sim.step(None, substeps)
        else:
            sim.step(u[k], substeps, motor_velocities=ud[k])
        out[k] = sim.node_positions()
    return out


def _engine(structure, backend, integrator, X0, V0, n, u=None, ud=None):
    """n engine steps of 1 ms from (X0, V0) (projected onto the bar lengths for the nodal engine)."""
    eng = make_engine(structure, backend, integrator)
    p = eng.default_params()
    st = eng.initial_state(torch.as_tensor(X0), torch.as_tensor(V0))
    if backend == "nodal":
        st = eng.project(p, st)
    inp = None if u is None else Inputs(motor_angles=torch.as_tensor(u).unsqueeze(1),
                                        motor_velocities=torch.as_tensor(ud).unsqueeze(1))
    x = eng.rollout(p, st, inp, 1e-3, steps=None if inp is not None else n).positions[:, 0].numpy()
    return x, st.positions[0].numpy(), st.velocities[0].numpy()


def _rms_mm(a, b):
    e = np.linalg.norm(a - b, axis=-1)
    return float(np.sqrt((e ** 2).mean()) * 1e3), float(e.max() * 1e3)


def test_spring_rod_vs_mujoco():
    """The seed's rod between two nails, launched away from them: the springs stretch, go slack and re-tighten
    (both sides taut ~40 % of the time). Engine: the seed's semi-implicit Euler; twin: implicitfast (gate on)."""
    s = load_structure(MODELS / "spring_rod.yaml")
    X0 = np.array([n.position for n in s.nodes])
    V0 = np.zeros_like(X0)
    V0[2], V0[3] = (0.1, 0.2, -0.5), (-0.1, 0.3, -0.3)
    xe, X0p, V0p = _engine(s, "spring_rod", "semi_implicit", X0, V0, 2000)
    xm = _mujoco(s, X0p, V0p, 2000, "implicitfast")
    rms, worst = _rms_mm(xe, xm)
    print(f"spring-rod vs MuJoCo, 2 s: RMS {rms:.3f} mm, max {worst:.3f} mm")
    stretch = np.linalg.norm(xe[:, [2, 3]] - xe[:, [0, 1]], axis=-1) - np.array([st.rest_length for st in s.strings])
    assert ((stretch > 0).mean(axis=0) > 0.2).all()  # the springs do act
    assert rms < 1.0


def test_icosahedron_vs_mujoco():
    s = load_structure(MODELS / "icosahedron.yaml")
    s = dataclasses.replace(s, gravity=(0.0, 0.0, 0.0))
    X0 = np.array([n.position for n in s.nodes])
    V0 = np.random.default_rng(0).normal(0.0, 0.5, X0.shape)
    xe, X0p, V0p = _engine(s, "nodal", "semi_implicit", X0, V0, 2000)
    xm = _mujoco(s, X0p, V0p, 2000, "implicitfast")
    rms, worst = _rms_mm(xe, xm)
    print(f"icosahedron vs MuJoCo, 2 s, gravity off, random velocities: RMS {rms:.3f} mm, max {worst:.3f} mm")
    assert rms < 5.0


def test_stated_bar_inertia_vs_mujoco():
    """Bars with a stated ``inertia`` (rho = I / (m L^2) = 0.2, heavy ends, against the thin rod's 1/12): the engine's
    bar mass matrix and the twin's body inertia follow it, and agree as for thin rods; the thin-rod engine does not
    follow that twin."""
    s = load_structure(MODELS / "icosahedron.yaml")
    s = dataclasses.replace(s, gravity=(0.0, 0.0, 0.0), bars=tuple(
        dataclasses.replace(b, inertia=0.2 * b.mass * s.bar_length(b) ** 2) for b in s.bars))
    X0 = np.array([n.position for n in s.nodes])
    V0 = np.random.default_rng(0).normal(0.0, 0.5, X0.shape)
    xe, X0p, V0p = _engine(s, "nodal", "semi_implicit", X0, V0, 1000)
    xm = _mujoco(s, X0p, V0p, 1000, "implicitfast")
    rms, worst = _rms_mm(xe, xm)
    thin = dataclasses.replace(s, bars=tuple(dataclasses.replace(b, inertia=None) for b in s.bars))
    rms_thin, _ = _rms_mm(_engine(thin, "nodal", "semi_implicit", X0, V0, 1000)[0], xm)
    print(f"icosahedron, heavy-ended bars, 1 s vs MuJoCo: RMS {rms:.3f} mm (thin-rod engine {rms_thin:.3f} mm)")
    assert rms < 5.0 and rms_thin > 5 * rms


@pytest.mark.skipif(not (MODELS / "stacked_manipulator.yaml").exists(), reason="no manipulator model")
def test_manipulator_vs_mujoco_one_period():
    """Engine: implicit-damping Euler at 1 ms (0.04 mm RMS from its converged trajectory). MuJoCo: RK4 at 1 ms
    (0.16 mm from the same), or at 0.25 ms substeps if the strings are damped too hard for RK4 at 1 ms. (MuJoCo's
    implicitfast is first order with a large constant here: 12 mm at 1 ms, 3.6 mm at 0.25 ms.)"""
    from tensegrity_ros import references as R
    s = load_structure(MODELS / "stacked_manipulator.yaml")
    n = 7000
    t = 1e-3 * np.arange(n)
    ref = R.seed_reference()
    u, ud = R.motor_angles(ref, s, t), R.motor_velocities(ref, s, t)
    X0 = np.array([nd.position for nd in s.nodes])
    xe, X0p, V0p = _engine(s, "nodal", "implicit", X0, np.zeros_like(X0), n, u, ud)
    xm = _mujoco(s, X0p, V0p, n, "RK4", u, ud)
    if not np.isfinite(xm).all():
        xm = _mujoco(s, X0p, V0p, n, "RK4", u, ud, substeps=4)
    rms, worst = _rms_mm(xe, xm)
    print(f"manipulator vs MuJoCo, one 7 s period of the seed drive: RMS {rms:.3f} mm, max {worst:.3f} mm")
    assert float(np.abs(xe - X0).max()) > 0.02  # the drive moves it by centimetres
    assert rms < 5.0
