"""The engine bench's roofline line (issue 20 item 2): the flops it counts are per batch item and per step (the
work done once per rollout is left out), and the fraction it prints is rate x flops / measured peak."""
from __future__ import annotations

import pytest
import torch

from tensegrity_ros.engine import make_engine
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import CONFIG_DIR, REPO_ROOT


@pytest.fixture
def bench_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import bench_engine as module
    return module


def _engine(name="icosahedron", integrator="semi_implicit"):
    return make_engine(load_structure(CONFIG_DIR / "models" / f"{name}.yaml"), "nodal", integrator,
                       dtype=torch.float32)


def test_flops_per_item_step_do_not_depend_on_batch_or_steps(bench_engine):
    eng = _engine()
    ref = bench_engine.reference_flops_per_item_step(eng, 64, 10)
    assert bench_engine.reference_flops_per_item_step(eng, 8, 10) == pytest.approx(ref, rel=1e-9)
    assert bench_engine.reference_flops_per_item_step(eng, 8, 3) == pytest.approx(ref, rel=1e-9)
    # more nodes and strings, more work; the implicit step adds its solve
    manip = bench_engine.reference_flops_per_item_step(_engine("stacked_manipulator"), 8, 3)
    assert ref < manip < bench_engine.reference_flops_per_item_step(_engine("stacked_manipulator", "implicit"), 8, 3)


def test_roofline_fraction_is_rate_times_flops_over_peak(bench_engine):
    rf = bench_engine.roofline(_engine(), rate=1e5, peak=200.0)
    assert rf["achieved_gflops"] == pytest.approx(1e5 * rf["flops_per_item_step"] / 1e9)
    assert rf["fraction_of_peak"] == pytest.approx(rf["achieved_gflops"] / 200.0)
    assert bench_engine.peak_gflops(n=256, repeats=2) > 0
