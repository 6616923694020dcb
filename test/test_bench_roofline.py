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


def test_first_call_cache_count_and_a_failing_child_said_so(bench_engine, monkeypatch, tmp_path):
    """The compile-cache line (issue 20 item 2, "paid once and cached across runs"): the cache's files are counted
    where TORCHINDUCTOR_CACHE_DIR points, and a new process that cannot run the call comes back as an error that
    says why, not as a figure (the real call compiles for minutes: `make bench` measures it)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert bench_engine._cache_files() == 0
    (tmp_path / "cache" / "a").mkdir(parents=True)
    (tmp_path / "cache" / "a" / "x.py").write_text("")
    (tmp_path / "cache" / "y").write_text("")
    assert bench_engine._cache_files() == 2
    out = bench_engine.first_call_in_new_process("no_such_structure", "semi_implicit", [1], timeout_s=120)
    assert "seconds" not in out and "exit 1" in out["error"] and "no_such_structure" in out["error"]
