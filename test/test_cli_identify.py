"""`tensegrity simulate --bag` and `tensegrity identify` as a user runs them, including bad recordings.

Every bad recording exits with code 2, names the problem, and writes nothing.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from tensegrity_ros.bags import (JOINT_STATE, POSE_ARRAY, JointSeries, MarkerSeries, TopicNames, read_robot_bag,
                                 write_robot_bag)
from tensegrity_ros.cli import main
from tensegrity_ros.model import dump_structure, load_structure
from tensegrity_ros.param_names import kind_of

ROOT = Path(__file__).resolve().parents[1]
MANIPULATOR = ROOT / "config" / "models" / "stacked_manipulator.yaml"
SHORT_REF = ROOT / "config" / "references" / "seed_sinusoids_short.yaml"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 6-s recording of a 'true' robot 10% off the nominal model, as it would come off the robot."""
    out = tmp_path_factory.mktemp("sim")
    rc = main(["simulate", str(MANIPULATOR), "--duration", "6", "--out", str(out), "--bag", str(out / "bag"),
               "--reference", str(SHORT_REF), "--perturb", "0.1", "--noise-mm", "0.3", "--occlusion", "0.02",
               "--seed", "3"])
    assert rc == 0
    return out


def test_simulate_writes_trajectories_plots_and_a_readable_bag(recorded):
    for name in ("trajectory.npz", "plates.csv", "plates.png", "summary.json", "true_model.yaml"):
        assert (recorded / name).is_file(), name
    rec = read_robot_bag(recorded / "bag")
    assert rec.motor_names == tuple(f"m{i}" for i in range(1, 7))
    assert 75 < len(rec.motor_times) / rec.duration_s < 85          # 80 Hz motors
    assert 115 < len(rec.marker_times) / rec.duration_s < 125       # 120 Hz mocap
    sizes = [len(m) for m in rec.markers]
    assert max(sizes) == 24 and min(sizes) < 24                      # unlabeled physical nodes, some occluded
    # the mocap frame is Y-up: the ground nodes sit at mocap y ~ 0, the top plate ~1.4 m up along y
    pts = np.concatenate(rec.markers)
    assert abs(pts[:, 1].min()) < 0.02 and pts[:, 1].max() > 1.2


def test_identify_writes_a_valid_structure_file_and_a_report(recorded, tmp_path, capsys):
    out, report = tmp_path / "params.yaml", tmp_path / "report"
    rc = main(["identify", str(recorded / "bag"), "--model", str(MANIPULATOR), "--out", str(out),
               "--report", str(report), "--max-iter", "3", "--window", "0.1", "--windows", "6",
               "--longer-windows", "0.2:3:1"])
    assert rc == 0
    # the progress bar must not stop stage 2 (tqdm's update() returns True when it redraws)
    printed = capsys.readouterr().out
    assert "stopped by the callback" not in printed
    summary = json.loads((report / "summary.json").read_text())
    assert any("continued on 0.2-s windows" in n for n in summary["notes"])
    # the model check and the held-out check, with their figures, where they are seen (issue 17 items 2, 5)
    mm = summary["model_mismatch"]
    assert mm["status"] in ("model_ok", "model_mismatch", "fit_not_converged") and mm["noise_std_m"] > 0
    assert mm["noise_std_m"] == pytest.approx(0.3e-3, rel=0.15)      # the bag's 0.3 mm, from the tracks alone
    assert "max_ratio" in mm["thresholds"]
    assert summary["held_out"]["windows"] >= 3 and summary["held_out"]["verdict"] != "not_checked"
    assert summary["held_out"]["fit_rms_m"] > 0 and summary["held_out"]["prior_rms_m"] > 0
    assert "model check" in printed.lower() or "MODEL MISMATCH" in printed
    assert "held-out check" in printed.lower()
    timed = [ln for ln in printed.splitlines() if ln.startswith("time: ")]       # where the wall time went
    assert len(timed) == 1 and "x real time): " in timed[0] and "stage 2 " in timed[0], timed
    assert "the rest (reading, labelling, report)" in timed[0]
    text = (report / "parameters.txt").read_text().lower()
    assert "model check" in text or "model mismatch" in text
    identified = load_structure(out)                                 # a valid structure file
    assert main(["validate", str(out)]) == 0
    names = {k for k, _ in identified.std_devs}
    assert {"sc1.stiffness", "b1.mass"} <= names
    assert all(np.isfinite(v) and v >= 0 for _, v in identified.std_devs)
    for name in ("plates.png", "residuals.png", "convergence.png", "parameters.txt", "summary.json",
                 "parameters.csv", "parameters.md"):
        assert (report / name).is_file(), name
    # the report a person reads (issue 17 item 10): every parameter, with its prior, value, +-2 sigma and, the
    # truth lying beside the bag (simulate's true_model.yaml), its error
    from tensegrity_ros.engine import params_from_structure
    every = params_from_structure(load_structure(MANIPULATOR)).names()
    assert len(every) == 72                          # 14 strings x 3, 18 masses, 6 actuators x 2 (spool, zero offset)
    import csv
    rows = {r["parameter"]: r for r in csv.DictReader((report / "parameters.csv").open())}
    assert list(rows) == every
    md = (report / "parameters.md").read_text()
    assert all(f"| {n} |" in md for n in every)
    truth = {n: float(v) for n, v in params_from_structure(load_structure(recorded / "true_model.yaml")).named().items()}
    for n in ("sc1.stiffness", "b1.mass", "sc4.rest_length"):
        r = rows[n]
        assert r["status"] in ("estimated", "kept at the prior") and float(r["prior"]) > 0 and float(r["std"]) > 0
        assert float(r["truth"]) == pytest.approx(truth[n])
        assert float(r["plus_2sigma"]) - float(r["minus_2sigma"]) == pytest.approx(4 * float(r["std"]), rel=1e-6)
        err = float(r["error"])
        expect = 1e3 * (float(r["value"]) - truth[n]) if kind_of(n) == "rest_length" else \
            100 * (float(r["value"]) / truth[n] - 1)
        assert err == pytest.approx(expect, rel=1e-6, abs=1e-9)
    assert rows["m1.spool_radius"]["status"] == "fixed"                 # not estimated, still listed
    assert summary["truth_inside_2sigma"]["of"] > 0 and len(summary["parameters"]) == 72
    assert sum(r["status"] != "fixed" for r in rows.values()) == 60     # the 60 the convergence plot cut to 24
    # progress while the checks run and the report is built, and a single bag reported as before
    assert "model check (" in printed and "held-out check (" in printed and "report [1/4]" in printed
    assert "recording 1" not in printed and isinstance(summary["bag"], str)


def test_identify_fits_several_bags_jointly(recorded, tmp_path, capsys):
    """Two recordings of the same robot (the second: another drive, another noise draw) give ONE parameter set,
    and each recording's residual is reported (console, summary.json, report); issue 17 item 7."""
    reversed_drive = tmp_path / "reversed.yaml"
    reversed_drive.write_text(SHORT_REF.read_text().replace("phases_deg: [120.0, 0.0, -120.0]",
                                                            "phases_deg: [-120.0, 0.0, 120.0]"))
    second = tmp_path / "second"
    assert main(["simulate", str(recorded / "true_model.yaml"), "--duration", "3", "--out", str(second), "--bag",
                 str(second / "bag"), "--reference", str(reversed_drive), "--noise-mm", "0.3", "--occlusion", "0.02",
                 "--seed", "4"]) == 0
    capsys.readouterr()
    out, report = tmp_path / "params.yaml", tmp_path / "report"
    rc = main(["identify", str(recorded / "bag"), str(second / "bag"), "--model", str(MANIPULATOR), "--out", str(out),
               "--report", str(report), "--max-iter", "2", "--windows", "6", "--longer-windows", "none",
               "--holdout", "0"])
    assert rc == 0
    printed = capsys.readouterr().out
    summary = json.loads((report / "summary.json").read_text())
    recs = summary["recordings"]
    assert [r["bag"] for r in recs] == [str(recorded / "bag"), str(second / "bag")]
    for k, r in enumerate(recs):
        assert r["windows"] >= 1 and r["samples"] > 0, r                # both recordings are in the one fit
        assert 0 < r["residual_rms_m"] < 0.01 and r["prediction_1s_rms_mm"] > 0
        assert f"recording {k + 1} {r['bag']}: residual RMS {r['residual_rms_m'] * 1e3:.3f} mm" in printed
    assert sum(r["windows"] for r in recs) <= 6                          # --windows counts over all of them
    assert summary["duration_s"] == pytest.approx(6.0 + 3.0, abs=0.2)
    for name in ("plates-1.png", "plates-2.png", "residuals.png", "convergence.png", "parameters.csv"):
        assert (report / name).is_file(), name
    assert "recording 2" in (report / "parameters.md").read_text()
    assert main(["validate", str(out)]) == 0


def test_identify_jackknife_widens_sigma_and_says_so(recorded, tmp_path, capsys):
    """``--jackknife``: the last stage refitted once per window without it; summary.json and the console say so,
    and no standard deviation shrinks (stop 41; docs/identification.md "The window jackknife")."""
    common = ["identify", str(recorded / "bag"), "--model", str(MANIPULATOR), "--max-iter", "2", "--windows", "4",
              "--longer-windows", "none", "--holdout", "0", "--no-law-check", "--no-step-check", "--force"]
    plain, jk = tmp_path / "plain.yaml", tmp_path / "jk.yaml"
    assert main(common + ["--out", str(plain)]) == 0
    capsys.readouterr()
    assert main(common + ["--out", str(jk), "--report", str(tmp_path / "report"), "--jackknife"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["jackknife"]["windows"] == summary["jackknife"]["refits"] == 4
    assert "standard deviations widened by the window jackknife (4 refits" in printed
    before = yaml.safe_load(plain.read_text())["std_devs"]
    after = yaml.safe_load(jk.read_text())["std_devs"]
    assert before.keys() == after.keys()
    assert all(after[n] >= before[n] * (1 - 1e-9) for n in before) and any(after[n] > before[n] * 1.01 for n in before)


def test_several_bags_of_different_robots_exit_2(recorded, tmp_path, capsys):
    """A bag among several whose motors are not the model's (another robot): exit 2 naming that bag and the fix,
    nothing written."""
    rec = read_robot_bag(recorded / "bag")
    other = tmp_path / "other_robot"
    write_robot_bag(other, motor_states=JointSeries(rec.motor_times, tuple(f"motor_{k}" for k in range(6)),
                                                    rec.motor_angles),
                    markers=MarkerSeries(rec.marker_times, rec.markers))
    out = tmp_path / "params.yaml"
    rc = main(["identify", str(recorded / "bag"), str(other), "--model", str(MANIPULATOR), "--out", str(out),
               "--max-iter", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert str(other) in err and "bag 2 of 2" in err and "every bag must record the robot of --model" in err


def _run_bad(tmp_path, bag, model=MANIPULATOR, capsys=None):
    out = tmp_path / "params.yaml"
    rc = main(["identify", str(bag), "--model", str(model), "--out", str(out), "--report", str(tmp_path / "rep"),
               "--max-iter", "2"])
    assert rc == 2
    assert not out.exists() and not (tmp_path / "rep").exists()      # nothing written half-way
    return capsys.readouterr().err if capsys else ""


def _rewrite(src: Path, dst: Path, *, t_max=None, markers=None, topics=TopicNames(), extra=None):
    """A new bag from a recording: optionally cut at ``t_max`` s, other markers, renamed or extra topics."""
    rec = read_robot_bag(src)
    t_max = np.inf if t_max is None else rec.motor_times[0] + t_max
    km, kk = rec.motor_times < t_max, rec.marker_times < t_max
    mk = markers if markers is not None else [m for m, keep in zip(rec.markers, kk) if keep]
    write_robot_bag(dst, motor_states=JointSeries(rec.motor_times[km], rec.motor_names, rec.motor_angles[km]),
                    markers=MarkerSeries(rec.marker_times[kk][:len(mk)], mk), topics=topics, extra_topics=extra)
    return dst


def test_missing_topic(recorded, tmp_path, capsys):
    bag = _rewrite(recorded / "bag", tmp_path / "bag", topics=TopicNames(markers="/optitrack/markers"))
    err = _run_bad(tmp_path, bag, capsys=capsys)
    assert "/mocap/markers" in err and "missing" in err.lower()


def test_topic_of_the_wrong_type(recorded, tmp_path, capsys):
    wrong = {"/mocap/markers": (JOINT_STATE, [(0.01 * k, {"header": {"stamp": 0.01 * k}, "name": ["x"],
                                                          "position": [0.0]}) for k in range(1, 50)])}
    bag = _rewrite(recorded / "bag", tmp_path / "bag", topics=TopicNames(markers="/optitrack/markers"), extra=wrong)
    err = _run_bad(tmp_path, bag, capsys=capsys)
    assert "/mocap/markers" in err and POSE_ARRAY in err and JOINT_STATE in err


def test_bag_too_short(recorded, tmp_path, capsys):
    bag = _rewrite(recorded / "bag", tmp_path / "bag", t_max=0.3)
    err = _run_bad(tmp_path, bag, capsys=capsys)
    assert "short" in err.lower()


def test_markers_that_never_match_the_structure(recorded, tmp_path, capsys):
    rng = np.random.default_rng(0)
    junk = [rng.uniform(-2, 2, (24, 3)) for _ in range(len(read_robot_bag(recorded / "bag").markers))]
    err = _run_bad(tmp_path, _rewrite(recorded / "bag", tmp_path / "bag", markers=junk), capsys=capsys)
    assert "never match" in err or "no marker frame matched" in err


def test_truncated_file(recorded, tmp_path, capsys):
    bag = tmp_path / "bag"
    shutil.copytree(recorded / "bag", bag)
    data = next(bag.glob("*.mcap"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    err = _run_bad(tmp_path, bag, capsys=capsys)
    assert str(bag) in err or data.name in err


def test_model_actuators_not_in_the_bag(recorded, tmp_path, capsys):
    s = load_structure(MANIPULATOR)
    renamed = {a.name: f"motor_{a.motor_id}" for a in s.actuators}
    s2 = replace(s, actuators=tuple(replace(a, name=renamed[a.name]) for a in s.actuators),
                 strings=tuple(replace(st, actuator=renamed.get(st.actuator)) if st.actuator else st
                               for st in s.strings))
    model = tmp_path / "renamed.yaml"
    dump_structure(s2, model)
    err = _run_bad(tmp_path, recorded / "bag", model=model, capsys=capsys)
    assert "motor_1" in err


def test_bad_model_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes: [{name: a, position: [0, 0, 0]}]\nbars: []\nstrings: []\n")
    assert main(["validate", str(bad)]) == 2
    assert "nodes[0]" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--prior-std", "stifness=0.2"), ("--longer-windows", "0.3:24"),
                                         ("--longer-windows", "0.3:x:3"), ("--longer-windows", "0:24:3"),
                                         ("--workers", "0"), ("--workers", "two"),
                                         ("--prior-std", "rest_length=2%"), ("--prior-std", "mass=x%"),
                                         ("--holdout", "0.9"), ("--holdout", "-0.1")])
def test_bad_flag_fails_before_reading_the_bag(tmp_path, capsys, flag, value):
    out = tmp_path / "params.yaml"
    rc = main(["identify", str(tmp_path / "no_such_bag"), "--model", str(MANIPULATOR), "--out", str(out),
               flag, value])
    assert rc == 2 and not out.exists()
    assert flag in capsys.readouterr().err


def test_prior_std_takes_percent():
    from tensegrity_ros.commands.identify import _prior_std
    assert _prior_std("mass=2%,stiffness=0.2,rest_length=0.002", ("mass", "stiffness", "rest_length")) == \
        pytest.approx({"mass": 0.02, "stiffness": 0.2, "rest_length": 0.002})


def test_workers_default_to_the_usable_cores_at_most_8():
    import os
    from tensegrity_ros.commands.identify import _workers
    assert _workers("auto") == min(8, len(os.sched_getaffinity(0)))
    assert _workers("3") == 3


def test_longer_windows_default_to_the_ladder_and_none_turns_it_off():
    from tensegrity_ros.commands.identify import _ladder
    from tensegrity_ros.ident import LONGER_WINDOWS_LADDER
    assert _ladder(None) == LONGER_WINDOWS_LADDER
    assert [ws for ws, _, _ in _ladder(None)] == sorted(ws for ws, _, _ in _ladder(None))   # ever longer
    assert _ladder(["none"]) == ()
    assert _ladder(["0.3:24:8"]) == ((0.3, 24, 8),)


def test_identify_help_states_the_default_ladder(capsys):
    with pytest.raises(SystemExit):
        main(["identify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    from tensegrity_ros.ident import LONGER_WINDOWS_LADDER
    assert " ".join(f"--longer-windows {ws}:{nw}:{it}" for ws, nw, it in LONGER_WINDOWS_LADDER) in text
