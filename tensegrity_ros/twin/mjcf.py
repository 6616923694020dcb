"""MJCF generation for the MuJoCo twin, from any structure file.

Mapping from the nodal model (``docs/twin.md`` explains the choices):

* every real bar -> one body with a free joint, a capsule geom, and an explicit ``inertial`` equal to the thin
  uniform rod's (m L^2/12 transverse, a tiny axial value), so bar dynamics match the nodal engine's consistent
  mass matrix m/6 [[2,1],[1,2]];
* bars whose ends are tied by coincident constraints into triangles (the plates' virtual bars) -> ONE rigid
  body carrying the summed thin-rod inertia of its bars;
* every node -> a site named after the node on the body that carries it (extra copies on other bodies are
  named ``NODE@BODY``);
* every (composite) string -> a spatial tendon through its nodes' sites (closed loops return to the first
  site), driven by a general actuator ``force = kappa (ctrl - L) - zeta L'`` clamped to pull-only; ``ctrl`` is
  the rest length (see ``docs/CONTRACTS.md``, string law);
* fixed nodes, coincident and midpoint constraints -> ``connect`` equalities between sites;
* gravity from the structure; contacts off unless ``ground=True``.
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..model.schema import CoincidentConstraint, MidpointConstraint, Structure

#: Axial moment of inertia of a bar, relative to its transverse one (a thin rod has none; MuJoCo needs > 0).
AXIAL_INERTIA_RATIO = 1e-4
#: Default soft-constraint parameters for the connect equalities (hold within ~1 mm, see docs/twin.md).
DEFAULT_SOLREF = (0.002, 1.0)
DEFAULT_SOLIMP = (0.999, 0.9999, 0.001, 0.5, 2.0)
WORLD = "world"


class TwinBuildError(ValueError):
    """A structure the MuJoCo twin cannot express (names the structure and what is wrong)."""


# ---------------------------------------------------------------------------------------------------------
# Layout: which body carries which node, where, and what ties the bodies together.
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BodySpec:
    name: str
    bars: Tuple[str, ...]
    pos: np.ndarray  # world position of the body frame (= centre of mass) in the reference pose
    rot: np.ndarray  # 3x3 world-from-body rotation in the reference pose
    mass: float
    inertia: np.ndarray  # 3x3 about the COM, in body axes
    #: node name -> local position, for each node this body carries (includes virtual duplicates)
    nodes: Dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def rigid_cluster(self) -> bool:
        return len(self.bars) > 1


@dataclass
class SiteSpec:
    name: str
    body: str  # body name or WORLD
    local: np.ndarray
    node: str  # structure node this site sits at


@dataclass
class TwinLayout:
    """Everything the MJCF and :class:`~tensegrity_ros.twin.sim.TwinSim` need to agree on."""

    structure: Structure
    bodies: List[BodySpec]
    sites: List[SiteSpec]
    #: structure node name -> name of the site that reports its position
    node_site: Dict[str, str]
    #: (site1, site2, why) for each connect equality
    connects: List[Tuple[str, str, str]]

    def body(self, name: str) -> BodySpec:
        return next(b for b in self.bodies if b.name == name)


def _rod_inertia(a: np.ndarray, b: np.ndarray, m: float, about: np.ndarray, rho: float = 1.0 / 12.0) -> np.ndarray:
    """World-axes inertia tensor of a bar a-b of mass m (centre of mass midway, transverse inertia rho m L^2
    about it, none about its axis; a thin uniform rod: rho = 1/12), about point ``about``."""
    d = b - a
    c = 0.5 * (a + b) - about
    eye = np.eye(3)
    return m * rho * (d @ d * eye - np.outer(d, d)) + m * (c @ c * eye - np.outer(c, c))


def frame_along(d: np.ndarray) -> np.ndarray:
    """A rotation whose z axis is ``d`` (unit), x axis chosen deterministically."""
    z = d / np.linalg.norm(d)
    helper = np.array([1.0, 0.0, 0.0]) if abs(z[0]) < 0.9 else np.array([0.0, 1.0, 0.0])
    x = helper - (helper @ z) * z
    x /= np.linalg.norm(x)
    return np.column_stack([x, np.cross(z, x), z])


class _UnionFind:
    def __init__(self, items):
        self.p = {i: i for i in items}

    def find(self, i):
        while self.p[i] != i:
            self.p[i] = self.p[self.p[i]]
            i = self.p[i]
        return i

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.p[rb] = ra


def _rigid_clusters(s: Structure, cls) -> List[List[int]]:
    """Groups of bar indices that are rigid together: triangles of bars over coincidence classes, grown by
    adding any bar whose both ends already belong to the cluster's classes (or a new triangle sharing an edge)."""
    ends = [(cls(b.nodes[0]), cls(b.nodes[1])) for b in s.bars]
    uf = _UnionFind(range(len(s.bars)))
    n = len(s.bars)
    for i in range(n):
        for j in range(i + 1, n):
            for k in range(j + 1, n):
                classes = set(ends[i]) | set(ends[j]) | set(ends[k])
                if len(classes) == 3 and all(len(set(e)) == 2 for e in (ends[i], ends[j], ends[k])) and \
                        len({frozenset(ends[i]), frozenset(ends[j]), frozenset(ends[k])}) == 3:
                    uf.union(i, j)
                    uf.union(i, k)
    groups: Dict[int, List[int]] = {}
    for i in range(n):
        groups.setdefault(uf.find(i), []).append(i)
    # two triangles that share two classes (an edge) are rigid together
    changed = True
    glist = [g for g in groups.values()]
    while changed:
        changed = False
        for a in range(len(glist)):
            for b in range(a + 1, len(glist)):
                ca = {c for i in glist[a] for c in ends[i]}
                cb = {c for i in glist[b] for c in ends[i]}
                if len(glist[a]) > 1 and len(glist[b]) > 1 and len(ca & cb) >= 2:
                    glist[a] = sorted(glist[a] + glist[b])
                    del glist[b]
                    changed = True
                    break
            if changed:
                break
    return sorted(glist, key=min)


def build_layout(s: Structure) -> TwinLayout:
    """Decide bodies, sites and connect equalities for ``s`` (pure numpy; no MuJoCo)."""
    pos = {n.name: np.asarray(n.position, dtype=float) for n in s.nodes}
    uf = _UnionFind(s.node_names)
    for con in s.constraints:
        if isinstance(con, CoincidentConstraint):
            uf.union(con.nodes[0], con.nodes[1])
    cls = uf.find
    fixed_cls = {cls(n) for n in s.fixed_nodes}

    bodies: List[BodySpec] = []
    bar_body: Dict[str, str] = {}
    used_names = set()
    for group in _rigid_clusters(s, cls):
        bars = [s.bars[i] for i in group]
        mass = sum(b.mass for b in bars)
        if len(bars) == 1:
            b = bars[0]
            a, c = pos[b.nodes[0]], pos[b.nodes[1]]
            length = float(np.linalg.norm(c - a))
            com, rot = 0.5 * (a + c), frame_along(c - a)
            it = b.mass * length ** 2 * s.bar_inertia_ratio(b)
            inertia = np.diag([it, it, max(it * AXIAL_INERTIA_RATIO, 1e-12)])
            name = b.name
        else:
            com = sum(b.mass * 0.5 * (pos[b.nodes[0]] + pos[b.nodes[1]]) for b in bars) / mass
            rot = np.eye(3)
            inertia = sum(_rod_inertia(pos[b.nodes[0]], pos[b.nodes[1]], b.mass, com, s.bar_inertia_ratio(b))
                          for b in bars)
            w = np.linalg.eigvalsh(inertia)
            if w.min() <= 1e-9 * max(w.max(), 1e-12):  # collinear cluster: add the same tiny axial value
                inertia = inertia + np.eye(3) * max(w.max() * AXIAL_INERTIA_RATIO, 1e-12)
            # A planar cluster (a plate) has A + B = C exactly; rounding in the MJCF text can make MuJoCo's
            # A + B >= C check fail, so give every axis a relative 1e-6 of margin (physically negligible).
            inertia = inertia + np.eye(3) * 1e-6 * max(w.max(), 1e-12)
            name = "rigid_" + "_".join(b.name for b in bars)
        if name in used_names or name == WORLD:
            raise TwinBuildError(f"{s.source}: body name {name!r} is used twice")
        used_names.add(name)
        spec = BodySpec(name, tuple(b.name for b in bars), com, rot, mass, inertia)
        for b in bars:
            bar_body[b.name] = name
            for n in b.nodes:
                spec.nodes[n] = rot.T @ (pos[n] - com)
        bodies.append(spec)
    by_name = {b.name: b for b in bodies}

    # ---- sites ------------------------------------------------------------------------------------------
    sites: List[SiteSpec] = []
    site_names = set()
    node_site: Dict[str, str] = {}
    connects: List[Tuple[str, str, str]] = []

    def add_site(name, body, node):
        if name in site_names:
            return name
        site_names.add(name)
        local = pos[node] if body == WORLD else by_name[body].rot.T @ (pos[node] - by_name[body].pos)
        sites.append(SiteSpec(name, body, np.asarray(local, dtype=float), node))
        return name

    # bodies hosting each coincidence class: first host (in bar order) is primary
    class_hosts: Dict[str, List[Tuple[str, str]]] = {}  # class -> [(body, node)]
    for b in s.bars:
        for n in b.nodes:
            hosts = class_hosts.setdefault(cls(n), [])
            if bar_body[b.name] not in [h[0] for h in hosts]:
                hosts.append((bar_body[b.name], n))
    # primary site per node: on the first body carrying that node itself, else on the class's primary host
    node_hosts: Dict[str, List[str]] = {}
    for b in s.bars:
        for n in b.nodes:
            node_hosts.setdefault(n, [])
            if bar_body[b.name] not in node_hosts[n]:
                node_hosts[n].append(bar_body[b.name])
    midpoints = {con.node: con for con in s.constraints if isinstance(con, MidpointConstraint)}

    def common_body(a: str, b: str) -> Optional[str]:
        ha = [h for h, _ in class_hosts.get(cls(a), [])]
        hb = [h for h, _ in class_hosts.get(cls(b), [])]
        both = [h for h in ha if h in hb]
        return both[0] if both else None

    for node in s.nodes:
        n = node.name
        if n in node_hosts:
            node_site[n] = add_site(n, node_hosts[n][0], n)
        elif cls(n) in class_hosts:
            node_site[n] = add_site(n, class_hosts[cls(n)][0][0], n)
        elif cls(n) in fixed_cls:
            node_site[n] = add_site(n, WORLD, n)
        elif n in midpoints:
            host = common_body(*midpoints[n].between)
            if host is None:
                raise TwinBuildError(f"{s.source}: node {n!r} is a midpoint of nodes on different rigid bodies; "
                                     "the MuJoCo twin can only place it on one rigid body")
            node_site[n] = add_site(n, host, n)
        else:
            raise TwinBuildError(f"{s.source}: node {n!r} has no bar, constraint or fixed anchor")

    # ---- connects ----------------------------------------------------------------------------------------
    # (1) a class (coincident nodes, or one node shared by several bars) hosted by several bodies
    for c, hosts in class_hosts.items():
        anchor_body, anchor_node = hosts[0]
        anchor = add_site(anchor_node if node_site.get(anchor_node) and
                          _site_body(sites, node_site[anchor_node]) == anchor_body else f"{anchor_node}@{anchor_body}",
                          anchor_body, anchor_node)
        if c in fixed_cls:
            fixed_node = next(n for n in s.fixed_nodes if cls(n) == c)
            world_site = add_site(f"{fixed_node}@{WORLD}", WORLD, fixed_node)
            for body, n in hosts:
                site = _site_on(sites, node_site, n, body, add_site)
                connects.append((site, world_site, f"fixed node {fixed_node}"))
            continue
        for body, n in hosts[1:]:
            site = _site_on(sites, node_site, n, body, add_site)
            connects.append((anchor, site, f"coincident class of {anchor_node}"))
    # (2) midpoint constraints
    for m, con in midpoints.items():
        host = common_body(*con.between)
        if host is None:
            raise TwinBuildError(f"{s.source}: midpoint constraint on {m!r}: {con.between[0]!r} and "
                                 f"{con.between[1]!r} are not on one rigid body (the MuJoCo twin cannot express it)")
        if _site_body(sites, node_site[m]) == host:
            continue
        target = add_site(f"{m}@{host}", host, m)
        connects.append((node_site[m], target, f"midpoint of {con.between[0]} and {con.between[1]}"))
        # other bodies carrying m (or its coincident class) follow through (1)
    return TwinLayout(s, bodies, sites, node_site, connects)


def _site_body(sites: Sequence[SiteSpec], name: str) -> str:
    return next(x.body for x in sites if x.name == name)


def _site_on(sites, node_site, node, body, add_site) -> str:
    if node in node_site and _site_body(sites, node_site[node]) == body:
        return node_site[node]
    return add_site(f"{node}@{body}", body, node)


# ---------------------------------------------------------------------------------------------------------
# MJCF text
# ---------------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    return " ".join(f"{float(x):.10g}" for x in np.ravel(v))


def _quat(rot: np.ndarray) -> np.ndarray:
    """(w, x, y, z) of a rotation matrix."""
    m = rot
    tr = np.trace(m)
    if tr > 0:
        s = math.sqrt(tr + 1.0) * 2
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    else:
        i = int(np.argmax(np.diag(m)))
        j, k = (i + 1) % 3, (i + 2) % 3
        s = math.sqrt(1.0 + m[i, i] - m[j, j] - m[k, k]) * 2
        q = [0.0] * 4
        q[0] = (m[k, j] - m[j, k]) / s
        q[1 + i] = 0.25 * s
        q[1 + j] = (m[j, i] + m[i, j]) / s
        q[1 + k] = (m[k, i] + m[i, k]) / s
    q = np.array(q)
    return q / np.linalg.norm(q) * (1 if q[0] >= 0 else -1)


def string_kappa(string, rest_length: Optional[float] = None) -> float:
    """The string's stiffness (N/m) at rest length ``rest_length`` (default: its nominal one), by its
    ``stiffness_law``: ``cord``: kappa = EA / xi0 with EA = stiffness * nominal rest length (contract string
    law); ``spring``: kappa = stiffness, whatever xi0."""
    if string.stiffness_law == "spring":
        return string.stiffness
    xi0 = string.rest_length if rest_length is None else rest_length
    return string.stiffness * string.rest_length / xi0


#: up to this many degrees of freedom the twin's constraint Jacobians are dense (MuJoCo's ``auto`` goes sparse
#: from 60). Same arithmetic, other storage: on the manipulator (14 free bodies, 84 dof) an implicitfast step took
#: 62 us instead of 75 and an RK4 step (the simulated robot's) 180 us instead of 226 (min of 15 interleaved rounds),
#: the node trajectories the same to 2e-13 m. The simulated robot steps at 1 kHz; the predictor's and controller's
#: nominals run the twin too.
DENSE_JACOBIAN_MAX_DOF = 120


def build_mjcf(structure: Structure, *, timestep: float = 0.001, ground: bool = False,
               integrator: str = "implicitfast", solref: Sequence[float] = DEFAULT_SOLREF,
               solimp: Sequence[float] = DEFAULT_SOLIMP, gravity: Optional[Sequence[float]] = None,
               damping: bool = True, string_width: float = 0.003, layout: Optional[TwinLayout] = None) -> str:
    """MJCF text for ``structure`` (see module docstring). Names: bodies = bar names (``rigid_b13_b14_b15``
    for merged clusters), sites = node names, tendons and actuators = string names, equalities ``eq_*``.

    ``damping=False`` drops the strings' damping (energy checks); ``gravity`` overrides the structure's.
    A keyframe ``nominal`` holds the reference pose with ``ctrl`` = nominal rest lengths.
    """
    s = structure
    lay = layout or build_layout(s)
    root = ET.Element("mujoco", model=s.name)
    ET.SubElement(root, "compiler", angle="radian", autolimits="true")
    opt = ET.SubElement(root, "option", timestep=f"{timestep:.10g}", integrator=integrator,
                        gravity=_fmt(s.gravity if gravity is None else gravity))
    if 6 * len(lay.bodies) <= DENSE_JACOBIAN_MAX_DOF:
        opt.set("jacobian", "dense")
    ET.SubElement(opt, "flag", contact="enable" if ground else "disable")
    size = ET.SubElement(root, "size")
    size.set("memory", "64M")
    vis = ET.SubElement(root, "visual")
    ET.SubElement(vis, "global", offwidth="1280", offheight="960")
    asset = ET.SubElement(root, "asset")
    ET.SubElement(asset, "texture", name="grid", type="2d", builtin="checker", rgb1=".2 .3 .4", rgb2=".1 .2 .3",
                  width="512", height="512")
    ET.SubElement(asset, "material", name="grid", texture="grid", texrepeat="4 4", reflectance="0.1")
    world = ET.SubElement(root, "worldbody")
    ET.SubElement(world, "light", pos="0 0 5", dir="0 0 -1", directional="true")
    if ground:
        ET.SubElement(world, "geom", name="ground", type="plane", size="5 5 0.1", material="grid",
                      contype="0", conaffinity="1")
    for site in lay.sites:
        if site.body == WORLD:
            ET.SubElement(world, "site", name=site.name, pos=_fmt(site.local), size="0.012", rgba="0.2 0.2 0.2 1")
    bars = {b.name: b for b in s.bars}
    pos = {n.name: np.asarray(n.position, dtype=float) for n in s.nodes}
    fixed = set(s.fixed_nodes)
    for body in lay.bodies:
        # bodies pinned to the world do not collide with the ground (their pinned end sits on it)
        collide = ground and not (fixed & set(body.nodes))
        el = ET.SubElement(world, "body", name=body.name, pos=_fmt(body.pos), quat=_fmt(_quat(body.rot)))
        ET.SubElement(el, "freejoint", name=f"{body.name}_free")
        inertial = ET.SubElement(el, "inertial", pos="0 0 0", mass=f"{body.mass:.10g}")
        if body.rigid_cluster:
            I = body.inertia
            inertial.set("fullinertia", _fmt([I[0, 0], I[1, 1], I[2, 2], I[0, 1], I[0, 2], I[1, 2]]))
        else:
            inertial.set("diaginertia", _fmt(np.diag(body.inertia)))
        for bname in body.bars:
            bar = bars[bname]
            a, c = (body.rot.T @ (pos[n] - body.pos) for n in bar.nodes)
            ET.SubElement(el, "geom", name=bname, type="capsule", fromto=_fmt(np.r_[a, c]), size=f"{bar.radius:.6g}",
                          mass="0", contype="1" if collide else "0", conaffinity="0",
                          rgba="0.75 0.45 0.2 1" if not body.rigid_cluster else "0.4 0.4 0.45 0.8")
        for site in lay.sites:
            if site.body == body.name:
                ET.SubElement(el, "site", name=site.name, pos=_fmt(site.local), size="0.01", rgba="0.9 0.1 0.1 1")
    eq = ET.SubElement(root, "equality")
    for k, (s1, s2, why) in enumerate(lay.connects):
        ET.SubElement(eq, "connect", name=f"eq{k}_{s1}_{s2}", site1=s1, site2=s2, solref=_fmt(solref),
                      solimp=_fmt(solimp))
    tendon = ET.SubElement(root, "tendon")
    for st in s.strings:
        sp = ET.SubElement(tendon, "spatial", name=st.name, width=f"{string_width:.4g}",
                           rgba="0.1 0.5 0.9 1" if st.actuator else "0.2 0.8 0.3 1")
        ring = list(st.nodes) + ([st.nodes[0]] if st.closed else [])
        for n in ring:
            ET.SubElement(sp, "site", site=lay.node_site[n])
    act = ET.SubElement(root, "actuator")
    for st in s.strings:
        kappa = string_kappa(st)
        zeta = st.damping if damping else 0.0
        ET.SubElement(act, "general", name=st.name, tendon=st.name, gaintype="fixed", biastype="affine",
                      gainprm=f"{kappa:.10g}", biasprm=f"0 {-kappa:.10g} {-zeta:.10g}",
                      ctrllimited="false", forcelimited="true", forcerange="-1e7 0")
    key = ET.SubElement(root, "keyframe")
    ET.SubElement(key, "key", name="nominal", ctrl=_fmt([st.rest_length for st in s.strings]))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode")
