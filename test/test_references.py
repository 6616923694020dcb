"""Phase-shifted sinusoidal references: seed values, C1 ramps, angle conversion, YAML validation."""
import math
from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros.model import Actuator
from tensegrity_ros.references import (ReferenceConfigError, ReferenceLimitError, SinusoidReference,
                                       displacement_from_motor_angles, envelope, load_reference,
                                       motor_angles, motor_velocities, seed_reference, string_displacement,
                                       string_velocity)

REF_DIR = Path(__file__).resolve().parents[1] / "config" / "references"


def _acts(n=6):
    # Mixed directions, radii and zero offsets so the conversion is really exercised.
    return tuple(Actuator(f"m{i + 1}", i + 1, spool_radius=0.01 + 0.002 * i, direction=(1 if i % 2 else -1),
                          zero_offset=0.1 * i, limits=(-20.0, 20.0)) for i in range(n))


def test_seed_file_matches_paper_values():
    ref = load_reference(REF_DIR / "seed_sinusoids.yaml", actuators=_acts())
    assert ref.actuator_names == ("m1", "m2", "m3", "m4", "m5", "m6")
    assert ref.period_s == 7.0
    np.testing.assert_allclose(ref.amplitudes_m, [0.0363] * 3 + [0.0168] * 3)
    np.testing.assert_allclose(ref.phases_rad, [2 * math.pi / 3, 0, -2 * math.pi / 3] * 2, atol=1e-12)
    assert ref == seed_reference(duration_s=42.0)
    short = load_reference(REF_DIR / "seed_sinusoids_short.yaml")
    assert short.duration_s == 8.0 and short.amplitudes_m == ref.amplitudes_m


def test_phases_amplitudes_and_period():
    ref = seed_reference(duration_s=None, ramp_s=1.0)
    t = np.arange(7.0, 21.0, 0.001)  # steady part, two whole periods
    d = string_displacement(ref, t)
    np.testing.assert_allclose(d.max(axis=0), ref.amplitudes_m, rtol=1e-5)
    np.testing.assert_allclose(d.min(axis=0), -np.asarray(ref.amplitudes_m), rtol=1e-5)
    # periodic with 7 s
    np.testing.assert_allclose(string_displacement(ref, t + 7.0), d, atol=1e-12)
    # phase: actuator 0 leads actuator 1 by 2pi/3, i.e. reaches its peak period/3 earlier
    i0, i1, i2 = (np.argmax(d[: 7000, k]) for k in range(3))
    assert ((i1 - i0) * 0.001) % 7.0 == pytest.approx(7.0 / 3.0, abs=2e-3)
    assert ((i2 - i1) * 0.001) % 7.0 == pytest.approx(7.0 / 3.0, abs=2e-3)
    # the three phases of one stage sum to zero at all times (balanced three-phase drive)
    np.testing.assert_allclose(d[:, :3].sum(axis=1), 0.0, atol=1e-12)


def test_ramp_is_c1_and_zero_at_ends():
    ref = SinusoidReference(period_s=7.0, amplitudes_m=(0.03, 0.02), phases_rad=(1.0, -0.5),
                            offsets_m=(0.005, 0.0), ramp_in_s=2.0, ramp_out_s=1.5, start_s=1.0, duration_s=12.0)
    eps = 1e-7
    boundaries = [1.0, 3.0, 1.0 + 12.0 - 1.5, 13.0]
    for tb in boundaries:
        lo, hi = string_displacement(ref, [tb - eps, tb + eps])
        np.testing.assert_allclose(lo, hi, atol=1e-8)  # continuous value
        vlo, vhi = string_velocity(ref, [tb - eps, tb + eps])
        np.testing.assert_allclose(vlo, vhi, atol=1e-6)  # continuous derivative
    for tb in (1.0, 13.0):  # rest at both ends
        np.testing.assert_allclose(string_displacement(ref, [tb]), 0.0, atol=1e-15)
        np.testing.assert_allclose(string_velocity(ref, [tb]), 0.0, atol=1e-15)
    np.testing.assert_allclose(string_displacement(ref, [0.0, 0.99, 13.5, 100.0]), 0.0)
    e = envelope(ref, np.linspace(0, 14, 1401))
    assert e.min() == 0.0 and e.max() == 1.0
    # the analytic velocity is the derivative of the displacement everywhere
    t = np.linspace(0.0, 14.0, 14001)
    num = np.gradient(string_displacement(ref, t), t, axis=0)
    np.testing.assert_allclose(string_velocity(ref, t)[1:-1], num[1:-1], atol=2e-5)


def test_angle_conversion_round_trip_and_contract():
    acts = _acts()
    ref = seed_reference(duration_s=10.0)
    t = np.linspace(0, 10, 501)
    u = motor_angles(ref, acts, t)
    d = string_displacement(ref, t)
    np.testing.assert_allclose(displacement_from_motor_angles(acts, u), d, atol=1e-15)
    # CONTRACTS.md: xi0 = xi00 + direction * spool_radius * (u - zero_offset)
    a = acts[0]
    np.testing.assert_allclose(a.direction * a.spool_radius * (u[:, 0] - a.zero_offset), d[:, 0], atol=1e-15)
    np.testing.assert_allclose(u[0], [x.zero_offset for x in acts])  # rest = zero offsets
    w = motor_velocities(ref, acts, t)
    np.testing.assert_allclose(w * np.array([x.direction * x.spool_radius for x in acts]),
                               string_velocity(ref, t), atol=1e-15)
    # columns follow the reference's names, not the order the actuators are given in
    np.testing.assert_allclose(motor_angles(ref, acts[::-1], t), u)


def test_select_actuators():
    from tensegrity_ros.references import select_actuators
    ref = seed_reference(duration_s=10.0)
    sub = select_actuators(ref, ["m5", "m1"])
    t = np.linspace(0, 10, 50)
    np.testing.assert_array_equal(string_displacement(sub, t), string_displacement(ref, t)[:, [4, 0]])
    with pytest.raises(ReferenceConfigError, match="m9"):
        select_actuators(ref, ["m9"])


def test_limits_are_checked():
    tight = tuple(Actuator(f"m{i + 1}", i + 1, spool_radius=0.01, limits=(-1.0, 1.0)) for i in range(6))
    with pytest.raises(ReferenceLimitError, match=r"actuators\.m1.*outside limits"):
        motor_angles(seed_reference(), tight, np.linspace(0, 20, 100))
    with pytest.raises(ReferenceLimitError, match="seed_sinusoids.yaml: actuators.m1"):
        load_reference(REF_DIR / "seed_sinusoids.yaml", actuators=tight)


@pytest.mark.parametrize("patch, key, words", [
    ({"period_s": -7.0}, "period_s", "must be > 0"),
    ({"period_s": "seven"}, "period_s", "finite number"),
    ({"duration_s": 1.5}, "duration_s", "shorter than ramp"),
    ({"bogus": 1}, "bogus", "unknown key"),
    ({"stages": []}, "stages", "non-empty list"),
    ({"stages": [{"actuators": ["m1", "m2"], "amplitude_m": [0.01], "phases_deg": [0, 90]}]},
     "stages[0].amplitude_m", "expected 2 values"),
    ({"stages": [{"actuators": ["m1"], "amplitude_m": -0.01, "phases_deg": 0}]},
     "stages[0].amplitude_m", ">= 0"),
    ({"stages": [{"actuators": ["m1"], "amplitude_m": 0.01}]}, "stages[0].phases_rad", "exactly one"),
    ({"stages": [{"actuators": ["m1", "m1"], "amplitude_m": 0.01, "phases_rad": 0}]},
     "stages[0].actuators[1]", "listed twice"),
])
def test_yaml_errors_name_file_key_and_value(tmp_path, patch, key, words):
    import yaml
    data = yaml.safe_load((REF_DIR / "seed_sinusoids_short.yaml").read_text())
    data.update(patch)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ReferenceConfigError) as err:
        load_reference(path)
    msg = str(err.value)
    assert str(path) in msg and key in msg and words in msg, msg
    assert err.value.key == key


def test_unknown_actuator_and_unreadable_file(tmp_path):
    with pytest.raises(ReferenceConfigError, match=r"stages\[1\]\.actuators\[0\] = 'm4': not an actuator"):
        load_reference(REF_DIR / "seed_sinusoids.yaml", actuators=_acts(3))
    with pytest.raises(ReferenceConfigError, match="cannot read file"):
        load_reference(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("period_s: [1, 2\n")
    with pytest.raises(ReferenceConfigError, match="not valid YAML"):
        load_reference(tmp_path / "broken.yaml")
