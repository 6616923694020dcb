"""The spring_rod backend follows each string's stiffness law (``String.stiffness_law``) like the nodal one.

A hoist (1 m, 1 kg rod hung from two fixed anchors by two actuated strings, held sideways by two lateral ones;
as in test_string_laws.py, with a vanishing bar radius so the two backends share the thin-rod inertia) is
driven through a -33 % rest-length change. For each law of the actuated strings the spring_rod and nodal
backends agree to round-off (RK4, 1 ms, 1 s), and the two laws give visibly different motions.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from tensegrity_ros.engine import Inputs, make_engine
from tensegrity_ros.model import structure_from_dict
from test_string_laws import HOIST, drive

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 1000
DT = 1e-3


def _rollouts(law: str):
    """Node trajectories (N, 6, 3) m of the nodal and spring_rod backends (RK4) from the file pose at rest."""
    # test_string_laws' hoist, its rod thin (radius -> 0): both backends then model the same zero-thickness bar
    s = structure_from_dict(yaml.safe_load(HOIST.format(law1=law, law2=law).replace(
        "mass: 1.0}", "mass: 1.0, radius: 1.0e-6}")), source="<hoist>")
    u, ud = drive(DT * np.arange(N))                                        # 0..-3 rad: rest 0.9..0.6 m
    inp = Inputs(motor_angles=torch.as_tensor(u).unsqueeze(1), motor_velocities=torch.as_tensor(ud).unsqueeze(1))
    en, er = make_engine(s, "nodal", "rk4"), make_engine(s, "spring_rod", "rk4")
    p = en.default_params()
    s0 = en.project(p, en.initial_state())
    xn = en.rollout(p, s0, inp, DT).positions[:, 0].numpy()
    xr = er.rollout(er.default_params(), er.initial_state(s0.positions, s0.velocities), inp, DT).positions[:, 0]
    return xn, xr.numpy()


@pytest.fixture(scope="module")
def rollouts():
    return {law: _rollouts(law) for law in ("cord", "spring")}


@pytest.mark.parametrize("law", ["cord", "spring"])
def test_spring_rod_matches_nodal(rollouts, law):
    xn, xr = rollouts[law]
    err = float(np.linalg.norm(xn - xr, axis=-1).max())
    print(f"{law}: max |spring_rod - nodal| over 1 s = {err:.3e} m")
    assert np.abs(xn[-1] - xn[0]).max() > 0.05          # the drive moves the rod by centimetres
    assert err < 1e-8


def test_laws_differ(rollouts):
    """Guard: the law reaches the spring_rod backend (a spring-law run treated as cord would fail this)."""
    d = float(np.linalg.norm(rollouts["cord"][1] - rollouts["spring"][1], axis=-1).max())
    print(f"spring_rod, max |cord - spring| over 1 s = {d * 1e3:.1f} mm")
    assert d > 5e-3
