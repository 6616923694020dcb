"""Pure safety clamps, property-style with a seeded generator (no hardware)."""
import math

import numpy as np
import pytest

from tensegrity_ros.hardware.safety import (Action, SafetyConfig, SafetyFilter, State, blend, blend_weight,
                                            clamp_goals, hardware_error_policy, rate_limit, watchdog)

RNG = np.random.default_rng(1234)
NASTY = np.array([np.nan, np.inf, -np.inf, 1e308, -1e308, 1e-320, 0.0, -0.0, 3.0, -3.0])


def nasty_vector(n):
    v = RNG.normal(0, 5, n)
    mask = RNG.random(n) < 0.4
    v[mask] = RNG.choice(NASTY, mask.sum())
    return v


def test_clamp_goals_properties():
    for _ in range(500):
        n = int(RNG.integers(1, 8))
        lo = RNG.uniform(-3, 0, n)
        hi = lo + RNG.uniform(0, 3, n)
        last = RNG.uniform(lo, hi)
        goals = nasty_vector(n)
        out = clamp_goals(goals, lo, hi, last)
        assert out.shape == (n,) and np.all(np.isfinite(out))
        assert np.all(out >= lo) and np.all(out <= hi)
        bad = ~np.isfinite(goals)
        assert np.array_equal(out[bad], last[bad])  # NaN/inf hold the last safe goal
        ok = ~bad & (goals >= lo) & (goals <= hi)
        assert np.array_equal(out[ok], goals[ok])  # in-range values untouched


def test_clamp_goals_edge_cases():
    assert clamp_goals([np.nan], [-1], [1], [np.nan])[0] == 0.0  # nothing safe known: middle
    assert clamp_goals([np.nan], [-1], [1], [5.0])[0] == 1.0     # last safe itself clamped
    assert clamp_goals(7.0, -1, 1, [0.0, 0.0]).tolist() == [1.0, 1.0]  # scalar broadcast
    with pytest.raises(ValueError):
        clamp_goals([0.0, 0.0, 0.0], [-1], [1], [0.0, 0.0])
    with pytest.raises(ValueError):
        clamp_goals([0.0], [1], [-1], [0.0])


def test_rate_limit_properties():
    for _ in range(500):
        n = int(RNG.integers(1, 8))
        prev = RNG.uniform(-2, 2, n)
        new = nasty_vector(n)
        rate = float(RNG.uniform(0.01, 10))
        dt = float(RNG.uniform(0, 0.1))
        out = rate_limit(prev, new, rate, dt)
        assert np.all(np.isfinite(out))
        assert np.all(np.abs(out - prev) <= rate * dt * (1 + 1e-12) + 1e-15)
        fin = np.isfinite(new) & (np.abs(new - prev) <= rate * dt)
        assert np.allclose(out[fin], new[fin])
    prev = np.array([0.0, 1.0])
    for dt in (0.0, -1.0, float("nan"), float("inf")):
        assert np.array_equal(rate_limit(prev, [5.0, -5.0], 1.0, dt), prev)
    assert np.allclose(rate_limit([0.0], [1.0], [np.inf], 0.01), [1.0])


def test_watchdog():
    assert watchdog(None, 10.0, 0.5)
    assert not watchdog(9.8, 10.0, 0.5)
    assert watchdog(9.4, 10.0, 0.5)
    assert watchdog(11.0, 10.0, 0.5)  # from the future: clock problem
    assert watchdog(float("nan"), 10.0, 0.5) and watchdog("x", 10.0, 0.5)


def test_hardware_error_policy():
    assert hardware_error_policy({}) is Action.CONTINUE
    assert hardware_error_policy({1: 0, 2: 0}) is Action.CONTINUE
    assert hardware_error_policy({1: 0x01}) is Action.HOLD
    for bit in (1, 2, 3, 4, 5, 6, 7):
        assert hardware_error_policy({1: 0, 4: 1 << bit}) is Action.TORQUE_OFF_ALL
    assert hardware_error_policy({1: 0x01, 2: 0x20}) is Action.TORQUE_OFF_ALL


def test_blend():
    assert blend_weight(0.0, 1.0) == 0.0 and blend_weight(1.0, 1.0) == 1.0 and blend_weight(5, 0) == 1.0
    w = [blend_weight(t, 1.0) for t in np.linspace(-0.5, 1.5, 41)]
    assert all(b >= a for a, b in zip(w, w[1:]))
    assert np.allclose(blend([0.0, 1.0], [2.0, np.nan], 0.5), [1.0, 1.0])


def make_filter(**kw):
    cfg = dict(names=("a", "b", "c"), lower=(-1.0, -0.5, 0.0), upper=(1.0, 0.5, 2.0), max_rate_rad_s=2.0,
               watchdog_s=0.2, ramp_s=0.5)
    cfg.update(kw)
    f = SafetyFilter(SafetyConfig(**cfg))
    f.reset([0.0, 0.0, 0.0], now=0.0)
    return f


def test_safety_config_validation_and_from_actuators():
    with pytest.raises(ValueError):
        SafetyConfig(("a",), (1.0,), (-1.0,))
    with pytest.raises(ValueError):
        SafetyConfig(("a",), (float("nan"),), (1.0,))
    with pytest.raises(ValueError):
        SafetyConfig(("a",), (0.0,), (1.0,), max_rate_rad_s=0)

    class A:
        def __init__(self, name, limits):
            self.name, self.limits = name, limits

    c = SafetyConfig.from_actuators([A("m1", (-10, 10)), A("m2", (0, 1))], bounds=[(-3, 3), (-3, 3)])
    assert c.lower == (-3, 0) and c.upper == (3, 1)


def test_filter_never_leaves_limits_or_rate_under_garbage():
    f = make_filter()
    t = 0.0
    lo, hi = f.lower, f.upper
    prev = f.last_goal.copy()
    for k in range(2000):
        t += float(RNG.choice([0.0125, 0.0, 0.05, 0.3, -0.01]))
        target = None if k % 17 == 0 else nasty_vector(3)
        stamp = t - float(RNG.uniform(-0.5, 0.5))
        out = f.step(t, target, command_stamp=stamp, check_watchdog=bool(k % 2))
        assert out.action is Action.CONTINUE
        g = out.goals
        assert np.all(np.isfinite(g)) and np.all(g >= lo) and np.all(g <= hi)
        assert np.all(np.abs(g - prev) <= 2.0 * f.config.max_step_dt + 1e-9)
        prev = g
    c = f.counters
    assert c.nonfinite > 0 and c.clamped > 0 and c.stale > 0 and c.rate_limited > 0 and c.holds > 0


def test_filter_stale_commands_hold_and_fresh_ones_move():
    f = make_filter()
    out = f.step(0.1, [1.0, 1.0, 1.0], command_stamp=-0.5, check_watchdog=True)
    assert out.stale and np.allclose(out.goals, 0.0)
    out = f.step(0.2, [1.0, 1.0, 1.0], command_stamp=0.2, check_watchdog=True)
    assert not out.stale and np.allclose(out.goals, [0.1, 0.1, 0.1])  # 2 rad/s * 0.05 s (max_step_dt)
    for k in range(100):
        out = f.step(0.2 + 0.0125 * (k + 1), [1.0, 1.0, 1.0], command_stamp=0.2 + 0.0125 * (k + 1),
                     check_watchdog=True)
    assert np.allclose(out.goals, [1.0, 0.5, 1.0])  # reaches the target, clamped


def test_filter_hardware_errors_latch_torque_off_and_hold():
    f = make_filter()
    assert f.step(0.01, [0.1, 0.1, 0.1], hardware_errors={1: 0x01}).action is Action.HOLD
    assert f.state is State.HOLD
    out = f.step(0.02, [0.1, 0.1, 0.1], hardware_errors={1: 0})
    assert out.action is Action.CONTINUE and f.state is State.RUNNING
    out = f.step(0.03, [0.1, 0.1, 0.1], hardware_errors={2: 0x20})
    assert out.action is Action.TORQUE_OFF_ALL and out.goals is None and f.state is State.STOPPED
    # latched even when the error clears
    assert f.step(0.04, [0.1, 0.1, 0.1], hardware_errors={}).action is Action.TORQUE_OFF_ALL
    f.reset([0.0, 0.0, 0.0], 0.05)
    assert f.step(0.06, None).action is Action.CONTINUE


def test_filter_smooth_source_switch():
    f = make_filter(max_rate_rad_s=100.0, ramp_s=0.5)
    for k in range(10):
        f.step(0.0125 * (k + 1), [0.5, 0.0, 0.0])
    f.begin_switch(0.125)
    goals = []
    for k in range(60):
        t = 0.125 + 0.0125 * (k + 1)
        goals.append(f.step(t, [-0.5, 0.0, 0.0]).goals[0])
    d = np.diff([0.5] + goals)
    assert np.all(d <= 1e-12)  # monotone
    assert np.max(np.abs(d)) < 0.05  # no jump (a hard switch would jump by 1.0)
    assert math.isclose(goals[-1], -0.5) and not f.switching


def test_step_before_reset_raises():
    f = SafetyFilter(SafetyConfig(("a",), (-1.0,), (1.0,)))
    with pytest.raises(RuntimeError, match="reset"):
        f.step(0.0, [0.0])
