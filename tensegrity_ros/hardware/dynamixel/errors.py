"""Typed Dynamixel errors. Every error carries a ``hint`` telling the operator how to fix it."""
from __future__ import annotations

from typing import Optional, Sequence

HINT_PORT = ("check the device path (ls -l /dev/ttyUSB* /dev/serial/by-id/), the udev rule, and that "
             "your user is in the 'dialout' group (sudo usermod -aG dialout $USER, then log in again)")
HINT_BAUD = ("check the baud rate and the motor ids with `tensegrity emulate-bus` (to test the software "
             "path) or Dynamixel Wizard 2.0 (to scan the real bus); also check power (24 V for PRO, "
             "12 V for X) and the RS-485 cable")
HINT_MISSING = ("motor {id} stopped answering: check its power and daisy-chain cable, then that its id and "
                "baud rate match the config (Dynamixel Wizard 2.0 scan)")
HINT_HARDWARE = ("motor {id} reported a hardware error ({what}); torque was turned off. Remove the cause "
                 "(load, temperature, supply voltage), then reboot the motor (DynamixelBus.reboot({id}) "
                 "or power-cycle) before re-enabling torque")
HINT_COMM = ("communication failed; check cabling/termination, the FTDI latency timer (1 ms), the baud "
             "rate, and that nothing else (Dynamixel Wizard, another driver) holds the port")
HINT_MODEL = "the motor answers with a different model number: fix the model in the bus/structure YAML"
HINT_PACKET = "the motor refused the instruction; see the error text (e.g. EEPROM writes need torque off)"


class DynamixelError(RuntimeError):
    """Base class: ``str(err)`` is the message followed by the hint."""

    default_hint = HINT_COMM

    def __init__(self, message: str, hint: Optional[str] = None):
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(f"{message}. Hint: {self.hint}")


class PortNotFound(DynamixelError):
    default_hint = HINT_PORT

    def __init__(self, port: str, reason: str = ""):
        self.port = port
        super().__init__(f"cannot open serial port {port!r}" + (f" ({reason})" if reason else ""))


class NoResponse(DynamixelError):
    """No motor answered at the configured baud rate."""

    default_hint = HINT_BAUD

    def __init__(self, port: str, baud: int, ids: Sequence[int]):
        self.port, self.baud, self.ids = port, baud, tuple(ids)
        super().__init__(f"no Dynamixel answered on {port} at {baud} baud (ids {list(ids)})")


class BaudMismatch(NoResponse):
    """Motors answered, but only at a different baud rate than configured."""

    def __init__(self, port: str, baud: int, ids: Sequence[int], found_baud: int):
        self.found_baud = found_baud
        DynamixelError.__init__(
            self, f"no Dynamixel answered on {port} at {baud} baud, but id(s) answered at {found_baud} baud",
            f"set baud: {found_baud} in the bus YAML, or change the motors' Baud Rate register with "
            f"Dynamixel Wizard 2.0. " + HINT_BAUD)
        self.port, self.baud, self.ids = port, baud, tuple(ids)


class MotorMissing(DynamixelError):
    def __init__(self, motor_id: int, detail: str = ""):
        self.motor_id = motor_id
        super().__init__(f"motor {motor_id} does not answer" + (f" ({detail})" if detail else ""),
                         HINT_MISSING.format(id=motor_id))


class ModelMismatch(DynamixelError):
    default_hint = HINT_MODEL

    def __init__(self, motor_id: int, expected: int, found: int):
        self.motor_id, self.expected, self.found = motor_id, expected, found
        super().__init__(f"motor {motor_id}: expected model number {expected}, found {found}")


class HardwareError(DynamixelError):
    def __init__(self, motor_id: int, bits: int, decoded: Sequence[str]):
        self.motor_id, self.bits, self.decoded = motor_id, bits, tuple(decoded)
        what = ", ".join(decoded) or f"bits 0x{bits:02X}"
        super().__init__(f"motor {motor_id} hardware error 0x{bits:02X}: {what}",
                         HINT_HARDWARE.format(id=motor_id, what=what))


class CommError(DynamixelError):
    """A failed transaction; ``text`` is the SDK's getTxRxResult()/getRxPacketError() text."""

    def __init__(self, operation: str, result: int, text: str, motor_id: Optional[int] = None):
        self.operation, self.result, self.text, self.motor_id = operation, result, text, motor_id
        who = f" (motor {motor_id})" if motor_id is not None else ""
        super().__init__(f"{operation}{who} failed: {text} [result {result}]")


class PacketError(DynamixelError):
    """The motor answered with an error number in its status packet (e.g. access error)."""

    default_hint = HINT_PACKET

    def __init__(self, operation: str, motor_id: int, error: int, text: str):
        self.operation, self.motor_id, self.error, self.text = operation, motor_id, error, text
        super().__init__(f"{operation} on motor {motor_id} refused: {text} (error byte 0x{error:02X})")
