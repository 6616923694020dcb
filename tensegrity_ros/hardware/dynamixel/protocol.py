"""Dynamixel Protocol 2.0 packets: pure build / parse functions, CRC-16 and byte stuffing.

Nothing here touches a port. The emulator (:mod:`.emulator`) uses these functions to speak the
protocol, and the byte-exact tests check them against the ROBOTIS e-manual vectors, e.g. PING for
ID 1 is ``FF FF FD 00 01 03 00 01 19 4E``.

Packet layout (instruction and status)::

    FF FF FD 00 | ID | LEN_L LEN_H | INST | [ERR] PARAM ... | CRC_L CRC_H

``LEN`` counts INST + (ERR +) params + the two CRC bytes, *after* byte stuffing. Byte stuffing
inserts an extra ``FD`` after every ``FF FF FD`` found in the INST..params region; the CRC is
computed over the stuffed packet. Fast Sync Read and Fast Bulk Read status packets are not stuffed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

HEADER = b"\xff\xff\xfd\x00"
BROADCAST_ID = 0xFE
MAX_ID = 0xFC

# Instructions
PING = 0x01
READ = 0x02
WRITE = 0x03
REG_WRITE = 0x04
ACTION = 0x05
FACTORY_RESET = 0x06
REBOOT = 0x08
CLEAR = 0x10
STATUS = 0x55
SYNC_READ = 0x82
SYNC_WRITE = 0x83
FAST_SYNC_READ = 0x8A
BULK_READ = 0x92
BULK_WRITE = 0x93
FAST_BULK_READ = 0x9A

INSTRUCTION_NAMES = {
    PING: "PING", READ: "READ", WRITE: "WRITE", REG_WRITE: "REG_WRITE", ACTION: "ACTION",
    FACTORY_RESET: "FACTORY_RESET", REBOOT: "REBOOT", CLEAR: "CLEAR", STATUS: "STATUS",
    SYNC_READ: "SYNC_READ", SYNC_WRITE: "SYNC_WRITE", FAST_SYNC_READ: "FAST_SYNC_READ",
    BULK_READ: "BULK_READ", BULK_WRITE: "BULK_WRITE", FAST_BULK_READ: "FAST_BULK_READ",
}

# Status packet error field: bit 7 = alert (hardware error, see Hardware Error Status register),
# bits 0..6 = error number.
ERR_ALERT = 0x80
ERR_RESULT_FAIL = 0x01
ERR_INSTRUCTION = 0x02
ERR_CRC = 0x03
ERR_DATA_RANGE = 0x04
ERR_DATA_LENGTH = 0x05
ERR_DATA_LIMIT = 0x06
ERR_ACCESS = 0x07

#: CLEAR (0x10) parameters that reset the multi-turn position: option 0x01 + the fixed "DXL\"" key
CLEAR_MULTI_TURN = bytes((0x01, 0x44, 0x58, 0x4C, 0x22))

ERROR_NAMES = {
    ERR_RESULT_FAIL: "result fail", ERR_INSTRUCTION: "instruction error", ERR_CRC: "CRC error",
    ERR_DATA_RANGE: "data range error", ERR_DATA_LENGTH: "data length error",
    ERR_DATA_LIMIT: "data limit error", ERR_ACCESS: "access error",
}


def _make_crc_table() -> Tuple[int, ...]:
    table = []
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) if crc & 0x8000 else (crc << 1)
        table.append(crc & 0xFFFF)
    return tuple(table)


_CRC_TABLE = _make_crc_table()


def crc16(data: Iterable[int], crc: int = 0) -> int:
    """CRC-16 (poly 0x8005, init 0, no reflection, no final xor) as used by Protocol 2.0."""
    table = _CRC_TABLE
    for b in data:
        crc = ((crc << 8) ^ table[((crc >> 8) ^ b) & 0xFF]) & 0xFFFF
    return crc


def add_stuffing(body: bytes) -> bytes:
    """Insert ``FD`` after each ``FF FF FD`` in ``body`` (the INST..params region)."""
    out = bytearray()
    n = len(body)
    for i in range(n):
        b = body[i]
        out.append(b)
        if b == 0xFD and i >= 2 and body[i - 1] == 0xFF and body[i - 2] == 0xFF:
            out.append(0xFD)
    return bytes(out)


def remove_stuffing(body: bytes) -> bytes:
    """Inverse of :func:`add_stuffing`: drop the ``FD`` that follows each ``FF FF FD``."""
    out = bytearray()
    i, n = 0, len(body)
    while i < n:
        b = body[i]
        out.append(b)
        if b == 0xFD and len(out) >= 3 and out[-2] == 0xFF and out[-3] == 0xFF and i + 1 < n \
                and body[i + 1] == 0xFD:
            i += 2  # skip the stuffed FD
            continue
        i += 1
    return bytes(out)


def _frame(dxl_id: int, body: bytes, stuff: bool = True) -> bytes:
    if not 0 <= dxl_id <= 0xFE or dxl_id == 0xFD:
        raise ValueError(f"invalid Dynamixel id {dxl_id}")
    if stuff:
        body = add_stuffing(body)
    length = len(body) + 2
    head = HEADER + bytes((dxl_id, length & 0xFF, (length >> 8) & 0xFF)) + body
    crc = crc16(head)
    return head + bytes((crc & 0xFF, crc >> 8))


def build_instruction(dxl_id: int, instruction: int, params: bytes = b"") -> bytes:
    """A complete, stuffed instruction packet."""
    return _frame(dxl_id, bytes((instruction,)) + bytes(params))


def build_status(dxl_id: int, error: int = 0, params: bytes = b"") -> bytes:
    """A complete, stuffed status packet (instruction 0x55)."""
    return _frame(dxl_id, bytes((STATUS, error & 0xFF)) + bytes(params))


def build_fast_read_status(entries: Sequence[Tuple[int, int, bytes]]) -> bytes:
    """The combined status packet of a Fast Sync Read or Fast Bulk Read, ``entries`` = [(id, error,
    data), ...] in request order.

    Layout: ``FF FF FD 00 FE LEN 55 | ERR1 ID1 DATA1 CRC1 | ERR2 ID2 DATA2 CRC2 | ...`` where each
    device's CRC is the running CRC of the whole packet so far (each motor appends its block to the
    chain, so the last one is the packet CRC). Not byte-stuffed (e-manual). ``LEN = 1 + sum(len(data)
    + 4)``. Fast Sync Read blocks all have the same data length; Fast Bulk Read blocks each have the
    length that device was asked for, so a client needs its own request list to split the packet.
    """
    length = 1 + sum(len(d) + 4 for _, _, d in entries)
    pkt = bytearray(HEADER + bytes((BROADCAST_ID, length & 0xFF, (length >> 8) & 0xFF, STATUS)))
    for dxl_id, err, data in entries:
        pkt += bytes((err & 0xFF, dxl_id)) + bytes(data)
        crc = crc16(pkt)
        pkt += bytes((crc & 0xFF, crc >> 8))
    return bytes(pkt)


def build_fast_sync_read_status(entries: Sequence[Tuple[int, int, bytes]]) -> bytes:
    """The Fast Sync Read status packet (see :func:`build_fast_read_status`); all data the same length."""
    if len({len(d) for _, _, d in entries}) > 1:
        raise ValueError("Fast Sync Read entries must all have the same data length")
    return build_fast_read_status(entries)


def build_fast_bulk_read_status(entries: Sequence[Tuple[int, int, bytes]]) -> bytes:
    """The Fast Bulk Read status packet (see :func:`build_fast_read_status`); per-device lengths."""
    return build_fast_read_status(entries)


def parse_fast_sync_read_params(params: bytes, data_length: int) -> List[Tuple[int, int, bytes]]:
    """Split the body of a Fast Sync Read status (from the first ERR byte up to, but excluding,
    the final packet CRC) into [(id, error, data)]."""
    out = []
    step = data_length + 4
    blob = bytes(params) + b"\x00\x00"  # the last block's CRC is the packet CRC (already stripped)
    for k in range(0, len(blob) - 2, step):
        block = blob[k:k + step]
        if len(block) < 2 + data_length:
            break
        out.append((block[1], block[0], bytes(block[2:2 + data_length])))
    return out


def parse_fast_bulk_read_params(params: bytes, data_lengths: Sequence[int]) -> List[Tuple[int, int, bytes]]:
    """Split the body of a Fast Bulk Read status (first ERR byte up to, but excluding, the final
    packet CRC) into [(id, error, data)], the k-th block holding ``data_lengths[k]`` bytes."""
    out = []
    blob = bytes(params) + b"\x00\x00"
    k = 0
    for n in data_lengths:
        block = blob[k:k + n + 4]
        if len(block) < 2 + n:
            break
        out.append((block[1], block[0], bytes(block[2:2 + n])))
        k += n + 4
    return out


# ---- instruction builders ------------------------------------------------------------------
def u16(v: int) -> bytes:
    return bytes((v & 0xFF, (v >> 8) & 0xFF))


def ping(dxl_id: int) -> bytes:
    return build_instruction(dxl_id, PING)


def read(dxl_id: int, address: int, length: int) -> bytes:
    return build_instruction(dxl_id, READ, u16(address) + u16(length))


def write(dxl_id: int, address: int, data: bytes) -> bytes:
    return build_instruction(dxl_id, WRITE, u16(address) + bytes(data))


def reg_write(dxl_id: int, address: int, data: bytes) -> bytes:
    return build_instruction(dxl_id, REG_WRITE, u16(address) + bytes(data))


def action(dxl_id: int = BROADCAST_ID) -> bytes:
    return build_instruction(dxl_id, ACTION)


def reboot(dxl_id: int) -> bytes:
    return build_instruction(dxl_id, REBOOT)


def clear_multi_turn(dxl_id: int) -> bytes:
    return build_instruction(dxl_id, CLEAR, CLEAR_MULTI_TURN)


def sync_read(address: int, length: int, ids: Sequence[int], fast: bool = False) -> bytes:
    return build_instruction(BROADCAST_ID, FAST_SYNC_READ if fast else SYNC_READ,
                             u16(address) + u16(length) + bytes(ids))


def sync_write(address: int, length: int, data_by_id: Sequence[Tuple[int, bytes]]) -> bytes:
    params = bytearray(u16(address) + u16(length))
    for dxl_id, data in data_by_id:
        if len(data) != length:
            raise ValueError(f"sync write data for id {dxl_id} has {len(data)} bytes, expected {length}")
        params += bytes((dxl_id,)) + bytes(data)
    return build_instruction(BROADCAST_ID, SYNC_WRITE, bytes(params))


def bulk_read(requests: Sequence[Tuple[int, int, int]], fast: bool = False) -> bytes:
    params = bytearray()
    for dxl_id, address, length in requests:
        params += bytes((dxl_id,)) + u16(address) + u16(length)
    return build_instruction(BROADCAST_ID, FAST_BULK_READ if fast else BULK_READ, bytes(params))


def bulk_write(writes: Sequence[Tuple[int, int, bytes]]) -> bytes:
    params = bytearray()
    for dxl_id, address, data in writes:
        params += bytes((dxl_id,)) + u16(address) + u16(len(data)) + bytes(data)
    return build_instruction(BROADCAST_ID, BULK_WRITE, bytes(params))


# ---- parsing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Packet:
    """A received, CRC-checked and unstuffed packet.

    For status packets (``instruction == 0x55``) ``error`` is the error byte and ``params`` the
    data after it; for instruction packets ``error`` is None.
    """

    dxl_id: int
    instruction: int
    params: bytes
    error: Optional[int] = None
    raw: bytes = b""

    @property
    def is_status(self) -> bool:
        return self.instruction == STATUS


@dataclass(frozen=True)
class BadPacket:
    """A framed packet whose CRC did not match (``dxl_id`` is as received, so not trustworthy)."""

    dxl_id: int
    raw: bytes


def parse_packet(raw: bytes, stuffed: bool = True) -> Packet:
    """Parse one complete packet (header..CRC). Raises ValueError on a malformed packet or CRC."""
    raw = bytes(raw)
    if len(raw) < 10 or raw[:4] != HEADER:
        raise ValueError("not a Protocol 2.0 packet (bad header or too short)")
    length = raw[5] | (raw[6] << 8)
    if len(raw) != 7 + length:
        raise ValueError(f"length field {length} does not match packet size {len(raw)}")
    crc = raw[-2] | (raw[-1] << 8)
    if crc16(raw[:-2]) != crc:
        raise ValueError("CRC mismatch")
    body = raw[7:-2]
    if stuffed:
        body = remove_stuffing(body)
    inst = body[0]
    if inst == STATUS:
        return Packet(raw[4], inst, bytes(body[2:]), body[1] if len(body) > 1 else 0, raw)
    return Packet(raw[4], inst, bytes(body[1:]), None, raw)


class PacketParser:
    """Incremental packet framer for a byte stream (used by the emulator).

    ``feed(data)`` returns the complete packets found so far: :class:`Packet` for good ones and
    :class:`BadPacket` for framed packets with a CRC mismatch. Garbage before a header is dropped.
    """

    MAX_LENGTH = 1024

    def __init__(self) -> None:
        self._buf = bytearray()

    def reset(self) -> None:
        self._buf.clear()

    def feed(self, data: bytes) -> List[object]:
        self._buf += data
        out: List[object] = []
        buf = self._buf
        while True:
            idx = buf.find(HEADER)  # "FF FF FD 00": a stuffed body never contains it
            if idx < 0:
                # keep a possible partial header at the end of the buffer
                keep = 0
                for k in (3, 2, 1):
                    if len(buf) >= k and bytes(buf[-k:]) == HEADER[:k]:
                        keep = k
                        break
                del buf[:len(buf) - keep]
                return out
            if idx > 0:
                del buf[:idx]
            if len(buf) < 7:
                return out
            length = buf[5] | (buf[6] << 8)
            if length < 3 or length > self.MAX_LENGTH:
                del buf[:1]
                continue
            total = 7 + length
            if len(buf) < total:
                return out
            raw = bytes(buf[:total])
            del buf[:total]
            try:
                out.append(parse_packet(raw))
            except ValueError:
                out.append(BadPacket(raw[4], raw))


def error_text(error: int) -> str:
    """Human-readable decoding of a status packet error byte."""
    parts = []
    if error & ERR_ALERT:
        parts.append("hardware alert (check Hardware Error Status)")
    num = error & 0x7F
    if num:
        parts.append(ERROR_NAMES.get(num, f"unknown error {num}"))
    return ", ".join(parts) if parts else "ok"
