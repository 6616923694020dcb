"""The nodal engine's two layouts run one set of equations (engine/laws.py).

The reference layout (engine/nodal.py, batch first) and the throughput layout (engine/fast.py, batch last,
what torch.compile runs) differ only in how they multiply and solve (a ``laws.Layout``). Here: the modules do
not import each other's physics (no cycle), one evaluation of every shared equation agrees between the
layouts for both stiffness laws, with batched and unbatched params, and the per-params quantities come from
one ``prepare``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import yaml

from tensegrity_ros.engine import fast, laws, make_engine, stack_params
from tensegrity_ros.engine.nodal import BatchFirst, reduce
from tensegrity_ros.model import structure_from_dict

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tensegrity_ros" / "engine"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _imports(module: str) -> set:
    """The engine modules ``module`` imports (relative imports, any depth in the file)."""
    names = set()
    for node in ast.walk(ast.parse((ENGINE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update([node.module] if node.module else [a.name for a in node.names])
    return names


def test_no_import_cycle():
    """fast.py and laws.py do not import nodal.py (nodal.py imports both): one direction only."""
    assert "nodal" not in _imports("fast")
    assert not {"nodal", "fast"} & _imports("laws")
    assert {"fast", "laws"} <= _imports("nodal")


def mixed_manipulator():
    """The stacked manipulator with its actuated strings alternately spring and cord law (composite strings,
    bars, fixed nodes and motors: every term of the equations)."""
    data = yaml.safe_load((ROOT / "config" / "models" / "stacked_manipulator.yaml").read_text())
    acted = [s for s in data["strings"] if s.get("actuator")]
    for k, s in enumerate(acted):
        s["stiffness_law"] = "spring" if k % 2 == 0 else "cord"
    assert {s["stiffness_law"] for s in acted} == {"spring", "cord"}
    return structure_from_dict(data, source="<mixed manipulator>")


def _state(eng, B, seed=3):
    g = torch.Generator().manual_seed(seed)
    s0 = eng.initial_state(batch=B)
    X = s0.positions + 0.01 * torch.randn(s0.positions.shape, generator=g, dtype=torch.float64)
    V = 0.3 * torch.randn(s0.positions.shape, generator=g, dtype=torch.float64)
    u = -0.5 + 0.4 * torch.randn(B, len(eng.structure.actuators), generator=g, dtype=torch.float64)
    ud = torch.randn(B, len(eng.structure.actuators), generator=g, dtype=torch.float64)
    fe = torch.randn(B, 3, reduce(eng.constants, X).shape[-1], generator=g, dtype=torch.float64)
    return X, V, u, ud, fe


@pytest.mark.parametrize("batched", [False, True])
def test_layouts_evaluate_the_same_equations(batched):
    """String law (both laws), forces, constrained accelerations (with Baumgarte terms), projection and the
    implicit step: batch-first == batch-last, one evaluation each (float64)."""
    eng = make_engine(mixed_manipulator(), "nodal", "implicit", baumgarte=(5.0, 10.0))
    c, B = eng.constants, 3
    p = eng.default_params()
    if batched:
        p = stack_params([p.replace(mass=p.mass * (1.0 + 0.1 * k), stiffness=p.stiffness * (1.0 - 0.2 * k))
                          for k in range(B)])
    X, V, u, ud, fe = _state(eng, B)
    ref, bl = BatchFirst(), fast.LAYOUT
    der = laws.prepare(c, p)
    derl = der.batch_last()
    Q, Vq = reduce(c, X), reduce(c, V)

    def last(t):                                                    # batch first -> batch last
        return t.movedim(0, -1)

    Ql, Vl, ul, udl, fel = last(Q), last(Vq), last(u), last(ud), last(fe)
    F, st = laws.generalized_forces(ref, c, der, Q, Vq, u, ud, fe, with_strings=True)
    Fl, stl = laws.generalized_forces(bl, c, derl, Ql, Vl, ul, udl, fel, with_strings=True)
    assert bool((st.tension > 0).any()) and bool((st.tension == 0).any())
    for name in ("L", "xi0", "xi0dot", "D", "Ddot", "kappa", "tension"):
        torch.testing.assert_close(last(getattr(st, name)), getattr(stl, name), rtol=1e-13, atol=1e-12, msg=name)
    torch.testing.assert_close(last(F), Fl, rtol=1e-13, atol=1e-9)
    opts = eng.options
    a = laws.constrained_accelerations(ref, c, der, Q, Vq, F, opts)
    al = laws.constrained_accelerations(bl, c, derl, Ql, Vl, Fl, opts)
    torch.testing.assert_close(last(a.a), al.a, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(last(a.lam), al.lam, rtol=1e-12, atol=1e-9)
    for integrator in ("semi_implicit", "implicit"):
        out = laws.step(ref, c, der, Q, Vq, u, ud, fe, 1e-3, integrator, opts)
        outl = laws.step(bl, c, derl, Ql, Vl, ul, udl, fel, 1e-3, integrator, opts)
        for x, xl in zip(out, outl):
            torch.testing.assert_close(last(x), xl, rtol=0, atol=1e-12, msg=integrator)


def test_one_prepare_for_both_layouts():
    """The batch-last path's per-params quantities are prepare()'s, moved: the stiffness law's split included
    (spring strings EA = 0, kc = stiffness; cord strings EA = stiffness * rest length, kc = 0)."""
    eng = make_engine(mixed_manipulator())
    c, p = eng.constants, eng.default_params()
    der = laws.prepare(c, p)
    spring = c.spring.bool()
    assert bool(spring.any()) and bool((~spring).any())
    torch.testing.assert_close(der.kc, torch.where(spring, p.stiffness, 0.0), rtol=0, atol=0)
    torch.testing.assert_close(der.EA, torch.where(spring, 0.0, p.stiffness * p.rest_length), rtol=0, atol=0)
    derl = fast.prepare_fast(c, p)
    for name in laws.Derived.RANKS:
        assert torch.equal(getattr(derl, name).squeeze(-1), getattr(der, name)), name
    ps = stack_params([p, p])
    for name in laws.Derived.RANKS:
        assert torch.equal(getattr(fast.prepare_fast(c, ps), name), getattr(laws.prepare(c, ps), name).movedim(0, -1))


def _chord_structures():
    """Every structure file of config/models and the generality suite's (independent.SUITE): fixed nodes,
    coincident nodes between stages, composite strings."""
    from tensegrity_ros.validation.independent import SUITE, load_suite_structure
    from tensegrity_ros.model import load_structure
    files = sorted((ROOT / "config" / "models").glob("*.yaml"))
    return [(f.stem, lambda f=f: load_structure(f)) for f in files] + [(n, lambda n=n: load_suite_structure(n))
                                                                    for n in SUITE]


@pytest.mark.parametrize("name,load", _chord_structures(), ids=lambda v: v if isinstance(v, str) else "")
def test_chord_inverse_by_blocks_is_the_dense_inverse(name, load):
    """Topology.chord_blocks: the bar-constraint matrix A = G_c * (D^T D) is zero between blocks for any masses
    and bar directions (so its inverse is too), and laws.chord_inverse of the batch-last (compiled) layout, one
    block at a time, equals LAPACK's dense inverse (the reference layout's, one call on the whole matrix)."""
    eng = make_engine(load())
    c = eng.constants
    nba = c.Cb_q.shape[0]
    blocks = eng.topology.chord_blocks
    assert sorted(int(i) for b in blocks for i in b) == list(range(nba))
    if name == "stacked_manipulator":              # the sparsity the compiled step's speed relies on
        assert sorted(len(b) for b in blocks) == [1, 1, 1, 6, 9]
    g = torch.Generator().manual_seed(5)
    p = eng.default_params()
    p = p.replace(mass=p.mass * (0.5 + torch.rand(p.mass.shape, generator=g, dtype=torch.float64)))
    d = torch.randn(4, 3, nba, generator=g, dtype=torch.float64)
    ref = BatchFirst()
    A = laws.chord_matrix(ref, laws.prepare(c, p), d)
    dense = torch.linalg.inv(A)
    inside = torch.zeros(nba, nba, dtype=torch.bool)
    for b in blocks:
        inside[torch.as_tensor(b).unsqueeze(-1), torch.as_tensor(b)] = True
    scale = dense.abs().max()
    assert float(A.masked_fill(inside, 0.0).abs().max()) == 0.0
    assert float(dense.masked_fill(inside, 0.0).abs().max()) < 1e-12 * float(scale)
    assert torch.equal(laws.chord_inverse(ref, c, A), dense)
    torch.testing.assert_close(laws.chord_inverse(fast.LAYOUT, c, A.movedim(0, -1)), dense.movedim(0, -1),
                               rtol=1e-10, atol=1e-10 * float(scale))
