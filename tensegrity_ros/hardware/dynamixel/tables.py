"""Dynamixel control tables as data.

Each supported model is a frozen :class:`ControlTable`: register name -> (address, size), the
unit conversions, the operating-mode value for position control, where the EEPROM area ends
(EEPROM registers are write-protected while torque is on), whether the firmware supports the
"fast" reads (Fast Sync Read 0x8A and Fast Bulk Read 0x9A), and where the Indirect Address /
Indirect Data blocks are. Callers use register *names*; only this module knows addresses.

Indirect addressing (e-manual, "Indirect Address, Indirect Data"): Indirect Address n (2 bytes)
holds a control-table address; Indirect Data n (1 byte) then reads and writes *that* byte, with its
access rights (a read-only target makes the data byte read-only). A multi-byte register needs one
indirect slot per byte. Only RAM addresses may be assigned (X: 64..661, PRO: 562..892); by default
each Indirect Address points at its own Indirect Data byte.

Sources (ROBOTIS e-manual):
- X series, Protocol 2.0 table (XM430-W350, model 1020; XM540-W270, model 1120): 4096 pulses/rev,
  0.229 rev/min per velocity unit, 2.69 mA per current unit; EEPROM = addresses 0..63; Torque
  Enable 64, Hardware Error Status 70, Goal Position 116, Present Current 126, Present Velocity
  128, Present Position 132. Fast Sync Read / Fast Bulk Read from firmware v45. Indirect Address
  1..28 at 168..222 -> Indirect Data 1..28 at 224..251; Indirect Address 29..56 at 578..632 ->
  Indirect Data 29..56 at 634..661 (all RAM).
- Dynamixel PRO (old, not PRO+) table: Torque Enable 562, Goal Position 596, Goal Velocity 600,
  Present Position 611, Present Velocity 615, Present Current 621, Hardware Error Status 892; EEPROM
  = addresses 0..561. L54-50-S290-R: model 38176, 207,692 pulses/rev (+-103,846),
  0.00346667 rev/min per unit, current 33,000/2,048 mA per unit. M42-10-S260-R: model 43288,
  263,187 pulses/rev (+-131,593), 0.00389076 rev/min per unit, current 8,250/2,048 mA per unit.
  No Fast Sync Read / Fast Bulk Read on the old PRO firmware. Indirect Address 1..256 at 49..559
  (EEPROM) -> Indirect Data 1..256 at 634..889 (RAM).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, FrozenSet, Mapping, Optional, Tuple

Register = Tuple[int, int]  # (address, size in bytes)

#: Hardware Error Status bits (X series and PRO share the layout; bit 1 is PRO-only).
HARDWARE_ERROR_BITS: Mapping[int, str] = MappingProxyType({
    0: "input voltage error",
    1: "motor hall sensor error",
    2: "overheating error",
    3: "motor encoder error",
    4: "electrical shock error",
    5: "overload error",
})


def decode_hardware_error(bits: int) -> Tuple[str, ...]:
    """Names of the set bits of a Hardware Error Status value."""
    return tuple(name for bit, name in HARDWARE_ERROR_BITS.items() if bits & (1 << bit)) + \
        tuple(f"unknown bit {b}" for b in range(6, 8) if bits & (1 << b))


def to_signed(value: int, size: int) -> int:
    """Interpret an unsigned ``size``-byte register value as two's complement."""
    bits = 8 * size
    value &= (1 << bits) - 1
    return value - (1 << bits) if value & (1 << (bits - 1)) else value


def to_unsigned(value: int, size: int) -> int:
    """Encode a (possibly negative) integer as an unsigned ``size``-byte register value."""
    bits = 8 * size
    lo, hi = -(1 << (bits - 1)), (1 << bits) - 1
    if not lo <= value <= hi:
        raise ValueError(f"{value} does not fit in {size} bytes")
    return value & ((1 << bits) - 1)


def encode(value: int, size: int) -> bytes:
    """Little-endian bytes of a register value (negative values as two's complement)."""
    return to_unsigned(int(value), size).to_bytes(size, "little")


def decode(data: bytes, signed: bool = False) -> int:
    v = int.from_bytes(bytes(data), "little")
    return to_signed(v, len(data)) if signed else v


@dataclass(frozen=True)
class ControlTable:
    model: str                      # canonical name, e.g. "xm430"
    full_name: str                  # e.g. "XM430-W350"
    family: str                     # "x" or "pro"
    model_number: int
    registers: Mapping[str, Register]
    ticks_per_rev: int
    zero_tick: int                  # the tick that means 0 rad
    position_range: Tuple[int, int]  # goal ticks allowed in position mode (default limits)
    velocity_unit_rpm: float        # rev/min per velocity unit
    current_unit_a: float           # ampere per current unit
    position_mode: int              # Operating Mode value for position control
    extended_position_mode: int
    eeprom_end: int                 # first address of the RAM area
    fast_sync_read: bool            # Fast Sync Read (0x8A) and Fast Bulk Read (0x9A) supported
    signed_registers: FrozenSet[str]
    read_only: FrozenSet[str]
    defaults: Mapping[str, int] = field(default_factory=dict)   # power-on values (emulator)
    table_size: int = 0
    #: indirect blocks: (address of Indirect Address k, address of Indirect Data k, slots) per block
    indirect_blocks: Tuple[Tuple[int, int, int], ...] = ()

    # ---- registers --------------------------------------------------------------------------
    def reg(self, name: str) -> Register:
        try:
            return self.registers[name]
        except KeyError:
            # the indirect slots are summarised: listing a few hundred names would bury the hint
            known = sorted(n for n in self.registers if not n.startswith("indirect_"))
            if self.indirect_blocks:
                known.append(f"indirect_address_1..{self.indirect_slots}, indirect_data_1..{self.indirect_slots}")
            raise KeyError(f"{self.full_name} has no register {name!r}; known: {', '.join(known)}") from None

    def addr(self, name: str) -> int:
        return self.reg(name)[0]

    def size(self, name: str) -> int:
        return self.reg(name)[1]

    def is_signed(self, name: str) -> bool:
        return name in self.signed_registers

    def in_eeprom(self, name: str) -> bool:
        return self.addr(name) < self.eeprom_end

    # ---- indirect addressing ----------------------------------------------------------------
    @property
    def indirect_slots(self) -> int:
        return sum(n for _, _, n in self.indirect_blocks)

    def indirect_pointer(self, address: int) -> Optional[int]:
        """If ``address`` is an Indirect Data byte: the address of the 2-byte Indirect Address
        register that says which byte it stands for; else None."""
        for addr0, data0, n in self.indirect_blocks:
            if data0 <= address < data0 + n:
                return addr0 + 2 * (address - data0)
        return None

    def indirect_address_slot(self, address: int) -> Optional[int]:
        """If ``address`` is a byte of an Indirect Address register: that register's address."""
        for addr0, _, n in self.indirect_blocks:
            if addr0 <= address < addr0 + 2 * n:
                return address - (address - addr0) % 2
        return None

    def overlaps_indirect_data(self, start: int, length: int) -> bool:
        return any(data0 < start + length and start < data0 + n for _, data0, n in self.indirect_blocks)

    @property
    def indirect_target_range(self) -> Tuple[int, int]:
        """Addresses an Indirect Address may hold (inclusive): the RAM area."""
        return self.eeprom_end, self.table_size - 1

    def block(self, names) -> Tuple[int, int]:
        """(start address, length) of the smallest contiguous block covering ``names``."""
        regs = [self.reg(n) for n in names]
        start = min(a for a, _ in regs)
        end = max(a + s for a, s in regs)
        return start, end - start

    # ---- units ------------------------------------------------------------------------------
    @property
    def rad_per_tick(self) -> float:
        return 2.0 * math.pi / self.ticks_per_rev

    @property
    def rad_s_per_velocity_unit(self) -> float:
        return self.velocity_unit_rpm * 2.0 * math.pi / 60.0

    @property
    def angle_range(self) -> Tuple[float, float]:
        """Goal angles (rad) reachable in position mode with the default position limits."""
        lo, hi = self.position_range
        return self.ticks_to_rad(lo), self.ticks_to_rad(hi)

    def ticks_to_rad(self, ticks: int) -> float:
        return (ticks - self.zero_tick) * self.rad_per_tick

    def rad_to_ticks(self, rad: float) -> int:
        """Nearest tick, saturated to the position-mode range. Raises on NaN/inf."""
        if not math.isfinite(rad):
            raise ValueError(f"cannot convert non-finite angle {rad} to ticks")
        t = int(round(rad / self.rad_per_tick)) + self.zero_tick
        lo, hi = self.position_range
        return min(max(t, lo), hi)

    def velocity_to_rad_s(self, raw: int) -> float:
        return raw * self.rad_s_per_velocity_unit

    def rad_s_to_velocity(self, rad_s: float) -> int:
        return int(round(rad_s / self.rad_s_per_velocity_unit))

    def current_to_amp(self, raw: int) -> float:
        return raw * self.current_unit_a

    def amp_to_current(self, amp: float) -> int:
        return int(round(amp / self.current_unit_a))


def _indirect_registers(blocks: Tuple[Tuple[int, int, int], ...]) -> Tuple[Dict[str, Register], Dict[str, int]]:
    """Registers and power-on values of the Indirect Address / Indirect Data slots of ``blocks``,
    numbered from 1 across the blocks as in the e-manual; each address points at its own data byte."""
    regs: Dict[str, Register] = {}
    defaults: Dict[str, int] = {}
    k = 1
    for addr0, data0, n in blocks:
        for j in range(n):
            regs[f"indirect_address_{k}"] = (addr0 + 2 * j, 2)
            regs[f"indirect_data_{k}"] = (data0 + j, 1)
            defaults[f"indirect_address_{k}"] = data0 + j
            k += 1
    return regs, defaults


# ---- X series (XM430 / XM540 share the Protocol 2.0 table) ----------------------------------
_X_INDIRECT = ((168, 224, 28), (578, 634, 28))
_X_REGISTERS: Dict[str, Register] = {
    "model_number": (0, 2), "model_information": (2, 4), "firmware_version": (6, 1), "id": (7, 1),
    "baud_rate": (8, 1), "return_delay_time": (9, 1), "drive_mode": (10, 1), "operating_mode": (11, 1),
    "secondary_id": (12, 1), "protocol_type": (13, 1), "homing_offset": (20, 4),
    "moving_threshold": (24, 4), "temperature_limit": (31, 1), "max_voltage_limit": (32, 2),
    "min_voltage_limit": (34, 2), "pwm_limit": (36, 2), "current_limit": (38, 2),
    "acceleration_limit": (40, 4), "velocity_limit": (44, 4), "max_position_limit": (48, 4),
    "min_position_limit": (52, 4), "shutdown": (63, 1),
    # RAM
    "torque_enable": (64, 1), "led": (65, 1), "status_return_level": (68, 1),
    "registered_instruction": (69, 1), "hardware_error_status": (70, 1),
    "velocity_i_gain": (76, 2), "velocity_p_gain": (78, 2), "position_d_gain": (80, 2),
    "position_i_gain": (82, 2), "position_p_gain": (84, 2), "feedforward_2nd_gain": (88, 2),
    "feedforward_1st_gain": (90, 2), "bus_watchdog": (98, 1), "goal_pwm": (100, 2),
    "goal_current": (102, 2), "goal_velocity": (104, 4), "profile_acceleration": (108, 4),
    "profile_velocity": (112, 4), "goal_position": (116, 4), "realtime_tick": (120, 2),
    "moving": (122, 1), "moving_status": (123, 1), "present_pwm": (124, 2),
    "present_current": (126, 2), "present_velocity": (128, 4), "present_position": (132, 4),
    "velocity_trajectory": (136, 4), "position_trajectory": (140, 4),
    "present_input_voltage": (144, 2), "present_temperature": (146, 1),
    **_indirect_registers(_X_INDIRECT)[0],
}
_X_SIGNED = frozenset({"homing_offset", "goal_pwm", "goal_current", "goal_velocity", "goal_position",
                       "present_pwm", "present_current", "present_velocity", "present_position",
                       "velocity_trajectory", "position_trajectory", "bus_watchdog"})
_X_READ_ONLY = frozenset({"model_number", "model_information", "firmware_version",
                          "registered_instruction", "hardware_error_status", "realtime_tick", "moving",
                          "moving_status", "present_pwm", "present_current", "present_velocity",
                          "present_position", "velocity_trajectory", "position_trajectory",
                          "present_input_voltage", "present_temperature"})
_X_DEFAULTS = {
    "firmware_version": 46, "id": 1, "baud_rate": 1, "return_delay_time": 250, "operating_mode": 3,
    "secondary_id": 255, "protocol_type": 2, "moving_threshold": 10, "temperature_limit": 80,
    "max_voltage_limit": 160, "min_voltage_limit": 95, "pwm_limit": 885, "current_limit": 1193,
    "acceleration_limit": 32767, "velocity_limit": 200, "max_position_limit": 4095,
    "min_position_limit": 0, "shutdown": 52, "status_return_level": 2, "velocity_i_gain": 1920,
    "velocity_p_gain": 100, "position_p_gain": 800, "goal_position": 2048, "present_position": 2048,
    "present_input_voltage": 120, "present_temperature": 30,
    **_indirect_registers(_X_INDIRECT)[1],
}


def _x_table(model: str, full_name: str, model_number: int, defaults: Dict[str, int]) -> ControlTable:
    d = dict(_X_DEFAULTS)
    d.update(defaults)
    d["model_number"] = model_number
    return ControlTable(
        model=model, full_name=full_name, family="x", model_number=model_number,
        registers=MappingProxyType(dict(_X_REGISTERS)), ticks_per_rev=4096, zero_tick=2048,
        position_range=(0, 4095), velocity_unit_rpm=0.229, current_unit_a=2.69e-3,
        position_mode=3, extended_position_mode=4, eeprom_end=64, fast_sync_read=True,
        signed_registers=_X_SIGNED, read_only=_X_READ_ONLY, defaults=MappingProxyType(d),
        table_size=662, indirect_blocks=_X_INDIRECT)


# ---- Dynamixel PRO (old table) --------------------------------------------------------------
_PRO_INDIRECT = ((49, 634, 256),)
_PRO_REGISTERS: Dict[str, Register] = {
    "model_number": (0, 2), "model_information": (2, 4), "firmware_version": (6, 1), "id": (7, 1),
    "baud_rate": (8, 1), "return_delay_time": (9, 1), "operating_mode": (11, 1),
    "homing_offset": (13, 4), "moving_threshold": (17, 4), "temperature_limit": (21, 1),
    "max_voltage_limit": (22, 2), "min_voltage_limit": (24, 2), "acceleration_limit": (26, 4),
    "torque_limit": (30, 2), "velocity_limit": (32, 4), "max_position_limit": (36, 4),
    "min_position_limit": (40, 4), "external_port_mode_1": (44, 1), "external_port_mode_2": (45, 1),
    "external_port_mode_3": (46, 1), "external_port_mode_4": (47, 1), "shutdown": (48, 1),
    # RAM
    "torque_enable": (562, 1), "led_red": (563, 1), "led_green": (564, 1), "led_blue": (565, 1),
    "velocity_i_gain": (586, 2), "velocity_p_gain": (588, 2), "position_p_gain": (594, 2),
    "goal_position": (596, 4), "goal_velocity": (600, 4), "goal_torque": (604, 2),
    "goal_acceleration": (606, 4), "moving": (610, 1), "present_position": (611, 4),
    "present_velocity": (615, 4), "present_current": (621, 2), "present_input_voltage": (623, 2),
    "present_temperature": (625, 1), "registered_instruction": (890, 1),
    "status_return_level": (891, 1), "hardware_error_status": (892, 1),
    **_indirect_registers(_PRO_INDIRECT)[0],
}
_PRO_SIGNED = frozenset({"homing_offset", "max_position_limit", "min_position_limit", "goal_position",
                         "goal_velocity", "goal_torque", "present_position", "present_velocity",
                         "present_current"})
_PRO_READ_ONLY = frozenset({"model_number", "model_information", "firmware_version", "moving",
                            "present_position", "present_velocity", "present_current",
                            "present_input_voltage", "present_temperature", "registered_instruction",
                            "hardware_error_status"})
_PRO_DEFAULTS = {
    "firmware_version": 19, "id": 1, "baud_rate": 1, "return_delay_time": 250, "operating_mode": 3,
    "moving_threshold": 50, "temperature_limit": 80, "max_voltage_limit": 400, "min_voltage_limit": 150,
    "shutdown": 58, "status_return_level": 2, "goal_position": 0, "present_position": 0,
    "present_input_voltage": 240, "present_temperature": 30,
    **_indirect_registers(_PRO_INDIRECT)[1],
}


def _pro_table(model: str, full_name: str, model_number: int, ticks_half: int, vel_rpm: float,
               current_ma: float, defaults: Dict[str, int]) -> ControlTable:
    d = dict(_PRO_DEFAULTS)
    d.update(defaults)
    d.update(model_number=model_number, max_position_limit=ticks_half, min_position_limit=-ticks_half)
    return ControlTable(
        model=model, full_name=full_name, family="pro", model_number=model_number,
        registers=MappingProxyType(dict(_PRO_REGISTERS)), ticks_per_rev=2 * ticks_half, zero_tick=0,
        position_range=(-ticks_half, ticks_half), velocity_unit_rpm=vel_rpm,
        current_unit_a=current_ma * 1e-3, position_mode=3, extended_position_mode=4, eeprom_end=562,
        fast_sync_read=False, signed_registers=_PRO_SIGNED, read_only=_PRO_READ_ONLY,
        defaults=MappingProxyType(d), table_size=893, indirect_blocks=_PRO_INDIRECT)


TABLES: Mapping[str, ControlTable] = MappingProxyType({
    "xm430": _x_table("xm430", "XM430-W350", 1020, {"velocity_limit": 200}),
    "xm540": _x_table("xm540", "XM540-W270", 1120, {"velocity_limit": 128, "current_limit": 2047}),
    "l54-50-s290-r": _pro_table("l54-50-s290-r", "L54-50-S290-R", 38176, 103846, 0.00346667,
                                33000.0 / 2048.0, {"velocity_limit": 8000, "torque_limit": 300}),
    "m42-10-s260-r": _pro_table("m42-10-s260-r", "M42-10-S260-R", 43288, 131593, 0.00389076,
                                8250.0 / 2048.0, {"velocity_limit": 8000, "torque_limit": 300}),
})

_ALIASES = {
    "xm430-w350": "xm430", "xm430-w350-r": "xm430", "xm430-w350-t": "xm430",
    "xm540-w270": "xm540", "xm540-w270-r": "xm540", "xm540-w270-t": "xm540",
    "l54-50-s290": "l54-50-s290-r", "l54": "l54-50-s290-r", "pro-l54": "l54-50-s290-r",
    "m42-10-s260": "m42-10-s260-r", "m42": "m42-10-s260-r", "pro-m42": "m42-10-s260-r",
}


def get_table(model: str) -> ControlTable:
    """The control table for ``model`` (case-insensitive; a few aliases such as ``XM430-W350``)."""
    key = str(model).strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    try:
        return TABLES[key]
    except KeyError:
        raise KeyError(f"unknown Dynamixel model {model!r}; supported: {', '.join(TABLES)}") from None


def table_for_model_number(model_number: int) -> ControlTable:
    for t in TABLES.values():
        if t.model_number == model_number:
            return t
    raise KeyError(f"no control table for model number {model_number}")
