"""`tensegrity export-mjcf PARAMS.yaml --out model.xml` (issue 17, item 9).

(1) The exported file, loaded on its own with ``mujoco.MjModel.from_xml_path`` and stepped with plain
``mj_step`` (motors held at their zero offsets: the keyframe's ctrl = nominal rest lengths), follows the torch
engine's rollout of the same structure from the same initial state within 1 mm over 1 s (the issue's
criterion), for the manipulator and for an identified-style parameters file (stiffnesses changed by -30..+30 %,
with ``std_devs``, so the pose is out of equilibrium and the robot moves by ~0.1 m). Pairing as in
test_engine_vs_mujoco.py: all strings stay taut, so MuJoCo's RK4 (exported with ``--integrator RK4``) against
the engine's RK4, both at 1 ms.
(2) Bad input exits 2 with one line and writes nothing.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros.cli import main
from tensegrity_ros.model import dump_structure, load_structure

mujoco = pytest.importorskip("mujoco")
twin = pytest.importorskip("tensegrity_ros.twin")
from test_engine_vs_mujoco import _engine, _rms_mm  # noqa: E402  (same helpers as the twin comparison)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
MANIPULATOR = ROOT / "config" / "models" / "stacked_manipulator.yaml"
N = 1000          # 1 s of 1 ms steps


def _identified(tmp_path: Path) -> Path:
    """An identified-style parameters file: the manipulator with changed stiffnesses and std_devs."""
    s = load_structure(MANIPULATOR)
    f = np.resize([0.7, 1.3, 0.9, 1.2, 0.8, 1.1, 1.0], len(s.strings))
    s = dataclasses.replace(s, strings=tuple(dataclasses.replace(st, stiffness=st.stiffness * float(k))
                                             for st, k in zip(s.strings, f)))
    path = tmp_path / "identified.yaml"
    dump_structure(s, path, std_devs={f"{st.name}.stiffness": 0.05 * st.stiffness for st in s.strings},
                   header="identified parameters (test)")
    return path


def _mujoco_from_file(xml: Path, structure, X0, V0, n: int) -> np.ndarray:
    """n steps of the exported model (its own timestep, 1 ms), site positions of the structure's nodes after
    each. The initial state (X0, V0) is put into qpos/qvel with the twin's node -> body fit
    (TwinSim.set_node_state on the same structure: same bodies, same joint layout)."""
    m = mujoco.MjModel.from_xml_path(str(xml))
    d = mujoco.MjData(m)
    mujoco.mj_resetDataKeyframe(m, d, 0)         # ctrl = nominal rest lengths: motors at their zero offsets
    ref = twin.TwinSim(structure)
    ref.set_node_state(X0, V0)
    assert (m.nq, m.nv, m.nu) == (ref.model.nq, ref.model.nv, ref.model.nu)
    d.qpos[:], d.qvel[:] = ref.data.qpos, ref.data.qvel
    np.testing.assert_allclose(d.ctrl, [st.rest_length for st in structure.strings], rtol=0, atol=1e-9)
    mujoco.mj_forward(m, d)
    ids = [mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, ref.layout.node_site[nm]) for nm in structure.node_names]
    assert min(ids) >= 0
    out = np.empty((n, len(ids), 3))
    for k in range(n):
        mujoco.mj_step(m, d)
        out[k] = d.site_xpos[ids]
    return out


@pytest.mark.parametrize("which", ["manipulator", "identified"])
def test_exported_model_follows_engine(tmp_path, which, capsys):
    src = MANIPULATOR if which == "manipulator" else _identified(tmp_path)
    out = tmp_path / "model.xml"
    assert main(["export-mjcf", str(src), "--out", str(out), "--integrator", "RK4"]) == 0
    text = out.read_text()
    assert "ctrl is the string's REST LENGTH" in text and "xi0 = xi00 + direction * spool_radius" in text
    s = load_structure(src)
    if which == "identified":
        assert s.std_devs and "standard deviations" in text
        assert f'gainprm="{s.strings[1].stiffness:.10g}"' in text         # the identified values, not the seed's
    X0 = np.array([nd.position for nd in s.nodes])
    xe, X0p, V0p = _engine(s, "nodal", "rk4", X0, np.zeros_like(X0), N)
    xm = _mujoco_from_file(out, s, X0p, V0p, N)
    rms, worst = _rms_mm(xe, xm)
    moved = float(np.linalg.norm(xe - X0p, axis=-1).max() * 1e3)
    with capsys.disabled():
        print(f"\nexport-mjcf {which}: exported MuJoCo vs engine over 1 s: RMS {rms:.3f} mm, max {worst:.3f} mm "
              f"(engine moves {moved:.1f} mm)")
    if which == "identified":
        assert moved > 20.0                      # out of equilibrium: the comparison is not trivial
    assert worst < 1.0


# ---- (2) bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing", "binary", "exists"])
def test_bad_input_exit_2_nothing_written(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    src, out = str(MANIPULATOR), "model.xml"
    if case == "missing":
        src = "nope.yaml"
    elif case == "binary":
        src = "params.yaml"
        (tmp_path / src).write_bytes(bytes(range(256)) * 8)
    else:
        (tmp_path / out).write_text("<mujoco/>\n")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["export-mjcf", src, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tensegrity export-mjcf: error:"), err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before       # nothing written, nothing left
    if case == "exists":
        assert "--force" in err
        assert main(["export-mjcf", src, "--out", out, "--force"]) == 0
        mujoco.MjModel.from_xml_path(str(tmp_path / out))
        assert sorted(p.name for p in tmp_path.iterdir()) == [out]
