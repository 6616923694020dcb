"""Parameter names, kinds and kind groups: their one owner.

A parameter is named ``"<element>.<kind>"`` (``s12.stiffness``, ``s12.rest_length``, ``b3.mass``,
``m1.spool_radius``, ``m1.zero_offset``); a global kind (``control_force_scalar``) is named by its kind alone.
:func:`split_name`, :func:`kind_of`, :func:`element_of` and :func:`join_name` are the only code that takes such
names apart or puts them together.

Plain Python (no torch, no numpy, no rclpy), so the message conversions and the nodes use it without importing
the engine; :mod:`tensegrity_ros.engine.params` (the engine's parameters) re-exports every name here.
"""
from __future__ import annotations

from typing import Dict, Tuple

#: kind -> (element group, unit, transform name); the order is the order of the engine's unconstrained vector.
KINDS: Tuple[Tuple[str, str, str, str], ...] = (
    ("stiffness", "strings", "N/m", "log"),
    ("damping", "strings", "N s/m", "log"),
    ("rest_length", "strings", "m", "bounded"),
    ("mass", "bars", "kg", "log"),
    ("spool_radius", "actuators", "m", "log"),
    ("zero_offset", "actuators", "rad", "identity"),
    ("control_force_scalar", "global", "1", "log"),
)
KIND_NAMES: Tuple[str, ...] = tuple(k[0] for k in KINDS)
#: kind -> the elements it belongs to: ``strings``, ``bars``, ``actuators`` or ``global`` (one value, no element)
ELEMENT_GROUPS: Dict[str, str] = {k[0]: k[1] for k in KINDS}
UNITS: Dict[str, str] = {k[0]: k[2] for k in KINDS}
#: kind -> its unconstrained form (``log``, ``bounded``, ``identity``; see :mod:`tensegrity_ros.engine.params`)
TRANSFORMS: Dict[str, str] = {k[0]: k[3] for k in KINDS}

# ---- kind groups -------------------------------------------------------------------------------------
#: kinds named by the kind alone (no element)
GLOBAL_KINDS: Tuple[str, ...] = tuple(k for k in KIND_NAMES if ELEMENT_GROUPS[k] == "global")
#: kinds of the strings
STRING_KINDS: Tuple[str, ...] = tuple(k for k in KIND_NAMES if ELEMENT_GROUPS[k] == "strings")
#: the scale gauge: multiplying every mass, stiffness and damping (and the spring-rod control gain) by one factor
#: leaves the motion unchanged, so without a known force only their ratios are identifiable
GAUGE_KINDS: Tuple[str, ...] = ("stiffness", "damping", "mass", "control_force_scalar")
#: positive kinds, parametrised by their logarithm: their sizes are relative (a prior width of 0.2 is 20 %, the
#: online identifier bounds them by a factor around the nominal); the others (rest lengths, zero offsets) are
#: absolute (m, rad)
RELATIVE_KINDS: Tuple[str, ...] = tuple(k for k in KIND_NAMES if TRANSFORMS[k] == "log")


# ---- names -------------------------------------------------------------------------------------------
def split_name(name: str) -> Tuple[str, str]:
    """``"s12.stiffness"`` -> ("s12", "stiffness"); a global name (``control_force_scalar``) -> ("", name)."""
    elem, dot, kind = name.rpartition(".")
    return (elem, kind) if dot else ("", name)


def kind_of(name: str) -> str:
    """``"s12.stiffness"`` -> "stiffness"; ``"control_force_scalar"`` -> "control_force_scalar"."""
    return split_name(name)[1]


def element_of(name: str) -> str:
    """``"s12.stiffness"`` -> "s12"; a global name -> ""."""
    return split_name(name)[0]


def join_name(element: str, kind: str) -> str:
    """Inverse of :func:`split_name`: ("s12", "stiffness") -> ``"s12.stiffness"``; ("", kind) -> kind."""
    return f"{element}.{kind}" if element else kind
