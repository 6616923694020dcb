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
    captured = capsys.readouterr()
    err = captured.err
    motion = json.loads((out / "summary.json").read_text())["max_internal_motion_mm"]
    wrote = next(ln for ln in captured.out.splitlines() if ln.startswith("wrote "))
    listed = wrote[wrote.index("(") + 1:wrote.rindex(")")].split(", ")
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.is_file())   # what is there, no more
    assert ("warning: the structure barely deforms" in err) == warned, err
    if warned:
        assert motion < 1.0 and "no actuators" in err and "no fixed node" in err
    else:
        assert motion > 1.0


def test_simulate_plots_the_nodes_of_a_structure_without_plates(tmp_path, capsys):
    """A lab's own structure (here the generality suite's prism, driven by its own reference) has none of the
    manipulator's plates: simulate plots its moving nodes instead of writing no plot, and says what it wrote."""
    from tensegrity_ros.validation.independent import STRUCTURES_DIR
    ref = tmp_path / "sway.yaml"
    ref.write_text("name: sway\nperiod_s: 1.0\nramp_in_s: 0.2\nramp_out_s: 0.2\nstart_s: 0.0\nduration_s: 1.0\n"
                   "stages:\n  - name: verticals\n    actuators: [m1, m2]\n    amplitude_m: 0.01\n"
                   "    phases_deg: [0.0, 180.0]\n    offsets_m: 0.0\n")
    out = tmp_path / "sim"
    assert main(["simulate", str(STRUCTURES_DIR / "prism4_fixed.yaml"), "--reference", str(ref), "--duration", "0.5",
                 "--settle", "0", "--out", str(out)]) == 0
    written = {p.name for p in out.iterdir()}
    assert "nodes.png" in written and "plates.png" not in written
    assert "wrote " in capsys.readouterr().out
