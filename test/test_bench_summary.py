"""`make bench` (bench/run_all.py) says how it went: exit 0 when every headline target is met, 3 when one is
missed (named on its last line), 1 when a bench failed to run; the figures are written in every case."""
from __future__ import annotations

import json
import sys
import types

import pytest

from tensegrity_ros.paths import REPO_ROOT


@pytest.fixture
def run_all(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import run_all as module
    fake = types.ModuleType("fake_bench")
    fake.run = lambda value=1.0: {"figure": value} if value is not None else 1 / 0
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(module, "OUT", tmp_path)
    monkeypatch.setattr(module, "HEADLINES", [("fake", "figure", "fake figure", "< 2", lambda v: v < 2)])
    return module


@pytest.mark.parametrize("value, code, last", [(1.0, 0, "all 1 headline targets met"),
                                               (5.0, 3, "1 of 1 headline targets missed: fake figure 5"),
                                               (None, 1, "FAILED to run: fake")])
def test_exit_status_and_last_line(run_all, monkeypatch, capsys, tmp_path, value, code, last):
    monkeypatch.setattr(run_all, "BENCHES", {"fake": ("fake_bench", {"value": value}, {})})
    assert run_all.main(["--only", "fake"]) == code
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(f"bench: {last}"), lines[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["missed"] == ([] if code != 3 else ["fake figure 5 (target < 2)"])
    # what the figures were measured on, printed first and kept with them
    assert lines[0].startswith("machine: cpu ") and summary["machine"]["cores"] >= 1
    assert summary["machine"]["tangent_blas"] in ("torch", "numpy") and len(summary["machine"]["load_1_5_15"]) == 3
