"""The twin's vectorised node velocities equal MuJoCo's own mj_objectVelocity, site by site."""
from __future__ import annotations

import mujoco
import numpy as np

from tensegrity_ros.model import load_structure
from tensegrity_ros.twin.sim import TwinSim


def test_node_velocities_equal_mj_object_velocity():
    from pathlib import Path

    s = load_structure(Path(__file__).resolve().parents[1] / "config" / "models" / "stacked_manipulator.yaml")
    sim = TwinSim(s)
    sim.step(np.array([a.zero_offset for a in s.actuators]) + 0.3, n_steps=300)   # moving, rotating bars
    v = sim.node_velocities()
    m, d = sim.model, sim.data
    ref = np.zeros_like(v)
    for i, sid in enumerate(sim._site_ids):
        if m.site_bodyid[sid] == 0:
            continue
        res = np.zeros(6)
        mujoco.mj_objectVelocity(m, d, mujoco.mjtObj.mjOBJ_SITE, sid, res, 0)
        ref[i] = res[3:]
    assert np.abs(ref).max() > 0.05                    # the structure is moving: the comparison means something
    np.testing.assert_allclose(v, ref, rtol=0, atol=1e-12)


def test_stepping_without_observing_moves_the_twin_identically():
    """step(observe=False) skips only the closing forward pass: the same motion, read after the last chunk."""
    from pathlib import Path

    s = load_structure(Path(__file__).resolve().parents[1] / "config" / "models" / "stacked_manipulator.yaml")
    u0 = np.array([a.zero_offset for a in s.actuators])
    out = []
    for observe in (True, False):
        sim = TwinSim(s, gate_slack=False)
        for i in range(40):                      # new motor angles every 5 steps, as the predictor's nominal
            sim.step(u0 + 0.3 * np.sin(0.1 * i + np.arange(u0.size)), 5, 6.0 * np.cos(0.1 * i + np.arange(u0.size)),
                     observe=observe or i == 39)
        out.append((sim.node_positions(), sim.node_velocities(), sim.string_tensions()))
    assert np.abs(out[0][1]).max() > 0.05
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)
