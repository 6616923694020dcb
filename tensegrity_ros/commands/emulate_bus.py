"""`tensegrity emulate-bus --link PATH --ids 1,2,3 --model xm430`: a Protocol 2.0 device set on a pty.

The options are checked here before the emulator starts: a malformed or empty id list (``--ids 6-1``), a bad
``--fault-silent`` / ``--fault-hw`` / ``--model`` entry, a non-positive rate or an out-of-range probability
exits with code 2 and one line on stderr instead of serving no motors. ``--link`` never replaces a file, nor a
symlink that leads somewhere (a udev alias of a real adapter, another emulator's pty) unless ``--force``: only a
dangling one, left by an emulator that was killed, is replaced without asking.
"""
from __future__ import annotations

import os
import re
from typing import List

from . import UserError
from ._common import finite
from ..hardware.dynamixel import emulator
from ..hardware.dynamixel.emulator import add_arguments as _emulator_arguments

__all__ = ["add_arguments", "run"]


def add_arguments(parser) -> None:
    _emulator_arguments(parser)
    parser.add_argument("--force", action="store_true",
                        help="let --link replace a symlink that leads somewhere (default: refuse it with exit code "
                             "2; a dangling one is always replaced)")

#: Dynamixel ids a motor may have (253-255 are reserved: 254 is broadcast).
MAX_ID = 252
_PART = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_ids(flag: str, text: str, allow_empty: bool = False) -> List[int]:
    """``1,2,3`` / ``1-6`` / ``1-3,5`` -> ids in 0..252 without repeats; anything else is a UserError."""
    ids: List[int] = []
    parts = [p for p in text.split(",") if p.strip()] if text.strip() else []
    for part in parts:
        m = _PART.match(part)
        if not m:
            raise UserError(f"{flag} {text!r}: {part.strip()!r} is not an id or a range A-B; write e.g. 1,2,3 or 1-6")
        a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if a > b:
            raise UserError(f"{flag} {text!r}: the range {part.strip()} is empty (start > end); write it as {b}-{a}")
        if b > MAX_ID:
            raise UserError(f"{flag} {text!r}: id {b} is out of range; Dynamixel ids are 0..{MAX_ID}")
        for i in range(a, b + 1):
            if i in ids:
                raise UserError(f"{flag} {text!r}: id {i} is listed twice; list each motor once")
            ids.append(i)
    if not ids and not allow_empty:
        raise UserError(f"{flag} {text!r}: no motor ids; give at least one, e.g. 1,2,3 or 1-6")
    return ids


def _check(args) -> None:
    """Every option, before the emulator opens a pty."""
    ids = parse_ids("--ids", args.ids)
    link = args.link
    if link and os.path.lexists(link):
        if not os.path.islink(link):
            raise UserError(f"--link {link}: exists and is not a symlink; choose another path (nothing is replaced)")
        if os.path.exists(link) and not getattr(args, "force", False):
            raise UserError(f"--link {link}: a symlink to {os.readlink(link)} exists (a device alias, or another "
                            "emulator's pty?); choose another path, remove it, or give --force to replace it")
    silent = parse_ids("--fault-silent", args.fault_silent, allow_empty=True)
    unknown = [i for i in silent if i not in ids]
    if unknown:
        raise UserError(f"--fault-silent {args.fault_silent!r}: ids {unknown} are not in --ids {args.ids!r}; "
                        "silence only emulated motors")
    for item in args.fault_hw:
        mid, sep, bits = item.partition(":")
        try:
            ok = sep and int(mid) in ids and 0 <= int(bits, 0) <= 0xFF
        except ValueError:
            ok = False
        if not ok:
            raise UserError(f"--fault-hw {item!r}: expected ID:BITS with ID in --ids and BITS a byte, e.g. 3:0x20")
    if ":" in args.model:
        for part in (p for p in args.model.split(",") if p.strip()):
            sel, sep, name = part.rpartition(":")
            if not sep or not name.strip():
                raise UserError(f"--model {args.model!r}: {part!r} is not IDS:MODEL; write e.g. 1-3:xm430,4-6:xm540")
            parse_ids("--model", sel)
    if args.baud <= 0:
        raise UserError(f"--baud {args.baud}: expected a positive baud rate, e.g. 1000000")
    finite("--tau", args.tau, lo=0, lo_open=True, hint="position time constant in seconds, e.g. 0.05")
    finite("--max-speed", args.max_speed, lo=0, lo_open=True, hint="rad/s, e.g. 4")
    finite("--fault-drop", args.fault_drop, lo=0, hi=1, hint="a probability")
    finite("--fault-crc", args.fault_crc, lo=0, hi=1, hint="a probability")


def run(args) -> int:
    """Check the options (UserError: exit code 2), then serve until SIGINT/SIGTERM."""
    _check(args)
    return emulator.run(args)
