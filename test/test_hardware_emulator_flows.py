"""Protocol 2.0 flows that ROBOTIS' own example scripts (and ROBOTIS' ROS 2 hardware interface) use,
driven through the unmodified dynamixel_sdk on the emulator's pty: Fast Bulk Read (0x9A), indirect
addressing, and CLEAR (multi-turn reset) on a stopped motor. The emulator runs on the manual clock, so
no test sleeps: motion happens in ``advance``."""
import os
import select
import termios
import time
import tty

import pytest
from dynamixel_sdk import (COMM_SUCCESS, GroupBulkRead, GroupBulkWrite, GroupSyncRead, GroupSyncWrite,
                           PacketHandler, PortHandler)

from tensegrity_ros.hardware.dynamixel import protocol as P
from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus
from tensegrity_ros.hardware.dynamixel.tables import encode

# XM430-W350 addresses, written out (as a client would) rather than taken from our tables
TORQUE, LED, OPERATING_MODE, GOAL, MOVING, PRESENT = 64, 65, 11, 116, 122, 132
IND_ADDR_1, IND_DATA_1 = 168, 224        # Indirect Address 1..28 -> Indirect Data 1..28
IND_ADDR_29, IND_DATA_29 = 578, 634      # Indirect Address 29..56 -> Indirect Data 29..56


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


@pytest.fixture
def emu():
    bus = EmulatedBus([1, 2], "xm430", baud=1_000_000, clock="manual")
    yield bus
    bus.stop()


@pytest.fixture
def port(emu):
    p = PortHandler(emu.port)
    assert p.openPort() and p.setBaudRate(1_000_000)
    yield p
    p.closePort()


ph = PacketHandler(2.0)


def _ok(result):
    """(comm, error) of a TxRx call must both be clean."""
    assert tuple(result[-2:]) == (COMM_SUCCESS, 0), result


# ---- Fast Bulk Read (0x9A) ---------------------------------------------------------------------------
def test_fast_bulk_read_two_motors_different_registers(emu, port):
    emu.set_position(1, emu.table(1).ticks_to_rad(3000))
    _ok(ph.write1ByteTxRx(port, 2, LED, 1))
    g = GroupBulkRead(port, ph)
    assert g.addParam(1, PRESENT, 4) and g.addParam(2, LED, 1)
    assert g.fastBulkRead() == COMM_SUCCESS
    assert g.isAvailable(1, PRESENT, 4) and g.isAvailable(2, LED, 1)
    assert (g.getData(1, PRESENT, 4), g.getData(2, LED, 1)) == (3000, 1)
    assert emu.stats.instructions.get("FAST_BULK_READ") == 1
    # a second read sees new values (the reply is built per request, not cached)
    _ok(ph.write1ByteTxRx(port, 2, LED, 0))
    emu.set_position(1, emu.table(1).ticks_to_rad(100))
    assert g.fastBulkRead() == COMM_SUCCESS
    assert (g.getData(1, PRESENT, 4), g.getData(2, LED, 1)) == (100, 0)
    # a silent motor breaks the chain: no complete packet, the SDK reports a failure
    emu.set_silent(2)
    assert g.fastBulkRead() != COMM_SUCCESS


def test_fast_bulk_read_status_packet_is_byte_exact(emu):
    """The raw reply on the wire, against a packet computed by hand (CRCs with the SDK's own
    updateCRC): one block per motor, each with its own data length, each block's CRC the running CRC
    of the packet so far, no byte stuffing."""
    emu.set_position(1, emu.table(1).ticks_to_rad(166))
    fd = os.open(emu.port, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        tty.setraw(fd)
        attrs = termios.tcgetattr(fd)
        attrs[4] = attrs[5] = termios.B1000000
        termios.tcsetattr(fd, termios.TCSANOW, attrs)
        os.write(fd, P.write(2, LED, b"\x01"))
        assert _read_packet(fd, 11) == P.build_status(2, 0)
        # id 1: Present Position (132, 4 bytes) = 166; id 2: LED (65, 1 byte) = 1
        request = h("FF FF FD 00 FE 0D 00 9A 01 84 00 04 00 02 41 00 01 00 DD 2A")
        assert P.bulk_read([(1, 132, 4), (2, 65, 1)], fast=True) == request
        os.write(fd, request)
        expected = h("FF FF FD 00 FE 0E 00 55"
                     " 00 01 A6 00 00 00 57 FD"   # ERR ID1 DATA(4) CRC1 (= CRC of everything before it)
                     " 00 02 01 05 B4")           # ERR ID2 DATA(1) CRC2 (= the packet CRC)
        assert _read_packet(fd, len(expected)) == expected
    finally:
        os.close(fd)


def test_fast_bulk_read_status_matches_emanual_example():
    """e-manual Protocol 2.0, Fast Bulk Read example (XC330 ids 3/7/4: Present Position 166, Present
    PWM 421, Present Temperature 31)."""
    entries = [(3, 0, encode(166, 4)), (7, 0, encode(421, 2)), (4, 0, bytes([31]))]
    pkt = P.build_fast_bulk_read_status(entries)
    assert pkt == h("FF FF FD 00 FE 14 00 55 00 03 A6 00 00 00 67 A4 00 07 A5 01 24 74 00 04 1F D9 C1")
    assert P.parse_fast_bulk_read_params(pkt[8:-2], [4, 2, 1]) == entries
    with pytest.raises(ValueError):  # Fast Sync Read blocks all have one length
        P.build_fast_sync_read_status(entries)


def test_fast_bulk_read_not_answered_by_old_pro_firmware():
    emu = EmulatedBus([1, 2], "l54-50-s290-r", clock="manual")
    try:
        p = PortHandler(emu.port)
        assert p.openPort() and p.setBaudRate(1_000_000)
        g = GroupBulkRead(p, ph)
        assert g.addParam(1, 611, 4) and g.addParam(2, 611, 4)
        assert g.fastBulkRead() != COMM_SUCCESS
        assert g.txRxPacket() == COMM_SUCCESS  # the plain Bulk Read is answered
        p.closePort()
    finally:
        emu.stop()


def _read_packet(fd: int, n: int, timeout: float = 2.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            out += os.read(fd, n - len(out))
    return out


# ---- indirect addressing ---------------------------------------------------------------------------
def _map(port, dxl_id, first_slot_addr, targets):
    """Point consecutive Indirect Address registers (from ``first_slot_addr``) at ``targets``."""
    for k, target in enumerate(targets):
        _ok(ph.write2ByteTxRx(port, dxl_id, first_slot_addr + 2 * k, target))


def test_indirect_address_goal_and_present_position(emu, port):
    """The ROBOTIS indirect_address flow: Indirect Data 1..5 = Goal Position bytes + LED (written with
    Sync Write), Indirect Data 6..10 = Present Position bytes + Moving (read with every read path)."""
    for i in (1, 2):
        _map(port, i, IND_ADDR_1, [GOAL, GOAL + 1, GOAL + 2, GOAL + 3, LED])
        _map(port, i, IND_ADDR_1 + 10, [PRESENT, PRESENT + 1, PRESENT + 2, PRESENT + 3, MOVING])
        assert ph.read2ByteTxRx(port, i, IND_ADDR_1 + 2)[:2] == (GOAL + 1, COMM_SUCCESS)
        _ok(ph.write1ByteTxRx(port, i, TORQUE, 1))
    goals = {1: 3000, 2: 1000}
    gsw = GroupSyncWrite(port, ph, IND_DATA_1, 5)
    for i, g in goals.items():
        assert gsw.addParam(i, list(encode(g, 4)) + [1])
    assert gsw.txPacket() == COMM_SUCCESS
    assert ph.ping(port, 1)[1] == COMM_SUCCESS  # Sync Write has no reply: a round trip orders it
    for i, g in goals.items():
        assert (emu.register(i, "goal_position"), emu.register(i, "led")) == (g, 1)
        assert ph.read4ByteTxRx(port, i, IND_DATA_1) == (g, COMM_SUCCESS, 0)  # reads back through the map
    emu.advance(0.05)
    assert emu.register(1, "moving") == 1
    assert ph.read1ByteTxRx(port, 1, IND_DATA_1 + 9) == (1, COMM_SUCCESS, 0)  # Moving via indirect data
    emu.advance(3.0)  # the motors really moved
    for i, g in goals.items():
        assert abs(emu.register(i, "present_position") - g) <= 1
    present = {i: emu.register(i, "present_position") for i in goals}
    # plain read, Sync Read, Bulk Read, Fast Sync Read, Fast Bulk Read of Indirect Data 6..10
    for i in goals:
        assert ph.read4ByteTxRx(port, i, IND_DATA_1 + 5) == (present[i], COMM_SUCCESS, 0)
    gsr = GroupSyncRead(port, ph, IND_DATA_1 + 5, 5)
    for i in goals:
        gsr.addParam(i)
    gbr = GroupBulkRead(port, ph)
    for i in goals:
        gbr.addParam(i, IND_DATA_1 + 5, 5)
    for result in (gsr.txRxPacket(), gsr.fastSyncRead()):
        assert result == COMM_SUCCESS
        for i in goals:
            assert gsr.getData(i, IND_DATA_1 + 5, 4) == present[i] and gsr.getData(i, IND_DATA_1 + 9, 1) == 0
    for result in (gbr.txRxPacket(), gbr.fastBulkRead()):
        assert result == COMM_SUCCESS
        for i in goals:
            assert gbr.getData(i, IND_DATA_1 + 5, 4) == present[i]


def test_indirect_data_inherits_the_target_rules(emu, port):
    _map(port, 1, IND_ADDR_1, [GOAL, GOAL + 1, GOAL + 2, GOAL + 3, PRESENT])
    # a goal outside the position limits, through indirect data: data limit error, nothing written
    assert ph.write4ByteTxRx(port, 1, IND_DATA_1, 5000) == (COMM_SUCCESS, P.ERR_DATA_LIMIT)
    assert emu.register(1, "goal_position") == 2048
    # indirect data standing for a read-only register is read-only
    assert ph.write1ByteTxRx(port, 1, IND_DATA_1 + 4, 7) == (COMM_SUCCESS, P.ERR_ACCESS)
    # only RAM addresses may be assigned (EEPROM: Operating Mode 11) or past the table end
    assert ph.write2ByteTxRx(port, 1, IND_ADDR_1, OPERATING_MODE) == (COMM_SUCCESS, P.ERR_DATA_RANGE)
    assert ph.write2ByteTxRx(port, 1, IND_ADDR_1, 662) == (COMM_SUCCESS, P.ERR_DATA_RANGE)
    assert ph.read2ByteTxRx(port, 1, IND_ADDR_1)[0] == GOAL  # unchanged
    # the Torque Enable value check applies through indirect data too
    _map(port, 1, IND_ADDR_1 + 12, [TORQUE])
    assert ph.write1ByteTxRx(port, 1, IND_DATA_1 + 6, 2) == (COMM_SUCCESS, P.ERR_DATA_RANGE)
    _ok(ph.write1ByteTxRx(port, 1, IND_DATA_1 + 6, 1))
    assert emu.torque_enabled()[1]
    # the second block (Indirect Address 29 -> Indirect Data 29), written by Bulk Write
    _map(port, 1, IND_ADDR_29, [LED])
    gbw = GroupBulkWrite(port, ph)
    assert gbw.addParam(1, IND_DATA_29, 1, [1])
    assert gbw.txPacket() == COMM_SUCCESS
    assert ph.read1ByteTxRx(port, 1, IND_DATA_29) == (1, COMM_SUCCESS, 0)
    assert emu.register(1, "led") == 1
    # REG_WRITE / ACTION through indirect data
    _ok(ph.regWriteTxRx(port, 1, IND_DATA_1, 4, list(encode(1500, 4))))
    assert emu.register(1, "goal_position") == 2048
    assert ph.action(port, 1) == COMM_SUCCESS
    # a unicast ACTION gets a status packet (e-Manual: ...55 00 A1 0C), which the SDK's action() does not read:
    # read it, or the next call takes it for its own answer (0x0CA1 came back as a register value)
    assert ph.rxPacket(port, False)[1] == COMM_SUCCESS
    assert ph.ping(port, 1)[1] == COMM_SUCCESS
    assert emu.register(1, "goal_position") == 1500
    # the indirect addresses are RAM: a reboot points each one back at its own data byte
    assert ph.reboot(port, 1)[0] == COMM_SUCCESS
    assert ph.read2ByteTxRx(port, 1, IND_ADDR_1)[:2] == (IND_DATA_1, COMM_SUCCESS)
    assert ph.read2ByteTxRx(port, 1, IND_ADDR_29)[:2] == (IND_DATA_29, COMM_SUCCESS)
    _ok(ph.write1ByteTxRx(port, 1, IND_DATA_1, 0x5A))  # unmapped: plain storage
    assert ph.read1ByteTxRx(port, 1, IND_DATA_1) == (0x5A, COMM_SUCCESS, 0)


def test_pro_indirect_addresses_are_eeprom():
    """Old PRO table: Indirect Address 1 (49, EEPROM) -> Indirect Data 1 (634); LED Red is 563."""
    emu = EmulatedBus([1], "l54-50-s290-r", clock="manual")
    try:
        p = PortHandler(emu.port)
        assert p.openPort() and p.setBaudRate(1_000_000)
        _ok(ph.write2ByteTxRx(p, 1, 49, 563))
        _ok(ph.write1ByteTxRx(p, 1, 634, 1))
        assert emu.register(1, "led_red") == 1
        _ok(ph.write1ByteTxRx(p, 1, 562, 1))  # torque on: EEPROM, indirect addresses included, locked
        assert ph.write2ByteTxRx(p, 1, 49, 564) == (COMM_SUCCESS, P.ERR_ACCESS)
        assert ph.write2ByteTxRx(p, 1, 51, 48) == (COMM_SUCCESS, P.ERR_ACCESS)
        p.closePort()
    finally:
        emu.stop()


# ---- CLEAR: multi-turn reset -------------------------------------------------------------------------
def test_clear_multi_turn_refused_while_moving_accepted_once_stopped(emu, port):
    """The ROBOTIS clear_multi_turn flow: extended position mode, spin towards a far goal, refuse CLEAR
    while moving; then hold the last position read (a stale read: the motor has moved on a little)
    and CLEAR 0.3 s later, when a real motor has stopped."""
    t = emu.table(1)
    _ok(ph.write1ByteTxRx(port, 1, OPERATING_MODE, t.extended_position_mode))
    _ok(ph.write1ByteTxRx(port, 1, TORQUE, 1))
    _ok(ph.write4ByteTxRx(port, 1, GOAL, 1048575))
    emu.advance(10.0)  # 4 rad/s: over six turns
    assert emu.register(1, "moving") == 1
    spinning = ph.read4ByteTxRx(port, 1, PRESENT)[0]
    assert spinning > 6 * 4096
    assert ph.clearMultiTurn(port, 1) == (COMM_SUCCESS, P.ERR_RESULT_FAIL)
    assert ph.read4ByteTxRx(port, 1, PRESENT)[0] >= spinning  # not cleared

    held = ph.read4ByteTxRx(port, 1, PRESENT)[0]
    emu.advance(0.02)  # the goal write arrives after the read: the motor is 0.08 rad further on
    _ok(ph.write4ByteTxRx(port, 1, GOAL, held))
    emu.advance(0.3)
    # still creeping back at ~4e-3 rad/s (first-order approach), far below Moving Threshold (0.24 rad/s)
    assert emu.register(1, "moving") == 0
    _ok(ph.clearMultiTurn(port, 1))
    cleared = ph.read4ByteTxRx(port, 1, PRESENT)[0]
    assert 0 <= cleared <= 4095
    assert abs(cleared - held % 4096) <= 2
    # the goal moved by the same whole turns: the motor stays put instead of unwinding them
    goal = ph.read4ByteTxRx(port, 1, GOAL)[0]
    assert (held - goal) % 4096 == 0 and abs(goal - cleared) <= 2
    emu.advance(1.0)
    assert abs(ph.read4ByteTxRx(port, 1, PRESENT)[0] - cleared) <= 1


def test_clear_on_a_motor_at_rest_and_bad_parameters(emu, port):
    assert ph.read4ByteTxRx(port, 2, PRESENT)[0] == 2048
    _ok(ph.clearMultiTurn(port, 2))  # torque off, at rest, already within one turn: nothing to do
    assert ph.read4ByteTxRx(port, 2, PRESENT)[0] == 2048
    bad = [0] * 15
    bad[4], bad[5], bad[6], bad[7] = 2, 8, 0, P.CLEAR  # id, length, instruction
    bad[8:13] = [0x01, 0x44, 0x58, 0x4C, 0x00]  # wrong key
    assert ph.txRxPacket(port, bad)[1:] == (COMM_SUCCESS, P.ERR_DATA_RANGE)
    assert P.clear_multi_turn(1) == h("FF FF FD 00 01 08 00 10 01 44 58 4C 22 B1 DC")  # e-manual example
