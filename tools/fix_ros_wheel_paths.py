#!/usr/bin/env python3
"""Rewrite build-machine paths baked into the ROS 2 PyPI wheels' CMake files.

The ``ros-*`` wheels are built in a manylinux container whose interpreter
lives in ``/opt/python/cp3XX-cp3XX``; their exported CMake targets and
ament-index files still point there (Python headers, NumPy headers, the
install prefix). This script rewrites those paths, in place and only inside
the given virtual environment, to the interpreter that runs it:

* ``<old>/include/python3.X``                         -> this Python's headers
* ``<old>/lib/python3.X/site-packages/numpy/...``     -> the venv's NumPy
* ``<old>/lib/python3.X/site-packages``               -> the venv's site-packages
* ``<old>``                                           -> the venv prefix

It is idempotent (a second run finds nothing to change) and fast enough to
run on every ``make setup``.

Usage: ``.venv/bin/python tools/fix_ros_wheel_paths.py [--prefix VENV] [--check]``
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import sysconfig

OLD_PREFIX_RE = re.compile(r"/opt/python/cp3\d+-cp3\d+t?")
# Only these trees of the venv carry CMake / ament-index text files.
SEARCH_DIRS = ("share", os.path.join("lib", "cmake"))
MAX_BYTES = 4 * 1024 * 1024


def _replacements(prefix: str) -> list[tuple[re.Pattern[str], str]]:
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    py_include = sysconfig.get_paths()["include"]
    site_packages = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})["purelib"]
    try:
        import numpy  # noqa: PLC0415

        numpy_root = os.path.dirname(numpy.__file__)
    except ImportError:  # numpy not installed yet: map into the venv anyway
        numpy_root = os.path.join(site_packages, "numpy")
    old = OLD_PREFIX_RE.pattern
    esc = re.escape
    return [
        (re.compile(old + esc(f"/include/{pyver}")), py_include),
        (re.compile(old + esc(f"/lib/{pyver}/site-packages/numpy")), numpy_root),
        (re.compile(old + esc(f"/lib/{pyver}/site-packages")), site_packages),
        (OLD_PREFIX_RE, prefix),
    ]


def _iter_candidates(prefix: str):
    for sub in SEARCH_DIRS:
        root = os.path.join(prefix, sub)
        for dirpath, _dirnames, filenames in os.walk(root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):
                    continue
                try:
                    if os.path.getsize(path) > MAX_BYTES:
                        continue
                except OSError:
                    continue
                yield path


def fix(prefix: str, check_only: bool = False) -> list[str]:
    """Rewrite files under ``prefix``; return the list of files (to be) changed."""
    prefix = os.path.abspath(prefix)
    reps = _replacements(prefix)
    changed: list[str] = []
    for path in _iter_candidates(prefix):
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        if b"/opt/python/" not in raw or b"\0" in raw:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        new = text
        for pattern, repl in reps:
            new = pattern.sub(lambda _m, r=repl: r, new)
        if new == text:
            continue
        changed.append(path)
        if check_only:
            continue
        tmp = path + ".tmp-fixpaths"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(new)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=sys.prefix, help="venv prefix (default: this interpreter's)")
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if anything needs fixing")
    args = parser.parse_args(argv)
    changed = fix(args.prefix, check_only=args.check)
    verb = "would rewrite" if args.check else "rewrote"
    print(f"fix_ros_wheel_paths: {verb} {len(changed)} file(s) under {os.path.abspath(args.prefix)}")
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
