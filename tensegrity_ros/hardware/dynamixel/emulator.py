"""A Protocol 2.0 Dynamixel bus emulated on a pseudo-terminal.

:class:`EmulatedBus` opens a pty pair, puts it in raw mode and serves a set of emulated motors on
the master side from a background thread. The *unmodified* ``dynamixel_sdk`` opens the slave side
(``bus.port``, or the ``link_path`` symlink) exactly like a USB serial adapter, so the driver runs
the same code path against the emulator as against the robot.

Each motor has a full control table (a ``bytearray`` laid out as in :mod:`.tables`), refuses EEPROM
writes while torque is on (status error 0x07, access error), rejects goal positions outside its
position limits (0x06, data limit error) and follows its goal with first-order dynamics (time
constant ``time_constant_s``) under a speed limit (``max_speed_rad_s``). Time is the wall clock
(``clock="wall"``) plus any explicit :meth:`advance`, or only :meth:`advance` (``clock="manual"``).
Moving is 1 while |Present Velocity| > Moving Threshold, as the e-manual defines it.

Indirect addressing: every read and write path (READ/WRITE, REG_WRITE/ACTION, sync, bulk and the
fast reads) resolves each Indirect Data byte to the byte its Indirect Address names, with that byte's
rules (read-only, EEPROM lock, goal limits, torque value); an Indirect Address outside the RAM area is
refused with a data range error (0x04).

Instructions: PING (unicast and broadcast), READ, WRITE, REG_WRITE/ACTION, FACTORY_RESET, REBOOT,
CLEAR (multi-turn reset: Result Fail while Moving, like the firmware), SYNC_READ, SYNC_WRITE,
FAST_SYNC_READ (0x8A) and FAST_BULK_READ (0x9A) (X series only, like the real firmware), BULK_READ,
BULK_WRITE. Status Return Level (0/1/2) is honoured.

Injected faults (:class:`FaultConfig`, all off by default): drop a reply with some probability,
corrupt a reply's CRC with some probability, a hardware error on some ids (sets Hardware Error
Status, the alert bit 0x80 in every status packet of that motor and, for shutdown bits, torque
off), and motors that stop answering altogether. A baud-rate check ignores every packet while the
client's port speed differs from the emulated bus speed (what a real bus does with a wrong baud).

CLI: :func:`emulate_bus_main` backs ``tensegrity emulate-bus``.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import select
import signal
import sys
import termios
import threading
import time
import tty
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from . import protocol as P
from .tables import ControlTable, decode, encode, get_table

log = logging.getLogger(__name__)

#: Baud rates the SDK accepts (PortHandler.getCFlagBaud); all have a termios constant on Linux.
STANDARD_BAUDS = (9600, 19200, 38400, 57600, 115200, 230400, 460800, 500000, 576000, 921600, 1000000,
                  1152000, 2000000, 2500000, 3000000, 3500000, 4000000)

#: Baud Rate register values (X and PRO tables agree on these; X also has 4.5M = 7, PRO 4.5M = 7, 10.5M = 8).
_BAUD_INDEX = {9600: 0, 57600: 1, 115200: 2, 1000000: 3, 2000000: 4, 3000000: 5, 4000000: 6}


def _baud_const(baud: int) -> Optional[int]:
    return getattr(termios, f"B{baud}", None)


@dataclass
class FaultConfig:
    """Faults to inject. All probabilities are per reply (a Fast Sync Read counts each device)."""

    drop_probability: float = 0.0
    corrupt_crc_probability: float = 0.0
    #: motor id -> Hardware Error Status bits raised at start (see :data:`tables.HARDWARE_ERROR_BITS`)
    hardware_errors: Dict[int, int] = field(default_factory=dict)
    #: motors that do not answer anything (as if unplugged)
    silent_ids: Set[int] = field(default_factory=set)


@dataclass
class EmulatorStats:
    packets_in: int = 0
    bad_crc_in: int = 0
    replies: int = 0
    dropped: int = 0
    corrupted: int = 0
    ignored_wrong_baud: int = 0
    rejected_goal_writes: int = 0
    refused_eeprom_writes: int = 0
    instructions: Dict[str, int] = field(default_factory=dict)


class _Motor:
    """One emulated motor: control table memory plus the physical state."""

    def __init__(self, dxl_id: int, table: ControlTable, baud: int, t0: float):
        self.id = dxl_id
        self.table = table
        self.baud = baud
        self.mem = bytearray(max(table.table_size, max(a + s for a, s in table.registers.values())))
        self.writable = bytearray(len(self.mem))  # 1 where a byte belongs to a RW register
        for name, (a, s) in table.registers.items():
            if name not in table.read_only:
                self.writable[a:a + s] = b"\x01" * s
        self.hw_error = 0
        self.external_load_a = 0.0
        self.registered: Optional[Tuple[int, bytes]] = None
        self.reset(t0, keep_position=False)

    # ---- memory helpers ---------------------------------------------------------------------
    def get(self, name: str) -> int:
        a, s = self.table.reg(name)
        return decode(self.mem[a:a + s], self.table.is_signed(name))

    def set(self, name: str, value: int) -> None:
        a, s = self.table.reg(name)
        self.mem[a:a + s] = encode(int(value), s)

    def reset(self, now: float, keep_position: bool = True) -> None:
        """Power-on / reboot: RAM and EEPROM to defaults (id, baud and position kept)."""
        pos = getattr(self, "pos", None)
        self.mem[:] = bytes(len(self.mem))
        t = self.table
        for name, value in t.defaults.items():
            self.set(name, value)
        self.set("id", self.id)
        idx = _BAUD_INDEX.get(self.baud)
        if idx is not None:
            self.set("baud_rate", idx)
        if keep_position and pos is not None:
            self.pos = pos
        else:
            self.pos = t.ticks_to_rad(t.defaults.get("present_position", t.zero_tick))
        self.vel = 0.0
        self.goal = self.pos
        self.t_last = now
        self.hw_error = 0
        self.registered = None
        self.set("goal_position", t.rad_to_ticks(self.goal))

    def target(self, address: int) -> int:
        """The byte an access to ``address`` really reaches: an Indirect Data byte stands for the byte
        its Indirect Address holds. One level only: a pointer at an Indirect Data byte (the power-on
        default points each one at itself) makes that byte plain storage."""
        ptr = self.table.indirect_pointer(address)
        if ptr is None:
            return address
        return self.mem[ptr] | (self.mem[ptr + 1] << 8)

    @property
    def torque_on(self) -> bool:
        return self.mem[self.table.addr("torque_enable")] != 0

    @property
    def status_return_level(self) -> int:
        return self.mem[self.table.addr("status_return_level")]

    @property
    def error_byte(self) -> int:
        return P.ERR_ALERT if self.hw_error else 0


class EmulatedBus:
    """Emulated Dynamixel motors behind a pseudo-terminal.

    Args:
        ids: motor ids on the bus.
        model: a model name for all ids, or ``{id: model}``.
        baud: the bus speed the motors use; a client opening the port at another speed gets no
            answers (set ``check_baud=False`` to accept any speed).
        link_path: create a symlink at this path pointing to the pty slave (removed on stop).
        time_constant_s, max_speed_rad_s: first-order position dynamics and speed limit.
        clock: "wall" (real time + advance()) or "manual" (only advance()).
        faults: a :class:`FaultConfig`.
        seed: seed of the fault random generator.
    """

    def __init__(self, ids: Sequence[int] = (1, 2, 3, 4, 5, 6),
                 model: Union[str, Mapping[int, str]] = "xm430", *, baud: int = 1_000_000,
                 link_path: Optional[str] = None, time_constant_s: float = 0.05,
                 max_speed_rad_s: float = 4.0, current_per_rad_s: float = 0.05,
                 load_compliance_rad_per_a: float = 0.0, clock: str = "wall",
                 faults: Optional[FaultConfig] = None, seed: Optional[int] = None,
                 check_baud: bool = True, start: bool = True):
        if baud not in STANDARD_BAUDS:
            raise ValueError(f"baud {baud} is not a standard rate the SDK accepts: {STANDARD_BAUDS}")
        if clock not in ("wall", "manual"):
            raise ValueError("clock must be 'wall' or 'manual'")
        ids = [int(i) for i in ids]
        if len(set(ids)) != len(ids) or any(not 0 <= i <= P.MAX_ID for i in ids):
            raise ValueError(f"ids must be unique and in 0..252, got {ids}")
        self.baud = baud
        self.time_constant_s = float(time_constant_s)
        self.max_speed_rad_s = float(max_speed_rad_s)
        self.current_per_rad_s = float(current_per_rad_s)
        self.load_compliance_rad_per_a = float(load_compliance_rad_per_a)
        self.clock = clock
        self.check_baud = check_baud
        self.faults = faults if faults is not None else FaultConfig()
        self.stats = EmulatorStats()
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._t0 = time.monotonic()
        self._offset = 0.0
        now = self._now()
        models = model if isinstance(model, Mapping) else {i: model for i in ids}
        self._motors: Dict[int, _Motor] = {}
        for i in ids:
            self._motors[i] = _Motor(i, get_table(models[i]), baud, now)
        for i, bits in self.faults.hardware_errors.items():
            self.inject_hardware_error(i, bits)

        self._master, self._slave = os.openpty()
        tty.setraw(self._slave)
        tty.setraw(self._master)
        attrs = termios.tcgetattr(self._slave)
        attrs[4] = attrs[5] = _baud_const(baud)
        termios.tcsetattr(self._slave, termios.TCSANOW, attrs)
        self.slave_path = os.ttyname(self._slave)
        self.link_path = link_path
        if link_path:
            if os.path.islink(link_path):
                os.unlink(link_path)
            elif os.path.exists(link_path):
                raise FileExistsError(f"{link_path} exists and is not a symlink; refusing to replace it")
            os.symlink(self.slave_path, link_path)
        self._parser = P.PacketParser()
        self._last_rx = 0.0
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def port(self) -> str:
        """The path to give to the SDK / DynamixelBus (the symlink if one was made)."""
        return self.link_path or self.slave_path

    @property
    def ids(self) -> Tuple[int, ...]:
        return tuple(self._motors)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="dxl-emulator", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop serving, close the pty and remove the symlink. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for fd in (self._master, self._slave, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.link_path and os.path.islink(self.link_path) and \
                os.readlink(self.link_path) == self.slave_path:
            os.unlink(self.link_path)

    def __enter__(self) -> "EmulatedBus":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # best effort; tests and the CLI call stop()
        try:
            self.stop()
        except Exception:
            pass

    # ---- time and physics -----------------------------------------------------------------------
    def _now(self) -> float:
        if self.clock == "wall":
            return time.monotonic() - self._t0 + self._offset
        return self._offset

    def now(self) -> float:
        """Emulated time in seconds."""
        with self._lock:
            return self._now()

    def advance(self, dt: float) -> None:
        """Move emulated time forward by ``dt`` seconds (in addition to the wall clock).

        Instructions without a reply (Sync Write, broadcast writes) are processed asynchronously
        by the server thread: do a round trip (any read or ping) before advancing if the step must
        see them."""
        if dt < 0:
            raise ValueError("cannot go back in time")
        with self._lock:
            self._offset += dt
            now = self._now()
            for m in self._motors.values():
                self._integrate(m, now)

    def _integrate(self, m: _Motor, now: float) -> None:
        dt = now - m.t_last
        m.t_last = now
        if dt <= 0:
            return
        if not m.torque_on:
            m.vel = 0.0
            return
        goal = m.goal - self.load_compliance_rad_per_a * m.external_load_a
        tau, vmax = max(self.time_constant_s, 1e-6), self.max_speed_rad_s
        e = goal - m.pos
        sign = 1.0 if e >= 0 else -1.0
        # saturated phase: |e| / tau > vmax -> move at vmax until |e| = vmax * tau
        sat_err = vmax * tau
        if abs(e) > sat_err:
            t_sat = (abs(e) - sat_err) / vmax
            if dt <= t_sat:
                m.pos += sign * vmax * dt
                m.vel = sign * vmax
                return
            m.pos = goal - sign * sat_err
            dt -= t_sat
            e = sign * sat_err
        e_new = e * math.exp(-dt / tau)
        m.pos = goal - e_new
        m.vel = e_new / tau

    def _refresh(self, m: _Motor) -> None:
        """Bring a motor's physics to now and write its present-value registers."""
        self._integrate(m, self._now())
        t = m.table
        m.set("present_position", int(round(m.pos / t.rad_per_tick)) + t.zero_tick)
        vel = t.rad_s_to_velocity(m.vel)
        m.set("present_velocity", vel)
        cur = m.external_load_a + self.current_per_rad_s * m.vel
        m.set("present_current", max(-32768, min(32767, t.amp_to_current(cur))))
        # e-manual Moving(122): 1 while |Present Velocity| > Moving Threshold (both in velocity units).
        # Not "any velocity at all": the first-order approach leaves a creep of a few 1e-3 rad/s for a
        # long time, and a real motor holding its position reads 0 here (so CLEAR is accepted). There
        # is no profile generator, so the "profile in progress" clause never applies.
        m.set("moving", 1 if abs(vel) > m.get("moving_threshold") else 0)
        m.set("hardware_error_status", m.hw_error)
        if "realtime_tick" in t.registers:
            m.set("realtime_tick", int(self._now() * 1000) % 32768)

    # ---- simulator / test hooks -------------------------------------------------------------------
    def present_positions_rad(self) -> Dict[int, float]:
        """Current motor angles (rad, 0 = the table's zero tick), keyed by id."""
        with self._lock:
            now = self._now()
            out = {}
            for i, m in self._motors.items():
                self._integrate(m, now)
                out[i] = m.pos
            return out

    def goal_positions_rad(self) -> Dict[int, float]:
        with self._lock:
            return {i: m.goal for i, m in self._motors.items()}

    def torque_enabled(self) -> Dict[int, bool]:
        with self._lock:
            return {i: m.torque_on for i, m in self._motors.items()}

    def set_external_load(self, motor_id: int, current_a: float) -> None:
        """An external load on a motor, expressed as the current it draws (A). It shows up in
        Present Current and deflects the position by ``load_compliance_rad_per_a * current``."""
        with self._lock:
            self._integrate(self._motors[motor_id], self._now())
            self._motors[motor_id].external_load_a = float(current_a)

    def set_position(self, motor_id: int, rad: float) -> None:
        """Teleport a motor (test setup); the goal is left alone."""
        with self._lock:
            m = self._motors[motor_id]
            self._integrate(m, self._now())
            m.pos, m.vel = float(rad), 0.0

    def table(self, motor_id: int) -> ControlTable:
        """The control table (model) of an emulated motor."""
        return self._motors[motor_id].table

    def register(self, motor_id: int, name: str) -> int:
        """Read a register of an emulated motor directly (for tests)."""
        with self._lock:
            m = self._motors[motor_id]
            self._refresh(m)
            return m.get(name)

    # ---- fault injection --------------------------------------------------------------------------
    def inject_hardware_error(self, motor_id: int, bits: int) -> None:
        """Raise Hardware Error Status ``bits`` on a motor (alert bit in its status packets); bits in
        its Shutdown register turn its torque off. Cleared by REBOOT."""
        with self._lock:
            m = self._motors[motor_id]
            self._integrate(m, self._now())
            m.hw_error |= bits & 0xFF
            m.set("hardware_error_status", m.hw_error)
            if m.hw_error & m.get("shutdown"):
                m.set("torque_enable", 0)
                m.vel = 0.0

    def set_silent(self, motor_id: int, silent: bool = True) -> None:
        with self._lock:
            (self.faults.silent_ids.add if silent else self.faults.silent_ids.discard)(motor_id)

    def set_fault_probabilities(self, drop: Optional[float] = None, corrupt_crc: Optional[float] = None) -> None:
        with self._lock:
            if drop is not None:
                self.faults.drop_probability = float(drop)
            if corrupt_crc is not None:
                self.faults.corrupt_crc_probability = float(corrupt_crc)

    # ---- serving ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                r, _, _ = select.select([self._master, self._wake_r], [], [], 0.1)
            except (OSError, ValueError):
                return
            if self._stop.is_set():
                return
            if self._master not in r:
                continue
            try:
                data = os.read(self._master, 4096)
            except OSError:
                time.sleep(0.01)
                continue
            if not data:
                continue
            now = time.monotonic()
            if now - self._last_rx > 0.5:
                self._parser.reset()  # an idle gap ends any half-received packet
            self._last_rx = now
            for pkt in self._parser.feed(data):
                try:
                    self._handle(pkt)
                except Exception:  # never let a bad packet kill the bus
                    log.exception("emulator failed to handle %r", pkt)

    def _baud_ok(self) -> bool:
        if not self.check_baud:
            return True
        try:
            attrs = termios.tcgetattr(self._slave)
        except termios.error:
            return True
        return attrs[5] == _baud_const(self.baud)

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._master, view)
            except BlockingIOError:
                time.sleep(0.0005)
                continue
            except OSError:
                return
            view = view[n:]

    def _maybe_fault(self, pkt: bytes) -> Optional[bytes]:
        f = self.faults
        if f.drop_probability > 0 and self._rng.random() < f.drop_probability:
            self.stats.dropped += 1
            return None
        if f.corrupt_crc_probability > 0 and self._rng.random() < f.corrupt_crc_probability:
            self.stats.corrupted += 1
            return pkt[:-2] + bytes((pkt[-2] ^ 0xFF, pkt[-1] ^ 0x5A))
        return pkt

    def _reply(self, m: _Motor, error: int, params: bytes = b"", *, inst: int = 0) -> None:
        if m.status_return_level == 0 and inst != P.PING:
            return
        if m.status_return_level == 1 and inst not in (P.PING, P.READ, P.SYNC_READ, P.BULK_READ):
            return
        pkt = self._maybe_fault(P.build_status(m.id, error | m.error_byte, params))
        if pkt is not None:
            self.stats.replies += 1
            self._send(pkt)

    def _alive(self, dxl_id: int) -> Optional[_Motor]:
        m = self._motors.get(dxl_id)
        if m is None or dxl_id in self.faults.silent_ids:
            return None
        return m

    def _handle(self, pkt) -> None:
        with self._lock:
            if not self._baud_ok():
                self.stats.ignored_wrong_baud += 1
                return
            if isinstance(pkt, P.BadPacket):
                self.stats.bad_crc_in += 1
                m = self._alive(pkt.dxl_id)
                if m is not None:
                    self._reply(m, P.ERR_CRC)
                return
            if pkt.is_status:
                return  # our own traffic echoed, or another device's status: ignore
            self.stats.packets_in += 1
            name = P.INSTRUCTION_NAMES.get(pkt.instruction, hex(pkt.instruction))
            self.stats.instructions[name] = self.stats.instructions.get(name, 0) + 1
            handler = {
                P.PING: self._ping, P.READ: self._read, P.WRITE: self._write, P.REG_WRITE: self._reg_write,
                P.ACTION: self._action, P.REBOOT: self._reboot, P.FACTORY_RESET: self._factory_reset,
                P.CLEAR: self._clear, P.SYNC_READ: self._sync_read, P.SYNC_WRITE: self._sync_write,
                P.FAST_SYNC_READ: self._fast_sync_read, P.BULK_READ: self._bulk_read,
                P.BULK_WRITE: self._bulk_write, P.FAST_BULK_READ: self._fast_bulk_read,
            }.get(pkt.instruction)
            if handler is None:
                if pkt.dxl_id != P.BROADCAST_ID:
                    m = self._alive(pkt.dxl_id)
                    if m is not None:
                        self._reply(m, P.ERR_INSTRUCTION)
                return
            handler(pkt)

    def _targets(self, dxl_id: int) -> List[_Motor]:
        if dxl_id == P.BROADCAST_ID:
            return [m for i, m in sorted(self._motors.items()) if i not in self.faults.silent_ids]
        m = self._alive(dxl_id)
        return [m] if m is not None else []

    # ---- register access with the device's rules -------------------------------------------------
    def _do_read(self, m: _Motor, addr: int, length: int) -> Tuple[int, bytes]:
        if length <= 0 or addr < 0 or addr + length > len(m.mem):
            return P.ERR_ACCESS, b""
        self._refresh(m)
        data = bytearray(m.mem[addr:addr + length])
        if m.table.overlaps_indirect_data(addr, length):
            for k in range(length):
                data[k] = m.mem[m.target(addr + k)]
        return 0, bytes(data)

    def _do_write(self, m: _Motor, addr: int, data: bytes) -> int:
        """Write ``data`` at ``addr`` with the device's rules; the status error (0 = written).

        Nothing is written unless every byte is accepted: the checks run on the bytes as they will
        land (an Indirect Data byte lands on the byte its Indirect Address names and inherits its
        access rights, EEPROM lock and value checks, e-manual), then the whole write is applied."""
        n = len(data)
        if n == 0 or addr < 0 or addr + n > len(m.mem):
            return P.ERR_ACCESS
        t = m.table
        if t.overlaps_indirect_data(addr, n):
            writes: Dict[int, int] = {}
            for k in range(n):
                writes[m.target(addr + k)] = data[k]
        else:  # the common case (goals, torque): no byte to resolve
            writes = dict(zip(range(addr, addr + n), data))
        if not all(m.writable[a] for a in writes):
            return P.ERR_ACCESS
        if m.torque_on and any(a < t.eeprom_end for a in writes):
            self.stats.refused_eeprom_writes += 1
            return P.ERR_ACCESS

        def after(a: int, size: int, signed: bool = False) -> Optional[int]:
            """The value at [a, a + size) once this write is applied; None if the write misses it."""
            if not any(a + i in writes for i in range(size)):
                return None
            return decode(bytes(writes.get(a + i, m.mem[a + i]) for i in range(size)), signed)

        self._integrate(m, self._now())
        new_goal = None
        ticks = after(*t.reg("goal_position"), signed=True)
        if ticks is not None:
            lo, hi = m.get("min_position_limit"), m.get("max_position_limit")
            if m.get("operating_mode") == t.position_mode and not lo <= ticks <= hi:
                self.stats.rejected_goal_writes += 1
                return P.ERR_DATA_LIMIT
            new_goal = t.ticks_to_rad(ticks)
        torque = after(*t.reg("torque_enable"))
        if torque is not None:
            if torque > 1:
                return P.ERR_DATA_RANGE
            if torque == 1 and m.hw_error & m.get("shutdown"):
                return P.ERR_RESULT_FAIL  # shut down: needs a REBOOT first
        lo, hi = t.indirect_target_range
        for slot in {t.indirect_address_slot(a) for a in writes} - {None}:
            if not lo <= after(slot, 2) <= hi:
                return P.ERR_DATA_RANGE  # only RAM addresses may be assigned (e-manual)
        for a, b in writes.items():
            m.mem[a] = b
        if new_goal is not None:
            m.goal = new_goal
        return 0

    # ---- instruction handlers ----------------------------------------------------------------------
    def _ping(self, pkt: P.Packet) -> None:
        for m in self._targets(pkt.dxl_id):
            t = m.table
            params = encode(t.model_number, 2) + bytes((m.get("firmware_version"),))
            pkt_out = self._maybe_fault(P.build_status(m.id, m.error_byte, params))
            if pkt_out is not None:
                self.stats.replies += 1
                self._send(pkt_out)

    def _read(self, pkt: P.Packet) -> None:
        if pkt.dxl_id == P.BROADCAST_ID or len(pkt.params) != 4:
            m = self._alive(pkt.dxl_id)
            if m is not None:
                self._reply(m, P.ERR_DATA_LENGTH, inst=P.READ)
            return
        m = self._alive(pkt.dxl_id)
        if m is None:
            return
        addr, length = decode(pkt.params[0:2]), decode(pkt.params[2:4])
        err, data = self._do_read(m, addr, length)
        self._reply(m, err, data, inst=P.READ)

    def _write(self, pkt: P.Packet) -> None:
        if len(pkt.params) < 3:
            return
        addr, data = decode(pkt.params[0:2]), bytes(pkt.params[2:])
        for m in self._targets(pkt.dxl_id):
            err = self._do_write(m, addr, data)
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, err, inst=P.WRITE)

    def _reg_write(self, pkt: P.Packet) -> None:
        if len(pkt.params) < 3:
            return
        for m in self._targets(pkt.dxl_id):
            m.registered = (decode(pkt.params[0:2]), bytes(pkt.params[2:]))
            m.set("registered_instruction", 1)
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, 0, inst=P.REG_WRITE)

    def _action(self, pkt: P.Packet) -> None:
        for m in self._targets(pkt.dxl_id):
            err = 0
            if m.registered is None:
                err = P.ERR_INSTRUCTION
            else:
                err = self._do_write(m, *m.registered)
                m.registered = None
                m.set("registered_instruction", 0)
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, err, inst=P.ACTION)

    def _reboot(self, pkt: P.Packet) -> None:
        for m in self._targets(pkt.dxl_id):
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, 0, inst=P.REBOOT)
            self._integrate(m, self._now())
            m.reset(self._now(), keep_position=True)

    def _factory_reset(self, pkt: P.Packet) -> None:
        for m in self._targets(pkt.dxl_id):
            if m.torque_on:
                err = P.ERR_ACCESS
            else:
                err = 0
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, err, inst=P.FACTORY_RESET)
            if not err:
                m.reset(self._now(), keep_position=True)

    def _clear(self, pkt: P.Packet) -> None:
        for m in self._targets(pkt.dxl_id):
            err = self._clear_multi_turn(m, pkt.params)
            if pkt.dxl_id != P.BROADCAST_ID:
                self._reply(m, err, inst=P.CLEAR)

    def _clear_multi_turn(self, m: _Motor, params: bytes) -> int:
        """CLEAR option 0x01: bring Present Position back within one turn; the status error.

        The e-manual: only while the motor is stopped, else Result Fail; "stopped" is the Moving
        register (|Present Velocity| <= Moving Threshold), so a motor told to hold its position is
        accepted once it has settled. Other options / a wrong key get a data range error (the e-manual
        does not say; the X firmware knows no other option). The goal moves by the same whole turns,
        so the motor stays where it is instead of unwinding the turns it was cleared of."""
        if bytes(params) != P.CLEAR_MULTI_TURN:
            return P.ERR_DATA_RANGE
        self._refresh(m)
        if m.get("moving"):
            return P.ERR_RESULT_FAIL
        t = m.table
        turns = (m.get("present_position") - t.position_range[0]) // t.ticks_per_rev
        if turns:
            m.pos -= turns * 2.0 * math.pi
            m.goal -= turns * 2.0 * math.pi
            m.set("goal_position", m.get("goal_position") - turns * t.ticks_per_rev)
            self._refresh(m)
        return 0

    def _sync_header(self, pkt: P.Packet) -> Optional[Tuple[int, int]]:
        if pkt.dxl_id != P.BROADCAST_ID or len(pkt.params) < 4:
            return None
        return decode(pkt.params[0:2]), decode(pkt.params[2:4])

    def _sync_read(self, pkt: P.Packet) -> None:
        hdr = self._sync_header(pkt)
        if hdr is None:
            return
        addr, length = hdr
        for dxl_id in pkt.params[4:]:
            m = self._alive(dxl_id)
            if m is None:
                continue
            err, data = self._do_read(m, addr, length)
            self._reply(m, err, data, inst=P.SYNC_READ)

    def _fast_sync_read(self, pkt: P.Packet) -> None:
        hdr = self._sync_header(pkt)
        if hdr is None:
            return
        addr, length = hdr
        self._fast_read([(dxl_id, addr, length) for dxl_id in pkt.params[4:]])

    def _fast_bulk_read(self, pkt: P.Packet) -> None:
        if pkt.dxl_id != P.BROADCAST_ID:
            return
        body = pkt.params
        self._fast_read([(body[k], decode(body[k + 1:k + 3]), decode(body[k + 3:k + 5]))
                         for k in range(0, len(body) - 4, 5)])

    def _fast_read(self, requests: Sequence[Tuple[int, int, int]]) -> None:
        """Answer a Fast Sync Read or Fast Bulk Read, ``requests`` = [(id, address, length)] in packet
        order, with one combined status packet (:func:`protocol.build_fast_read_status`)."""
        entries = []
        for dxl_id, addr, length in requests:
            m = self._motors.get(dxl_id)
            if m is None or not m.table.fast_sync_read:
                return  # the chain does not start / firmware without the fast reads: no answer
            err, data = self._do_read(m, addr, length)
            entries.append((dxl_id, err | m.error_byte, data if not err else bytes(length)))
        if not entries:
            return
        full = P.build_fast_read_status(entries)
        # the chain breaks at the first device that does not answer: the packet is cut there
        cut, start = len(full), 8
        for dxl_id, _, length in requests:
            dropped = dxl_id in self.faults.silent_ids or (
                self.faults.drop_probability > 0 and self._rng.random() < self.faults.drop_probability)
            if dropped:
                self.stats.dropped += 1
                cut = start
                break
            start += length + 4
        out = full[:cut]
        if cut == len(full) and self.faults.corrupt_crc_probability > 0 and \
                self._rng.random() < self.faults.corrupt_crc_probability:
            self.stats.corrupted += 1
            out = out[:-2] + bytes((out[-2] ^ 0xFF, out[-1] ^ 0x5A))
        if cut > 8:
            self.stats.replies += 1
            self._send(out)

    def _sync_write(self, pkt: P.Packet) -> None:
        hdr = self._sync_header(pkt)
        if hdr is None:
            return
        addr, length = hdr
        body = pkt.params[4:]
        step = length + 1
        for k in range(0, len(body) - step + 1, step):
            m = self._alive(body[k])
            if m is not None:
                self._do_write(m, addr, bytes(body[k + 1:k + step]))

    def _bulk_read(self, pkt: P.Packet) -> None:
        if pkt.dxl_id != P.BROADCAST_ID:
            return
        body = pkt.params
        for k in range(0, len(body) - 4, 5):
            m = self._alive(body[k])
            if m is None:
                continue
            err, data = self._do_read(m, decode(body[k + 1:k + 3]), decode(body[k + 3:k + 5]))
            self._reply(m, err, data, inst=P.BULK_READ)

    def _bulk_write(self, pkt: P.Packet) -> None:
        if pkt.dxl_id != P.BROADCAST_ID:
            return
        body, k = pkt.params, 0
        while k + 5 <= len(body):
            dxl_id, addr, length = body[k], decode(body[k + 1:k + 3]), decode(body[k + 3:k + 5])
            data = bytes(body[k + 5:k + 5 + length])
            m = self._alive(dxl_id)
            if m is not None:
                self._do_write(m, addr, data)
            k += 5 + length


# ---- CLI ---------------------------------------------------------------------------------------------
def _parse_ids(text: str) -> List[int]:
    ids: List[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            ids.extend(range(int(a), int(b) + 1))
        else:
            ids.append(int(part))
    return ids


def _parse_models(text: str, ids: Sequence[int]) -> Union[str, Dict[int, str]]:
    """``xm430`` or ``1-3:l54-50-s290-r,4-6:m42-10-s260-r``."""
    if ":" not in text:
        return text
    out: Dict[int, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        sel, name = part.rsplit(":", 1)
        for i in _parse_ids(sel):
            out[i] = name.strip()
    missing = [i for i in ids if i not in out]
    if missing:
        raise ValueError(f"--model gives no model for ids {missing}")
    return out


def _parse_hw(items: Iterable[str]) -> Dict[int, int]:
    out = {}
    for item in items:
        i, bits = item.split(":", 1)
        out[int(i)] = int(bits, 0)
    return out


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``tensegrity emulate-bus`` options (for the CLI's subcommand module)."""
    p.add_argument("--link", default=None, help="create a symlink at PATH to the pty (e.g. /tmp/ttyDXL)")
    p.add_argument("--ids", default="1,2,3,4,5,6", help="motor ids, e.g. 1,2,3 or 1-6")
    p.add_argument("--model", default="xm430",
                   help="model for all ids (xm430, xm540, l54-50-s290-r, m42-10-s260-r), or per id: "
                        "1-3:l54-50-s290-r,4-6:m42-10-s260-r")
    p.add_argument("--baud", type=int, default=1_000_000, help="bus baud rate (standard rates up to 4000000)")
    p.add_argument("--tau", type=float, default=0.05, help="position time constant [s]")
    p.add_argument("--max-speed", type=float, default=4.0, help="speed limit [rad/s]")
    p.add_argument("--clock", choices=("wall", "manual"), default="wall")
    p.add_argument("--fault-drop", type=float, default=0.0, help="probability of dropping a reply")
    p.add_argument("--fault-crc", type=float, default=0.0, help="probability of corrupting a reply's CRC")
    p.add_argument("--fault-hw", action="append", default=[], metavar="ID:BITS",
                   help="raise Hardware Error Status BITS on motor ID (e.g. 3:0x20 = overload); repeatable")
    p.add_argument("--fault-silent", default="", help="ids that never answer, e.g. 4 or 4,5")
    p.add_argument("--no-baud-check", action="store_true", help="answer whatever speed the client uses")
    p.add_argument("--seed", type=int, default=None)
    return p


def build_arg_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="tensegrity emulate-bus",
        description="Serve emulated Dynamixel motors (Protocol 2.0) on a pseudo-terminal until SIGINT/SIGTERM."))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM with parsed ``args``; 0 on a clean stop, 2 on bad options."""
    try:
        ids = _parse_ids(args.ids)
        faults = FaultConfig(drop_probability=args.fault_drop, corrupt_crc_probability=args.fault_crc,
                             hardware_errors=_parse_hw(args.fault_hw),
                             silent_ids=set(_parse_ids(args.fault_silent)))
        models = _parse_models(args.model, ids)
        bus = EmulatedBus(ids, models, baud=args.baud, link_path=args.link, time_constant_s=args.tau,
                          max_speed_rad_s=args.max_speed, clock=args.clock, faults=faults, seed=args.seed,
                          check_baud=not args.no_baud_check, start=False)
    except (ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"tensegrity emulate-bus: error: {msg}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with bus:
            bus.start()
            names = {i: bus.table(i).full_name for i in bus.ids}
            print(f"emulated Dynamixel bus: {len(ids)} motor(s) {names} at {args.baud} baud on "
                  f"{bus.slave_path}" + (f" (link {args.link})" if args.link else ""), flush=True)
            print("press Ctrl-C to stop", flush=True)
            while not stop.wait(0.5):
                pass
            print(f"stopping; served {bus.stats.packets_in} packets, {bus.stats.replies} replies", flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def emulate_bus_main(argv: Optional[Sequence[str]] = None) -> int:
    """``tensegrity emulate-bus``: serve until SIGINT/SIGTERM. Returns the exit code."""
    return run(build_arg_parser().parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(emulate_bus_main())
