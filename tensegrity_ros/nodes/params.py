"""Node parameters as data: :class:`ParamSpec` (name, default, description, range / choices, check), reusable
checks, and :func:`declare_parameters`. Each node's table is in :mod:`tensegrity_ros.nodes.tables`.

The node declares them with ParameterDescriptors (:func:`declare_parameters`), validates the start values (a bad
value fails node creation with every problem listed) and rejects bad run-time changes with a reason
(:func:`check_changes`, in every node's set-parameters callback, as in ros2/demos ``set_parameters_callback.py``).
The launch-file test reads the same tables (``tensegrity_ros.nodes.tables.<node>.PARAMS``).

ROS-free at import time: :meth:`ParamSpec.descriptor` imports ``rcl_interfaces`` and :func:`declare_parameters`
``rclpy.parameter`` when called, so the specs, the tables and their validation need no ROS installation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from rcl_interfaces.msg import ParameterDescriptor
    from rclpy.node import Node


class ParameterError(ValueError):
    """Start values of a node's parameters that are not usable (every problem is in the message)."""


Check = Callable[[Any], Optional[str]]   # value -> None if fine, else what is wrong


@dataclass(frozen=True)
class ParamSpec:
    """One declared parameter.

    default: its value (its Python type is the parameter type); use ``type_`` for an empty list default
    ("double_array" | "string_array" | "integer_array"). range: inclusive (lo, hi), also put in the
    descriptor; choices: allowed strings; check: value -> error text or None; read_only: only settable at
    start (from YAML / launch / ``-p``).
    """

    name: str
    default: Any
    description: str
    range: Optional[Tuple[float, float]] = None
    choices: Optional[Tuple[str, ...]] = None
    check: Optional[Check] = None
    read_only: bool = False
    type_: Optional[str] = None

    def problem(self, value: Any) -> Optional[str]:
        """None if ``value`` is acceptable, else the reason (``name = value: reason``)."""
        def bad(why):
            return f"{self.name} = {value!r}: {why}"

        expect = type(self.default)
        if self.type_ is not None or isinstance(self.default, (list, tuple)):
            if not isinstance(value, (list, tuple)):
                return bad("expected a list")
        elif expect is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return bad("expected a number")
            if not math.isfinite(float(value)):
                return bad("must be finite")
        elif expect is int and (isinstance(value, bool) or not isinstance(value, int)):
            return bad("expected an integer")
        elif expect is bool and not isinstance(value, bool):
            return bad("expected true or false")
        elif expect is str and not isinstance(value, str):
            return bad("expected a string")
        if self.range is not None and not (self.range[0] <= value <= self.range[1]):
            return bad(f"must be within [{self.range[0]:g}, {self.range[1]:g}]")
        if self.choices is not None and value not in self.choices:
            return bad(f"must be one of {', '.join(self.choices)}")
        if self.check is not None:
            why = self.check(value)
            if why:
                return bad(why)
        return None

    def descriptor(self) -> ParameterDescriptor:
        from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

        d = ParameterDescriptor(description=self.description, read_only=self.read_only)
        if self.choices:
            d.additional_constraints = "one of: " + ", ".join(self.choices)
        if self.range is not None:
            if type(self.default) is float:
                d.floating_point_range = [FloatingPointRange(from_value=float(self.range[0]),
                                                             to_value=float(self.range[1]), step=0.0)]
            elif type(self.default) is int:
                d.integer_range = [IntegerRange(from_value=int(self.range[0]), to_value=int(self.range[1]), step=0)]
        return d


#: ``type_`` -> the name of its ``rclpy.parameter.Parameter.Type`` (looked up in :func:`declare_parameters`, so
#: that importing this module imports no rclpy)
_ARRAY_TYPES = {"double_array": "DOUBLE_ARRAY", "string_array": "STRING_ARRAY", "integer_array": "INTEGER_ARRAY"}


# ---- reusable checks ---------------------------------------------------------------------------------
def positive(value) -> Optional[str]:
    return None if value > 0 else "must be > 0"


def nonnegative(value) -> Optional[str]:
    return None if value >= 0 else "must be >= 0"


def file_exists(value: str) -> Optional[str]:
    import os
    return None if value == "" or os.path.isfile(value) else "no such file"


def required_file(value: str) -> Optional[str]:
    import os
    if not value:
        return "required (a path)"
    return None if os.path.isfile(value) else "no such file"


def transform_list(value) -> Optional[str]:
    """[] (none), 12 values (R row-major, then t) or 16 values (4x4 row-major)."""
    if len(value) not in (0, 12, 16):
        return "expected [] or 12 values (R row-major, t) or 16 values (4x4 row-major)"
    if not all(math.isfinite(float(v)) for v in value):
        return "values must be finite"
    return None


def transform_from_list(value: Sequence[float]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(R (3, 3), t (3,)) from a :func:`transform_list` parameter, or None for []."""
    v = np.asarray(list(value), dtype=float)
    if v.size == 0:
        return None
    if v.size == 16:
        M = v.reshape(4, 4)
        return M[:3, :3].copy(), M[:3, 3].copy()
    return v[:9].reshape(3, 3).copy(), v[9:12].copy()


def declare_parameters(node: Node, specs: Sequence[ParamSpec]) -> Dict[str, Any]:
    """Declare every spec on ``node`` (with its descriptor) and return {name: value}.

    Raises :class:`ParameterError` listing every start value that fails its spec.
    """
    from rclpy.parameter import Parameter

    values: Dict[str, Any] = {}
    for s in specs:
        default = getattr(Parameter.Type, _ARRAY_TYPES[s.type_]) if (s.type_ and not s.default) else s.default
        p = node.declare_parameter(s.name, default, s.descriptor())
        v = p.value
        if v is None and s.type_:
            v = list(s.default) if s.default is not None else []
        if isinstance(v, (list, tuple)) or type(v).__name__ == "array":
            v = list(v)
        if type(s.default) is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        values[s.name] = v
    problems = [why for s in specs if (why := s.problem(values[s.name]))]
    if problems:
        raise ParameterError(f"{node.get_name()}: bad parameter value(s): " + "; ".join(problems))
    return values


def spec_table(specs: Sequence[ParamSpec]) -> Dict[str, ParamSpec]:
    return {s.name: s for s in specs}


def check_changes(table: Mapping[str, ParamSpec], params: Sequence[Any],
                  veto: Optional[Callable[[str, Any], Optional[str]]] = None) -> Tuple[Optional[str], Dict[str, Any]]:
    """Run-time changes (rclpy ``Parameter`` objects: ``.name``, ``.value``) against their specs, as every node's
    set-parameters callback checks them: (None, {name: value}) when all are accepted, else (the first reason, {}).

    Values are normalised as :func:`declare_parameters` does (arrays -> lists, an integer for a float parameter ->
    float). Parameters outside ``table`` (``use_sim_time``, ...) pass unchecked and are not returned. ``veto(name,
    value)`` is asked for each change that meets its spec (the node may apply it there) and returns a reason to
    refuse it, or None."""
    values: Dict[str, Any] = {}
    for prm in params:
        spec = table.get(prm.name)
        if spec is None:
            continue
        value = list(prm.value) if isinstance(prm.value, (list, tuple)) else prm.value
        if type(spec.default) is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        why = spec.problem(value)
        if why is None and veto is not None:
            why = veto(prm.name, value)
        if why:
            return why, {}
        values[prm.name] = value
    return None, values
