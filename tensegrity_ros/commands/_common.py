"""Pieces several subcommands share: model loading with user-facing errors, progress bars."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

from . import UserError


def load_model(path):
    """The structure file at ``path``; a bad file becomes a UserError naming file, key and value."""
    from ..model import StructureError, load_structure

    try:
        return load_structure(path)
    except StructureError as err:
        raise UserError(str(err)) from err


#: The default rough mocap frame: OptiTrack Motive's Y-up convention (config/mocap/optitrack_yup.yaml).
DEFAULT_MOCAP_FRAME = Path(__file__).resolve().parents[2] / "config" / "mocap" / "optitrack_yup.yaml"


def load_mocap_frame(path=None):
    """The mocap frame (p_mocap = rotation @ p_structure + offset) from a YAML file with keys
    ``rotation`` (3x3 rows) and ``offset`` (m); errors name the file, key and value."""
    import numpy as np
    import yaml

    from ..twin.markers import MocapFrame

    path = Path(path) if path else DEFAULT_MOCAP_FRAME
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"{path}: cannot read mocap frame: {err}") from err
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
