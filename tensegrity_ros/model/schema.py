"""Typed, frozen description of a tensegrity structure.

A structure file (YAML, see ``config/models/``) is loaded into these records once, validated at
the edge (:mod:`tensegrity_ros.model.loader`), and then trusted by the torch engine, the MuJoCo
twin and the node graph. All quantities are SI: metres, kilograms, newtons, seconds, radians.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Tuple, Union

Vec3 = Tuple[float, float, float]

#: How a string's stiffness kappa follows its rest length xi0 (``String.stiffness_law``); the one list of
#: valid laws (the loader, the engine and the twin import it), the first the default. ``cord``: kappa = EA / xi0 with
#: EA = stiffness * rest_length (an elastic cord whose active length is xi0: shortening it stiffens it; the
#: seed paper's law, the default). ``spring``: kappa = stiffness whatever xi0 (a coil spring of constant rate
#: in series with an inextensible cable wound on the spool). Identical for strings without an actuator.
STIFFNESS_LAWS = ("cord", "spring")


@dataclass(frozen=True)
class Node:
    """A point where bars and strings meet. ``fixed`` nodes are welded to the world."""

    name: str
    position: Vec3
    fixed: bool = False


@dataclass(frozen=True)
class Bar:
    """A rigid bar between two nodes; its length is fixed by the node positions, its centre of mass is midway.

    ``radius`` only matters for drawing and for the MuJoCo capsule geom. ``inertia`` and ``mass_std``: see the
    fields.
    """

    name: str
    nodes: Tuple[str, str]
    mass: float
    radius: float = 0.01
    #: How well ``mass`` is known (the bar was weighed): its standard deviation in kg, or None (not stated). The
    #: file may give it in kg or as a percentage of the mass (``mass_std: 2%``); it is held in kg. Identification
    #: uses it as this bar's mass prior, in place of the global ``--prior-std mass=``.
    mass_std: Optional[float] = None
    #: Moment of inertia about the bar's centre, perpendicular to the bar, kg m^2, or None: a thin uniform rod,
    #: mass * L^2 / 12. Real bars carry end caps, hooks and markers near their ends, which raise it (a MuJoCo
    #: capsule of radius 8 mm on a 0.45-m bar: +4.9 %); state it (from CAD, or a pendulum test) when it differs.
    #: The engine keeps the ratio inertia / (mass L^2) when a mass is identified: :meth:`with_mass`.
    inertia: Optional[float] = None

    def with_mass(self, mass: float) -> "Bar":
        """A copy with ``mass`` replaced and a stated ``inertia`` scaled with it (the mass distribution keeps its
        shape); use it, not ``dataclasses.replace``, wherever a mass changes."""
        scale = float(mass) / float(self.mass)
        return replace(self, mass=mass, inertia=None if self.inertia is None else self.inertia * scale)


@dataclass(frozen=True)
class String:
    """A tension-only string through ``nodes`` in order (two nodes: simple; more: composite).

    ``stiffness`` is in N/m at the nominal ``rest_length``. ``stiffness_law`` (one of
    :data:`STIFFNESS_LAWS`) says how it changes when an actuator changes the rest length xi0: ``cord``
    scales it as EA/xi0 with EA = stiffness * rest_length (seed paper, Sec. II-B), ``spring`` keeps it.
    ``damping`` is in N·s/m on the rate of stretch of the whole composite string.
    """

    name: str
    nodes: Tuple[str, ...]
    stiffness: float
    damping: float
    rest_length: float
    actuator: Optional[str] = None
    #: A closed loop (the manipulator's saddle strings): the last node connects back to the first.
    closed: bool = False
    #: ``cord`` (kappa = stiffness * rest_length / xi0) or ``spring`` (kappa = stiffness), see STIFFNESS_LAWS.
    stiffness_law: str = "cord"

    @property
    def segments(self) -> Tuple[Tuple[str, str], ...]:
        """The simple strings this (composite) string is made of, in order."""
        ring = self.nodes + (self.nodes[:1] if self.closed else ())
        return tuple(zip(ring[:-1], ring[1:]))


@dataclass(frozen=True)
class Actuator:
    """A motor that changes one string's rest length through a spool.

    rest_length = rest_length_0 + direction * spool_radius * (motor_angle - zero_offset)
    ``limits`` are motor angles in rad (after nothing: the raw goal-position range allowed).
    """

    name: str
    motor_id: int
    spool_radius: float
    direction: int = 1
    zero_offset: float = 0.0
    limits: Tuple[float, float] = (-3.14159, 3.14159)
    model: str = "xm430"


@dataclass(frozen=True)
class CoincidentConstraint:
    """``nodes[1]`` (usually a virtual node) stays at ``nodes[0]``."""

    nodes: Tuple[str, str]
    type: Literal["coincident"] = "coincident"


@dataclass(frozen=True)
class MidpointConstraint:
    """``node`` stays at the midpoint of ``between`` (Stage 2 on Stage 1's plate)."""

    node: str
    between: Tuple[str, str]
    type: Literal["midpoint"] = "midpoint"


Constraint = Union[CoincidentConstraint, MidpointConstraint]


@dataclass(frozen=True)
class Structure:
    """A whole tensegrity. Element order is the file's order and is the engine's index order."""

    name: str
    nodes: Tuple[Node, ...]
    bars: Tuple[Bar, ...]
    strings: Tuple[String, ...]
    constraints: Tuple[Constraint, ...] = ()
    actuators: Tuple[Actuator, ...] = ()
    gravity: Vec3 = (0.0, 0.0, -9.81)
    description: str = ""
    source: str = "<memory>"
    #: Optional identified standard deviations, keyed "element.kind" (written by `tensegrity identify`).
    std_devs: Tuple[Tuple[str, float], ...] = field(default=(), compare=False)
    #: Free-form notes kept verbatim from the file (assumptions, provenance).
    notes: str = field(default="", compare=False)

    # ---- lookups -------------------------------------------------------------------------
    def node_index(self, name: str) -> int:
        return self._names("nodes").index(name)

    def _names(self, kind: str) -> list:
        return [e.name for e in getattr(self, kind)]

    @property
    def node_names(self) -> Tuple[str, ...]:
        return tuple(self._names("nodes"))

    @property
    def fixed_nodes(self) -> Tuple[str, ...]:
        return tuple(n.name for n in self.nodes if n.fixed)

    def bar(self, name: str) -> Bar:
        return self.bars[self._names("bars").index(name)]

    def string(self, name: str) -> String:
        return self.strings[self._names("strings").index(name)]

    def actuator(self, name: str) -> Actuator:
        return self.actuators[self._names("actuators").index(name)]

    def actuated_strings(self) -> Tuple[String, ...]:
        """Strings with an actuator, in actuator order."""
        by_act = {s.actuator: s for s in self.strings if s.actuator}
        return tuple(by_act[a.name] for a in self.actuators if a.name in by_act)

    def bar_length(self, bar: Bar) -> float:
        a, b = (self.nodes[self.node_index(n)].position for n in bar.nodes)
        return sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5

    def bar_inertia_ratio(self, bar: Bar) -> float:
        """rho = I / (m L^2) of ``bar`` (I about its centre, perpendicular): 1/12 for a thin uniform rod, 1/4 with
        all the mass at the two nodes. The nodal engine's bar mass matrix is m [[1/4 + rho, 1/4 - rho],
        [1/4 - rho, 1/4 + rho]] (kinetic energy m |v_c|^2 / 2 + I |v2 - v1|^2 / (2 L^2))."""
        if bar.inertia is None:
            return 1.0 / 12.0
        return float(bar.inertia) / (float(bar.mass) * self.bar_length(bar) ** 2)

    def with_positions(self, positions) -> "Structure":
        """A copy with node positions replaced ((n_nodes, 3) array-like, metres)."""
        nodes = tuple(replace(n, position=tuple(float(v) for v in p)) for n, p in zip(self.nodes, positions))
        return replace(self, nodes=nodes)
