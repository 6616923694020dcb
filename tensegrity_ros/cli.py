"""`tensegrity`: one console script, subcommands registered by name.

Each subcommand lives in ``tensegrity_ros/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so ``tensegrity validate``
does not pay for torch or MuJoCo. Exit codes: 0 success, 2 bad input (one line on stderr: what, where, how to
fix), 130 interrupted. Subcommands check every flag and output location before any work, refuse existing
non-empty outputs unless ``--force`` and write them all at once (see ``commands/_common.py``:
``check_output_target``, ``atomic_output``), so a failed run leaves nothing behind and destroys nothing.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from .commands import UserError

#: subcommand -> (module under tensegrity_ros.commands, one-line help)
SUBCOMMANDS = {
    "validate": ("validate", "check a structure file and print a summary"),
    "simulate": ("simulate", "run the MuJoCo twin driven by the references; plots, trajectories, optional bag"),
    "identify": ("identify", "identify parameters from a rosbag2 recording"),
    "emulate-bus": ("emulate_bus", "serve an emulated Dynamixel Protocol 2.0 bus on a pseudo-terminal"),
    "demo": ("demo", "the full hardware-in-the-loop graph against the simulated robot"),
    "export-mjcf": ("export_mjcf", "write a structure file (e.g. identified parameters) as a MuJoCo MJCF model"),
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states one; an option without a
    default (None, empty) or a plain on/off switch (False) shows none."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and default not in (None, False, "", argparse.SUPPRESS) and default != []
                and "default" not in text.lower()):
            text += " (default: %(default)s)"
        return text


def _parser_for(name: str) -> argparse.ArgumentParser:
    module, help_text = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"tensegrity {name}", description=help_text,
                                     formatter_class=_DefaultsFormatter)
    importlib.import_module(f"tensegrity_ros.commands.{module}").add_arguments(parser)
    return parser


def _environment_error() -> Optional[str]:
    """Settings read from the environment, checked at the edge like the flags: what is wrong and how to fix it, or
    None. Only imports what a set variable needs (``tensegrity validate`` still does not pay for torch)."""
    if os.environ.get("TENSEGRITY_BLAS") is not None:
        from .engine import blas
        try:
            blas.resolve()
        except ValueError as err:
            return f"{err} (the BLAS behind the tangent model's products; unset it for auto)"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: tensegrity SUBCOMMAND [options]\n\nsubcommands:")
        for name, (_, help_text) in SUBCOMMANDS.items():
            print(f"  {name:<12} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tensegrity: unknown subcommand {name!r} (valid: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    args = _parser_for(name).parse_args(rest)
    bad_env = _environment_error()
    if bad_env:
        print(f"tensegrity {name}: error: {bad_env}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"tensegrity_ros.commands.{SUBCOMMANDS[name][0]}")
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"tensegrity {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
