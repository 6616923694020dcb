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


def test_effort_is_newton_metres_where_the_torque_constant_is_known_else_amps():
    """JointState.effort (issue 18 item 6): current x the e-Manual's stall torque / current (XM430-W350: 4.1 N·m at
    2.3 A) when every motor's constant is known, else the Present Current in A for every motor; named either way."""
    from tensegrity_ros.hardware.driver_core import PublisherCheck, driver_diagnostics
    from tensegrity_ros.hardware.torque import effort_scale, torque_constant

    assert torque_constant("XM430-W350") == pytest.approx(4.1 / 2.3)
    assert torque_constant("l54-50-s290-r") is None
    assert effort_scale(["xm430", "xm540"])[0] == "N.m"
    unit, k = effort_scale(["xm430", "l54-50-s290-r"])      # one unknown: amps for all, never mixed units
    assert unit == "A" and np.all(k == 1.0)

    acts = (MotorSpec("a", 1, "xm430"), MotorSpec("b", 2, "xm430"))
    emu = EmulatedBus([1, 2], {1: "xm430", 2: "xm430"}, baud=1_000_000)
    bus = DynamixelBus(emu.port, 1_000_000, {1: "xm430", 2: "xm430"})
    try:
        core = DriverCore(bus, acts, command_source="hold")
        assert core.effort_unit == "N.m" and core.stats.effort_unit == "N.m"
        core.start()
        emu.set_external_load(1, 1.0)
        for _ in range(5):
            states, stats = core.cycle()
        assert states.currents[0] == pytest.approx(1.0, abs=0.05)
        assert np.allclose(states.efforts, np.array(states.currents) * 4.1 / 2.3)
        kv = dict(driver_diagnostics(stats, PublisherCheck(True, ()))[2])
        assert kv["effort_unit"] == "N.m" and kv["torque"] == "on"
    finally:
        bus.close()
        emu.stop()
    # the manipulator's PRO motors: no torque constant, so current
    pro_bus = DynamixelBus("/dev/null", 1_000_000, {a.motor_id: a.model for a in ACTS})   # never opened
    assert DriverCore(pro_bus, ACTS).effort_unit == "A"


def test_connect_enable_disable_reboot_and_the_service_rules(rig):
    """The lifecycle steps of the core (configure / activate / deactivate, reboot) on the emulated registers, and the
    pure rules of ~/set_torque and ~/reboot."""
    from tensegrity_ros.hardware.driver_core import command_goals, reboot_refusal, torque_refusal

    emu, bus = rig
    core = DriverCore(bus, ACTS, command_source="hold")
    core.connect()
    assert core.connected and not core.torque_on and not any(emu.torque_enabled().values())
    states, stats = core.cycle()                     # torque off: read only, no goal written
    assert stats.state == "torque_off" and all(states.valid)
    core.enable()
    assert core.torque_on and all(emu.torque_enabled().values())
    assert core.set_torque(False) == (True, "torque off: the motors are limp; their states are still published")
    assert not any(emu.torque_enabled().values()) and bus.is_open
    emu.inject_hardware_error(2, 0x04)               # overheating: enable refused, torque stays off
    core.cycle()
    ok, why = core.set_torque(True)
    assert not ok and "HardwareError" in why and not any(emu.torque_enabled().values())
    ok, msg = core.request_reboot("active")
    assert ok and "rebooted" in msg and emu.register(2, "hardware_error_status") == 0
    assert core.set_torque(True)[0] and all(emu.torque_enabled().values())
    core.shutdown()
    assert not core.connected and not any(emu.torque_enabled().values())

    assert reboot_refusal("unconfigured", False, "none") and reboot_refusal("active", True, "following")
    assert reboot_refusal("active", False, "following") is None and reboot_refusal("active", True, "stale") is None
    assert torque_refusal("inactive", True) and torque_refusal("inactive", False) is None
    assert torque_refusal("active", True) is None and torque_refusal("unconfigured", False)
    assert command_goals(("m1", "m2"), ["m2", "x"], [0.5, 1.0]) == ({"m2": 0.5}, "")
    assert command_goals(("m1", "m2"), [], [0.1, 0.2]) == ([0.1, 0.2], "")
    assert command_goals(("m1", "m2"), [], [0.1])[0] is None and command_goals(("m1",), ["x"], [1.0])[0] is None
