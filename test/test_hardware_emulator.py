"""The unmodified dynamixel_sdk and DynamixelBus against the pty emulator (no SDK mocks)."""
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from dynamixel_sdk import (COMM_RX_TIMEOUT, COMM_SUCCESS, GroupSyncRead, GroupSyncWrite, PacketHandler,
                           PortHandler)

from tensegrity_ros.hardware.dynamixel import protocol as P
from tensegrity_ros.hardware.dynamixel.bus import DynamixelBus
from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus, FaultConfig
from tensegrity_ros.hardware.dynamixel.errors import (BaudMismatch, HardwareError, ModelMismatch, MotorMissing,
                                                      NoResponse, PacketError, PortNotFound)

IDS = [1, 2, 3, 4, 5, 6]
PRO = {1: "l54-50-s290-r", 2: "l54-50-s290-r", 3: "l54-50-s290-r",
       4: "m42-10-s260-r", 5: "m42-10-s260-r", 6: "m42-10-s260-r"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def emu():
    bus = EmulatedBus(IDS, "xm430", baud=1_000_000, clock="manual", seed=0)
    yield bus
    bus.stop()


@pytest.fixture
def sdk_port(emu):
    port = PortHandler(emu.port)
    assert port.openPort() and port.setBaudRate(1_000_000)
    yield port
    port.closePort()


def test_sdk_example_flow(emu, sdk_port):
    """ping, torque on, sync write goal, sync read present position (the SDK's sync_read_write example)."""
    ph = PacketHandler(2.0)
    model, res, err = ph.ping(sdk_port, 1)
    assert (model, res, err) == (1020, COMM_SUCCESS, 0)
    for i in IDS:
        assert ph.write1ByteTxRx(sdk_port, i, 64, 1) == (COMM_SUCCESS, 0)
    gsw = GroupSyncWrite(sdk_port, ph, 116, 4)
    goals = {i: 2048 + 300 * (i - 3) for i in IDS}
    for i in IDS:
        assert gsw.addParam(i, list(goals[i].to_bytes(4, "little")))
    assert gsw.txPacket() == COMM_SUCCESS
    assert ph.ping(sdk_port, 1)[1] == COMM_SUCCESS  # Sync Write has no reply: sync with a round trip
    emu.advance(2.0)
    gsr = GroupSyncRead(sdk_port, ph, 132, 4)
    for i in IDS:
        gsr.addParam(i)
    assert gsr.txRxPacket() == COMM_SUCCESS
    for i in IDS:
        assert gsr.isAvailable(i, 132, 4)
        assert abs(gsr.getData(i, 132, 4) - goals[i]) <= 1
    # Fast Sync Read (0x8A) through the SDK
    assert gsr.fastSyncRead() == COMM_SUCCESS
    assert [gsr.getData(i, 132, 4) for i in IDS] == [emu.register(i, "present_position") for i in IDS]
    # broadcast ping finds everyone
    found, res = ph.broadcastPing(sdk_port)
    assert res == COMM_SUCCESS and sorted(found) == IDS
    # REG_WRITE + ACTION
    assert ph.regWriteTxRx(sdk_port, 2, 65, 1, [1]) == (COMM_SUCCESS, 0)
    assert emu.register(2, "led") == 0
    assert ph.action(sdk_port, 2) == COMM_SUCCESS
    # a unicast ACTION gets a status packet, which the SDK's action() leaves unread: read it, so the bus stays in sync
    pkt, res = ph.rxPacket(sdk_port, False)
    assert res == COMM_SUCCESS and pkt[4] == 2        # ID 2's status
    assert ph.ping(sdk_port, 2)[1] == COMM_SUCCESS
    assert emu.register(2, "led") == 1


def test_device_rules(emu, sdk_port):
    ph = PacketHandler(2.0)
    # EEPROM (operating mode, 11) refused with an access error while torque is on
    assert ph.write1ByteTxRx(sdk_port, 1, 64, 1) == (COMM_SUCCESS, 0)
    assert ph.write1ByteTxRx(sdk_port, 1, 11, 4) == (COMM_SUCCESS, P.ERR_ACCESS)
    assert emu.register(1, "operating_mode") == 3
    assert ph.write1ByteTxRx(sdk_port, 1, 64, 0) == (COMM_SUCCESS, 0)
    assert ph.write1ByteTxRx(sdk_port, 1, 11, 4) == (COMM_SUCCESS, 0)
    assert ph.write1ByteTxRx(sdk_port, 1, 11, 3) == (COMM_SUCCESS, 0)
    # read-only register
    assert ph.write4ByteTxRx(sdk_port, 1, 132, 5)[1] == P.ERR_ACCESS
    # goal outside the position limits: data limit error, goal unchanged
    assert ph.write4ByteTxRx(sdk_port, 1, 116, 5000) == (COMM_SUCCESS, P.ERR_DATA_LIMIT)
    assert emu.register(1, "goal_position") == 2048
    # unknown instruction -> instruction error
    assert ph.txRxPacket(sdk_port, _inst(0x77))[2] == P.ERR_INSTRUCTION
    # status return level 1: writes are silent (already the one that sets it), reads answered
    ph.write1ByteTxRx(sdk_port, 3, 68, 1)
    assert emu.register(3, "status_return_level") == 1
    assert ph.write1ByteTxRx(sdk_port, 3, 65, 1)[0] == COMM_RX_TIMEOUT
    assert ph.read1ByteTxRx(sdk_port, 3, 65) == (1, COMM_SUCCESS, 0)


def _inst(code):
    pkt = [0] * 10
    pkt[4], pkt[5], pkt[6], pkt[7] = 1, 3, 0, code
    return pkt


def test_first_order_dynamics_with_speed_limit():
    emu = EmulatedBus([1], "xm430", clock="manual", time_constant_s=0.05, max_speed_rad_s=2.0)
    try:
        port = PortHandler(emu.port)
        assert port.openPort()
        ph = PacketHandler(2.0)
        ph.write1ByteTxRx(port, 1, 64, 1)
        table = emu.table(1)
        goal = table.rad_to_ticks(1.0)
        assert ph.write4ByteTxRx(port, 1, 116, goal) == (COMM_SUCCESS, 0)
        g = table.ticks_to_rad(goal)
        # saturated phase: |e| > vmax * tau = 0.1 rad, so it moves at exactly 2 rad/s
        emu.advance(0.2)
        assert math.isclose(emu.present_positions_rad()[1], 0.4, abs_tol=1e-9)
        assert math.isclose(emu.register(1, "present_velocity") * 0.229 * 2 * math.pi / 60, 2.0, rel_tol=0.02)
        # then exponential: saturation ends at g - 0.1 after (g - 0.1) / 2 s
        t_sat = (g - 0.1) / 2.0
        emu.advance(t_sat - 0.2 + 0.05)
        assert math.isclose(emu.present_positions_rad()[1], g - 0.1 * math.exp(-1.0), abs_tol=1e-9)
        prev = emu.present_positions_rad()[1]
        for _ in range(50):
            emu.advance(0.02)
            pos = emu.present_positions_rad()[1]
            assert 0 <= pos - prev <= 2.0 * 0.02 + 1e-12  # monotone, speed-limited
            prev = pos
        assert abs(emu.register(1, "present_position") - goal) <= 1
        # torque off: the motor stops where it is
        ph.write4ByteTxRx(port, 1, 116, 2048)
        ph.write1ByteTxRx(port, 1, 64, 0)
        emu.advance(1.0)
        assert abs(emu.register(1, "present_position") - goal) <= 1
        port.closePort()
    finally:
        emu.stop()


def test_bus_open_modes_torque_and_close(emu):
    bus = DynamixelBus(emu.port, 1_000_000, IDS, "xm430")
    with bus:
        assert bus.model_numbers == {i: 1020 for i in IDS}
        bus.set_operating_mode("position")
        bus.enable_torque()
        assert all(emu.torque_enabled().values())
        bus.write_goals({i: 0.1 * i for i in IDS})
        bus.read_states()  # Sync Write has no reply: a round trip makes sure it was processed
        emu.advance(2.0)
        states = bus.read_states()
        assert sorted(states) == IDS
        for i in IDS:
            assert abs(states[i].position_rad - 0.1 * i) < 2e-3
        # EEPROM writes are refused by the motor while torque is on -> typed PacketError
        with pytest.raises(PacketError, match="access error"):
            bus.write_register(1, "operating_mode", 4)
        assert bus.read_register(1, "present_position") == emu.register(1, "present_position")
    assert not any(emu.torque_enabled().values())
    assert not bus.is_open
    bus.close()  # idempotent


def test_pro_bus_sync_read_and_units():
    emu = EmulatedBus(IDS, PRO, baud=4_000_000, clock="manual")
    try:
        with DynamixelBus(emu.port, 4_000_000, PRO) as bus:
            assert not any(bus.uses_fast_sync_read.values())  # old PRO firmware: no Fast Sync Read
            bus.enable_torque()
            bus.write_goals({i: -0.5 + 0.2 * i for i in IDS})
            bus.read_states()  # round trip: the Sync Write has been processed
            emu.advance(3.0)
            st = bus.read_states()
            for i in IDS:
                assert abs(st[i].position_rad - (-0.5 + 0.2 * i)) < 1e-4
            assert emu.register(1, "goal_position") == bus.tables[1].rad_to_ticks(-0.3)
            assert emu.register(1, "goal_position") < 0  # signed PRO positions
        assert not any(emu.torque_enabled().values())
        # a Fast Sync Read to PRO motors gets no answer, like the real firmware
        port = PortHandler(emu.port)
        assert port.openPort() and port.setBaudRate(4_000_000)
        gsr = GroupSyncRead(port, PacketHandler(2.0), 611, 4)
        gsr.addParam(1)
        assert gsr.fastSyncRead() != COMM_SUCCESS
        port.closePort()
    finally:
        emu.stop()


def test_open_errors(emu):
    with pytest.raises(PortNotFound, match="dialout"):
        DynamixelBus("/dev/does-not-exist", 1_000_000, [1], "xm430").open()
    with pytest.raises(BaudMismatch) as e:
        DynamixelBus(emu.port, 57600, [1, 2], "xm430").open()
    assert e.value.found_baud == 1_000_000 and "baud" in e.value.hint
    with pytest.raises(NoResponse, match="emulate-bus"):
        DynamixelBus(emu.port, 1_000_000, [20, 21], "xm430", baud_scan=()).open()
    with pytest.raises(ModelMismatch):
        DynamixelBus(emu.port, 1_000_000, [1], "xm540").open()
    emu.set_silent(5)
    with pytest.raises(MotorMissing) as e:
        DynamixelBus(emu.port, 1_000_000, IDS, "xm430", retries=0).open()
    assert e.value.motor_id == 5 and "motor 5" in e.value.hint and "power" in e.value.hint


def test_latency_timer_check_skipped_for_pty(emu):
    with DynamixelBus(emu.port, 1_000_000, [1], "xm430") as bus:
        assert bus.warnings == []  # no /sys/bus/usb-serial entry for a pty


@pytest.mark.parametrize("fast", [True, False])
def test_dropped_and_corrupted_replies_are_retried_and_counted(fast):
    emu = EmulatedBus(IDS, "xm430", clock="manual", seed=1,
                      faults=FaultConfig(drop_probability=0.1, corrupt_crc_probability=0.1))
    try:
        # SDK default receive timeout (34 ms): no spurious timeouts on a loaded CI machine
        bus = DynamixelBus(emu.port, 1_000_000, IDS, "xm430", fast_sync_read=fast, retries=3, missing_after=20)
        with bus:
            bus.enable_torque()
            complete = 0
            for _ in range(25):
                bus.write_goals({i: 0.2 for i in IDS})
                complete += len(bus.read_states()) == len(IDS)
            c, b = bus.counters, bus.bus_counters
            if fast:  # one combined reply: failures are per group, culprits found by individual reads
                assert b["group_read_failures"] > 0 and b["fallback_reads"] > 0
            else:     # Sync Read: the motor whose reply was lost or corrupted is known
                assert sum(x.timeouts for x in c.values()) > 0
                assert sum(x.corrupt for x in c.values()) > 0
                assert sum(x.retries for x in c.values()) > 0
            assert complete >= 18  # retries recover most cycles
            emu.set_fault_probabilities(drop=0.0, corrupt_crc=0.0)
        assert not any(emu.torque_enabled().values())
        assert emu.stats.dropped > 0 and emu.stats.corrupted > 0
    finally:
        emu.stop()


def test_hardware_error_is_reported_typed_and_cleared_by_reboot(emu):
    bus = DynamixelBus(emu.port, 1_000_000, IDS, "xm430")
    with bus:
        bus.enable_torque()
        emu.inject_hardware_error(3, 0x20)  # overload: a shutdown bit -> the motor drops torque
        st = bus.read_states()
        assert st[3].status_error & P.ERR_ALERT and st[3].hardware_error == 0x20
        assert bus.hardware_errors[3] == 0x20 and bus.counters[3].hardware_alerts == 1
        assert not emu.torque_enabled()[3]
        with pytest.raises(HardwareError) as e:
            bus.raise_on_hardware_error()
        assert e.value.motor_id == 3 and "overload error" in e.value.decoded and "reboot" in e.value.hint
        with pytest.raises(PacketError):  # shut down: torque cannot come back before a reboot
            bus.write_register(3, "torque_enable", 1)
        bus.reboot(3)
        assert bus.hardware_errors[3] == 0 and bus.read_states()[3].status_error == 0
    assert not any(emu.torque_enabled().values())
    # a motor already in error at open: typed error, port closed again
    emu.inject_hardware_error(2, 0x04)
    with pytest.raises(HardwareError, match="overheating"):
        DynamixelBus(emu.port, 1_000_000, IDS, "xm430").open()


@pytest.mark.parametrize("fast", [True, False])
def test_motor_that_stops_answering_raises_motor_missing(emu, fast):
    bus = DynamixelBus(emu.port, 1_000_000, IDS, "xm430", fast_sync_read=fast, retries=1, missing_after=3)
    bus.open()
    try:
        bus.enable_torque()
        assert len(bus.read_states()) == 6
        emu.set_silent(4)
        states = bus.read_states()
        assert 4 not in states and len(states) >= 4  # partial data, counted
        assert bus.counters[4].consecutive_failures == 1 and bus.counters[4].timeouts >= 1
        bus.read_states()
        with pytest.raises(MotorMissing) as e:
            bus.read_states()
        assert e.value.motor_id == 4 and "motor 4" in str(e.value)
    finally:
        bus.close()
    t = emu.torque_enabled()
    assert not any(t[i] for i in IDS if i != 4)  # the silent one cannot hear us


def test_wrong_thread_use_is_serialized(emu):
    import threading

    errors = []
    with DynamixelBus(emu.port, 1_000_000, IDS, "xm430") as bus:
        def hammer():
            try:
                for _ in range(30):
                    assert len(bus.read_states()) == 6
                    bus.write_goals({1: 0.0})
            except Exception as e:  # pragma: no cover
                errors.append(e)

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


def test_emulate_bus_cli_serves_until_sigterm(tmp_path):
    link = str(tmp_path / "ttyDXL")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import sys; from tensegrity_ros.hardware.dynamixel.emulator import emulate_bus_main; "
            "sys.exit(emulate_bus_main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--link", link, "--ids", "1-3", "--model", "xm540",
                             "--baud", "2000000", "--fault-hw", "2:0x01"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not os.path.islink(link):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        bus = DynamixelBus(link, 2_000_000, [1, 2, 3], "xm540").open(check_hardware_errors=False)
        try:
            assert bus.ping() == {1: 1120, 2: 1120, 3: 1120}
            assert bus.hardware_errors[2] == 0x01 and bus.hardware_errors[1] == 0
        finally:
            bus.close()
        bus2 = DynamixelBus(link, 2_000_000, [1, 2, 3], "xm540")
        with pytest.raises(HardwareError, match="input voltage"):
            bus2.open()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
        assert "emulated Dynamixel bus" in out
        assert not os.path.lexists(link)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
