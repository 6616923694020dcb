"""The driver loop core against the emulator through the real SDK: limits, garbage commands,
stale commands, source switching, torque off on every exit path."""
import math
import os

import numpy as np
import pytest

from tensegrity_ros.hardware.driver_core import (BusConfig, DriverCore, MotorSpec, RateScheduler, load_bus_config,
                                                 make_bus, resolve_actuators)
from tensegrity_ros.hardware.dynamixel.bus import DynamixelBus
from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus
from tensegrity_ros.hardware.dynamixel.errors import HardwareError, MotorMissing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ["l54-50-s290-r"] * 3 + ["m42-10-s260-r"] * 3
ACTS = tuple(MotorSpec(name=f"m{i}", motor_id=i, model=MODELS[i - 1], limits=(-0.4 - 0.05 * i, 0.3 + 0.1 * i))
             for i in range(1, 7))
LO = np.array([a.limits[0] for a in ACTS])
HI = np.array([a.limits[1] for a in ACTS])


@pytest.fixture
def rig():
    emu = EmulatedBus([a.motor_id for a in ACTS], {a.motor_id: a.model for a in ACTS}, baud=1_000_000,
                      max_speed_rad_s=3.0, seed=0)
    # SDK default receive timeout: only real faults time out, even on a loaded machine
    bus = DynamixelBus(emu.port, 1_000_000, {a.motor_id: a.model for a in ACTS}, retries=1, missing_after=3)
    yield emu, bus
    bus.close()
    emu.stop()


def absurd_reference(t):
    """Huge sinusoids, NaN/inf bursts, wrong types now and then."""
    k = int(t * 80)
    g = 50.0 * np.sin(2 * np.pi * 0.7 * t + np.arange(6))
    if k % 7 == 0:
        g[k % 6] = np.nan
    if k % 11 == 0:
        g[(k + 1) % 6] = np.inf if k % 2 else -np.inf
    if k % 13 == 0:
        g[:] = 1e300
    return g


def test_loop_two_seconds_limits_hold_under_absurd_stale_and_nan_commands(rig):
    emu, bus = rig
    max_rate = 1.5
    core = DriverCore(bus, ACTS, rate_hz=80, max_rate_rad_s=max_rate, watchdog_s=0.1, ramp_s=0.3,
                      command_source="reference", reference=absurd_reference)
    goal_log, emu_goal_log, pos_log = [], [], []
    phase = {"n": 0}

    def on_cycle(states, stats):
        n = phase["n"] = phase["n"] + 1
        goal_log.append((states.stamp, np.array(states.goals)))
        emu_goal_log.append(np.array([emu.goal_positions_rad()[i] for i in core.ids]))
        pos_log.append(np.array(states.positions))
        assert all(states.valid) or stats.read_failures > 0
        if n == 50:
            core.set_command_source("topic")
        if 50 < n < 90:  # fresh garbage on the topic
            core.set_topic_command(np.where(np.arange(6) % 2, np.nan, 1e9 * (-1) ** n))
        if n == 90:  # one sensible command, then it goes stale (no more commands)
            core.set_topic_command({"m1": 0.2, "m4": -0.3})
        if n == 130:
            core.set_command_source("hold")
        if n == 140:
            core.set_command_source("reference")

    stats = core.run(duration_s=2.0, on_cycle=on_cycle)
    assert stats.cycles >= 40  # a loaded CI machine may miss cycles; the limits are what matters
    goals = np.array([g for _, g in goal_log])
    stamps = np.array([t for t, _ in goal_log])
    assert np.all(np.isfinite(goals))
    assert np.all(goals >= LO - 1e-12) and np.all(goals <= HI + 1e-12)
    # what the motors actually received (tick-rounded) stays inside the limits too
    tick = max(bus.tables[i].rad_per_tick for i in core.ids)
    emu_goals = np.array(emu_goal_log)
    assert np.all(emu_goals >= LO - tick) and np.all(emu_goals <= HI + tick)
    # slew-rate limit between consecutive cycles (dt capped by max_step_dt)
    dg = np.abs(np.diff(goals, axis=0))
    dt = np.minimum(np.diff(stamps), core.safety.config.max_step_dt)
    assert np.all(dg <= max_rate * dt[:, None] + 1e-9)
    c = stats.safety_counters
    assert c["nonfinite"] > 0 and c["clamped"] > 0 and c["stale"] > 0 and c["rate_limited"] > 0
    assert emu.stats.rejected_goal_writes == 0
    # torque is off after the loop, bus closed
    assert not any(emu.torque_enabled().values()) and not bus.is_open
    assert stats.state == "shutdown"


def test_torque_off_after_exception_in_loop(rig):
    emu, bus = rig
    core = DriverCore(bus, ACTS, rate_hz=80, command_source="hold")

    def boom(states, stats):
        if stats.cycles == 5:
            assert all(emu.torque_enabled().values())
            raise RuntimeError("user callback failed")

    with pytest.raises(RuntimeError, match="callback"):
        core.run(duration_s=5.0, on_cycle=boom)
    assert not any(emu.torque_enabled().values()) and not bus.is_open


def test_hardware_error_mid_run_raises_typed_and_turns_all_torque_off(rig):
    emu, bus = rig
    core = DriverCore(bus, ACTS, rate_hz=80, command_source="hold")

    def inject(states, stats):
        if stats.cycles == 3:
            emu.inject_hardware_error(5, 0x10)  # electrical shock on motor 5

    with pytest.raises(HardwareError) as e:
        core.run(duration_s=5.0, on_cycle=inject)
    assert e.value.motor_id == 5 and "electrical shock error" in e.value.decoded
    assert not any(emu.torque_enabled().values())
    assert core.safety.state.value == "stopped"


def test_motor_missing_mid_run_turns_torque_off(rig):
    emu, bus = rig
    core = DriverCore(bus, ACTS, rate_hz=80, command_source="hold")
    core.start()
    for _ in range(3):
        core.cycle()
    emu.set_silent(2)
    with pytest.raises(MotorMissing) as e:
        for _ in range(10):
            states, stats = core.cycle()
            assert states.valid[1] is False  # the silent motor is flagged, last value kept
    assert e.value.motor_id == 2
    t = emu.torque_enabled()
    assert not any(t[i] for i in t if i != 2)
    core.shutdown()
    assert not bus.is_open


def test_start_holds_present_position_and_manual_cycles(rig):
    emu, bus = rig
    for i, a in zip(range(1, 7), ACTS):
        emu.set_position(i, 0.1 * i - 0.3)
    core = DriverCore(bus, ACTS, command_source="hold", max_rate_rad_s=0.5)
    with core:
        st = core.start()
        assert np.allclose(st.positions, np.clip([0.1 * i - 0.3 for i in range(1, 7)], LO, HI), atol=1e-4)
        assert all(emu.torque_enabled().values())
        core.set_command_source("topic")
        core.set_topic_command([0.2] * 6)
        t0 = core.clock()
        for k in range(20):
            states, stats = core.cycle(t0 + 0.0125 * (k + 1))
        g = np.array(states.goals)
        assert np.all(np.abs(g - np.array(st.positions)) <= 0.5 * 20 * 0.0125 + 1e-6)
        with pytest.raises(ValueError):
            core.set_command_source("nope")
        with pytest.raises(KeyError):
            core.set_topic_command({"nope": 1.0})
    assert not any(emu.torque_enabled().values())


def test_rate_scheduler_absolute_deadlines_and_missed_cycles():
    t = [0.0]

    def clock():
        return t[0]

    def sleep(dt):
        t[0] += dt

    s = RateScheduler(80.0, clock=clock, sleep=sleep)
    s.start()
    for _ in range(80):
        s.wait()
    assert math.isclose(t[0], 1.0) and s.missed == 0  # no drift
    t[0] += 0.05  # overrun by 4 periods: deadlines 81..83 are missed, 84 is served
    s.wait()
    assert s.missed == 3
    assert math.isclose((t[0] - 0.0) / s.period, round(t[0] / s.period))  # back on the grid
    summ = s.summary()
    assert summ["missed_cycles"] == 3 and summ["cycles"] == 81


def test_configs_load_and_make_bus_emulated():
    real = load_bus_config(os.path.join(REPO, "config/hardware/manipulator_bus.yaml"))
    assert real.bus == "real" and real.port == "/dev/ttyUSB0" and real.baud in (4_000_000, 1_000_000)
    assert [m.motor_id for m in real.motors] == [1, 2, 3, 4, 5, 6]
    assert {m.model for m in real.motors[:3]} == {"l54-50-s290-r"}
    assert {m.model for m in real.motors[3:]} == {"m42-10-s260-r"}
    assert real.rate_hz == 80
    emu_cfg = load_bus_config(os.path.join(REPO, "config/hardware/emulated_bus.yaml"))
    assert emu_cfg.bus == "emulated"
    acts = resolve_actuators(emu_cfg)
    bus, emu = make_bus(emu_cfg, acts)
    try:
        assert isinstance(emu, EmulatedBus) and emu.faults.drop_probability == 0.0
        core = DriverCore(bus, acts, rate_hz=emu_cfg.rate_hz, command_source="hold")
        stats = core.run(duration_s=0.2)
        assert stats.cycles > 0 and not any(emu.torque_enabled().values())
    finally:
        bus.close()
        emu.stop()
    with pytest.raises(ValueError, match="do not match"):
        resolve_actuators(real, [MotorSpec("x", 1, "xm430")])
    with pytest.raises(ValueError, match="unknown bus config keys"):
        BusConfig.from_dict({"bus": "real", "bogus": 1})
