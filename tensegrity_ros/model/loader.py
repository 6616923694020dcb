"""Load, validate and write structure files.

Everything a structure file says is checked here, once; past this point the engine, the twin and the
nodes trust the :class:`~tensegrity_ros.model.schema.Structure` they get. Each failure raises
:class:`StructureError` naming the file, the key path (``bars[2].nodes[1]``) and the offending value.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import yaml

from .errors import StructureError
from .schema import (STIFFNESS_LAWS, Actuator, Bar, CoincidentConstraint, MidpointConstraint, Node, String,
                     Structure)

#: Positions of constrained nodes must already satisfy their constraint this closely (m).
CONSTRAINT_TOLERANCE_M = 1e-5
#: Bars shorter than this are rejected as zero-length (m).
MIN_BAR_LENGTH_M = 1e-6

_TOP_KEYS = {"name", "description", "notes", "gravity", "nodes", "bars", "strings", "constraints",
             "actuators", "std_devs"}
_NODE_KEYS = {"name", "position", "fixed"}
_BAR_KEYS = {"name", "nodes", "mass", "radius", "mass_std", "inertia"}
_STRING_KEYS = {"name", "nodes", "stiffness", "damping", "rest_length", "actuator", "closed", "stiffness_law"}
_ACT_KEYS = {"name", "motor_id", "spool_radius", "direction", "zero_offset", "limits", "model"}
_CONSTRAINT_KEYS = {"coincident": {"type", "nodes"}, "midpoint": {"type", "node", "between"},
                    "fixed": {"type", "node"}}


class _Checker:
    """Carries the source name so every check can say where it failed."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value, problem: str):
        raise StructureError(self.source, key, value, problem)

    def mapping(self, key: str, value, allowed: Iterable[str], required: Iterable[str] = ()) -> Mapping:
        if not isinstance(value, Mapping):
            self.fail(key, value, "expected a mapping")
        for k in value:
            if k not in allowed:
                self.fail(f"{key}.{k}", value[k], f"unknown key (valid keys: {', '.join(sorted(allowed))})")
        for k in required:
            if k not in value:
                self.fail(f"{key}.{k}", None, "required key is missing")
        return value

    def seq(self, key: str, value, min_len: int = 0) -> Sequence:
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)):
            self.fail(key, value, "expected a list")
        if len(value) < min_len:
            self.fail(key, value, f"expected at least {min_len} entries")
        return value

    def name(self, key: str, value, seen: set) -> str:
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            self.fail(key, value, "expected a non-empty name without spaces")
        if value in seen:
            self.fail(key, value, "duplicate name")
        seen.add(value)
        return value

    def number(self, key: str, value, *, lo: float = -math.inf, lo_open: bool = False,
               hi: float = math.inf) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, value, "expected a finite number")
        v = float(value)
        if (lo_open and v <= lo) or v < lo:
            self.fail(key, value, f"must be {'>' if lo_open else '>='} {lo:g}")
        if v > hi:
            self.fail(key, value, f"must be <= {hi:g}")
        return v

    def vec3(self, key: str, value) -> tuple:
        value = self.seq(key, value)
        if len(value) != 3:
            self.fail(key, value, "expected three numbers [x, y, z]")
        return tuple(self.number(f"{key}[{i}]", v) for i, v in enumerate(value))

    def node_ref(self, key: str, value, known: Mapping[str, Node]) -> str:
        if value not in known:
            near = ", ".join(list(known)[:6]) + (", ..." if len(known) > 6 else "")
            self.fail(key, value, f"unknown node (known nodes: {near})")
        return value


def _distance(a: Sequence[float], b: Sequence[float]) -> float:
    return math.dist(a, b)


def structure_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Structure:
    """Validate ``data`` (a parsed structure file) and build a :class:`Structure`."""
    c = _Checker(source)
    c.mapping("<top>", data, _TOP_KEYS, required=("name", "nodes", "bars", "strings"))
    name = data["name"]
    if not isinstance(name, str) or not name:
        c.fail("name", name, "expected a non-empty string")
    gravity = c.vec3("gravity", data.get("gravity", [0.0, 0.0, -9.81]))

    # ---- nodes -------------------------------------------------------------------------------
    nodes: Dict[str, Node] = {}
    seen: set = set()
    for i, raw in enumerate(c.seq("nodes", data["nodes"], min_len=1)):
        key = f"nodes[{i}]"
        c.mapping(key, raw, _NODE_KEYS, required=("name", "position"))
        n = c.name(f"{key}.name", raw["name"], seen)
        fixed = raw.get("fixed", False)
        if not isinstance(fixed, bool):
            c.fail(f"{key}.fixed", fixed, "expected true or false")
        nodes[n] = Node(n, c.vec3(f"{key}.position", raw["position"]), fixed)

    # ---- bars --------------------------------------------------------------------------------
    bars: List[Bar] = []
    seen = set()
    for i, raw in enumerate(c.seq("bars", data["bars"])):
        key = f"bars[{i}]"
        c.mapping(key, raw, _BAR_KEYS, required=("name", "nodes", "mass"))
        b = c.name(f"{key}.name", raw["name"], seen)
        ends = c.seq(f"{key}.nodes", raw["nodes"])
        if len(ends) != 2:
            c.fail(f"{key}.nodes", ends, "a bar connects exactly two nodes")
        ends = tuple(c.node_ref(f"{key}.nodes[{j}]", e, nodes) for j, e in enumerate(ends))
        length = _distance(nodes[ends[0]].position, nodes[ends[1]].position)
        if length < MIN_BAR_LENGTH_M:
            c.fail(f"{key}.nodes", list(ends), f"zero-length bar: its nodes are {length:.3g} m apart "
                   "(move one node; bar length comes from the node positions)")
        mass = c.number(f"{key}.mass", raw["mass"], lo=0.0, lo_open=True)
        radius = c.number(f"{key}.radius", raw.get("radius", 0.01), lo=0.0, lo_open=True)
        mass_std = _mass_std(c, f"{key}.mass_std", raw["mass_std"], mass) if raw.get("mass_std") is not None else None
        inertia = None
        if raw.get("inertia") is not None:
            # rho = I / (m L^2) must be > 0 (a bar with no inertia about its centre cannot turn: singular mass
            # matrix); above 1 the mass would sit far beyond the nodes: almost surely a unit slip (g, cm).
            inertia = c.number(f"{key}.inertia", raw["inertia"], lo=0.0, lo_open=True)
            if inertia > mass * length ** 2:
                c.fail(f"{key}.inertia", raw["inertia"], f"expected kg m^2 about the bar's centre, perpendicular to "
                       f"it, at most mass * L^2 = {mass * length ** 2:.4g} (a thin uniform rod has mass * L^2 / 12 "
                       f"= {mass * length ** 2 / 12:.4g}; leave it out for that)")
        bars.append(Bar(b, ends, mass, radius, mass_std, inertia))

    # ---- actuators (before strings, which refer to them) -------------------------------------
    actuators: List[Actuator] = []
    seen, ids = set(), {}
    for i, raw in enumerate(c.seq("actuators", data.get("actuators"))):
        key = f"actuators[{i}]"
        c.mapping(key, raw, _ACT_KEYS, required=("name", "motor_id", "spool_radius"))
        a = c.name(f"{key}.name", raw["name"], seen)
        mid = raw["motor_id"]
        if isinstance(mid, bool) or not isinstance(mid, int) or not 0 <= mid <= 252:
            c.fail(f"{key}.motor_id", mid, "expected a Dynamixel id, an integer in 0..252")
        if mid in ids:
            c.fail(f"{key}.motor_id", mid, f"motor id already used by actuator '{ids[mid]}'")
        ids[mid] = a
        direction = raw.get("direction", 1)
        if direction not in (1, -1) or isinstance(direction, bool):
            c.fail(f"{key}.direction", direction, "expected 1 or -1")
        limits = c.seq(f"{key}.limits", raw.get("limits", [-math.pi, math.pi]))
        if len(limits) != 2:
            c.fail(f"{key}.limits", limits, "expected [min_rad, max_rad]")
        lo, hi = (c.number(f"{key}.limits[{j}]", v) for j, v in enumerate(limits))
        if not lo < hi:
            c.fail(f"{key}.limits", list(limits), "min must be below max")
        model = raw.get("model", "xm430")
        if not isinstance(model, str) or not model:
            c.fail(f"{key}.model", model, "expected a Dynamixel model name, e.g. xm430")
        actuators.append(Actuator(a, mid, c.number(f"{key}.spool_radius", raw["spool_radius"], lo=0.0,
                                                   lo_open=True),
                                  int(direction), c.number(f"{key}.zero_offset", raw.get("zero_offset", 0.0)),
                                  (lo, hi), model))
    act_names = {a.name for a in actuators}

    # ---- strings -----------------------------------------------------------------------------
    strings: List[String] = []
    seen, driven = set(), {}
    for i, raw in enumerate(c.seq("strings", data["strings"])):
        key = f"strings[{i}]"
        c.mapping(key, raw, _STRING_KEYS, required=("name", "nodes", "stiffness", "rest_length"))
        s = c.name(f"{key}.name", raw["name"], seen)
        path = c.seq(f"{key}.nodes", raw["nodes"], min_len=2)
        path = tuple(c.node_ref(f"{key}.nodes[{j}]", n, nodes) for j, n in enumerate(path))
        for j, n in enumerate(path):
            if n in path[:j]:
                c.fail(f"{key}.nodes[{j}]", n, "the string passes through this node twice "
                       "(for a closed loop list each node once and set `closed: true`)")
        closed = raw.get("closed", False)
        if not isinstance(closed, bool) or (closed and len(path) < 3):
            c.fail(f"{key}.closed", closed, "expected true or false; a closed loop needs 3 or more nodes")
        stiffness = c.number(f"{key}.stiffness", raw["stiffness"], lo=0.0, lo_open=True)
        damping = c.number(f"{key}.damping", raw.get("damping", 0.0), lo=0.0)
        rest = c.number(f"{key}.rest_length", raw["rest_length"], lo=0.0, lo_open=True)
        act = raw.get("actuator")
        if act is not None:
            if act not in act_names:
                c.fail(f"{key}.actuator", act, f"unknown actuator (known: {', '.join(sorted(act_names)) or 'none'})")
            if act in driven:
                c.fail(f"{key}.actuator", act, f"actuator already drives string '{driven[act]}'")
            driven[act] = s
        law = raw.get("stiffness_law", STIFFNESS_LAWS[0])
        if law not in STIFFNESS_LAWS:
            c.fail(f"{key}.stiffness_law", law, f"unknown stiffness law (valid laws: {', '.join(STIFFNESS_LAWS)}; "
                   "cord: stiffness * rest_length / xi0, spring: constant stiffness)")
        strings.append(String(s, path, stiffness, damping, rest, act, closed, law))

    # ---- constraints -------------------------------------------------------------------------
    constraints = []
    dependent: Dict[str, str] = {}  # node -> key path of the constraint that places it
    fixed = {n for n, node in nodes.items() if node.fixed}
    for i, raw in enumerate(c.seq("constraints", data.get("constraints"))):
        key = f"constraints[{i}]"
        kind = raw.get("type") if isinstance(raw, Mapping) else None
        if kind not in _CONSTRAINT_KEYS:
            c.fail(f"{key}.type", kind, f"unknown constraint type (valid: {', '.join(_CONSTRAINT_KEYS)})")
        c.mapping(key, raw, _CONSTRAINT_KEYS[kind], required=_CONSTRAINT_KEYS[kind])
        if kind == "fixed":
            n = c.node_ref(f"{key}.node", raw["node"], nodes)
            nodes[n] = Node(n, nodes[n].position, True)
            fixed.add(n)
            continue
        if kind == "coincident":
            pair = c.seq(f"{key}.nodes", raw["nodes"])
            if len(pair) != 2:
                c.fail(f"{key}.nodes", pair, "expected [node, virtual_node]")
            parent, node = (c.node_ref(f"{key}.nodes[{j}]", n, nodes) for j, n in enumerate(pair))
            parents, target = (parent,), nodes[parent].position
            con = CoincidentConstraint((parent, node))
            node_key = f"{key}.nodes[1]"
        else:
            node = c.node_ref(f"{key}.node", raw["node"], nodes)
            pair = c.seq(f"{key}.between", raw["between"])
            if len(pair) != 2:
                c.fail(f"{key}.between", pair, "expected two nodes")
            parents = tuple(c.node_ref(f"{key}.between[{j}]", n, nodes) for j, n in enumerate(pair))
            pa, pb = (nodes[p].position for p in parents)
            target = tuple((x + y) / 2 for x, y in zip(pa, pb))
            con = MidpointConstraint(node, parents)
            node_key = f"{key}.node"
        if node in parents:
            c.fail(node_key, node, "a node cannot be constrained to itself")
        if node in dependent or node in fixed:
            why = "it is fixed" if node in fixed else f"already placed by {dependent[node]}"
            c.fail(node_key, node, f"node is over-constrained: {why}")
        gap = _distance(nodes[node].position, target)
        if gap > CONSTRAINT_TOLERANCE_M:
            c.fail(node_key, node, f"position is {gap * 1e3:.3f} mm from where the constraint puts it "
                   f"({[round(v, 6) for v in target]}); fix the node's position")
        dependent[node] = key
        constraints.append(con)
    _check_acyclic(c, constraints)

    # Every free node must carry mass, or be placed by a constraint: otherwise it has no dynamics.
    carried = {n for b in bars for n in b.nodes}
    for i, n in enumerate(nodes):
        if not (nodes[n].fixed or n in carried or n in dependent):
            c.fail(f"nodes[{i}]", n, "free node with no bar and no constraint has no mass; "
                   "fix it, attach a bar, or constrain it")

    std = data.get("std_devs") or {}
    c.mapping("std_devs", std, set(std))
    std_devs = tuple((k, c.number(f"std_devs.{k}", v, lo=0.0)) for k, v in std.items())
    notes = data.get("notes", "")
    return Structure(name=name, nodes=tuple(nodes.values()), bars=tuple(bars), strings=tuple(strings),
                     constraints=tuple(constraints), actuators=tuple(actuators), gravity=gravity,
                     description=str(data.get("description", "")), source=source, std_devs=std_devs,
                     notes=notes if isinstance(notes, str) else yaml.safe_dump(notes))


def _mass_std(c: _Checker, key: str, value, mass: float) -> float:
    """A bar's ``mass_std``: a number in kg, or a percentage of ``mass`` (``'2%'``); finite and > 0. Returns kg."""
    how = "expected the mass's standard deviation in kg (e.g. 0.004) or as a percentage of the mass (e.g. 2%), > 0"
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            v = float(value.strip()[:-1]) / 100.0 * mass
        except ValueError:
            v = math.nan
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        v = math.nan
    if not (math.isfinite(v) and v > 0.0):
        c.fail(key, value, how)
    return v


def _check_acyclic(c: _Checker, constraints) -> None:
    """Reject constraint chains that loop (a on b, b on a): they have no consistent placement."""
    parents = {}
    for i, con in enumerate(constraints):
        node = con.nodes[1] if isinstance(con, CoincidentConstraint) else con.node
        parents[node] = (i, con.nodes[:1] if isinstance(con, CoincidentConstraint) else con.between)
    state: Dict[str, int] = {}

    def visit(n: str) -> None:
        if state.get(n) == 2 or n not in parents:
            return
        if state.get(n) == 1:
            c.fail(f"constraints[{parents[n][0]}]", n, "constraints form a cycle through this node")
        state[n] = 1
        for p in parents[n][1]:
            visit(p)
        state[n] = 2

    for n in parents:
        visit(n)


#: A structure file larger than this is not one (a binary or a data file given by mistake); bounds the read.
MAX_STRUCTURE_FILE_BYTES = 16 * 1024 * 1024
_HINT = "pass a structure file (YAML text), e.g. config/models/stacked_manipulator.yaml"


def _read_text(path: Path) -> str:
    """The file's text; unreadable, oversized, binary or non-UTF-8 content raises :class:`StructureError`."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STRUCTURE_FILE_BYTES + 1)
    except OSError as err:
        raise StructureError(str(path), "<file>", None,
                             f"cannot read file: {err.strerror or err}; check the path, or {_HINT}") from err
    if len(raw) > MAX_STRUCTURE_FILE_BYTES:
        raise StructureError(str(path), "<file>", None, f"larger than {MAX_STRUCTURE_FILE_BYTES >> 20} MiB, "
                             f"not a structure file; {_HINT}")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise StructureError(str(path), "<file>", raw[:8], f"binary data (NUL byte at offset {nul}), not YAML "
                             f"text; {_HINT}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise StructureError(str(path), f"line {line}", raw[err.start:err.start + 8],
                             f"not UTF-8 text (byte offset {err.start}); save the file as UTF-8 or {_HINT}") from err


def load_structure(path: Union[str, Path]) -> Structure:
    """Read and validate a structure YAML file.

    Every failure, including a file that is not UTF-8 YAML text at all (a binary, random bytes), raises
    :class:`StructureError` naming the file, where and why.
    """
    path = Path(path)
    text = _read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        if isinstance(err, yaml.reader.ReaderError):      # a control character: its str() spans lines
            where, problem = f"line {text.count(chr(10), 0, err.position) + 1}", err.reason
        else:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark else "<yaml>"
            problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise StructureError(str(path), where, None, f"not valid YAML: {problem}; fix the file there or "
                             f"{_HINT}") from err
    return structure_from_dict(data, source=str(path))


def structure_to_dict(s: Structure, std_devs: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """The YAML-ready mapping for ``s``; ``std_devs`` ("element.kind" -> value) are written beside."""
    out: Dict[str, Any] = {"name": s.name}
    if s.description:
        out["description"] = s.description
    if s.notes:
        out["notes"] = s.notes
    out["gravity"] = list(s.gravity)
    out["nodes"] = [{"name": n.name, "position": [float(v) for v in n.position], **({"fixed": True} if n.fixed else {})}
                    for n in s.nodes]
    out["bars"] = [{"name": b.name, "nodes": list(b.nodes), "mass": b.mass, "radius": b.radius,
                    **({"mass_std": b.mass_std} if b.mass_std is not None else {}),
                    **({"inertia": b.inertia} if b.inertia is not None else {})} for b in s.bars]
    out["strings"] = []
    for st in s.strings:
        d = {"name": st.name, "nodes": list(st.nodes), "stiffness": st.stiffness, "damping": st.damping,
             "rest_length": st.rest_length}
        if st.closed:
            d["closed"] = True
        if st.actuator:
            d["actuator"] = st.actuator
        if st.stiffness_law != STIFFNESS_LAWS[0]:   # the default (cord) stays implicit: old files are written as before
            d["stiffness_law"] = st.stiffness_law
        out["strings"].append(d)
    if s.constraints:
        out["constraints"] = [
            {"type": "coincident", "nodes": list(con.nodes)} if isinstance(con, CoincidentConstraint)
            else {"type": "midpoint", "node": con.node, "between": list(con.between)} for con in s.constraints]
    if s.actuators:
        out["actuators"] = [{"name": a.name, "motor_id": a.motor_id, "model": a.model, "spool_radius": a.spool_radius,
                             "direction": a.direction, "zero_offset": a.zero_offset, "limits": list(a.limits)}
                            for a in s.actuators]
    std = dict(s.std_devs)
    std.update(std_devs or {})
    if std:
        out["std_devs"] = {k: float(v) for k, v in std.items()}
    return out


def dump_structure(s: Structure, path: Union[str, Path], std_devs: Optional[Mapping[str, float]] = None,
                   header: str = "") -> None:
    """Write ``s`` as a structure file that :func:`load_structure` reads back unchanged.

    Written to a temporary file and renamed, so a failure never leaves half a file behind.
    """
    path = Path(path)
    text = yaml.safe_dump(structure_to_dict(s, std_devs), sort_keys=False, default_flow_style=None, width=110)
    if header:
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
