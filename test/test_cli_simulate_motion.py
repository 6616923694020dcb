"""`tensegrity simulate` says when its recording cannot identify anything: a structure that only moves rigidly (the
free-floating icosahedron falls under gravity, nothing drives it) gets a warning naming why; a driven one does not.
The measure, node-to-node distance changes, ignores rigid motion and sees a stretch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tensegrity_ros.cli import main
from tensegrity_ros.commands.simulate import internal_motion
from tensegrity_ros.paths import CONFIG_DIR


def test_internal_motion_ignores_rigid_motion_and_sees_a_stretch():
    rng = np.random.default_rng(0)
    X0 = rng.normal(size=(6, 3))
    c, s = np.cos(0.7), np.sin(0.7)
    R = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    moved = X0 @ R.T + np.array([0.0, 0.0, -40.0])              # turned and fallen 40 m
    assert internal_motion(np.stack([X0, moved])) == pytest.approx(0.0, abs=1e-12)
    stretched = X0.copy()
    stretched[0] += 0.003 * (X0[0] - X0[1]) / np.linalg.norm(X0[0] - X0[1])
    assert internal_motion(np.stack([X0, moved, stretched])) >= 0.003 - 1e-12


@pytest.mark.parametrize("model, warned", [("icosahedron", True), ("stacked_manipulator", False)])
def test_simulate_warns_when_nothing_deforms_the_structure(model, warned, tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", str(CONFIG_DIR / "models" / f"{model}.yaml"), "--duration", "0.5", "--settle", "0",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    motion = json.loads((out / "summary.json").read_text())["max_internal_motion_mm"]
    assert ("warning: the structure barely deforms" in err) == warned, err
    if warned:
        assert motion < 1.0 and "no actuators" in err and "no fixed node" in err
    else:
        assert motion > 1.0
