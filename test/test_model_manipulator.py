"""The stacked manipulator's structure file: generated, complete, and a taut equilibrium under gravity."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros.model import CoincidentConstraint, MidpointConstraint, load_structure
from tensegrity_ros.model import manipulator as gen

PATH = Path(__file__).resolve().parents[1] / "config" / "models" / "stacked_manipulator.yaml"


@pytest.fixture(scope="module")
def s():
    return load_structure(PATH)


@pytest.fixture(scope="module")
def generated():
    return gen.stacked_manipulator()


def test_file_matches_generator(s, generated):
    """Regenerate with `python -m tensegrity_ros.model.manipulator` if this fails."""
    assert s.node_names == generated.node_names
    np.testing.assert_allclose([n.position for n in s.nodes], [n.position for n in generated.nodes], atol=1e-7)
    assert [(b.name, b.nodes, b.mass, b.radius) for b in s.bars] == \
        [(b.name, b.nodes, b.mass, b.radius) for b in generated.bars]
    for a, b in zip(s.strings, generated.strings):
        assert (a.name, a.nodes, a.actuator, a.closed, a.damping) == (b.name, b.nodes, b.actuator, b.closed, b.damping)
        assert a.rest_length == pytest.approx(b.rest_length, abs=1e-7)
        assert a.stiffness == pytest.approx(b.stiffness, rel=1e-6)
    assert s.actuators == generated.actuators and s.constraints == generated.constraints


def test_counts_match_the_seed(s):
    virtual = [n for n in s.node_names if "_v" in n]
    physical = [n for n in s.node_names if "_v" not in n]
    assert physical == [f"n{i}" for i in range(1, 25)] and len(virtual) == 12            # mu, nu
    assert len(s.bars) == 18                                                              # beta
    assert [st.name for st in s.strings] == [f"sc{i}" for i in range(1, 15)]              # sigma_c
    assert sum(len(st.segments) for st in s.strings) == 36                                # sigma_s
    assert len(s.fixed_nodes) + len(s.constraints) == 18 and s.fixed_nodes == ("n1", "n2", "n3")  # phi
    assert [a.motor_id for a in s.actuators] == [1, 2, 3, 4, 5, 6]                        # alpha
    assert [a.model for a in s.actuators] == ["l54-50-s290-r"] * 3 + ["m42-10-s260-r"] * 3
    assert s.string("sc7").closed and s.string("sc14").closed and len(s.string("sc7").nodes) == 6
    assert [st.actuator for st in s.strings] == ["m1", "m2", "m3", None, None, None, None,
                                                 "m4", "m5", "m6", None, None, None, None]
    assert "n10" in s.bar("b4").nodes
    mids = [c for c in s.constraints if isinstance(c, MidpointConstraint)]
    assert [(c.node, set(c.between)) for c in mids] == [("n13", {"n11", "n12"}), ("n14", {"n10", "n12"}),
                                                         ("n15", {"n10", "n11"})]
    assert sum(isinstance(c, CoincidentConstraint) for c in s.constraints) == 12
    assert s.gravity == (0.0, 0.0, -9.81)


def test_sizes_and_masses(s):
    for i in range(1, 13):
        b = s.bar(f"b{i}")
        length, mass = (0.95, 0.29) if i <= 6 else (0.50, 0.11)
        assert s.bar_length(b) == pytest.approx(length, abs=1e-8) and b.mass == mass
    assert sum(s.bar(f"b{i}").mass for i in (13, 14, 15)) == pytest.approx(2.7)
    assert sum(s.bar(f"b{i}").mass for i in (16, 17, 18)) == pytest.approx(0.33)
    p = {n.name: np.array(n.position) for n in s.nodes}
    for tri, r in ((("n1", "n2", "n3"), 0.26), (("n10", "n11", "n12"), 0.26), (("n22", "n23", "n24"), 0.13),
                   (("n13", "n14", "n15"), 0.13)):
        c = sum(p[n] for n in tri) / 3
        assert [np.linalg.norm(p[n] - c) for n in tri] == pytest.approx([r] * 3, abs=1e-8)


def test_prestressed_equilibrium_all_taut(s):
    x = np.array([n.position for n in s.nodes[:24]])
    paths = gen.string_paths(x)
    assert [tuple(f"n{i + 1}" for i in p[2]) for p in paths] == [st.nodes for st in s.strings]
    lengths, _ = gen._lengths_grads(x, paths)
    tension = np.array([st.stiffness * (L - st.rest_length) for st, L in zip(s.strings, lengths)])
    assert tension.min() > 10.0
    residual, lam = gen.equilibrium_residual(x, tension, paths)
    assert np.abs(residual).max() < 1e-3  # N, after rounding the file to 1e-9 m
    assert lam[:12].min() > 0  # real bars in compression
    freqs = gen.natural_frequencies(x, tension, np.array([st.stiffness for st in s.strings]))
    assert np.all(np.isfinite(freqs)) and freqs[0] > 1.0  # stable, first mode above 1 Hz


def test_drive_amplitudes_within_limits(s):
    for a, amp in zip(s.actuators, [0.0363] * 3 + [0.0168] * 3):
        angle = amp / a.spool_radius
        assert a.limits[0] < -1.5 * angle and 1.5 * angle < a.limits[1]
    assert all(a.zero_offset == 0.0 and a.direction == 1 for a in s.actuators)
    assert "ASSUMED" in s.description and "Form-finding" in s.notes and math.isfinite(len(s.notes))


def test_seed_drive_is_smooth_periodic_and_taut(s):
    """Full seed drive on the twin: 2 s ramp + 3 periods; period 3 repeats period 2 (the first carries the ramp's
    transient, which the light damping lets ring for a few seconds), little energy above 1 Hz,
    every string keeps > 10% of its rest tension, motor torques stay plausible."""
    from tensegrity_ros.frames import manipulator_relative_poses
    from tensegrity_ros.references import load_reference, motor_angles
    from tensegrity_ros.twin import simulate

    ref = load_reference(PATH.parents[1] / "references" / "seed_sinusoids.yaml", s.actuators)
    hz, period, ramp = 60, 7.0, 2.0
    traj = simulate(s, lambda t: motor_angles(ref, s.actuators, np.atleast_1d(t))[0], ramp + 3 * period,
                    record_hz=hz, timestep=0.001, progress=False)
    x = np.array([n.position for n in s.nodes[:24]])
    lengths, _ = gen._lengths_grads(x, gen.string_paths(x))
    rest_tension = np.array([st.stiffness * (L - st.rest_length) for st, L in zip(s.strings, lengths)])
    assert (traj.tensions.min(0) > 0.1 * rest_tension).all()
    act = [i for i, st in enumerate(s.strings) if st.actuator]
    torque = traj.tensions[:, act].max(0) * np.array([a.spool_radius for a in s.actuators])
    assert (torque[:3] < 25.0).all() and (torque[3:] < 4.0).all()
    poses = manipulator_relative_poses(traj.positions, s.node_names)
    k0, n = int((ramp + period) * hz), int(period * hz)
    for key in ("0C1", "0C2"):
        p = np.asarray(poses[key])
        p1, p2 = p[k0:k0 + n, :3], p[k0 + n:k0 + 2 * n, :3]
        diff = np.linalg.norm(p1 - p2, axis=1)
        assert diff.max() < 0.012 and np.sqrt((diff ** 2).mean()) < 0.003  # m: single-valued in drive phase
        assert np.degrees(np.abs(p[k0:k0 + n, 3:] - p[k0 + n:k0 + 2 * n, 3:]).max()) < 1.5
        q = p[k0:, :3] - p[k0:, :3].mean(0)
        power = (np.abs(np.fft.rfft(q, axis=0)) ** 2).sum(1)
        freq = np.fft.rfftfreq(len(q), 1.0 / hz)
        # ~8% measured: the light damping (sized for the explicit engine) leaves some 2.7-Hz sway ringing
        assert power[freq > 1.0].sum() < 0.10 * power[1:].sum()
        excursion = (p[k0:, :3].max(0) - p[k0:, :3].min(0)) / 2
        assert 0.01 < excursion[:2].max() < 0.15  # tens of mm, not hundreds
