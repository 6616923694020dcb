"""Pieces several subcommands share: model loading with user-facing errors, flag checks, safe outputs
(:func:`check_output_target`, :func:`atomic_output`, :func:`add_force_argument`), progress bars."""
from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

from ..paths import CONFIG_DIR
from . import UserError


def load_model(path):
    """The structure file at ``path``; a bad file becomes a UserError naming file, key and value."""
    from ..model import StructureError, load_structure

    try:
        return load_structure(path)
    except StructureError as err:
        raise UserError(str(err)) from err


#: The default rough mocap frame: OptiTrack Motive's Y-up convention (config/mocap/optitrack_yup.yaml).
DEFAULT_MOCAP_FRAME = CONFIG_DIR / "mocap" / "optitrack_yup.yaml"


def read_text_file(path, flag: str, what: str, max_bytes: int = 16 * 1024 * 1024) -> str:
    """The UTF-8 text of the input file ``path`` given with ``flag``; a missing, unreadable, oversized, binary or
    non-UTF-8 file is a one-line UserError naming the flag, the file and the fix (``what`` it should be)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot read it ({err.strerror or err}); pass a {what}") from None
    if len(raw) > max_bytes or b"\0" in raw:
        raise UserError(f"{flag} {path}: binary or oversized data, not text; pass a {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte offset {err.start}); pass a {what}") from None


def load_mocap_frame(path=None):
    """The mocap frame (p_mocap = rotation @ p_structure + offset) from a YAML file with keys
    ``rotation`` (3x3 rows) and ``offset`` (m); errors name the file, key and value."""
    import numpy as np
    import yaml

    from ..twin.markers import MocapFrame

    path = Path(path) if path else DEFAULT_MOCAP_FRAME
    try:
        data = yaml.safe_load(read_text_file(path, "--mocap-frame", "mocap frame (YAML)"))
    except yaml.YAMLError as err:
        raise UserError(f"--mocap-frame {path}: not valid YAML: {' '.join(str(err).split())}; fix the file or "
                        "pass one of config/mocap/*.yaml") from err
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with keys rotation, offset")
    try:
        rot = np.asarray(data.get("rotation", np.eye(3).tolist()), dtype=float)
        off = np.asarray(data.get("offset", [0.0, 0.0, 0.0]), dtype=float)
    except (TypeError, ValueError) as err:
        raise UserError(f"{path}: rotation/offset must be numbers: {err}") from err
    if rot.shape != (3, 3) or not np.allclose(rot @ rot.T, np.eye(3), atol=1e-6) or np.linalg.det(rot) <= 0:
        raise UserError(f"{path}: rotation = {rot.tolist()}: expected a proper 3x3 rotation matrix")
    if off.shape != (3,):
        raise UserError(f"{path}: offset = {off.tolist()}: expected [x, y, z] in metres")
    return MocapFrame(rot, off)


@contextmanager
def progress_bar(total: int, desc: str):
    """A tqdm bar on a terminal; on a pipe (CI, logs) a few plain lines instead of redraws."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    with tqdm(total=total, desc=desc, unit="", leave=interactive, dynamic_ncols=True,
              mininterval=0.2 if interactive else 5.0, disable=None if interactive else False) as bar:
        yield bar


# ---- flag checks -------------------------------------------------------------------------------------
def finite(flag: str, value, *, lo: float = -math.inf, lo_open: bool = False, hi: float = math.inf,
           hint: str = "") -> float:
    """``value`` as a float if finite and within the bounds, else a UserError naming ``flag`` and the value.

    ``lo_open`` makes the lower bound strict (``> lo``); ``hint`` is appended to the message (how to fix)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        if lo_open and lo == 0 and hi == math.inf:
            want = "a finite number > 0"
        elif lo == 0 and hi == math.inf:
            want = "a finite number >= 0"
        else:
            want = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise UserError(f"{flag} {value!r}: expected {want}" + (f" ({hint})" if hint else ""))
    return v


# ---- outputs: never destroy the user's data, never leave half a result --------------------------------
def add_force_argument(parser) -> None:
    """The shared ``--force`` flag: replace existing non-empty outputs (only once the new ones are complete)."""
    parser.add_argument("--force", action="store_true",
                        help="replace outputs that exist and are not empty (default: refuse them with exit "
                             "code 2); the old ones are removed only after the new ones are complete")


def _is_empty(path: Path) -> bool:
    """An empty regular file or an empty folder (a symlink counts as content: it is left to --force)."""
    if path.is_symlink():
        return False
    if path.is_dir():
        return not any(path.iterdir())
    return path.is_file() and path.stat().st_size == 0


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_target(path, flag: str, force: bool = False, kind: str = "file",
                        inputs: Iterable = ()) -> Path:
    """Check, before any work starts, that ``path`` can take a ``kind`` ("file" or "dir") output of ``flag``.

    Refused with a :class:`UserError` (exit code 2) naming the flag, the path and the fix:

    * an existing target that is not empty, unless ``force`` (then :func:`atomic_output` replaces it, removing
      the old one only once the new one exists); an existing folder where a file is wanted, always;
    * a folder target that is, or contains, one of ``inputs`` (paths the command reads) or the current folder;
    * a location that cannot be written: the nearest existing ancestor must be a folder in which a probe file
      can be created and deleted (missing folders below it are created by :func:`atomic_output`).

    Nothing is created or changed. Returns the target as an absolute path (symlinks in it are not resolved).
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"kind = {kind!r} (valid: file, dir)")
    what = "file" if kind == "file" else "folder"
    if not str(path).strip():
        raise UserError(f"{flag} {str(path)!r}: empty path; give a {what} name")
    target = Path(os.path.abspath(os.path.expanduser(str(path))))
    protected = [*(Path(os.path.abspath(str(i))) for i in inputs if i), Path.cwd()] if kind == "dir" else []
    for inp in protected:                           # a folder replaced with --force must not take these along
        if _inside(inp, target) and os.path.lexists(target):
            role = "the current folder" if inp == Path.cwd() else f"the input {inp}"
            raise UserError(f"{flag} {path}: replacing it would remove {role}; write the {what} somewhere else")
    if os.path.lexists(target):
        if kind == "file" and target.is_dir() and not target.is_symlink():
            raise UserError(f"{flag} {path}: is a folder, expected a file path (e.g. {path}/out.yaml)")
        if not force and not _is_empty(target):
            existing = "folder" if target.is_dir() else "file"
            raise UserError(f"{flag} {path}: the {existing} exists and is not empty; choose another path, or pass "
                            f"--force to replace it (the old {existing} is removed only after the new one is complete)")
    ancestor = target.parent
    while not os.path.lexists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} {path}: {ancestor} is not a folder; choose a path in an existing folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=ancestor)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write in {ancestor} ({err.strerror or err}); choose a writable "
                        "location") from None
    return target


def _remove(path: Path) -> None:
    """Remove a file, symlink or folder tree if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            path.unlink()
        except OSError:
            pass


def _commit(tmp: Path, target: Path, kind: str, force: bool, flag: str) -> None:
    """Move the finished ``tmp`` onto ``target``; an old target is moved aside and removed only afterwards."""
    if os.path.lexists(target):
        if not force and not _is_empty(target):     # appeared while the command ran
            raise UserError(f"{flag} {target}: was created by someone else while this command ran; choose another "
                            "path, or pass --force to replace it")
        if kind == "file" and not (target.is_dir() and not target.is_symlink()):
            os.replace(tmp, target)                  # atomic: the old file stays until the new one is in
            return
        aside = target.with_name(f".{target.name}.old-{os.getpid()}")
        _remove(aside)
        os.rename(target, aside)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(aside, target)
            raise
        _remove(aside)
    else:
        os.rename(tmp, target)


@contextmanager
def atomic_output(path, kind: str = "file", force: bool = False, flag: Optional[str] = None) -> Iterator[Path]:
    """Write an output all at once: yields a temporary sibling of ``path`` to write to, renamed onto ``path``
    when the block succeeds.

    The sibling lives in the same folder (``.NAME.tmp-<pid>``, so the rename is atomic) and is an empty folder
    for ``kind="dir"``, a path to create for ``kind="file"``. Missing parent folders are created. On success an
    existing ``path`` is replaced only if empty or ``force`` (a folder is renamed aside, the new one renamed
    in, then the old one removed: the user's data goes only once the new result exists). If the block raises,
    the sibling and any parent folders created here are removed and the exception propagates: nothing is left
    behind. Call :func:`check_output_target` first, before any work, so that a refusal costs nothing.
    """
    flag = flag or str(path)
    target = Path(os.path.abspath(os.path.expanduser(str(path))))
    missing = []
    parent = target.parent
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = parent.parent
    created = []
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        try:
            for folder in reversed(missing):
                folder.mkdir()
                created.append(folder)
            _remove(tmp)                             # a stale sibling of an earlier process with this pid
            if kind == "dir":
                tmp.mkdir()
        except OSError as err:
            raise UserError(f"{flag} {path}: cannot create {err.filename or target.parent} "
                            f"({err.strerror or err}); choose a writable location") from None
        yield tmp
        try:
            _commit(tmp, target, kind, force, flag)
        except OSError as err:
            raise UserError(f"{flag} {path}: cannot move the result in place ({err.strerror or err}); choose "
                            "another location") from None
    except BaseException:
        _remove(tmp)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
