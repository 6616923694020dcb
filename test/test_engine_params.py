"""Params: names, physical transforms, YAML and structure round trips; engine registry and API errors."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tensegrity_ros.engine import (KIND_NAMES, REST_LENGTH_BOUNDS, Inputs, apply_to_structure, from_unconstrained,
                                   load_params_yaml, make_engine, save_params_yaml, stack_params, to_unconstrained)
from tensegrity_ros.model import dump_structure, load_structure, structure_from_dict

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


def _actuated():
    import test_engine_autodiff as t  # the small structure with actuators and constraints
    return t.small_structure()


def test_names_map_one_to_one_to_elements():
    s = _actuated()
    p = make_engine(s).default_params()
    named = p.named()
    assert "s2.stiffness" in named and "b2.mass" in named and "m1.spool_radius" in named
    assert "m2.zero_offset" in named and "s7.rest_length" in named and "control_force_scalar" not in named
    assert len(named) == 3 * len(s.strings) + len(s.bars) + 2 * len(s.actuators)
    assert list(named) == p.names()
    assert float(named["s2.stiffness"]) == s.string("s2").stiffness
    assert float(named["m2.zero_offset"]) == s.actuator("m2").zero_offset
    rod = make_engine(load_structure(MODELS / "spring_rod.yaml"), "spring_rod").default_params()
    assert float(rod.named()["control_force_scalar"]) == 1.0 and "rod.mass" in rod.named()


def test_with_values_replace_and_errors():
    p = make_engine(_actuated()).default_params()
    q = p.with_values({"s1.stiffness": 120.0, "b2.mass": 3.0, "m1.zero_offset": -0.5})
    assert float(q.named()["s1.stiffness"]) == 120.0 and float(q.named()["b2.mass"]) == 3.0
    assert float(p.named()["s1.stiffness"]) != 120.0  # the original is untouched (frozen, copied)
    assert float(q.named()["m1.zero_offset"]) == -0.5
    with pytest.raises(ValueError, match="no element 'zz'"):
        p.with_values({"zz.stiffness": 1.0})
    with pytest.raises(ValueError, match="unknown parameter"):
        p.with_values({"s1.color": 1.0})
    with pytest.raises(ValueError, match="unknown parameter kind"):
        p.replace(colour=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.mass = p.mass  # type: ignore[misc]


def test_unconstrained_round_trip_and_physical_range():
    p = make_engine(_actuated()).default_params(batch=2)
    z = to_unconstrained(p)
    assert z.shape == (2, len(p.names()))
    back = from_unconstrained(z, p)
    for k in p.kinds():
        torch.testing.assert_close(getattr(back, k), getattr(p, k), rtol=1e-12, atol=1e-12)
    # any unconstrained vector gives physical params
    wild = from_unconstrained(torch.randn_like(z) * 30, p)
    for k in ("stiffness", "damping", "mass", "spool_radius"):
        assert bool((getattr(wild, k) > 0).all()), k
    lo, hi = REST_LENGTH_BOUNDS
    nom = torch.tensor(p.meta.nominal_rest_length, dtype=torch.float64)
    assert bool((wild.rest_length >= lo * nom).all() and (wild.rest_length <= hi * nom).all())
    with pytest.raises(ValueError, match="bounds"):
        to_unconstrained(p.replace(rest_length=2.0 * p.rest_length))
    assert set(p.kinds()) <= set(KIND_NAMES)


def test_yaml_round_trip(tmp_path):
    eng = make_engine(_actuated())
    p = eng.default_params().with_values({"s3.damping": 7.5, "m2.spool_radius": 0.011})
    save_params_yaml(p, tmp_path / "p.yaml")
    q = load_params_yaml(tmp_path / "p.yaml", eng.default_params())
    assert q.named().keys() == p.named().keys()
    for n, v in p.named().items():
        assert float(q.named()[n]) == pytest.approx(float(v), rel=1e-15), n
    pb = stack_params([p, p.with_values({"b1.mass": 2.0})])
    save_params_yaml(pb, tmp_path / "pb.yaml")
    qb = load_params_yaml(tmp_path / "pb.yaml", eng.default_params())
    assert tuple(qb.batch_shape) == (2,) and float(qb.named()["b1.mass"][1]) == 2.0
    (tmp_path / "bad.yaml").write_text("params: {s1.colour: 1.0}\n")
    with pytest.raises(ValueError):
        load_params_yaml(tmp_path / "bad.yaml", eng.default_params())


def test_apply_to_structure_writes_a_valid_structure_file(tmp_path):
    s = _actuated()
    eng = make_engine(s)
    p = eng.default_params().with_values({"s1.stiffness": 111.0, "b1.mass": 1.25, "s2.rest_length": 0.7,
                                          "m1.spool_radius": 0.021, "m2.zero_offset": 0.05})
    s2 = apply_to_structure(s, p, std_devs={"s1.stiffness": 3.0})
    dump_structure(s2, tmp_path / "identified.yaml")
    s3 = load_structure(tmp_path / "identified.yaml")
    assert s3.string("s1").stiffness == 111.0 and s3.bar("b1").mass == 1.25
    assert s3.string("s2").rest_length == 0.7 and s3.actuator("m1").spool_radius == 0.021
    assert s3.actuator("m2").zero_offset == 0.05 and dict(s3.std_devs)["s1.stiffness"] == 3.0
    p3 = make_engine(s3).default_params()
    for n, v in p.named().items():
        assert float(p3.named()[n]) == pytest.approx(float(v), rel=1e-12), n
    with pytest.raises(ValueError, match="unbatched"):
        apply_to_structure(s, stack_params([p, p]))
    with pytest.raises(ValueError, match="unknown parameters"):
        apply_to_structure(s, p, std_devs={"s99.stiffness": 1.0})


def test_registry_names_and_errors():
    s = load_structure(MODELS / "icosahedron.yaml")
    with pytest.raises(ValueError, match="valid: nodal, spring_rod"):
        make_engine(s, backend="mujoco")
    with pytest.raises(ValueError, match="valid: semi_implicit, rk4"):
        make_engine(s, integrator="euler")
    for backend in ("nodal", "spring_rod"):
        for integ in ("semi_implicit", "rk4"):
            eng = make_engine(s, backend, integ)
            assert eng.backend == backend and eng.integrator == integ


def test_spring_rod_rejects_what_it_cannot_model():
    s = _actuated()  # composite strings and constraints
    with pytest.raises(ValueError, match="constraints"):
        make_engine(s, "spring_rod")
    composite = dataclasses.replace(s, constraints=(), strings=tuple(
        st for st in s.strings if st.name != "s3"))
    with pytest.raises(ValueError, match="composite"):
        make_engine(composite, "spring_rod")


def test_state_shapes_and_rollout_horizon():
    s = load_structure(MODELS / "icosahedron.yaml")
    for backend in ("nodal", "spring_rod"):
        eng = make_engine(s, backend)
        s0 = eng.initial_state(batch=4)
        assert s0.positions.shape == (4, 12, 3) and s0.velocities.shape == (4, 12, 3)
        out = eng.rollout(eng.default_params(), s0, Inputs(external_forces=None), 1e-3, steps=7) if backend == "nodal" \
            else eng.rollout(eng.default_params(), s0, None, 1e-3, steps=7)
        assert out.positions.shape == (7, 4, 12, 3)
        one = eng.step(eng.default_params(), s0, None, 1e-3)
        torch.testing.assert_close(one.positions, out.positions[0])
        with pytest.raises(ValueError, match="horizon"):
            eng.rollout(eng.default_params(), s0, None, 1e-3)


def test_fixed_and_virtual_nodes_are_output():
    s = _actuated()
    eng = make_engine(s)
    out = eng.rollout(eng.default_params(), eng.initial_state(), None, 0.01, steps=5)
    X = out.positions[-1, 0]
    idx = {n: i for i, n in enumerate(s.node_names)}
    for f in s.fixed_nodes:
        torch.testing.assert_close(X[idx[f]], torch.tensor(s.nodes[idx[f]].position, dtype=torch.float64))
    torch.testing.assert_close(X[idx["m"]], 0.5 * (X[idx["c"]] + X[idx["d"]]))
    torch.testing.assert_close(X[idx["v"]], X[idx["b"]])
    assert float((X[idx["a"]] - torch.tensor(s.nodes[idx["a"]].position, dtype=torch.float64)).norm()) > 1e-4


def test_params_pickle_by_value_for_worker_processes():
    """Through multiprocessing's pickler (what a worker job's arguments go through), Params travel as plain
    arrays: equal on the other side, and no tensor handed over by file descriptor (torch's default, whose
    listener thread printed a traceback when a worker stopped mid-handover)."""
    import copy
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    p = make_engine(load_structure(MODELS / "stacked_manipulator.yaml")).default_params().map(lambda t: t.float())
    buf = io.BytesIO()
    ForkingPickler(buf).dump(p)
    data = buf.getvalue()
    assert b"rebuild_storage" not in data and b"DupFd" not in data
    q = pickle.loads(data)
    assert q.meta == p.meta and q.dtype == torch.float32
    for k in p.kinds():
        assert torch.equal(getattr(q, k), getattr(p, k)), k
    d = copy.deepcopy(p)
    assert torch.equal(d.mass, p.mass) and d.mass.data_ptr() != p.mass.data_ptr()
