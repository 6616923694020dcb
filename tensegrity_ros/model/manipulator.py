"""Generator and form-finder for the seed's two-stage stacked tensegrity manipulator.

``python -m tensegrity_ros.model.manipulator`` writes ``config/models/stacked_manipulator.yaml``; a test checks
the file still matches :func:`stacked_manipulator`. What the seed paper pins down (counts, sizes, masses,
constraints) is in ``/work/shared/stacked_manipulator_topology.md``; everything else is chosen here and
written into the file's ``notes``. See ``docs/twin.md`` for the table of chosen values.

Topology (per stage, 0-based k = 0, 1, 2, indices mod 3; stage 2 has every node number + 12 and bar number + 6):

* bottom nodes B_k = n(1+k), "high" saddle nodes Sh_k = n(4+k), "low" saddle nodes Sl_k = n(7+k),
  top nodes T_k = n(10+k);
* bottom bars b(1+k): B_k -> Sh_k; top bars b(4+k): T_k -> Sl_k (so n10 carries b4);
* actuated verticals sc(1+k): B_k -> Sl_(k+1) -> T_(k+2);
* soft verticals sc(4+k): B_k -> Sh_(k+1) -> T_k;
* saddle loop sc7: the six saddle nodes in angular order (alternating high/low), closed.

Form-finding: each stage is parameterised with 3-fold symmetry by (H, theta, alpha_h, z_h, alpha_l, z_l):
top triangle height and twist, and the azimuth offset and height of the high/low saddle nodes (their radii
follow from the exact bar length). With the actuated verticals' tension fixed, the soft-vertical and saddle
tensions and the 12 shape parameters are solved (scipy least squares) so that every free node is in
equilibrium under string tensions, gravity (bar masses lumped m/2 on each end, plate mass m/3 on each
corner), bar compressions and the plate's internal forces. Rest lengths then follow from the chosen EA:
xi0 = L / (1 + T / EA). The starting shape came from a symmetric search over routings and shapes that
maximised the first natural frequency with >= 50 mm clearance between bar axes.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from .loader import dump_structure
from .schema import Actuator, Bar, CoincidentConstraint, MidpointConstraint, Node, String, Structure

GRAVITY = 9.81
#: Per stage: bar length (m), bar mass (kg), bar radius (m), circumradius (m), plate mass (kg).
STAGES = ({"bar_length": 0.95, "bar_mass": 0.29, "bar_radius": 0.01, "radius": 0.26, "plate_mass": 2.7},
          {"bar_length": 0.50, "bar_mass": 0.11, "bar_radius": 0.0075, "radius": 0.13, "plate_mass": 0.33})
#: Routing (offsets in k): actuated B_k -> Sl_(k+A_SADDLE) -> T_(k+A_TOP), soft B_k -> Sh_(k+S_SADDLE) -> T_(k+S_TOP).
A_SADDLE, A_TOP, S_SADDLE, S_TOP = 1, 2, 1, 0
#: Initial shape per stage (H, theta, alpha_h, z_h, alpha_l, z_l) (m, rad); the solver moves it to equilibrium.
SHAPE_GUESS = ((0.920815, 1.143879, -2.846613, 0.479796, 2.934707, 0.206805),
               (0.49, 1.143879, -2.846613, 0.25, 2.934707, 0.11))
#: Tension of each actuated vertical at the nominal equilibrium (N), per stage.
ACTUATED_TENSION = (800.0, 155.0)
#: Initial guess of (soft vertical, saddle) tensions (N), per stage.
TENSION_GUESS = ((147.0, 425.0), (37.0, 106.0))
#: EA (N) of (actuated vertical, soft vertical incl. its series spring, saddle loop), per stage.
EA = ((20000.0, 8000.0, 20000.0), (8000.0, 3000.0, 8000.0))
#: Damping zeta (N s/m) of (actuated, soft, saddle), per stage.
DAMPING = ((100.0, 100.0, 100.0), (30.0, 30.0, 30.0))
#: Actuators: spool radius (m), direction, zero offset (rad), limits (rad), Dynamixel model, per stage.
SPOOL_RADIUS = 0.02
MOTOR_MODELS = ("l54-50-s290-r", "m42-10-s260-r")
MOTOR_LIMITS = (-math.pi, math.pi)
#: Seed drive amplitudes of the actuated strings' rest lengths (m), per stage.
DRIVE_AMPLITUDE = (0.0363, 0.0168)
DECIMALS = 9

N_PHYS = 24
FIXED = (0, 1, 2)
MIDPOINTS = ((12, (10, 11)), (13, (9, 11)), (14, (9, 10)))  # n13=(n11+n12)/2, n14=(n10+n12)/2, n15=(n10+n11)/2


# ---------------------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------------------
def _stage_nodes(shape: Sequence[float], psi: float, base_z: float, radius: float, bar: float) -> np.ndarray:
    """12 nodes (B0-2, Sh0-2, Sl0-2, T0-2) of one stage, base centred on the z axis."""
    h, theta, a_h, z_h, a_l, z_l = shape
    out = np.zeros((12, 3))

    def ring(r, ang, z):
        return np.array([r * math.cos(ang), r * math.sin(ang), z])

    def arm(alpha, dz):  # radius of the far end of a bar from a corner at `radius`, offset alpha, height dz
        c = math.cos(alpha)
        disc = radius * radius * c * c - radius * radius - dz * dz + bar * bar
        return radius * c + math.sqrt(max(disc, 0.0))

    for k in range(3):
        a = psi + 2.0 * math.pi * k / 3.0
        out[k] = ring(radius, a, base_z)
        out[3 + k] = ring(arm(a_h, z_h), a + a_h, base_z + z_h)
        out[9 + k] = ring(radius, a + theta, base_z + h)
        out[6 + k] = ring(arm(a_l, h - z_l), a + theta + a_l, base_z + z_l)
    return out


def physical_nodes(shapes: Sequence[Sequence[float]]) -> np.ndarray:
    """(24, 3) positions n1..n24 for the two stages' shape parameters (stage 2 sits on Stage 1's plate)."""
    s1, s2 = STAGES
    x = np.zeros((N_PHYS, 3))
    x[:12] = _stage_nodes(shapes[0], 0.0, 0.0, s1["radius"], s1["bar_length"])
    for node, (a, b) in MIDPOINTS:
        x[node] = 0.5 * (x[a] + x[b])
    # n13 sits opposite n10, i.e. at azimuth (theta_1 + pi); stage 2's corners follow n13 -> n14 -> n15 (+120 deg)
    st2 = _stage_nodes(shapes[1], shapes[0][1] + math.pi, shapes[0][0], s2["radius"], s2["bar_length"])
    x[15:24] = st2[3:]
    return x


def _stage_strings(stage: int, x: np.ndarray) -> List[Tuple[str, List[int], bool]]:
    """(kind, node indices, closed) for one stage's 7 composite strings."""
    o = 12 * stage
    B = lambda k: o + k % 3  # noqa: E731
    Sh = lambda k: o + 3 + k % 3  # noqa: E731
    Sl = lambda k: o + 6 + k % 3  # noqa: E731
    T = lambda k: o + 9 + k % 3  # noqa: E731
    out = [("act", [B(k), Sl(k + A_SADDLE), T(k + A_TOP)], False) for k in range(3)]
    out += [("soft", [B(k), Sh(k + S_SADDLE), T(k + S_TOP)], False) for k in range(3)]
    centre = x[o:o + 3].mean(0)
    saddle = list(range(o + 3, o + 9))
    ang = [math.atan2(x[i, 1] - centre[1], x[i, 0] - centre[0]) for i in saddle]
    ring = [saddle[i] for i in np.argsort(ang)]
    start = ring.index(o + 3)  # start the loop at Sh_0 (n4 / n16)
    out.append(("saddle", ring[start:] + ring[:start], True))
    return out


def string_paths(x: np.ndarray) -> List[Tuple[str, int, List[int], bool]]:
    return [(kind, st, path, closed) for st in (0, 1) for kind, path, closed in _stage_strings(st, x)]


def _bars() -> List[Tuple[int, int, int]]:
    """(a, b, stage) for the 12 real bars, b1..b12."""
    out = []
    for st in (0, 1):
        o = 12 * st
        out += [(o + k, o + 3 + k, st) for k in range(3)] + [(o + 9 + k, o + 6 + k, st) for k in range(3)]
    return out


PLATE_EDGES = ((9, 10), (10, 11), (11, 9), (21, 22), (22, 23), (23, 21))  # b13-b15, b16-b18


def node_masses() -> np.ndarray:
    m = np.zeros(N_PHYS)
    for a, b, st in _bars():
        m[a] += STAGES[st]["bar_mass"] / 2
        m[b] += STAGES[st]["bar_mass"] / 2
    m[9:12] += STAGES[0]["plate_mass"] / 3
    m[21:24] += STAGES[1]["plate_mass"] / 3
    return m


# ---------------------------------------------------------------------------------------------------------
# Statics and modal analysis on the nodal model (physical nodes; plates as rigid triangles)
# ---------------------------------------------------------------------------------------------------------
FREE = [i for i in range(N_PHYS) if i not in FIXED and i not in [m for m, _ in MIDPOINTS]]


def _reduction() -> np.ndarray:
    """A (72, 3*len(FREE)): all coordinates from the free ones (fixed nodes are constants)."""
    a = np.zeros((3 * N_PHYS, 3 * len(FREE)))
    for q, n in enumerate(FREE):
        a[3 * n:3 * n + 3, 3 * q:3 * q + 3] = np.eye(3)
    for node, (i, j) in MIDPOINTS:
        for p in (i, j):
            q = FREE.index(p)
            a[3 * node:3 * node + 3, 3 * q:3 * q + 3] += 0.5 * np.eye(3)
    return a


_A = _reduction()


def _seg_grad(x, i, j, g, w=1.0):
    v = x[j] - x[i]
    length = float(np.linalg.norm(v))
    u = v / length
    g[3 * j:3 * j + 3] += w * u
    g[3 * i:3 * i + 3] -= w * u
    return length


def _seg_hess(x, i, j, h, w=1.0):
    v = x[j] - x[i]
    length = float(np.linalg.norm(v))
    u = v / length
    k = w * (np.eye(3) - np.outer(u, u)) / length
    for a, sa in ((i, 1.0), (j, -1.0)):
        for b, sb in ((i, 1.0), (j, -1.0)):
            h[3 * a:3 * a + 3, 3 * b:3 * b + 3] += sa * sb * k


def _lengths_grads(x, paths):
    lengths, grads = [], []
    for _, _, path, closed in paths:
        g = np.zeros(3 * N_PHYS)
        ring = path + ([path[0]] if closed else [])
        lengths.append(sum(_seg_grad(x, a, b, g) for a, b in zip(ring[:-1], ring[1:])))
        grads.append(g)
    return np.array(lengths), np.array(grads)


def _constraints():
    return [(a, b) for a, b, _ in _bars()] + list(PLATE_EDGES)


def _jacobian(x):
    cons = _constraints()
    j = np.zeros((len(cons), 3 * N_PHYS))
    for r, (a, b) in enumerate(cons):
        _seg_grad(x, a, b, j[r])
    return j @ _A


def equilibrium_residual(x: np.ndarray, tensions: np.ndarray, paths=None) -> Tuple[np.ndarray, np.ndarray]:
    """Out-of-balance generalised force on the free coordinates (N) after the best bar/plate forces, and
    those forces (lambda > 0: compression)."""
    paths = paths if paths is not None else string_paths(x)
    _, grads = _lengths_grads(x, paths)
    grav = np.zeros(3 * N_PHYS)
    grav[2::3] = node_masses() * GRAVITY
    f = _A.T @ (grads.T @ tensions + grav)
    j = _jacobian(x)
    lam, *_ = np.linalg.lstsq(j.T, f, rcond=None)
    return f - j.T @ lam, lam


def _mass_matrix():
    m = np.zeros((3 * N_PHYS, 3 * N_PHYS))
    elems = [(a, b, STAGES[st]["bar_mass"]) for a, b, st in _bars()]
    elems += [(a, b, STAGES[0 if r < 3 else 1]["plate_mass"] / 3) for r, (a, b) in enumerate(PLATE_EDGES)]
    for a, b, mass in elems:  # consistent mass m/6 [[2, 1], [1, 2]] (seed eq. 1)
        for i in (a, b):
            for j in (a, b):
                m[3 * i:3 * i + 3, 3 * j:3 * j + 3] += (mass / 3 if i == j else mass / 6) * np.eye(3)
    return _A.T @ m @ _A


def natural_frequencies(x: np.ndarray, tensions: np.ndarray, kappas: np.ndarray) -> np.ndarray:
    """Small-oscillation frequencies (Hz) about the equilibrium x of the nodal model (constrained Hessian
    of the potential with material + geometric string stiffness and the bars' compressive (negative)
    geometric stiffness, against the consistent mass matrix). NaN marks unstable (negative) modes."""
    from scipy.linalg import eigh

    paths = string_paths(x)
    _, grads = _lengths_grads(x, paths)
    h = np.zeros((3 * N_PHYS, 3 * N_PHYS))
    for c, (_, _, path, closed) in enumerate(paths):
        h += kappas[c] * np.outer(grads[c], grads[c])
        ring = path + ([path[0]] if closed else [])
        for a, b in zip(ring[:-1], ring[1:]):
            _seg_hess(x, a, b, h, tensions[c])
    _, lam = equilibrium_residual(x, tensions, paths)
    for r, (a, b) in enumerate(_constraints()):
        _seg_hess(x, a, b, h, -lam[r])
    hq = _A.T @ h @ _A
    _, sv, vt = np.linalg.svd(_jacobian(x))
    null = vt[int(np.sum(sv > 1e-9)):].T
    w = eigh(null.T @ hq @ null, null.T @ _mass_matrix() @ null, eigvals_only=True)
    return np.where(w > 0, np.sqrt(np.abs(w)) / (2 * math.pi), np.nan)


def _tension_vector(paths, act: Sequence[float], free: Sequence[float]) -> np.ndarray:
    """Per composite string: actuated -> act[stage], soft -> free[2*stage], saddle -> free[2*stage+1]."""
    out = []
    for kind, st, _, _ in paths:
        out.append(act[st] if kind == "act" else free[2 * st] if kind == "soft" else free[2 * st + 1])
    return np.array(out)


def form_find(shape_guess=SHAPE_GUESS, tension_guess=TENSION_GUESS, actuated_tension=ACTUATED_TENSION):
    """Solve the symmetric prestressed equilibrium under gravity. Returns (x (24, 3), tensions (14,), info)."""
    from scipy.optimize import least_squares

    z0 = np.r_[np.ravel(shape_guess), np.ravel(tension_guess)]
    lo = np.r_[[0.3, -math.pi, -math.pi, 0.05, -math.pi, 0.01] * 2, [1.0] * 4]
    hi = np.r_[[2.5, math.pi, math.pi, 0.95, math.pi, 1.5] * 2, [5000.0] * 4]
    paths0 = string_paths(physical_nodes(np.reshape(z0[:12], (2, 6))))

    def residual(z):
        x = physical_nodes(np.reshape(z[:12], (2, 6)))
        t = _tension_vector(paths0, actuated_tension, z[12:])
        return equilibrium_residual(x, t, paths0)[0]

    sol = least_squares(residual, z0, bounds=(lo, hi), xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=2000)
    shapes = np.reshape(sol.x[:12], (2, 6))
    x = physical_nodes(shapes)
    paths = string_paths(x)
    if [p[2] for p in paths] != [p[2] for p in paths0]:
        raise RuntimeError("form-finding changed the saddle loop's order; start closer to the design")
    t = _tension_vector(paths, actuated_tension, sol.x[12:])
    return x, t, {"shapes": shapes, "residual": float(np.abs(sol.fun).max()), "paths": paths}


# ---------------------------------------------------------------------------------------------------------
# The structure file
# ---------------------------------------------------------------------------------------------------------
def _r(v: float, d: int = DECIMALS) -> float:
    return float(round(float(v), d))


def stacked_manipulator() -> Structure:
    """The two-stage manipulator as a :class:`Structure` (positions from :func:`form_find`)."""
    x, tensions, info = form_find()
    x = np.round(x, DECIMALS)
    for node, (a, b) in MIDPOINTS:  # exact after rounding (loader checks to 1e-5 m)
        x[node] = np.round(0.5 * (x[a] + x[b]), DECIMALS)
    names = [f"n{i + 1}" for i in range(N_PHYS)]
    top = [9, 10, 11, 21, 22, 23]
    nodes = [Node(n, tuple(_r(v) for v in x[i]), i in FIXED) for i, n in enumerate(names)]
    for i in top:
        nodes += [Node(f"{names[i]}_v{j}", tuple(_r(v) for v in x[i])) for j in (1, 2)]
    bars = [Bar(f"b{k + 1}", (names[a], names[b]), STAGES[st]["bar_mass"], STAGES[st]["bar_radius"])
            for k, (a, b, st) in enumerate(_bars())]
    # plate edges: b13 (n10, n11), b14 (n11, n12), b15 (n12, n10); b16-b18 likewise on n22-n24
    for st, base in ((0, 13), (1, 16)):
        t0 = 9 + 12 * st
        m = STAGES[st]["plate_mass"] / 3
        corners = [names[t0 + k] for k in range(3)]
        edges = [(f"{corners[0]}_v1", f"{corners[1]}_v1"), (f"{corners[1]}_v2", f"{corners[2]}_v1"),
                 (f"{corners[2]}_v2", f"{corners[0]}_v2")]
        bars += [Bar(f"b{base + e}", edges[e], m, 0.005) for e in range(3)]

    paths = info["paths"]
    lengths, _ = _lengths_grads(x, paths)
    strings = []
    kinds = {"act": 0, "soft": 1, "saddle": 2}
    counter = {0: 0, 1: 0}
    for c, (kind, st, path, closed) in enumerate(paths):
        counter[st] += 1
        idx = 7 * st + counter[st]
        ea = EA[st][kinds[kind]]
        xi0 = _r(lengths[c] / (1.0 + tensions[c] / ea))
        act = f"m{3 * st + (idx - 7 * st)}" if kind == "act" else None
        strings.append(String(f"sc{idx}", tuple(names[i] for i in path), _r(ea / xi0, 6),
                              DAMPING[st][kinds[kind]], xi0, act, closed))
    actuators = [Actuator(f"m{i + 1}", i + 1, SPOOL_RADIUS, 1, 0.0, MOTOR_LIMITS, MOTOR_MODELS[i // 3])
                 for i in range(6)]
    constraints = []
    for i in top:
        constraints += [CoincidentConstraint((names[i], f"{names[i]}_v{j}")) for j in (1, 2)]
    constraints += [MidpointConstraint(names[n], (names[a], names[b])) for n, (a, b) in MIDPOINTS]

    kappa = np.array([s.stiffness for s in strings])  # EA / xi00 at the nominal rest length
    freqs = natural_frequencies(x, tensions, kappa)
    sh = info["shapes"]
    notes = "\n".join([
        "Chosen by tensegrity_ros/model/manipulator.py (form-finding); the seed's Tables 3-7 did not survive.",
        "Topology per stage (k = 0..2 mod 3; Stage 2 = node numbers + 12, bars + 6, strings + 7, motors + 3):",
        "  bottom B_k = n1-n3, high saddle Sh_k = n4-n6 (bottom bars b1-b3: B_k-Sh_k),",
        "  low saddle Sl_k = n7-n9 (top bars b4-b6: T_k-Sl_k, so n10 carries b4), top T_k = n10-n12.",
        f"  actuated verticals sc1-sc3: B_k -> Sl_(k+{A_SADDLE}) -> T_(k+{A_TOP}), driven by m1-m3;",
        f"  soft verticals sc4-sc6 (series springs): B_k -> Sh_(k+{S_SADDLE}) -> T_(k+{S_TOP});",
        "  saddle loop sc7: the 6 saddle nodes in angular order, alternating high/low, closed.",
        "  Plates: virtual bars b13 (n10,n11), b14 (n11,n12), b15 (n12,n10) through virtual duplicates n10_v1...",
        "Frame: z up, ground triangle centred on the origin, n1 on the +x axis; 3-fold symmetric about z.",
        "Form-finding: prestressed equilibrium under gravity (bar mass m/2 per end, plate mass m/3 per corner)",
        f"  with fixed n1-n3, exact bar lengths 0.95/0.50 m and plate circumradii 0.26/0.13 m; max residual "
        f"{info['residual']:.1e} N.",
        f"  shape (H, twist, alpha_h, z_h, alpha_l, z_l) [m, rad]: stage 1 {np.round(sh[0], 4).tolist()}, "
        f"stage 2 {np.round(sh[1], 4).tolist()}.",
        f"  tensions at rest [N] (actuated, soft, saddle): stage 1 {[round(float(tensions[i]), 2) for i in (0, 3, 6)]}, "
        f"stage 2 {[round(float(tensions[i]), 2) for i in (7, 10, 13)]}.",
        f"EA [N] (actuated, soft incl. series spring, saddle): stage 1 {list(EA[0])}, stage 2 {list(EA[1])};",
        "  stiffness = EA / rest_length; rest_length = L / (1 + T / EA).",
        f"Damping zeta [N s/m] (actuated, soft, saddle): stage 1 {list(DAMPING[0])}, stage 2 {list(DAMPING[1])} "
        "(assumed: equivalent damping of strings + series springs + saddle friction). 500/150 N s/m would damp",
        "  the sway pair at ~5%, but on the 0.11-0.145 kg bar ends it makes the damping term stiff: the torch",
        "  engine's explicit integrators diverge at any dt >= 0.5 ms (measured), so 100/30 N s/m keeps it",
        "  stable at 1 ms with margin; the plates then ring lightly (~1%) on top of the periodic response.",
        "Retuned (was EA soft 1.5/0.4 kN, prestress 400/100 N, zeta 10/5): the soft verticals were so much softer",
        "  than the actuated ones and the damping so low (~1%) that the seed drive made the plates ring at ~1.7 Hz",
        "  (+-200 mm). Now: prestress 800/155 N (stage-1 peak torque ~20 N m < 25 for the L54, stage 2 ~3.6 N m",
        "  < 4 for the M42; 155 rather than 160 N only because 160 gives a stage-2 plate inertia MuJoCo's",
        "  A+B>=C check rejects by rounding), soft verticals 8/3 kN (stiff series springs), all strings taut",
        "  with >= 67% of their rest tension under the full drive, motion 7-s periodic (see docs/twin.md).",
        f"Actuators: spool radius {SPOOL_RADIUS} m, direction +1 (positive angle pays string out), zero offset 0,",
        f"  limits [-pi, pi] rad; seed amplitudes 36.3 / 16.8 mm = "
        f"{DRIVE_AMPLITUDE[0] / SPOOL_RADIUS:.3f} / {DRIVE_AMPLITUDE[1] / SPOOL_RADIUS:.3f} rad.",
        f"Lowest natural frequencies of the nodal model [Hz]: {np.round(freqs[:6], 2).tolist()}.",
    ])
    return Structure(
        name="stacked_manipulator",
        description=("Seed two-stage stacked tensegrity manipulator: 24 physical + 12 virtual nodes, 12 real + 6 "
                     "virtual bars, 14 composite / 36 simple strings, 6 actuators, 18 constraints. Connectivity, "
                     "coordinates and string constants are ASSUMED (form-found), see notes."),
        notes=notes, nodes=tuple(nodes), bars=tuple(bars), strings=tuple(strings),
        constraints=tuple(constraints), actuators=tuple(actuators), gravity=(0.0, 0.0, -GRAVITY))


HEADER = "Generated by `python -m tensegrity_ros.model.manipulator`; edit the generator, not this file."


def write(path: Path) -> Structure:
    s = stacked_manipulator()
    dump_structure(s, path, header=HEADER)
    return s


if __name__ == "__main__":
    from ..paths import CONFIG_DIR

    write(CONFIG_DIR / "models" / "stacked_manipulator.yaml")
