"""Byte-exact Protocol 2.0 packets (ROBOTIS e-manual vectors), CRC, stuffing, tables."""
import math
import random

import pytest
from dynamixel_sdk.protocol2_packet_handler import Protocol2PacketHandler

from tensegrity_ros.hardware.dynamixel import protocol as P
from tensegrity_ros.hardware.dynamixel.tables import (TABLES, decode, decode_hardware_error, encode, get_table,
                                                      table_for_model_number, to_signed, to_unsigned)


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


# e-manual (Protocol 2.0 page) examples, XM430-W210 ids 1/2
VECTORS = {
    "ping1": (P.ping(1), "FF FF FD 00 01 03 00 01 19 4E"),
    "ping_broadcast": (P.ping(P.BROADCAST_ID), "FF FF FD 00 FE 03 00 01 31 42"),
    "read_present_position": (P.read(1, 132, 4), "FF FF FD 00 01 07 00 02 84 00 04 00 1D 15"),
    "write_goal_512": (P.write(1, 116, encode(512, 4)), "FF FF FD 00 01 09 00 03 74 00 00 02 00 00 CA 89"),
    "reg_write_velocity_200": (P.reg_write(1, 104, encode(200, 4)),
                               "FF FF FD 00 01 09 00 04 68 00 C8 00 00 00 AE 8E"),
    "action1": (P.action(1), "FF FF FD 00 01 03 00 05 02 CE"),
    "reboot1": (P.reboot(1), "FF FF FD 00 01 03 00 08 2F 4E"),
    "sync_read": (P.sync_read(132, 4, [1, 2]), "FF FF FD 00 FE 09 00 82 84 00 04 00 01 02 CE FA"),
    "sync_write": (P.sync_write(116, 4, [(1, encode(150, 4)), (2, encode(170, 4))]),
                   "FF FF FD 00 FE 11 00 83 74 00 04 00 01 96 00 00 00 02 AA 00 00 00 82 87"),
    "bulk_read": (P.bulk_read([(1, 144, 2), (2, 146, 1)]),
                  "FF FF FD 00 FE 0D 00 92 01 90 00 02 00 02 92 00 01 00 1A 05"),
    "bulk_write": (P.bulk_write([(1, 32, encode(160, 2)), (2, 31, bytes([80]))]),
                   "FF FF FD 00 FE 10 00 93 01 20 00 02 00 A0 00 02 1F 00 01 00 50 B7 68"),
    "fast_sync_read": (P.sync_read(132, 4, [3, 7, 4], fast=True),
                       "FF FF FD 00 FE 0A 00 8A 84 00 04 00 03 07 04 20 F2"),
    "status_ping": (P.build_status(1, 0, bytes([0x06, 0x04, 0x26])),
                    "FF FF FD 00 01 07 00 55 00 06 04 26 65 5D"),
    "status_ping2": (P.build_status(2, 0, bytes([0x06, 0x04, 0x26])),
                     "FF FF FD 00 02 07 00 55 00 06 04 26 6F 6D"),
    "status_read": (P.build_status(1, 0, encode(166, 4)), "FF FF FD 00 01 08 00 55 00 A6 00 00 00 8C C0"),
    "status_read2": (P.build_status(2, 0, encode(2079, 4)), "FF FF FD 00 02 08 00 55 00 1F 08 00 00 BA BE"),
    "status_ok": (P.build_status(1, 0), "FF FF FD 00 01 04 00 55 00 A1 0C"),
    "status_bulk1": (P.build_status(1, 0, encode(119, 2)), "FF FF FD 00 01 06 00 55 00 77 00 C3 69"),
    "status_bulk2": (P.build_status(2, 0, bytes([36])), "FF FF FD 00 02 05 00 55 00 24 8B A9"),
    # Fast Sync Read status, XC330 ids 3/7/4, Present Position 166 / 2079 / 1023
    "fast_sync_read_status": (
        P.build_fast_sync_read_status([(3, 0, encode(166, 4)), (7, 0, encode(2079, 4)), (4, 0, encode(1023, 4))]),
        "FF FF FD 00 FE 19 00 55 00 03 A6 00 00 00 84 08 00 07 1F 08 00 00 16 CA 00 04 FF 03 00 00 D1 9E"),
}


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_known_vectors(name):
    built, expected = VECTORS[name]
    assert built == h(expected), f"{name}: {built.hex(' ')}"


def test_crc_matches_sdk_and_known_value():
    sdk = Protocol2PacketHandler()
    rng = random.Random(1)
    for _ in range(200):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        assert P.crc16(data) == sdk.updateCRC(0, list(data), len(data))
    assert P.crc16(h("FF FF FD 00 01 03 00 01")) == 0x4E19


def test_stuffing_vector_and_round_trip():
    # FF FF FD inside the parameters gets an extra FD; length counts it
    body = bytes([P.WRITE, 0x74, 0x00, 0xFF, 0xFF, 0xFD, 0x00])
    assert P.add_stuffing(body) == bytes([P.WRITE, 0x74, 0x00, 0xFF, 0xFF, 0xFD, 0xFD, 0x00])
    pkt = P.write(1, 116, bytes([0xFF, 0xFF, 0xFD, 0x00]))
    assert pkt[5] | pkt[6] << 8 == 10  # 1 inst + 2 addr + 4 data + 1 stuffed + 2 crc
    parsed = P.parse_packet(pkt)
    assert parsed.params == bytes([0x74, 0x00, 0xFF, 0xFF, 0xFD, 0x00])
    rng = random.Random(7)
    for _ in range(500):
        raw = bytes(rng.choice([0xFF, 0xFD, 0x00, rng.randrange(256)]) for _ in range(rng.randrange(0, 40)))
        assert P.remove_stuffing(P.add_stuffing(raw)) == raw
        assert b"\xff\xff\xfd\x00" not in P.add_stuffing(raw)


def test_stuffing_matches_sdk():
    sdk = Protocol2PacketHandler()
    rng = random.Random(3)
    for _ in range(300):
        params = bytes(rng.choice([0xFF, 0xFD, rng.randrange(256)]) for _ in range(rng.randrange(0, 30)))
        ours = P.build_instruction(5, P.WRITE, params)
        tx = [0xFF, 0xFF, 0xFD, 0x00, 5, (len(params) + 3) & 0xFF, (len(params) + 3) >> 8, P.WRITE] + \
            list(params) + [0, 0]
        tx = sdk.addStuffing(tx)
        n = tx[5] + (tx[6] << 8) + 7
        crc = sdk.updateCRC(0, tx, n - 2)
        tx[n - 2], tx[n - 1] = crc & 0xFF, crc >> 8
        assert ours == bytes(tx[:n])


def test_parser_stream_garbage_split_and_bad_crc():
    a, b = P.ping(1), P.read(2, 132, 4)
    bad = bytearray(P.write(3, 64, b"\x01"))
    bad[-1] ^= 0xFF
    stream = b"\x00\x12\xff" + a + bytes(bad) + b"\xff\xff" + b
    parser = P.PacketParser()
    out = []
    for k in range(0, len(stream), 3):  # arbitrary chunking
        out += parser.feed(stream[k:k + 3])
    assert [type(x).__name__ for x in out] == ["Packet", "BadPacket", "Packet"]
    assert out[0].instruction == P.PING and out[0].dxl_id == 1
    assert out[1].dxl_id == 3
    assert out[2].instruction == P.READ and out[2].params == h("84 00 04 00")


def test_parse_status_and_errors():
    st = P.parse_packet(P.build_status(9, P.ERR_ALERT | P.ERR_ACCESS, b"\x01\x02"))
    assert st.is_status and st.error == 0x87 and st.params == b"\x01\x02"
    assert "access error" in P.error_text(st.error) and "hardware alert" in P.error_text(st.error)
    with pytest.raises(ValueError):
        P.parse_packet(P.ping(1)[:-1] + b"\x00")
    entries = P.parse_fast_sync_read_params(
        P.build_fast_sync_read_status([(3, 0, encode(166, 4)), (7, 0x80, encode(2079, 4))])[8:-2], 4)
    assert entries == [(3, 0, encode(166, 4)), (7, 0x80, encode(2079, 4))]


def test_tables_addresses_and_units():
    x = get_table("XM430-W350")
    assert (x.addr("torque_enable"), x.addr("goal_position"), x.addr("present_position")) == (64, 116, 132)
    assert (x.addr("present_velocity"), x.addr("present_current"), x.addr("hardware_error_status")) == (128, 126, 70)
    assert x.eeprom_end == 64 and x.fast_sync_read and x.model_number == 1020 and x.position_mode == 3
    assert get_table("xm540").model_number == 1120
    for name, number, ticks in (("l54-50-s290-r", 38176, 207692), ("m42-10-s260-r", 43288, 263186)):
        t = get_table(name)
        assert (t.addr("torque_enable"), t.addr("goal_position"), t.addr("present_position")) == (562, 596, 611)
        assert (t.addr("present_velocity"), t.addr("present_current"),
                t.addr("hardware_error_status")) == (615, 621, 892)
        assert t.model_number == number and t.ticks_per_rev == ticks and not t.fast_sync_read
        assert t.eeprom_end == 562 and t.block(("present_position", "present_velocity", "present_current")) == (611, 12)
        assert table_for_model_number(number) is t
    assert x.block(("present_position", "present_velocity", "present_current")) == (126, 10)
    assert math.isclose(get_table("l54").current_unit_a, 33.0 / 2048.0)
    assert math.isclose(get_table("m42").current_unit_a, 8.25 / 2048.0)
    # conversions
    assert x.rad_to_ticks(0.0) == 2048 and x.ticks_to_rad(2048) == 0.0
    assert x.rad_to_ticks(100.0) == 4095 and x.rad_to_ticks(-100.0) == 0  # saturated
    assert abs(x.ticks_to_rad(x.rad_to_ticks(1.0)) - 1.0) <= x.rad_per_tick / 2
    assert math.isclose(x.velocity_to_rad_s(1), 0.229 * 2 * math.pi / 60)
    with pytest.raises(ValueError):
        x.rad_to_ticks(float("nan"))
    with pytest.raises(KeyError, match="supported"):
        get_table("ax12")
    for t in TABLES.values():  # no overlapping registers
        spans = sorted(t.registers.values())
        assert all(a1 + s1 <= a2 for (a1, s1), (a2, _) in zip(spans, spans[1:]))


def test_signed_helpers_and_hw_decoding():
    assert to_signed(0xFFFFFFFF, 4) == -1 and to_signed(0x7FFF, 2) == 32767 and to_signed(0x8000, 2) == -32768
    assert to_unsigned(-1, 2) == 0xFFFF and to_unsigned(5, 1) == 5
    with pytest.raises(ValueError):
        to_unsigned(1 << 16, 2)
    assert decode(encode(-103846, 4), signed=True) == -103846
    assert decode_hardware_error(0x20) == ("overload error",)
    assert decode_hardware_error(0x15) == ("input voltage error", "overheating error", "electrical shock error")
