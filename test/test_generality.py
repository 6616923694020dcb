"""The generality suite, small (issue 17, item 6): robots the project did not write.

The structures (``tensegrity_ros/validation/structures/``) are not in ``config/``; the TRUE robot is an independently
written MuJoCo model (``tensegrity_ros/validation/independent.py``: capsule bars, tendons, spool actuators, a string
law per string) recorded with a lab's habits. The full table is ``bench/bench_generality.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

import numpy as np
import pytest
import torch

from tensegrity_ros.bags import read_robot_bag
from tensegrity_ros.cli import main
from tensegrity_ros.engine import Inputs, make_engine
from tensegrity_ros.ident.lawcheck import LawCheck
from tensegrity_ros.model import load_structure
from tensegrity_ros.validation import independent as I
from tensegrity_ros.validation.scoring import COVERAGE_TARGET, TARGETS, Z_RMS_RANGE, score

pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest.importorskip("mujoco")

#: The lab's flags: its rough mocap frame, its marker noise, the delay it knows exists, and how well it knows
#: its model (stiffness and damping to 20 %, bars weighed to 2 %, rest lengths to 2 mm).
LAB_PRIOR = "stiffness=0.2,damping=0.2,mass=0.02,rest_length=0.002"


@pytest.fixture(scope="module")
def lab_recording(tmp_path_factory):
    """24 s (the suite's, as bench_generality records) of the two-stage tower (20 strings, 6 bars, a composite
    actuated string), recorded the way a lab records, with the suite's identification drive."""
    out = tmp_path_factory.mktemp("tower2")
    info = I.record(I.load_suite_structure("tower2_prism3"), out, seed=0, duration_s=I.SUITE_DURATION_S)
    return out, info


def test_suite_structures_are_not_the_projects_and_differ_in_kind():
    shapes = {}
    for name in I.SUITE:
        s = I.load_suite_structure(name)
        assert not (I.STRUCTURES_DIR.parents[2] / "config" / "models" / f"{name}.yaml").exists()
        shapes[name] = (len(s.bars), len(s.fixed_nodes), len(s.actuators),
                        {st.stiffness_law for st in s.strings if st.actuator},
                        max(len(st.nodes) for st in s.strings), sum(a.direction for a in s.actuators))
    assert len({v[:3] for v in shapes.values()}) == 3                     # bars / welded nodes / motors all differ
    assert any(v[4] > 2 for v in shapes.values())                         # a composite string somewhere
    assert {"cord", "spring"} <= set().union(*(v[3] for v in shapes.values()))
    assert all(abs(v[5]) < v[2] for v in shapes.values())                 # mixed motor directions in each


def test_recorder_writes_a_bag_with_a_labs_habits(lab_recording):
    out, info = lab_recording
    nominal, truth = load_structure(out / "nominal.yaml"), load_structure(out / "truth.yaml")
    rec = read_robot_bag(out / "bag")
    habits = I.LabHabits()
    assert rec.motor_names == tuple(a.name for a in nominal.actuators)
    assert 78 < len(rec.motor_times) / rec.duration_s < 82 and 118 < len(rec.marker_times) / rec.duration_s < 122
    # mocap stamps run late by the mocap latency: a motor-to-mocap delay
    assert rec.marker_times[0] - rec.motor_times[0] == pytest.approx(habits.mocap_latency_s, abs=1e-6)
    # encoder ticks: every angle a whole number of 2 pi / 4096, starting at the (non-zero) zero offsets
    ticks = rec.motor_angles / (2 * math.pi / I.TICKS_PER_REV)
    assert np.allclose(ticks, np.round(ticks), atol=1e-6)
    zero = np.array([a.zero_offset for a in nominal.actuators])
    assert np.all(np.abs(zero) > 0.3) and np.allclose(rec.motor_angles[0], zero, atol=2 * math.pi / 4096)
    # markers: unlabelled, 5 % occluded, 1 mm noise, in a Y-up yawed frame
    n = len(nominal.nodes)
    sizes = np.array([len(m) for m in rec.markers])
    assert sizes.max() == n and 0.03 < 1 - sizes.mean() / n < 0.07
    T = np.array(info["true_mocap_transform"])
    fixed = np.array([nominal.node_index(f) for f in nominal.fixed_nodes])
    P = np.array([nd.position for nd in nominal.nodes])
    world = [(m - T[:3, 3]) @ T[:3, :3] for m in rec.markers]             # back to the structure frame
    first_label = [int(np.argmin(np.linalg.norm(P - w[0], axis=1))) for w in world[:50]]
    assert len(set(first_label)) > 3                                       # row 0 is a different node frame to frame
    fixed_err = [np.min(np.linalg.norm(w[:, None] - P[fixed][None], axis=2), axis=0) for w in world]
    fixed_err = np.concatenate(fixed_err)
    fixed_err = fixed_err[fixed_err < 0.01]
    assert 1.2e-3 < np.sqrt(np.mean(fixed_err ** 2)) < 2.2e-3              # 3-D noise of 1 mm per axis: 1.73 mm
    up = T[:3, :3] @ np.array([0.0, 0.0, 1.0])
    assert np.allclose(up, [0, 1, 0])                                      # structure z is mocap y
    assert abs(math.degrees(math.atan2(-T[2, 0], T[0, 0])) - habits.yaw_deg) < 1e-6   # and yawed about it
    # the truth is off the nominal by exactly the suite's spreads
    for st_t, st_n in zip(truth.strings, nominal.strings):
        assert abs(st_t.stiffness / st_n.stiffness - 1) == pytest.approx(0.2)
        assert abs(st_t.damping / st_n.damping - 1) == pytest.approx(0.2)
        assert abs(st_t.rest_length - st_n.rest_length) == pytest.approx(0.002)
    for b_t, b_n in zip(truth.bars, nominal.bars):
        assert abs(b_t.mass / b_n.mass - 1) == pytest.approx(0.02)
    assert info["slack_strings"] == [] and info["node_excursion_mm"] > 10


def test_recorder_hides_markers_in_bursts(tmp_path):
    """``occlusion_burst_s``: a marker drops out for runs of that mean length (a bar passing in front of it), the
    same fraction of the time; seen through the labeller, whose invalid runs are the dropouts."""
    from tensegrity_ros.mocap import IngestConfig, LabellerConfig, ingest_markers
    from tensegrity_ros.commands._common import load_mocap_frame
    from tensegrity_ros.frames import invert_transform
    habits = dataclasses.replace(I.LabHabits(), occlusion=0.2, occlusion_burst_s=0.25)
    I.record(I.load_suite_structure("prism4_fixed"), tmp_path, seed=0, duration_s=8.0, habits=habits)
    rec = read_robot_bag(tmp_path / "bag")
    n = len(load_structure(tmp_path / "nominal.yaml").nodes)
    assert 0.14 < 1 - np.mean([len(m) for m in rec.markers]) / n < 0.26
    guess = invert_transform(load_mocap_frame(tmp_path / "mocap_guess.yaml").matrix)
    s = ingest_markers(load_structure(tmp_path / "nominal.yaml"), rec.marker_times, rec.markers,
                       IngestConfig(labeller=LabellerConfig(initial_transform=guess)))
    first = int(np.argmax(s.valid.all(axis=1)))              # registered
    runs = []
    for col in (~s.valid[first:]).T:
        edges = np.flatnonzero(np.diff(np.r_[0, col.astype(int), 0]))
        runs += list((edges[1::2] - edges[::2]) / habits.mocap_hz)
    assert len(runs) > 20 and 0.15 < np.mean(runs) < 0.4, (len(runs), np.mean(runs))


def _rollout_error_mm(structure_for_engine, truth, traj, drive, k0: int, samples: int, sub: int = 4):
    """Engine (implicit, ``sub`` steps per 240-Hz sample) from the recording's state at sample k0 for ``samples``
    samples, against the recording: (RMS, max) node distance in mm."""
    eng = make_engine(structure_for_engine, "nodal", "implicit")
    s0 = eng.initial_state(torch.as_tensor(traj.positions[k0]), torch.as_tensor(traj.velocities[k0]))
    dt = 1.0 / (I.SAMPLE_HZ * sub)
    t = traj.times[k0] + dt * np.arange(samples * sub)
    u, ud = drive.angles(truth.actuators, t)
    inp = Inputs(motor_angles=torch.as_tensor(u).unsqueeze(1), motor_velocities=torch.as_tensor(ud).unsqueeze(1))
    x = eng.rollout(eng.default_params(), s0, inp, dt).positions[:, 0].numpy()[sub - 1::sub]
    e = np.linalg.norm(x - traj.positions[k0 + 1:k0 + 1 + samples], axis=-1)
    return float(1e3 * np.sqrt(np.mean(e ** 2))), float(1e3 * e.max())


@pytest.mark.parametrize("name", I.SUITE)
def test_engine_agrees_with_the_independent_model(name):
    """Noise off, the engine's law matching: a 1-s engine rollout from the true parameters follows the independent
    MuJoCo recording to well under a millimetre (measured 0.01-0.02 mm RMS, 0.03-0.06 mm max); the same rollout
    with the actuated strings' law swapped (cord <-> spring) is 14-35x further off (0.29-0.50 mm RMS), so the
    check sees the law. The slow families only, so that the law is the only thing under test (the fast ones and
    the bars' inertia: the next test)."""
    nominal = I.load_suite_structure(name)
    truth = I.draw_truth(nominal, seed=0)
    drive = I.suite_drive(nominal, 4.0, periods_s=(1.9, 0.7), weights=(1.0, 0.4))
    traj = I.simulate(truth, drive, 2.6)
    k0, n = int(1.5 * I.SAMPLE_HZ), int(I.SAMPLE_HZ)
    assert 1e3 * np.abs(traj.positions[k0:k0 + n] - traj.positions[k0]).max() > 10     # it does move (cm)
    assert traj.tensions.min() > 0                                                      # every string taut
    rms, worst = _rollout_error_mm(truth, truth, traj, drive, k0, n)
    flip = {"cord": "spring", "spring": "cord"}
    wrong = dataclasses.replace(truth, strings=tuple(
        dataclasses.replace(s, stiffness_law=flip[s.stiffness_law]) if s.actuator else s for s in truth.strings))
    rms_wrong, _ = _rollout_error_mm(wrong, truth, traj, drive, k0, n)
    print(f"{name}: engine vs independent MuJoCo over 1 s: RMS {rms:.3f} mm, max {worst:.3f} mm; "
          f"wrong law: RMS {rms_wrong:.3f} mm")
    assert rms < 0.1 and worst < 0.3
    assert rms_wrong > 5 * rms


@pytest.mark.parametrize("name", I.SUITE)
def test_stated_bar_inertia_matches_the_independent_capsules(name):
    """The suite's files state each bar's inertia, computed from its capsule geometry by the lab's formula
    (``independent.capsule_inertia``); MuJoCo computes its capsules' inertia itself. With the suite's fast families
    in the drive, a 1-s engine rollout (0.26-ms steps) from the truth follows the independent recording to
    0.014-0.021 mm RMS; the same bars as thin rods (m L^2 / 12, 4-5 % less) are 0.14-0.85 mm off (10-40x)."""
    nominal = I.load_suite_structure(name)
    assert all(b.inertia is not None for b in nominal.bars)
    truth = I.draw_truth(nominal, seed=0)
    drive = I.suite_drive(nominal, 4.0)
    traj = I.simulate(truth, drive, 2.6)
    k0, n = int(1.5 * I.SAMPLE_HZ), int(I.SAMPLE_HZ)
    # 0.26-ms steps: at the 4-step default the engine's own first-order error (0.07 mm on the prism) would hide
    # the inertia's effect there
    rms, worst = _rollout_error_mm(truth, truth, traj, drive, k0, n, sub=16)
    thin = dataclasses.replace(truth, bars=tuple(dataclasses.replace(b, inertia=None) for b in truth.bars))
    rms_thin, _ = _rollout_error_mm(thin, truth, traj, drive, k0, n, sub=16)
    print(f"{name}: engine vs independent MuJoCo, fast drive: stated inertia RMS {rms:.3f} mm (max {worst:.3f}); "
          f"thin rods RMS {rms_thin:.3f} mm")
    assert rms < 0.05 and worst < 0.15
    assert rms_thin > 5 * rms


def test_capsule_inertia_formula_matches_mujoco():
    """The lab's capsule formula against MuJoCo's own capsule inertia (one free body)."""
    import mujoco
    for L, r, m in ((0.45, 0.008, 0.25), (0.3, 0.02, 0.1)):
        xml = (f'<mujoco><worldbody><body><freejoint/><geom type="capsule" fromto="0 0 {-L / 2} 0 0 {L / 2}" '
               f'size="{r}" mass="{m}"/></body></worldbody></mujoco>')
        model = mujoco.MjModel.from_xml_string(xml)
        assert I.capsule_inertia(m, L, r) == pytest.approx(model.body_inertia[1][0], rel=1e-9)


@pytest.fixture(scope="module")
def identified(lab_recording, tmp_path_factory):
    """`tensegrity identify` as a lab runs it (its rough mocap guess, --estimate-delay, its prior; one worker; a
    report) on the tower recording: (score against the truth, identify's console output, exit code, report folder)."""
    out, _ = lab_recording
    params = tmp_path_factory.mktemp("identified") / "identified.yaml"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["identify", str(out / "bag"), "--model", str(out / "nominal.yaml"), "--mocap-frame",
                   str(out / "mocap_guess.yaml"), "--out", str(params), "--noise-mm", "1", "--estimate-delay",
                   "--prior-std", LAB_PRIOR, "--workers", "1", "--report", str(params.parent / "report")])
    assert params.exists(), buf.getvalue()[-2000:]
    s = score(load_structure(out / "truth.yaml"), load_structure(out / "nominal.yaml"), load_structure(params))
    print({k: (round(v["median"], 5), round(v["nominal_median"], 5), v["z_rms"]) for k, v in s["kinds"].items()},
          s["inside_2sigma"])
    return s, buf.getvalue(), rc, params.parent / "report"


def test_identify_meets_item_6s_targets_on_a_labs_recording_of_the_tower(identified):
    """Issue 17 item 6 on the suite's 24 s of the tower, as a lab runs identify (measured 2026-11-29, this fixture:
    stiffness 2.0 %, damping 14.5 %, mass 0.62 %, rest length 0.15 mm against the nominal's 16.7 %, 25 %, 2 %, 2 mm;
    100 % of 66 truths inside +-2 sigma, z RMS 0.59-0.90 per kind; bench_generality's seed 0 to every digit): it
    labels the shuffled markers in the yawed Y-up frame, finds the delay, moves every kind closer to the truth than
    the nominal (by a 10 % margin, so that a kind left at its prior cannot pass by rounding), meets every target,
    and reports sigmas that hold the truth (>= 90 % inside +-2 sigma, z RMS per kind in [0.5, 2]); the model check
    passes and identify exits 0.

    Damping is the narrow one. Until stop 38 this test recorded 12 s (14.4 %); the suite itself records 24 s
    (bench_generality), where this seed is at 14.5 % (10.8 % with ``--bridge-occlusions``, which draws other windows
    from the same recording); on seeds 1 and 2 the tower's median damping stays at 16.7 %, the prior's distance, so
    this target holds for this recording, not for every one."""
    s, text, rc, _ = identified
    assert rc == 0 and "MODEL MISMATCH" not in text, text[-2000:]
    assert LawCheck.verdict_in(text) in ("file_law_better", "no_clear_difference")   # the check ran, file kept
    delay = [ln for ln in text.splitlines() if ln.strip().startswith("delay_s")]
    assert delay and abs(float(delay[0].split()[1]) - I.LabHabits().mocap_latency_s) < 0.003
    for kind, k in s["kinds"].items():
        assert k["median"] < 0.9 * k["nominal_median"], (kind, k)
        assert k["median"] < TARGETS[kind], (kind, k["median"], TARGETS[kind])
        assert Z_RMS_RANGE[0] <= k["z_rms"] <= Z_RMS_RANGE[1] and k["z_rms_in_range"], (kind, k["z_rms"])
    assert s["inside_2sigma"] >= COVERAGE_TARGET


def test_the_report_on_a_labs_robot_shows_its_nodes(lab_recording, identified):
    """A lab's own robot has none of the manipulator's plates, and its report used to have no measured-against-
    predicted plot at all: now `nodes.png` shows the nodes that move most; every parameter of the model is in the
    tables, and summary.json carries the verdicts."""
    from tensegrity_ros.engine import params_from_structure
    out, _ = lab_recording
    report = identified[3]
    names = {p.name for p in report.iterdir()}
    assert {"nodes.png", "residuals.png", "convergence.png", "parameters.csv", "summary.json"} <= names, names
    assert "plates.png" not in names
    listed = {row.split(",")[0] for row in (report / "parameters.csv").read_text().splitlines()[1:]}
    assert set(params_from_structure(load_structure(out / "nominal.yaml")).named()) <= listed
    assert "model_mismatch" in json.loads((report / "summary.json").read_text())


def test_a_wrong_model_is_flagged_on_a_labs_recording(lab_recording, identified, tmp_path):
    """Issue 17 item 2 on the suite: the tower's structure file with one motor's direction flipped (a lab's
    wiring or sign slip) is flagged as a model mismatch, and the right file is not (the fixture above). One
    short fit is enough to see it (13 s), and `identify` exits 3 (degraded), having written its file. Measured
    2026-11-26 on the prism with the full default ladder: the flipped file left a structured residual (lag-1
    +0.41, 0.81 mm structured, ratio 1.29), the right one ratio 1.04, lag-1 +0.10. The actuated strings' law
    swapped leaves the residual check unmoved on the suite (ratio 1.00-1.07): the string-law check sees it
    (the next test)."""
    out, _ = lab_recording
    _, right_text, right_rc, _ = identified
    assert "MODEL MISMATCH" not in right_text and right_rc == 0
    nominal = load_structure(out / "nominal.yaml")
    a0 = nominal.actuators[0]
    wrong = dataclasses.replace(nominal, actuators=(dataclasses.replace(a0, direction=-a0.direction),)
                                + tuple(nominal.actuators[1:]))
    from tensegrity_ros.model import dump_structure
    dump_structure(wrong, tmp_path / "wrong.yaml")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["identify", str(out / "bag"), "--model", str(tmp_path / "wrong.yaml"), "--mocap-frame",
                   str(out / "mocap_guess.yaml"), "--out", str(tmp_path / "p.yaml"), "--noise-mm", "1",
                   "--estimate-delay", "--prior-std", LAB_PRIOR, "--workers", "1", "--longer-windows", "none",
                   "--holdout", "0", "--no-step-check"])      # the model check is the question; 2x faster without
    text = buf.getvalue()
    assert "MODEL MISMATCH" in text, [ln for ln in text.splitlines() if "model check" in ln]
    assert rc == 3 and (tmp_path / "p.yaml").exists(), text[-2000:]     # degraded, but nothing lost


def test_a_swapped_string_law_is_named_on_a_labs_recording(tmp_path_factory):
    """Issue 17 item 2, the string law: 12 s of the icosahedron (seed 1; its actuated strings s1, s7 cord and s5
    spring), identified as a lab runs identify from a file whose actuated strings have the other law. The
    residual check does not see it (ratio 1.07, lag-1 +0.13, measured 2026-11-27); the string-law check refits the
    other law and names it (the file's law 16 % worse in mean squared error over six 1-s windows, ~60 sigma), and
    identify exits 3 with its file written. Measured with bench_generality on seeds 0 and 1 (right file / swapped
    file): prism and icosahedron right / named on both seeds (3.5-62 sigma); the tower undecided on seed 0
    (2.2 sigma, limit 3). The right file is not named on the tower (the `identified` fixture exits 0)."""
    from tensegrity_ros.ident.lawcheck import swap_actuated_laws
    from tensegrity_ros.model import dump_structure
    out = tmp_path_factory.mktemp("icosa6")
    I.record(I.load_suite_structure("icosa6_fixed3"), out, seed=1, duration_s=12.0)
    swapped, strings = swap_actuated_laws(load_structure(out / "nominal.yaml"))
    assert strings == ("s1", "s5", "s7")
    dump_structure(swapped, out / "swapped.yaml")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["identify", str(out / "bag"), "--model", str(out / "swapped.yaml"), "--mocap-frame",
                   str(out / "mocap_guess.yaml"), "--out", str(out / "p.yaml"), "--noise-mm", "1",
                   "--estimate-delay", "--prior-std", LAB_PRIOR])
    text = buf.getvalue()
    lines = [ln for ln in text.splitlines() if "string-law" in ln or "STRING LAW" in ln]
    print("\n".join(lines[-1:]))
    assert LawCheck.verdict_in(text) == "other_law_better", lines
    assert "s1 cord, s5 spring, s7 cord" in lines[-1]                 # it names the laws the robot has
    assert rc == 3 and (out / "p.yaml").exists(), text[-2000:]


def test_the_prior_stays_on_the_model_file_when_stage_2_starts_from_stage_1(tmp_path):
    """Issue 17 items 4 and 5: the prior is what the user's file says. On a noise-free recording of the prism stage 1
    (smoothed accelerations, blind to the fast modes) puts single masses 18-23 % off and still out-predicts the
    20 %-off nominal on 0.1-s windows, so stage 2 starts there. Until stop 30 the stage-2 prior was centred on that
    start: the bars, weighed to 2 %, were held 2 % around stage 1's masses, and the default ladder ended 13 % off in
    mass (residual 0.093 mm against the truth's 0.014 mm). Centred on the file, the first rung alone brings every
    mass back inside 3 % of the truth (nominal: 2 %) and the stage-1 start is still taken (its note is absent)."""
    I.record(I.load_suite_structure("prism4_fixed"), tmp_path, seed=0, duration_s=12.0, habits=I.LabHabits.clean())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["identify", str(tmp_path / "bag"), "--model", str(tmp_path / "nominal.yaml"), "--mocap-frame",
                   str(tmp_path / "mocap_guess.yaml"), "--out", str(tmp_path / "p.yaml"), "--noise-mm", "1",
                   "--prior-std", LAB_PRIOR, "--workers", "1", "--longer-windows", "none", "--no-law-check"])
    text = buf.getvalue()
    assert (tmp_path / "p.yaml").exists(), text[-2000:]
    assert "stage 2 starts from the prior" not in text            # stage 1's start was taken: the case under test
    truth, fit = load_structure(tmp_path / "truth.yaml"), load_structure(tmp_path / "p.yaml")
    errors = {b.name: f.mass / b.mass - 1 for b, f in zip(truth.bars, fit.bars)}
    assert max(abs(e) for e in errors.values()) < 0.03, (errors, rc)


def test_the_score_holds_sigmas_to_the_errors():
    """Issue 17 item 3's z-score range is part of the suite's targets: an estimate 0.2 % off the truth everywhere
    (0.002 mm for rest lengths) misses them with sigmas of 1 % (z RMS 0.2: too wide to be of use) and of 0.09 %
    (z RMS 2.2: too narrow for the errors), and meets them with 0.2 % (z RMS 1)."""
    from tensegrity_ros.param_names import join_name
    truth = I.draw_truth(I.load_suite_structure("prism4_fixed"), 0)
    nominal = I.load_suite_structure("prism4_fixed")

    def off(sigma):
        strings = tuple(dataclasses.replace(s, stiffness=1.002 * s.stiffness, damping=1.002 * s.damping,
                                            rest_length=s.rest_length + 2e-6) for s in truth.strings)
        bars = tuple(b.with_mass(1.002 * b.mass) for b in truth.bars)
        std = tuple((join_name(e.name, k), sigma * (1e-3 if k == "rest_length" else getattr(e, k)))
                    for k, group in (("stiffness", strings), ("damping", strings), ("rest_length", strings),
                                     ("mass", bars)) for e in group)
        return dataclasses.replace(truth, strings=strings, bars=bars, std_devs=std)
    wide, narrow, right = (score(truth, nominal, off(sig)) for sig in (0.01, 0.0009, 0.002))
    assert all(k["z_rms"] == pytest.approx(0.2, rel=3e-3) for k in wide["kinds"].values())
    assert not any(k["z_rms_in_range"] for k in wide["kinds"].values()) and not wide["meets_targets"]
    assert not narrow["kinds"]["stiffness"]["z_rms_in_range"] and not narrow["meets_targets"]
    assert all(k["z_rms_in_range"] for k in right["kinds"].values()) and right["meets_targets"]
    assert Z_RMS_RANGE == (0.5, 2.0)
