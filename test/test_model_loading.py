"""Structure files: every validation error names the file, the key path and the offending value."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tensegrity_ros.model import StructureError, dump_structure, load_structure, structure_to_dict

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"
REFERENCE = ["spring_rod", "icosahedron", "icosahedron_spread", "stacked_manipulator"]


def _base() -> dict:
    """A small valid structure (two bars, three strings, one actuator, one coincidence)."""
    return {
        "name": "tiny",
        "gravity": [0.0, 0.0, -9.81],
        "nodes": [{"name": "a", "position": [0.0, 0.0, 0.0], "fixed": True},
                  {"name": "b", "position": [1.0, 0.0, 0.0]},
                  {"name": "c", "position": [1.0, 1.0, 0.0]},
                  {"name": "d", "position": [0.0, 1.0, 1.0]},
                  {"name": "d_v1", "position": [0.0, 1.0, 1.0]}],
        "bars": [{"name": "b1", "nodes": ["b", "c"], "mass": 1.0},
                 {"name": "b2", "nodes": ["d", "a"], "mass": 1.0}],
        "strings": [{"name": "s1", "nodes": ["a", "b"], "stiffness": 100.0, "damping": 1.0, "rest_length": 0.9},
                    {"name": "s2", "nodes": ["a", "c", "d"], "stiffness": 100.0, "rest_length": 2.0,
                     "actuator": "m1"},
                    {"name": "s3", "nodes": ["b", "d_v1"], "stiffness": 50.0, "rest_length": 1.5}],
        "constraints": [{"type": "coincident", "nodes": ["d", "d_v1"]}],
        "actuators": [{"name": "m1", "motor_id": 1, "spool_radius": 0.01},
                      {"name": "m2", "motor_id": 2, "spool_radius": 0.01}],
    }


def _write(tmp_path: Path, data, name="bad.yaml", text=None) -> Path:
    p = tmp_path / name
    p.write_text(text if text is not None else yaml.safe_dump(data, sort_keys=False))
    return p


def _error(tmp_path, data=None, text=None) -> StructureError:
    p = _write(tmp_path, data, text=text)
    with pytest.raises(StructureError) as info:
        load_structure(p)
    err = info.value
    assert str(p) in str(err), "message must name the file"
    return err


def test_base_is_valid(tmp_path):
    s = load_structure(_write(tmp_path, _base(), "ok.yaml"))
    assert s.name == "tiny" and len(s.strings) == 3 and s.fixed_nodes == ("a",)


def test_unknown_node(tmp_path):
    d = _base()
    d["strings"][0]["nodes"] = ["a", "zz"]
    err = _error(tmp_path, d)
    assert err.key == "strings[0].nodes[1]" and err.value == "zz"
    assert "strings[0].nodes[1]" in str(err) and "'zz'" in str(err) and "unknown node" in str(err)


def test_zero_length_bar(tmp_path):
    d = _base()
    d["nodes"][2]["position"] = [1.0, 0.0, 0.0]  # c on top of b
    err = _error(tmp_path, d)
    assert err.key == "bars[0].nodes" and "zero-length" in str(err) and "['b', 'c']" in str(err)


def test_negative_stiffness(tmp_path):
    d = _base()
    d["strings"][1]["stiffness"] = -5.0
    err = _error(tmp_path, d)
    assert err.key == "strings[1].stiffness" and err.value == -5.0 and "-5.0" in str(err) and "> 0" in str(err)


def test_string_through_same_node_twice(tmp_path):
    d = _base()
    d["strings"][1]["nodes"] = ["a", "c", "a"]
    err = _error(tmp_path, d)
    assert err.key == "strings[1].nodes[2]" and err.value == "a" and "twice" in str(err)


def test_duplicate_motor_id(tmp_path):
    d = _base()
    d["actuators"][1]["motor_id"] = 1
    err = _error(tmp_path, d)
    assert err.key == "actuators[1].motor_id" and err.value == 1 and "already used" in str(err) and "m1" in str(err)


def test_constraint_on_missing_node(tmp_path):
    d = _base()
    d["constraints"][0]["nodes"] = ["d", "ghost"]
    err = _error(tmp_path, d)
    assert err.key == "constraints[0].nodes[1]" and err.value == "ghost" and "'ghost'" in str(err)


def test_unknown_key(tmp_path):
    d = _base()
    d["bars"][1]["colour"] = "red"
    err = _error(tmp_path, d)
    assert err.key == "bars[1].colour" and err.value == "red" and "unknown key" in str(err)


def test_bad_yaml(tmp_path):
    err = _error(tmp_path, text="name: tiny\nnodes: [\n  - {name: a\n")
    assert err.key.startswith("line ") and "not valid YAML" in str(err)


def test_missing_file(tmp_path):
    with pytest.raises(StructureError) as info:
        load_structure(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value) and "cannot read" in str(info.value)


@pytest.mark.parametrize("name", REFERENCE)
def test_reference_files_load(name):
    s = load_structure(MODELS / f"{name}.yaml")
    assert s.name == name and s.nodes and s.bars and s.strings


@pytest.mark.parametrize("name", REFERENCE)
def test_dump_load_round_trip(tmp_path, name):
    s = load_structure(MODELS / f"{name}.yaml")
    out = tmp_path / f"{name}.yaml"
    dump_structure(s, out, header="round trip")
    back = load_structure(out)
    assert structure_to_dict(back) == structure_to_dict(s)
    assert back.notes == s.notes and back.description == s.description


def test_round_trip_of_edited_dict(tmp_path):
    d = copy.deepcopy(_base())
    s = load_structure(_write(tmp_path, d, "a.yaml"))
    dump_structure(s, tmp_path / "b.yaml")
    assert structure_to_dict(load_structure(tmp_path / "b.yaml")) == structure_to_dict(s)


def test_bar_mass_std_in_kg_or_percent_round_trips(tmp_path):
    """A bar's ``mass_std`` (issue 17 item 4): kg, or a percentage of its mass; held and written back in kg."""
    d = _base()
    d["bars"][0]["mass_std"] = "2%"
    d["bars"][1]["mass_std"] = 0.005
    s = load_structure(_write(tmp_path, d, "w.yaml"))
    assert s.bars[0].mass_std == pytest.approx(0.02) and s.bars[1].mass_std == pytest.approx(0.005)
    dump_structure(s, tmp_path / "back.yaml")
    back = load_structure(tmp_path / "back.yaml")
    assert [b.mass_std for b in back.bars] == pytest.approx([0.02, 0.005])
    assert load_structure(_write(tmp_path, _base(), "plain.yaml")).bars[0].mass_std is None
    assert "mass_std" not in (tmp_path / "plain.yaml").read_text()


def test_bar_inertia_round_trips_and_scales_with_an_identified_mass(tmp_path):
    """A bar's ``inertia`` (kg m^2 about its centre, perpendicular): written back as given; absent means the thin
    rod's m L^2 / 12; a changed mass (identification, perturbation) keeps rho = I / (m L^2)."""
    d = _base()
    s0 = load_structure(_write(tmp_path, d, "plain.yaml"))
    b0 = s0.bars[0]
    assert b0.inertia is None and s0.bar_inertia_ratio(b0) == pytest.approx(1 / 12)
    stated = 1.1 * b0.mass * s0.bar_length(b0) ** 2 / 12
    d["bars"][0]["inertia"] = stated
    s = load_structure(_write(tmp_path, d, "i.yaml"))
    assert s.bars[0].inertia == stated and s.bar_inertia_ratio(s.bars[0]) == pytest.approx(1.1 / 12)
    dump_structure(s, tmp_path / "back.yaml")
    assert load_structure(tmp_path / "back.yaml").bars[0].inertia == pytest.approx(stated)
    heavier = s.bars[0].with_mass(2 * s.bars[0].mass)
    assert heavier.inertia == pytest.approx(2 * stated)
    assert s.bar_inertia_ratio(heavier) == pytest.approx(1.1 / 12)
    assert "inertia" not in (tmp_path / "plain.yaml").read_text()


@pytest.mark.parametrize("value", [0, -1e-3, "big", True, 1e3])
def test_bad_bar_inertia_names_file_key_and_value(tmp_path, value):
    d = _base()
    d["bars"][1]["inertia"] = value
    err = _error(tmp_path, d)
    assert err.key == "bars[1].inertia"
    assert any(why in str(err) for why in ("kg m^2", "finite number", "> 0"))


@pytest.mark.parametrize("value", ["two", "x%", 0, -0.01, "0%", True, [0.01], float("inf")])
def test_bad_bar_mass_std_names_file_key_and_value(tmp_path, value):
    d = _base()
    d["bars"][1]["mass_std"] = value
    err = _error(tmp_path, d)
    assert err.key == "bars[1].mass_std" and "kg" in str(err) and "%" in str(err)
