"""How a run went, against thresholds: every figure, its limit, pass or fail, and one verdict line.

A graph run (``tensegrity demo``, :func:`tensegrity_ros.bringup.run_graph`, ``bench/bench_graph.py``) measures
what was delivered against what should have been (rate x duration, not only what a queue reported lost), how
fast the parts ran, and, where the truth is known, whether identification made things worse. This module
only judges: pure Python, no rclpy, thresholds from ``config/health.yaml``.

    checks = evaluate({"mocap_frames_delivered": 0.995, ...}, load_thresholds())
    checks.verdict()   # "HEALTHY: 8 of 8 figures within their thresholds" or "DEGRADED: mocap frames ..."

A figure that could not be measured (NaN, missing) fails its check: "no data" is never healthy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

from .paths import CONFIG_DIR

#: exit code of a run that completed and wrote everything, but whose health figures fell below a threshold
EXIT_DEGRADED = 3

DEFAULT_THRESHOLDS = CONFIG_DIR / "health.yaml"

OPS = ("min", "max")


@dataclass(frozen=True)
class Threshold:
    """``figure`` must be >= ``limit`` (op ``min``) or <= ``limit`` (op ``max``); ``unit`` and ``what`` for
    people."""

    figure: str
    op: str
    limit: float
    unit: str = ""
    what: str = ""

    def passes(self, value: float) -> bool:
        if value is None or not math.isfinite(float(value)):
            return False
        return float(value) >= self.limit if self.op == "min" else float(value) <= self.limit


@dataclass(frozen=True)
class Check:
    threshold: Threshold
    value: float

    @property
    def passed(self) -> bool:
        return self.threshold.passes(self.value)

    def describe(self) -> str:
        t = self.threshold
        rel = ">=" if t.op == "min" else "<="
        return f"{t.figure} {format_value(self.value, t.unit)} (needs {rel} {format_value(t.limit, t.unit)})"

    def as_dict(self) -> dict:
        t = self.threshold
        v = None if self.value is None or not math.isfinite(float(self.value)) else float(self.value)
        return {"value": v, "threshold": t.limit, "op": t.op, "unit": t.unit, "pass": self.passed, "what": t.what}


@dataclass(frozen=True)
class Health:
    """The checks of one run."""

    checks: Tuple[Check, ...]

    @property
    def healthy(self) -> bool:
        return all(c.passed for c in self.checks)

    def failures(self) -> Tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def verdict(self) -> str:
        """The last line a run prints: HEALTHY, or DEGRADED with every reason."""
        if self.healthy:
            return f"HEALTHY: all {len(self.checks)} health figures within their thresholds"
        return "DEGRADED: " + "; ".join(c.describe() for c in self.failures())

    def as_dict(self) -> dict:
        """The ``health`` block of a summary: {figure: {value, threshold, op, unit, pass, what}}, the verdict."""
        return {"healthy": self.healthy, "verdict": self.verdict(),
                "figures": {c.threshold.figure: c.as_dict() for c in self.checks}}

    def exit_code(self) -> int:
        return 0 if self.healthy else EXIT_DEGRADED


def format_value(v: Optional[float], unit: str) -> str:
    """A figure or threshold for people: fractions in %, counts whole, "no data" for None or NaN."""
    if v is None or not math.isfinite(float(v)):
        return "no data"
    v = float(v)
    if unit == "fraction":
        return f"{100.0 * v:.1f} %"
    if unit == "count":
        return f"{v:.0f}"
    return f"{v:.3g} {unit}".strip()


def load_thresholds(path: Optional[Path] = None, section: str = "graph") -> Dict[str, Threshold]:
    """Thresholds of ``section`` from a YAML file (default ``config/health.yaml``): ``figure: {min|max: value,
    unit: ..., what: ...}``. Errors name the file, key and value."""
    import yaml

    path = Path(path) if path else DEFAULT_THRESHOLDS
    data = yaml.safe_load(path.read_text()) or {}
    if section not in data or not isinstance(data[section], dict):
        raise ValueError(f"{path}: no section {section!r} (sections: {', '.join(data) or 'none'})")
    out: Dict[str, Threshold] = {}
    for figure, spec in data[section].items():
        if not isinstance(spec, dict):
            raise ValueError(f"{path}: {section}.{figure} = {spec!r}: expected a mapping with min or max")
        ops = [op for op in OPS if op in spec]
        if len(ops) != 1:
            raise ValueError(f"{path}: {section}.{figure}: exactly one of {', '.join(OPS)} (got {sorted(spec)})")
        try:
            limit = float(spec[ops[0]])
        except (TypeError, ValueError):
            raise ValueError(f"{path}: {section}.{figure}.{ops[0]} = {spec[ops[0]]!r}: expected a number") from None
        out[figure] = Threshold(figure, ops[0], limit, str(spec.get("unit", "")), str(spec.get("what", "")))
    return out


def evaluate(figures: Mapping[str, Optional[float]], thresholds: Mapping[str, Threshold]) -> Health:
    """Every threshold checked against its figure (a missing figure fails as "no data")."""
    checks = []
    for name, t in thresholds.items():
        v = figures.get(name)
        checks.append(Check(t, math.nan if v is None else float(v)))
    return Health(tuple(checks))


def delivered_fraction(received: int, rate_hz: float, duration_s: float) -> float:
    """Messages received over those a source at ``rate_hz`` should have sent in ``duration_s`` (capped at 1:
    a source's clock may run a frame ahead)."""
    expected = rate_hz * duration_s
    if not (expected > 0 and math.isfinite(expected)):
        return math.nan
    return min(1.0, float(received) / expected)


def expected_count(rate_hz: float, duration_s: float) -> int:
    return int(math.floor(rate_hz * duration_s))
