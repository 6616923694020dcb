"""Health verdicts: every figure against its threshold, "no data" never healthy, the shipped thresholds load."""
from __future__ import annotations

import math

import pytest

from tensegrity_ros.health import (EXIT_DEGRADED, Threshold, delivered_fraction, evaluate, load_thresholds)


def test_shipped_thresholds_load_with_their_units():
    graph = load_thresholds(section="graph")
    assert graph["mocap_frames_delivered"].op == "min" and graph["mocap_frames_delivered"].limit == 0.99
    assert graph["prediction_latency_ms_p99"].op == "max" and graph["prediction_latency_ms_p99"].limit == 20.0
    assert graph["identifier_update_period_s_p50"].limit == 10.0
    assert load_thresholds(section="demo")["accepted_worse_than_previous"].limit == 0


def test_verdicts_name_every_failure_and_missing_data_fails():
    th = {"a": Threshold("a", "min", 0.99, "fraction"), "b": Threshold("b", "max", 20.0, "ms"),
          "c": Threshold("c", "max", 0, "count")}
    ok = evaluate({"a": 0.995, "b": 12.0, "c": 0}, th)
    assert ok.healthy and ok.exit_code() == 0 and ok.verdict().startswith("HEALTHY")
    bad = evaluate({"a": 0.0026, "b": math.nan}, th)          # the 0.3 %-delivered run that said "all delivered"
    assert not bad.healthy and bad.exit_code() == EXIT_DEGRADED == 3
    v = bad.verdict()
    assert v.startswith("DEGRADED") and "a 0.3 % (needs >= 99.0 %)" in v and "b no data" in v and "c no data" in v
    d = bad.as_dict()
    assert d["healthy"] is False and d["figures"]["a"]["pass"] is False and d["figures"]["b"]["value"] is None


def test_delivered_fraction_counts_against_rate_times_duration():
    assert delivered_fraction(37, 120.0, 120.0) == pytest.approx(37 / 14400)
    assert delivered_fraction(14401, 120.0, 120.0) == 1.0
    assert math.isnan(delivered_fraction(5, 120.0, 0.0))


def test_bad_threshold_files_name_the_key(tmp_path):
    f = tmp_path / "h.yaml"
    f.write_text("graph:\n  x: {min: 1, max: 2}\n")
    with pytest.raises(ValueError, match=r"graph\.x: exactly one of min, max"):
        load_thresholds(f)
    f.write_text("graph:\n  x: {min: lots}\n")
    with pytest.raises(ValueError, match=r"graph\.x\.min = 'lots'"):
        load_thresholds(f)
    with pytest.raises(ValueError, match="no section 'demo'"):
        load_thresholds(f, "demo")
