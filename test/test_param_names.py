"""The one owner of parameter names, kinds and kind groups (tensegrity_ros.param_names)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tensegrity_ros import param_names as PN
from tensegrity_ros.engine import params as engine_params
from tensegrity_ros.engine import params_from_structure
from tensegrity_ros.model import load_structure
from tensegrity_ros.parameter_set import split_name

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


def test_names_split_and_join_both_ways():
    assert PN.split_name("s12.stiffness") == ("s12", "stiffness")
    assert PN.split_name("control_force_scalar") == ("", "control_force_scalar")
    assert PN.split_name("a.b.mass") == ("a.b", "mass")            # the kind is after the last dot
    assert PN.kind_of("b3.mass") == "mass" and PN.element_of("b3.mass") == "b3"
    assert PN.kind_of("control_force_scalar") == "control_force_scalar" and PN.element_of("control_force_scalar") == ""
    p = params_from_structure(load_structure(MODELS / "stacked_manipulator.yaml"), control_force_scalar=1.0)
    for name in p.names():
        assert PN.join_name(*PN.split_name(name)) == name
        assert PN.kind_of(name) in PN.KIND_NAMES
    assert split_name is PN.split_name                                # parameter_set re-exports the owner's


def test_kind_groups():
    assert set(PN.GAUGE_KINDS) == {"stiffness", "damping", "mass", "control_force_scalar"}
    assert set(PN.RELATIVE_KINDS) == {"stiffness", "damping", "mass", "spool_radius", "control_force_scalar"}
    assert PN.RELATIVE_KINDS == tuple(k for k in PN.KIND_NAMES if PN.TRANSFORMS[k] == "log")
    assert PN.STRING_KINDS == ("stiffness", "damping", "rest_length")
    assert PN.GLOBAL_KINDS == ("control_force_scalar",)
    for name in ("KINDS", "KIND_NAMES", "TRANSFORMS", "UNITS", "GAUGE_KINDS", "RELATIVE_KINDS", "split_name",
                 "kind_of", "element_of", "join_name"):
        assert getattr(engine_params, name) is getattr(PN, name)     # the engine's params module re-exports them


def test_the_owner_imports_neither_torch_nor_rclpy():
    code = textwrap.dedent("""
        import sys
        import tensegrity_ros.param_names, tensegrity_ros.parameter_set, tensegrity_ros.paths
        bad = sorted(m for m in sys.modules if m in ("torch", "rclpy"))
        assert not bad, bad
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=str(Path(__file__).resolve().parent))
    assert r.returncode == 0, r.stderr
