"""A Dynamixel Protocol 2.0 bus over the unmodified ``dynamixel_sdk``.

:class:`DynamixelBus` owns the serial port through one dedicated thread: every SDK call is
submitted to that thread and the caller waits for the result, so the port is never used from two
threads at once whatever thread the caller is (ROS executor, timer, signal handler...).

What it does:

- ``open()``: checks the device exists and is accessible (:class:`PortNotFound`), warns if the
  FTDI latency timer (``/sys/bus/usb-serial/devices/<tty>/latency_timer``) is above 1 ms (absent
  for a pty: skipped), opens the port at the configured baud, pings every id and checks its model
  number. If nobody answers it probes the other standard baud rates to tell :class:`BaudMismatch`
  from :class:`NoResponse`; a subset answering raises :class:`MotorMissing`.
- position operating mode, torque on (goal := present first, so nothing jumps) / off,
- ``write_goals``: GroupSyncWrite of Goal Position, grouped by control-table layout,
- ``read_states``: present position + velocity + current in one Sync Read per layout, or Fast
  Sync Read (0x8A) when every motor of the group supports it. The SDK's GroupSyncRead hides each
  device's status error byte, so the bus sends the group's instruction with the SDK
  (``GroupSyncRead.txPacket``/``fastSyncReadTxPacket``) and receives with the SDK packet handler's
  ``readRx``/``fastSyncReadRx``, keeping each device's error byte. A set alert bit (0x80) triggers
  a read of Hardware Error Status (70 on X, 892 on PRO).
- retries with per-motor counters; a motor failing ``missing_after`` reads in a row raises
  :class:`MotorMissing`,
- ``reboot(id)`` and ``close()``, which always tries to disable torque first (also from an
  ``atexit`` hook if the owner forgot to close).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import logging
import math
import os
import select
import queue
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import dynamixel_sdk as sdk

from . import protocol as P
from .errors import (BaudMismatch, CommError, HardwareError, ModelMismatch, MotorMissing, NoResponse,
                     PacketError, PortNotFound)
from .tables import ControlTable, decode, decode_hardware_error, encode, get_table, to_signed

log = logging.getLogger(__name__)

STATE_REGISTERS = ("present_position", "present_velocity", "present_current")
SDK_BAUDS = (9600, 19200, 38400, 57600, 115200, 230400, 460800, 500000, 576000, 921600, 1000000, 1152000,
             2000000, 2500000, 3000000, 3500000, 4000000)
DEFAULT_BAUD_SCAN = (57600, 1000000, 2000000, 3000000, 4000000, 115200)


@dataclass(frozen=True)
class MotorReading:
    motor_id: int
    position_rad: float
    velocity_rad_s: float
    current_a: float
    position_ticks: int
    #: status packet error byte (bit 7 = hardware alert)
    status_error: int = 0
    #: Hardware Error Status register (read when the alert bit is set)
    hardware_error: int = 0


@dataclass
class MotorCounters:
    """Per-motor communication counters (monotonic, never reset by the bus)."""

    reads: int = 0
    timeouts: int = 0
    corrupt: int = 0
    packet_errors: int = 0
    hardware_alerts: int = 0
    retries: int = 0
    failures: int = 0
    consecutive_failures: int = 0


def latency_timer_path(port: str) -> str:
    """Where Linux exposes the FTDI latency timer of ``port`` (may not exist)."""
    tty = os.path.basename(os.path.realpath(port))
    return f"/sys/bus/usb-serial/devices/{tty}/latency_timer"


def read_latency_timer_ms(port: str) -> Optional[int]:
    """The FTDI latency timer in ms, or None when the port has none (pty, CDC-ACM, non-Linux)."""
    try:
        with open(latency_timer_path(port)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class _PortHandler(sdk.PortHandler):
    """The SDK's PortHandler with two changes; every byte still goes through the SDK's packet handler.

    * The receive timeout is computed from the real latency timer (``latency_ms``; None = the SDK's 16 ms).
      The SDK assumes a 16 ms FTDI latency timer (timeout = bytes + 2*16 + 2 ms); with the timer set to
      1 ms that wastes ~30 ms per lost packet, i.e. several 80 Hz cycles.
    * A read with nothing received yet WAITS for bytes (``select`` on the port, at most the packet's remaining
      timeout) instead of returning empty: the SDK's receive loop calls ``readPort`` back to back until the
      packet is complete, so with a non-blocking port it spins a core for the whole transaction (profiled in
      the demo: a quarter of the robot process's samples in that loop). Same bytes, same timeouts, no spin.
    """

    def __init__(self, port_name: str, latency_ms: Optional[float] = None):
        super().__init__(port_name)
        self.latency_ms = None if latency_ms is None else float(latency_ms)

    def setPacketTimeout(self, packet_length):  # noqa: N802 (SDK naming)
        if self.latency_ms is None:
            return super().setPacketTimeout(packet_length)
        self.packet_start_time = self.getCurrentTime()
        self.packet_timeout = (self.tx_time_per_byte * packet_length) + (self.latency_ms * 2.0) + 2.0

    def readPort(self, length):  # noqa: N802 (SDK naming)
        ser = self.ser
        if ser.in_waiting == 0 and self.packet_timeout > 0:
            remaining_ms = self.packet_timeout - self.getTimeSinceStart()
            if remaining_ms > 0:
                select.select([ser.fileno()], [], [], remaining_ms * 1e-3)
        return ser.read(length)


class _Owner:
    """A single thread that executes every port operation."""

    def __init__(self, name: str):
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def in_owner(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def call(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs):
        if self.in_owner():
            return fn(*args, **kwargs)
        if not self.alive:
            raise RuntimeError("the bus port thread is not running (bus closed)")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, fn, args, kwargs))
        return fut.result(timeout)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)

    def stop(self) -> None:
        if self.alive:
            self._q.put(None)
            if not self.in_owner():
                self._thread.join(timeout=5.0)


@dataclass
class _Group:
    """Motors sharing one control-table layout for a group transaction."""

    table: ControlTable
    ids: List[int]
    fast: bool
    read_start: int = 0
    read_len: int = 0
    sync_read: Optional[sdk.GroupSyncRead] = None
    sync_write: Optional[sdk.GroupSyncWrite] = None


def _close_at_exit(ref: "weakref.ReferenceType[DynamixelBus]") -> None:
    bus = ref()
    if bus is not None and bus.is_open:
        log.warning("DynamixelBus on %s was not closed; disabling torque at exit", bus.port)
        try:
            bus.close()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            log.exception("torque off at exit failed")


class DynamixelBus:
    """Dynamixel motors on one serial port.

    Args:
        port: device path (``/dev/ttyUSB0``, a ``/dev/serial/by-id/...`` link, or an emulator pty).
        baud: one of the SDK's standard rates (up to 4 Mbit/s).
        motors: ``{id: model}`` (model names as in :mod:`.tables`), or a list of ids with ``model``.
        retries: extra attempts per transaction before a failure is counted.
        fast_sync_read: None = use Fast Sync Read where every motor of a group supports it.
        missing_after: consecutive failed reads after which a motor is declared missing.
        latency_ms: receive-timeout basis; None = the port's FTDI latency timer if readable,
            else the SDK default (16 ms).
        baud_scan: baud rates probed when nobody answers, to diagnose a baud mismatch.
    """

    def __init__(self, port: str, baud: int, motors: Union[Mapping[int, str], Sequence[int]],
                 model: Optional[str] = None, *, retries: int = 2, fast_sync_read: Optional[bool] = None,
                 missing_after: int = 3, latency_ms: Optional[float] = None,
                 baud_scan: Sequence[int] = DEFAULT_BAUD_SCAN, call_timeout_s: float = 10.0,
                 max_latency_timer_ms: int = 1):
        if baud not in SDK_BAUDS:
            raise ValueError(f"baud {baud} is not supported by dynamixel_sdk (allowed: {SDK_BAUDS})")
        if not isinstance(motors, Mapping):
            if model is None:
                raise ValueError("give motors as {id: model} or ids plus model=")
            motors = {int(i): model for i in motors}
        if not motors:
            raise ValueError("no motors configured")
        self.port = str(port)
        self.baud = int(baud)
        self.tables: Dict[int, ControlTable] = {int(i): get_table(m) for i, m in motors.items()}
        self.ids: Tuple[int, ...] = tuple(self.tables)
        self.retries = max(0, int(retries))
        self.fast_sync_read = fast_sync_read
        self.missing_after = max(1, int(missing_after))
        self.latency_ms = latency_ms
        self._baud_scan_all = tuple(baud_scan)
        self.baud_scan = tuple(b for b in baud_scan if b != self.baud)
        self.call_timeout_s = call_timeout_s
        self.max_latency_timer_ms = max_latency_timer_ms
        self.counters: Dict[int, MotorCounters] = {i: MotorCounters() for i in self.ids}
        self.hardware_errors: Dict[int, int] = {i: 0 for i in self.ids}
        self.model_numbers: Dict[int, int] = {}
        self.warnings: List[str] = []
        self.bus_counters = {"group_reads": 0, "group_read_failures": 0, "fallback_reads": 0,
                             "sync_writes": 0, "write_failures": 0}
        self._ph = sdk.PacketHandler(2.0)
        self._port: Optional[sdk.PortHandler] = None
        self._owner: Optional[_Owner] = None
        self._groups: List[_Group] = []
        self._torque_on = False
        self._atexit = None
        self._closing = False

    # ---- threading --------------------------------------------------------------------------------
    def _call(self, fn: Callable, *args, **kwargs):
        if self._owner is None:
            raise RuntimeError("bus is not open; call open() first")
        try:
            return self._owner.call(fn, *args, timeout=self.call_timeout_s, **kwargs)
        except concurrent.futures.TimeoutError:
            raise CommError("bus call", sdk.COMM_RX_TIMEOUT,
                            f"port thread did not answer within {self.call_timeout_s} s") from None

    @property
    def is_open(self) -> bool:
        return self._port is not None

    @property
    def uses_fast_sync_read(self) -> Dict[int, bool]:
        """{id: True if its state is read with Fast Sync Read} (known after open())."""
        return {i: g.fast for g in self._groups for i in g.ids}

    # ---- open / close -------------------------------------------------------------------------------
    def open(self, port: Optional[str] = None, baud: Optional[int] = None,
             check_hardware_errors: bool = True) -> "DynamixelBus":
        """Open the port (optionally another ``port``/``baud`` than given at construction), ping
        every motor, read their hardware error status.

        Raises PortNotFound, BaudMismatch, NoResponse, MotorMissing, ModelMismatch and (with
        ``check_hardware_errors``) HardwareError; the port is closed again on any failure.
        """
        if self.is_open:
            return self
        if port is not None:
            self.port = str(port)
        if baud is not None:
            if baud not in SDK_BAUDS:
                raise ValueError(f"baud {baud} is not supported by dynamixel_sdk (allowed: {SDK_BAUDS})")
            self.baud = int(baud)
            self.baud_scan = tuple(b for b in self._baud_scan_all if b != self.baud)
        self._owner = _Owner(f"dxl-bus:{os.path.basename(self.port)}")
        try:
            self._call(self._open_impl)
            if check_hardware_errors:
                self.raise_on_hardware_error()
        except BaseException:
            if self._port is not None and self._groups:
                try:  # motors answered: make sure none is left holding torque from an earlier run
                    self._call(self._torque_off_all_impl)
                except Exception:
                    pass
            self._call(self._close_port_impl)
            self._owner.stop()
            self._owner = None
            raise
        self._atexit = _close_at_exit_hook(self)
        return self

    def __enter__(self) -> "DynamixelBus":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _open_impl(self) -> None:
        if not os.path.exists(self.port):
            raise PortNotFound(self.port, "no such device")
        if not os.access(self.port, os.R_OK | os.W_OK):
            raise PortNotFound(self.port, "permission denied")
        lat = read_latency_timer_ms(self.port)
        if lat is not None and lat > self.max_latency_timer_ms:
            msg = (f"FTDI latency timer of {self.port} is {lat} ms (> {self.max_latency_timer_ms} ms): each "
                   f"transaction waits up to {lat} ms; set it with `echo 1 | sudo tee "
                   f"{latency_timer_path(self.port)}` or the udev rule in docs/hardware.md")
            self.warnings.append(msg)
            log.warning(msg)
        latency = self.latency_ms if self.latency_ms is not None else lat
        port = _PortHandler(self.port, latency)
        try:
            if not port.openPort():
                raise PortNotFound(self.port, "openPort() failed")
            if not port.setBaudRate(self.baud):
                raise PortNotFound(self.port, f"cannot set baud {self.baud}")
        except PortNotFound:
            raise
        except Exception as e:  # serial.SerialException, OSError
            raise PortNotFound(self.port, str(e)) from e
        self._port = port
        found = self._ping_impl(self.ids)
        if not found:
            found_baud = self._scan_bauds_impl()
            if found_baud is not None:
                raise BaudMismatch(self.port, self.baud, self.ids, found_baud)
            raise NoResponse(self.port, self.baud, self.ids)
        missing = [i for i in self.ids if i not in found]
        if missing:
            raise MotorMissing(missing[0], f"no answer to PING at {self.baud} baud; "
                                           f"answering: {sorted(found)}, missing: {missing}")
        for i, model_number in found.items():
            if model_number != self.tables[i].model_number:
                raise ModelMismatch(i, self.tables[i].model_number, model_number)
        self.model_numbers = dict(found)
        self._build_groups()
        for i in self.ids:
            self.hardware_errors[i] = self._read_impl(i, "hardware_error_status")

    def _scan_bauds_impl(self) -> Optional[int]:
        probe = self.ids[0]
        try:
            for b in self.baud_scan:
                if not self._port.setBaudRate(b):
                    continue
                for i in (probe,) + tuple(x for x in self.ids[1:2]):
                    _, res, _ = self._ph.ping(self._port, i)
                    if res == sdk.COMM_SUCCESS:
                        return b
            return None
        finally:
            self._port.setBaudRate(self.baud)

    def _ping_impl(self, ids: Iterable[int]) -> Dict[int, int]:
        found = {}
        for i in ids:
            for _ in range(self.retries + 1):
                model_number, res, _err = self._ph.ping(self._port, i)
                if res == sdk.COMM_SUCCESS:
                    found[i] = model_number
                    break
        return found

    def _build_groups(self) -> None:
        layouts: Dict[Tuple, _Group] = {}
        for i in self.ids:
            t = self.tables[i]
            key = (t.family, t.reg("goal_position"), t.block(STATE_REGISTERS))
            g = layouts.get(key)
            if g is None:
                g = layouts[key] = _Group(table=t, ids=[], fast=True)
            g.ids.append(i)
            g.fast = g.fast and self.tables[i].fast_sync_read
        for g in layouts.values():
            if self.fast_sync_read is not None:
                g.fast = bool(self.fast_sync_read) and g.fast
            g.read_start, g.read_len = g.table.block(STATE_REGISTERS)
            g.sync_read = sdk.GroupSyncRead(self._port, self._ph, g.read_start, g.read_len)
            for i in g.ids:
                g.sync_read.addParam(i)
            ga, gs = g.table.reg("goal_position")
            g.sync_write = sdk.GroupSyncWrite(self._port, self._ph, ga, gs)
        self._groups = list(layouts.values())

    def close(self) -> None:
        """Disable torque on every motor (best effort, each motor retried), then close the port.
        Safe to call more than once and from any thread."""
        if self._owner is None or self._closing:
            return
        self._closing = True
        try:
            if self.is_open:
                try:
                    failed = self._call(self._torque_off_all_impl)
                    if failed:
                        log.error("could not confirm torque off on motor(s) %s: %s", failed,
                                  "cut the motor power if they still hold")
                except Exception:
                    log.exception("torque off during close failed")
            try:
                self._call(self._close_port_impl)
            except Exception:
                log.exception("closing the port failed")
        finally:
            if self._owner is not None:
                self._owner.stop()
            self._owner = None
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
            self._closing = False

    def _close_port_impl(self) -> None:
        if self._port is not None:
            try:
                self._port.closePort()
            except Exception:
                pass
        self._port = None

    # ---- low-level register access (owner thread) --------------------------------------------------
    def _check(self, op: str, dxl_id: int, res: int, err: int) -> None:
        c = self.counters.get(dxl_id)
        if res != sdk.COMM_SUCCESS:
            if c is not None:
                if res == sdk.COMM_RX_TIMEOUT:
                    c.timeouts += 1
                elif res == sdk.COMM_RX_CORRUPT:
                    c.corrupt += 1
            raise CommError(op, res, self._ph.getTxRxResult(res), dxl_id)
        if err & P.ERR_ALERT and c is not None:
            c.hardware_alerts += 1
        if err & 0x7F:
            if c is not None:
                c.packet_errors += 1
            raise PacketError(op, dxl_id, err, self._ph.getRxPacketError(err & 0x7F) + f" ({P.error_text(err)})")

    def _retry(self, op: str, dxl_id: int, fn: Callable[[], Tuple]):
        """Run ``fn`` (returning (..., res, err)) with retries on communication errors."""
        last: Optional[Exception] = None
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters[dxl_id].retries += 1
            out = fn()
            res, err = out[-2], out[-1]
            try:
                self._check(op, dxl_id, res, err)
                return out
            except CommError as e:
                last = e
            except PacketError:
                raise
        self.counters[dxl_id].failures += 1
        raise last

    def _read_impl(self, dxl_id: int, name: str) -> int:
        t = self.tables[dxl_id]
        addr, size = t.reg(name)
        reader = {1: self._ph.read1ByteTxRx, 2: self._ph.read2ByteTxRx, 4: self._ph.read4ByteTxRx}[size]
        value, _res, err = self._retry(f"read {name}", dxl_id, lambda: reader(self._port, dxl_id, addr))
        if err & P.ERR_ALERT and name != "hardware_error_status":
            self._note_alert(dxl_id)
        return to_signed(value, size) if t.is_signed(name) else value

    def _write_impl(self, dxl_id: int, name: str, value: int) -> None:
        t = self.tables[dxl_id]
        addr, size = t.reg(name)
        data = list(encode(int(value), size))
        _res, err = self._retry(f"write {name}={value}", dxl_id,
                                lambda: self._ph.writeTxRx(self._port, dxl_id, addr, size, data))
        if err & P.ERR_ALERT:
            self._note_alert(dxl_id)

    def _note_alert(self, dxl_id: int) -> None:
        try:
            value, res, _err = self._ph.read1ByteTxRx(self._port, dxl_id,
                                                     self.tables[dxl_id].addr("hardware_error_status"))
            if res == sdk.COMM_SUCCESS:
                self.hardware_errors[dxl_id] = value
        except Exception:  # pragma: no cover
            log.exception("reading hardware error status of %s failed", dxl_id)

    # ---- public register API --------------------------------------------------------------------
    def read_register(self, dxl_id: int, name: str) -> int:
        """Read a register by name (signed registers decoded)."""
        return self._call(self._read_impl, dxl_id, name)

    def write_register(self, dxl_id: int, name: str, value: int) -> None:
        """Write a register by name, waiting for the status packet (raises PacketError on refusal)."""
        self._call(self._write_impl, dxl_id, name, value)

    def ping(self, ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """{id: model number} of the motors that answer."""
        return self._call(self._ping_impl, tuple(ids) if ids is not None else self.ids)

    # ---- modes and torque ---------------------------------------------------------------------------
    def set_operating_mode(self, mode: str = "position", ids: Optional[Iterable[int]] = None) -> None:
        """Set the operating mode ("position" or "extended_position"); turns torque off first where
        the mode has to change (Operating Mode is in EEPROM)."""
        self._call(self._set_mode_impl, mode, tuple(ids) if ids is not None else self.ids)

    def _set_mode_impl(self, mode: str, ids: Sequence[int]) -> None:
        for i in ids:
            t = self.tables[i]
            value = {"position": t.position_mode, "extended_position": t.extended_position_mode}[mode]
            if self._read_impl(i, "operating_mode") != value:
                self._write_impl(i, "torque_enable", 0)
                self._write_impl(i, "operating_mode", value)

    @property
    def torque_is_on(self) -> bool:
        return self._torque_on

    def enable_torque(self, ids: Optional[Iterable[int]] = None, hold_present: bool = True) -> None:
        """Torque on. With ``hold_present`` the goal is first set to the present position so the
        motors do not jump to a stale goal."""
        self._call(self._enable_impl, tuple(ids) if ids is not None else self.ids, hold_present)

    def _enable_impl(self, ids: Sequence[int], hold_present: bool) -> None:
        try:
            if hold_present:
                for i in ids:
                    self._write_impl(i, "goal_position", self._read_impl(i, "present_position"))
            for i in ids:
                self._write_impl(i, "torque_enable", 1)
            self._torque_on = True
        except BaseException:
            self._torque_off_all_impl()
            raise

    def disable_torque(self, ids: Optional[Iterable[int]] = None) -> List[int]:
        """Torque off; returns the ids where it could not be confirmed."""
        return self._call(self._torque_off_impl, tuple(ids) if ids is not None else self.ids)

    def _torque_off_all_impl(self) -> List[int]:
        return self._torque_off_impl(self.ids)

    def _torque_off_impl(self, ids: Sequence[int]) -> List[int]:
        if self._port is None:
            return list(ids)
        # 1) one Sync Write per layout (a single packet, no replies needed) ...
        for g in self._groups or []:
            targets = [i for i in g.ids if i in ids]
            if not targets:
                continue
            ta, ts = g.table.reg("torque_enable")
            gw = sdk.GroupSyncWrite(self._port, self._ph, ta, ts)
            for i in targets:
                gw.addParam(i, [0])
            try:
                gw.txPacket()
            except Exception:
                log.exception("torque-off sync write failed")
        # 2) ... then a confirmed write per motor, retried.
        failed = []
        for i in ids:
            try:
                self._write_impl(i, "torque_enable", 0)
            except Exception as e:
                failed.append(i)
                log.error("torque off on motor %s not confirmed: %s", i, e)
        if not failed and set(ids) >= set(self.ids):
            self._torque_on = False
        return failed

    def reboot(self, dxl_id: int, wait_s: float = 1.0) -> None:
        """REBOOT a motor (clears a hardware-error shutdown; torque comes back off) and wait for it."""
        self._call(self._reboot_impl, dxl_id, wait_s)

    def _reboot_impl(self, dxl_id: int, wait_s: float) -> None:
        self._retry("reboot", dxl_id, lambda: self._ph.reboot(self._port, dxl_id))
        deadline = time.monotonic() + wait_s
        while True:
            _, res, _ = self._ph.ping(self._port, dxl_id)
            if res == sdk.COMM_SUCCESS:
                break
            if time.monotonic() > deadline:
                raise MotorMissing(dxl_id, f"no answer {wait_s} s after REBOOT")
            time.sleep(0.02)
        self.hardware_errors[dxl_id] = self._read_impl(dxl_id, "hardware_error_status")

    # ---- hardware errors ---------------------------------------------------------------------------
    def read_hardware_errors(self, ids: Optional[Iterable[int]] = None) -> Dict[int, int]:
        """Read Hardware Error Status of each motor (register 70 on X, 892 on PRO)."""
        return self._call(self._read_hw_impl, tuple(ids) if ids is not None else self.ids)

    def _read_hw_impl(self, ids: Sequence[int]) -> Dict[int, int]:
        for i in ids:
            self.hardware_errors[i] = self._read_impl(i, "hardware_error_status")
        return {i: self.hardware_errors[i] for i in ids}

    def raise_on_hardware_error(self) -> None:
        """Raise HardwareError for the first motor with a known hardware error."""
        for i in self.ids:
            bits = self.hardware_errors.get(i, 0)
            if bits:
                raise HardwareError(i, bits, decode_hardware_error(bits))

    # ---- cyclic I/O -------------------------------------------------------------------------------
    def write_goals(self, goals_rad: Mapping[int, float]) -> None:
        """Sync-write Goal Position (rad, 0 = the table's zero tick; saturated to the position-mode
        range). Non-finite goals raise ValueError: filter them first (see hardware.safety)."""
        ticks = {}
        for i, rad in goals_rad.items():
            if not math.isfinite(rad):
                raise ValueError(f"non-finite goal {rad} for motor {i}")
            ticks[int(i)] = self.tables[int(i)].rad_to_ticks(float(rad))
        self._call(self._write_goals_impl, ticks)

    def write_goal_ticks(self, goals_ticks: Mapping[int, int]) -> None:
        self._call(self._write_goals_impl, {int(i): int(t) for i, t in goals_ticks.items()})

    def _write_goals_impl(self, ticks: Mapping[int, int]) -> None:
        for g in self._groups:
            targets = [i for i in g.ids if i in ticks]
            if not targets:
                continue
            gw = g.sync_write
            gw.clearParam()
            size = g.table.size("goal_position")
            for i in targets:
                gw.addParam(i, list(encode(ticks[i], size)))
            res = gw.txPacket()
            self.bus_counters["sync_writes"] += 1
            if res != sdk.COMM_SUCCESS:
                self.bus_counters["write_failures"] += 1
                raise CommError("sync write goal_position", res, self._ph.getTxRxResult(res))

    def read_states(self) -> Dict[int, MotorReading]:
        """Present position/velocity/current of every motor that answered this time.

        A motor missing from the result failed this read (counted in ``counters``); after
        ``missing_after`` consecutive failures :class:`MotorMissing` is raised.
        """
        return self._call(self._read_states_impl)

    def _read_states_impl(self) -> Dict[int, MotorReading]:
        out: Dict[int, Tuple[bytes, int]] = {}
        for g in self._groups:
            got: Dict[int, Tuple[bytes, int]] = {}
            for attempt in range(self.retries + 1):
                self.bus_counters["group_reads"] += 1
                failed_id, res = self._group_read_once(g, got)
                if failed_id is None and res == sdk.COMM_SUCCESS:
                    break
                self.bus_counters["group_read_failures"] += 1
                if failed_id is not None:  # a Sync Read tells which motor broke the chain
                    self._count_failure(failed_id, res, retried=attempt < self.retries)
            remaining = [i for i in g.ids if i not in got]
            if remaining:
                # a Fast Sync Read failure (or a motor failing every retry): isolate the culprit(s)
                # with individual reads
                self.bus_counters["fallback_reads"] += 1
                for i in remaining:
                    data, res, err = self._ph.readTxRx(self._port, i, g.read_start, g.read_len)
                    if res == sdk.COMM_SUCCESS and len(data) == g.read_len:
                        got[i] = (bytes(data), err)
                    else:
                        self._count_failure(i, res if res != sdk.COMM_SUCCESS else sdk.COMM_RX_CORRUPT,
                                            retried=False)
            out.update(got)
        readings: Dict[int, MotorReading] = {}
        missing = []
        for i in self.ids:
            c = self.counters[i]
            c.reads += 1
            if i not in out:
                c.failures += 1
                c.consecutive_failures += 1
                if c.consecutive_failures >= self.missing_after:
                    missing.append(i)
                continue
            c.consecutive_failures = 0
            data, err = out[i]
            if err & P.ERR_ALERT:
                c.hardware_alerts += 1
                self._note_alert(i)
            elif self.hardware_errors.get(i):
                self.hardware_errors[i] = 0  # cleared (e.g. after a reboot)
            if err & 0x7F:
                c.packet_errors += 1
            readings[i] = self._decode_state(i, data, err)
        if missing:
            also = f"; also failing: {missing[1:]}" if missing[1:] else ""
            raise MotorMissing(missing[0], f"{self.counters[missing[0]].consecutive_failures} consecutive "
                                           f"failed reads{also}")
        return readings

    def _count_failure(self, dxl_id: int, res: int, retried: bool) -> None:
        c = self.counters[dxl_id]
        if res == sdk.COMM_RX_TIMEOUT:
            c.timeouts += 1
        elif res == sdk.COMM_RX_CORRUPT:
            c.corrupt += 1
        if retried:
            c.retries += 1

    def _group_read_once(self, g: _Group, got: Dict[int, Tuple[bytes, int]]) -> Tuple[Optional[int], int]:
        """One group transaction. Fills ``got``; returns (first failing id or None, SDK result)."""
        todo = [i for i in g.ids if i not in got]
        if not todo:
            return None, sdk.COMM_SUCCESS
        sr = g.sync_read
        if sorted(sr.data_dict) != sorted(todo):
            sr.clearParam()
            for i in todo:
                sr.addParam(i)
        if g.fast:
            res = sr.fastSyncReadTxPacket()
            if res != sdk.COMM_SUCCESS:
                return None, res
            n = len(todo)
            raw, res, _ = self._ph.fastSyncReadRx(self._port, P.BROADCAST_ID, (g.read_len + 4) * n)
            if res != sdk.COMM_SUCCESS:
                return None, res
            step = g.read_len + 4
            for k in range(n):
                block = bytes(raw[k * step:(k + 1) * step])
                if len(block) < 2 + g.read_len or block[1] not in todo:
                    return None, sdk.COMM_RX_CORRUPT
                got[block[1]] = (block[2:2 + g.read_len], block[0])
            return None, sdk.COMM_SUCCESS
        res = sr.txPacket()
        if res != sdk.COMM_SUCCESS:
            return None, res
        for i in todo:
            data, res, err = self._ph.readRx(self._port, i, g.read_len)
            if res != sdk.COMM_SUCCESS or len(data) != g.read_len:
                return i, res if res != sdk.COMM_SUCCESS else sdk.COMM_RX_CORRUPT
            got[i] = (bytes(data), err)
        return None, sdk.COMM_SUCCESS

    def _decode_state(self, i: int, data: bytes, err: int) -> MotorReading:
        t = self.tables[i]
        start = t.block(STATE_REGISTERS)[0]

        def field_(name):
            a, s = t.reg(name)
            return decode(data[a - start:a - start + s], signed=True)

        ticks = field_("present_position")
        return MotorReading(
            motor_id=i, position_rad=t.ticks_to_rad(ticks),
            velocity_rad_s=t.velocity_to_rad_s(field_("present_velocity")),
            current_a=t.current_to_amp(field_("present_current")), position_ticks=ticks,
            status_error=err, hardware_error=self.hardware_errors.get(i, 0) if err & P.ERR_ALERT else 0)

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """A snapshot of the counters (plain dicts, safe to serialize)."""
        return {"bus": dict(self.bus_counters),
                "motors": {i: asdict(c) for i, c in self.counters.items()},
                "hardware_errors": dict(self.hardware_errors),
                "warnings": list(self.warnings)}


def _close_at_exit_hook(bus: DynamixelBus):
    ref = weakref.ref(bus)
    hook = lambda: _close_at_exit(ref)  # noqa: E731
    atexit.register(hook)
    return hook
