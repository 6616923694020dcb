"""Spring-rod engine (seed: spring-rod-differentiable-engine, Sec. 3), as separate testable modules.

Rods carry rigid-body state {p, v, q, w} (centre, velocity, unit quaternion wxyz, world angular velocity);
springs are the structure's strings between rod ends and/or fixed nodes. One step:

1. :func:`rod_endpoints`: node positions/velocities of the rod ends from the rod state.
2. :func:`force_module` (seed eqs. 1-2): each spring reduced to 1D along its direction,
   |f| = K * stretch + c * stretch_rate, f = -|f| * unit(dp) on the end that dp points to.
   K = EA / xi0(t) + kc and xi0 = xi00 + Y (u - z) as in the string law (CONTRACTS.md; EA = stiffness * xi00,
   kc = 0 for ``cord`` strings, EA = 0, kc = stiffness for ``spring`` strings, as in nodal.prepare); ``tension_only``
   (default, the structure semantics) clamps |f| >= 0 and gates it on stretch > 0.
3. :func:`acceleration_module` (seed eqs. 3-4): a = (f1 + f2 + h f_u) / M + g,
   alpha = R I^-1 (R^T tau - w_l x I w_l), tau = r x (f2 - f1) + r_u x (h f_u); I = diag(I11, I11, I33) of a
   solid cylinder of length L and the bar radius R (seed appendix): I11 = M (L^2/12 + R^2/4), I33 = M R^2 / 2.
   (The gyroscopic term vanishes for a thin rod without axial spin; the seed omits it.)
4. :func:`integrate_semi_implicit` (seed Sec. 3.4): v += a dt, w += alpha dt, p += v dt, q <- exp(w dt) q.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import integrators
from ._common import as_tensor, compile_fn, convert_like, register_tensor_dataclass
from .laws import split_stiffness, string_stiffness
from .nodal import Derived, rest_lengths
from .params import Params, params_from_structure
from .state import Inputs, RodState, rollout_horizon
from .topology import Topology, build_topology

INTEGRATORS = ("semi_implicit", "rk4")


# =====================================================================================================
# quaternion helpers (w, x, y, z)
# =====================================================================================================
def quat_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product a b of quaternions (..., 4)."""
    aw, ax, ay, az = a.unbind(-1)
    bw, bx, by, bz = b.unbind(-1)
    return torch.stack((aw * bw - ax * bx - ay * by - az * bz,
                        aw * bx + ax * bw + ay * bz - az * by,
                        aw * by - ax * bz + ay * bw + az * bx,
                        aw * bz + ax * by - ay * bx + az * bw), dim=-1)


def quat_to_matrix(q: torch.Tensor) -> torch.Tensor:
    """Rotation matrices (..., 3, 3) (local -> world) of unit quaternions q (..., 4)."""
    w, x, y, z = q.unbind(-1)
    return torch.stack((
        torch.stack((1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)), -1),
        torch.stack((2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)), -1),
        torch.stack((2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)), -1)), dim=-2)


def quat_exp(omega: torch.Tensor, h: float) -> torch.Tensor:
    """Unit quaternion of the rotation by the vector omega * h (..., 3) rad (smooth at zero)."""
    half = 0.5 * h * omega
    th2 = (half * half).sum(-1, keepdim=True)
    th = torch.sqrt(th2 + 1e-30)
    return torch.cat((torch.cos(th), torch.sin(th) / th * half), dim=-1)


def quat_from_z(u: torch.Tensor) -> torch.Tensor:
    """Unit quaternion (..., 4) rotating the local z axis onto the unit vectors u (..., 3) (shortest arc)."""
    ux, uy, uz = u.unbind(-1)
    q = torch.stack((1 + uz, -uy, ux, torch.zeros_like(uz)), dim=-1)
    flip = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=u.dtype, device=u.device).expand_as(q)
    q = torch.where((1 + uz).unsqueeze(-1) > 1e-9, q, flip)
    return q / torch.linalg.vector_norm(q, dim=-1, keepdim=True)


def cylinder_inertia(mass: torch.Tensor, length: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Local principal inertia (..., 3) kg m^2 of a solid cylinder along local z (seed appendix)."""
    i11 = mass * (length ** 2 / 12.0 + radius ** 2 / 4.0)
    i33 = mass * radius ** 2 / 2.0
    return torch.stack((i11, i11, i33), dim=-1)


# =====================================================================================================
# the three modules of the seed
# =====================================================================================================
class SpringForce(NamedTuple):
    """force: (..., 3) N on the end that dp points to (the other end gets -force); magnitude: (...,) N
    (positive = pulling); stretch: (...,) m; rate: (...,) m/s; direction: (..., 3) unit dp."""

    force: torch.Tensor
    magnitude: torch.Tensor
    stretch: torch.Tensor
    rate: torch.Tensor
    direction: torch.Tensor


def force_module(dp: torch.Tensor, dv: torch.Tensor, rest_length: torch.Tensor, stiffness: torch.Tensor,
                 damping: torch.Tensor, tension_only: bool = False) -> SpringForce:
    """Seed eqs. 1-2: 1D reduction of a spring along its direction.

    dp: (..., 3) end position minus the other end's, m. dv: (..., 3) their velocity difference, m/s.
    rest_length: (...,) m; stiffness: (...,) N/m; damping: (...,) N s/m.
    f = -(K * (|dp| - rest) + c * (dv . u)) u,  u = dp / |dp|.
    tension_only: the string law (CONTRACTS.md): magnitude clamped >= 0 and zero unless |dp| > rest.
    """
    length = torch.linalg.vector_norm(dp, dim=-1)
    u = dp / length.unsqueeze(-1)
    stretch = length - rest_length
    rate = (dv * u).sum(-1)
    mag = stiffness * stretch + damping * rate
    if tension_only:
        mag = torch.where(stretch > 0, torch.relu(mag), torch.zeros_like(mag))
    return SpringForce(-mag.unsqueeze(-1) * u, mag, stretch, rate, u)


def acceleration_module(f1: torch.Tensor, f2: torch.Tensor, r: torch.Tensor, mass: torch.Tensor,
                        inertia: torch.Tensor, omega: Optional[torch.Tensor] = None,
                        f_u: Optional[torch.Tensor] = None, r_u: Optional[torch.Tensor] = None,
                        gravity: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Seed eqs. 3-4: linear and angular acceleration of rods from their end forces.

    f1, f2: (..., 3) aggregate forces on the first (p - r) and second (p + r) end, N. r: (..., 3) half-length
    vector (centre to second end, world), m. mass: (...,) kg. inertia: (..., 3) local principal inertia
    (I11, I22 = I11, I33 about the rod axis), kg m^2. omega: (..., 3) world angular velocity, rad/s (for the
    gyroscopic term; None: 0). f_u: (..., 3) control force, N, applied at r_u: (..., 3) world arm from the
    centre, m. gravity: (3,) m/s^2. Returns a (..., 3) m/s^2 and alpha (..., 3) rad/s^2 (world frame).

    The seed's alpha = R I^-1 R^T tau is evaluated in closed form for an axisymmetric rod with unit axis n:
    R I^-1 R^T = (1 - n n^T) / I11 + n n^T / I33, and w x (I w) = (I33 - I11) (n . w) (w x n).
    """
    F = f1 + f2
    tau = torch.linalg.cross(r, f2 - f1)
    if f_u is not None:
        F = F + f_u
        if r_u is not None:
            tau = tau + torch.linalg.cross(r_u, f_u)
    a = F / mass.unsqueeze(-1)
    if gravity is not None:
        a = a + gravity
    n = r / torch.linalg.vector_norm(r, dim=-1, keepdim=True)
    i11, i33 = inertia[..., 0:1], inertia[..., 2:3]
    if omega is not None:
        tau = tau - (i33 - i11) * (n * omega).sum(-1, keepdim=True) * torch.linalg.cross(omega, n)
    tn = (n * tau).sum(-1, keepdim=True) * n
    alpha = (tau - tn) / i11 + tn / i33
    return a, alpha


def quat_axis(q: torch.Tensor) -> torch.Tensor:
    """The local z axis in world coordinates (..., 3) of unit quaternions q (..., 4)."""
    w, x, y, z = q.unbind(-1)
    return torch.stack((2 * (x * z + w * y), 2 * (y * z - w * x), 1 - 2 * (x * x + y * y)), dim=-1)


def quat_rotate(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rotate vectors v (..., 3) by unit quaternions q (..., 4) (local -> world)."""
    w, u = q[..., :1], q[..., 1:]
    t = 2.0 * torch.linalg.cross(u, v)
    return v + w * t + torch.linalg.cross(u, t)


def integrate_semi_implicit(p, v, q, w, a, alpha, dt: float):
    """Seed Sec. 3.4, semi-implicit Euler: v1 = v + a dt, w1 = w + alpha dt, p1 = p + v1 dt,
    q1 = exp(w1 dt) q (world-frame angular velocity, renormalised). Shapes as in :class:`RodState`."""
    v1 = v + dt * a
    w1 = w + dt * alpha
    p1 = p + dt * v1
    q1 = quat_mul(quat_exp(w1, dt), q)
    return p1, v1, q1 / torch.linalg.vector_norm(q1, dim=-1, keepdim=True), w1


# =====================================================================================================
# engine plumbing
# =====================================================================================================
@register_tensor_dataclass
@dataclass(frozen=True)
class RodConstants:
    """rod_a, rod_b: (R,) long node index of each rod's first/second end; half: (R,) half lengths, m;
    radius: (R,) m; node_src: (N,) long index of each node into cat(ends_a, ends_b, fixed);
    fixedX: (n_fixed, 3) m; seg_i, seg_j: (n_seg,) long; Cs: (n_seg, N); G: (n_seg, S); Ydir: (S, A);
    gravity: (3,); spring, cord: (S,) the stiffness law's 0/1 masks (as in :class:`.nodal.NodalConstants`)."""

    rod_a: torch.Tensor
    rod_b: torch.Tensor
    half: torch.Tensor
    radius: torch.Tensor
    node_src: torch.Tensor
    fixedX: torch.Tensor
    seg_i: torch.Tensor
    seg_j: torch.Tensor
    Cs: torch.Tensor
    G: torch.Tensor
    Ydir: torch.Tensor
    gravity: torch.Tensor
    spring: torch.Tensor
    cord: torch.Tensor


def _check_structure(s) -> None:
    name = s.name
    if s.constraints:
        raise ValueError(f"structure {name!r}: the spring_rod backend supports no nodal constraints "
                         f"({len(s.constraints)} given); use backend='nodal'")
    owner = {}
    fixed = set(s.fixed_nodes)
    for b in s.bars:
        for n in b.nodes:
            if n in owner:
                raise ValueError(f"structure {name!r}: node {n!r} is an end of bars {owner[n]!r} and {b.name!r}; "
                                 "the spring_rod backend needs class-1 structures (use backend='nodal')")
            if n in fixed:
                raise ValueError(f"structure {name!r}: bar {b.name!r} ends at fixed node {n!r}; the spring_rod "
                                 "backend has free rods only (use backend='nodal')")
            owner[n] = b.name
    for st in s.strings:
        if len(st.nodes) != 2 or st.closed:
            raise ValueError(f"structure {name!r}: string {st.name!r} is composite ({len(st.nodes)} nodes"
                             f"{', closed' if st.closed else ''}); the spring_rod backend takes simple strings "
                             "between rod ends and fixed nodes only (use backend='nodal')")
        for n in st.nodes:
            if n not in owner and n not in fixed:
                raise ValueError(f"structure {name!r}: string {st.name!r} ends at node {n!r}, which is neither a "
                                 "rod end nor fixed")


def build_rod_constants(top: Topology, dtype=torch.float64, device=None) -> RodConstants:
    R = top.n_bars
    fixed = [i for i, n in enumerate(top.structure.nodes) if n.fixed]
    src = np.zeros(top.n_nodes, dtype=np.int64)
    for r, (a, b) in enumerate(top.bar_nodes):
        src[a], src[b] = r, R + r
    for k, i in enumerate(fixed):
        src[i] = 2 * R + k
    t = lambda x: as_tensor(np.ascontiguousarray(x), dtype, device)  # noqa: E731
    return RodConstants(rod_a=t(top.bar_nodes[:, 0]), rod_b=t(top.bar_nodes[:, 1]), half=t(top.bar_lengths / 2),
                        radius=t(top.bar_radius), node_src=t(src), fixedX=t(top.X0[fixed].reshape(-1, 3)),
                        seg_i=t(top.seg_nodes[:, 0]), seg_j=t(top.seg_nodes[:, 1]), Cs=t(top.Cs), G=t(top.G),
                        Ydir=t(top.Ydir), gravity=t(top.gravity), spring=t(top.spring), cord=t(1.0 - top.spring))


def rod_endpoints(c: RodConstants, p, v, q, w):
    """Node positions and velocities (B, N, 3) of all nodes, and the half-length vectors r (B, R, 3) m."""
    r = quat_axis(q) * c.half.unsqueeze(-1)                             # (B, R, 3)
    wr = torch.linalg.cross(w, r)
    B = p.shape[0]
    fx = c.fixedX.expand(B, *c.fixedX.shape)
    X = torch.cat((p - r, p + r, fx), dim=-2).index_select(-2, c.node_src)
    V = torch.cat((v - wr, v + wr, torch.zeros_like(fx)), dim=-2).index_select(-2, c.node_src)
    return X, V, r


def _prepare(c: RodConstants, params: Params) -> Derived:
    """EA and kc by each string's law (:func:`.laws.split_stiffness`, as in :func:`.laws.prepare`; ``c`` carries
    the same 0/1 ``cord`` / ``spring`` masks), so that kappa = EA / xi0 + kc."""
    Y = c.Ydir * params.spool_radius.unsqueeze(-2)
    e = params.mass.new_zeros(())
    EA, kc = split_stiffness(c, params.stiffness, params.rest_length)
    return Derived(EA=EA, zeta=params.damping, xi00=params.rest_length, Y=Y,
                   z=params.zero_offset, Mq=e, Minv=e, Pt=e, Gc=e, FgT=e, kc=kc)


def node_spring_forces(c: RodConstants, der: Derived, X, V, u, udot, tension_only: bool):
    """Spring forces on all nodes (B, N, 3) N via :func:`force_module` (strings are simple here)."""
    dp = X.index_select(-2, c.seg_j) - X.index_select(-2, c.seg_i)      # (B, ns, 3)
    dv = V.index_select(-2, c.seg_j) - V.index_select(-2, c.seg_i)
    xi0, xi0dot = rest_lengths(der, u, udot)
    K = string_stiffness(der.EA, der.kc, xi0)                          # cord: EA/xi0 (kc = 0); spring: kc (EA = 0)
    Gt = c.G.T                                                          # strings are simple: one segment each
    if xi0dot is not None:
        # a moving rest length: the stretch rate is |dp|' - xi0'; remove xi0' along the spring from dv
        dv = dv - (xi0dot @ Gt).unsqueeze(-1) * dp / torch.linalg.vector_norm(dp, dim=-1, keepdim=True)
    sf = force_module(dp, dv, xi0 @ Gt, K @ Gt, der.zeta @ Gt, tension_only)
    return c.Cs.T @ sf.force                                            # +f on the second node, -f on the first


class RodOptions(NamedTuple):
    """tension_only: the structure's pull-only string law (default) or the seed's linear springs."""

    tension_only: bool = True


def _accel(c: RodConstants, der: Derived, params: Params, inertia, x, vel, u, udot, fu, arm, opts: RodOptions):
    p, q = x
    v, w = vel[..., :3], vel[..., 3:]
    X, V, r = rod_endpoints(c, p, v, q, w)
    F = node_spring_forces(c, der, X, V, u, udot, opts.tension_only)
    f1, f2 = F.index_select(-2, c.rod_a), F.index_select(-2, c.rod_b)
    r_u = None
    if fu is not None:
        h = params.control_force_scalar
        if h is not None:
            fu = fu * h.unsqueeze(-1).unsqueeze(-1) if h.dim() else fu * h
        if arm is not None:
            r_u = quat_rotate(q, arm)
    a, alpha = acceleration_module(f1, f2, r, params.mass, inertia, w, fu, r_u, c.gravity)
    return torch.cat((a, alpha), dim=-1), None


def _xdot(x, vel):
    return vel


def _add(x, dx, h):
    p, q = x
    q1 = quat_mul(quat_exp(dx[..., 3:], h), q)
    return p + h * dx[..., :3], q1 / torch.linalg.vector_norm(q1, dim=-1, keepdim=True)


def rod_step(c: RodConstants, params: Params, state: RodState, inputs: Optional[Inputs], dt: float,
             integrator: str = "semi_implicit", opts: RodOptions = RodOptions()) -> RodState:
    """Pure step of the spring-rod engine. ``semi_implicit`` is the seed's update
    (:func:`integrate_semi_implicit`); ``rk4`` integrates (p, q, v, w) with the exponential map."""
    ref = state.rod_positions
    c = convert_like(c, ref)
    params = convert_like(params, ref)
    inputs = convert_like(inputs, ref)
    der = _prepare(c, params)
    inertia = cylinder_inertia(params.mass, 2 * c.half, c.radius)
    u = ud = fu = arm = None
    if inputs is not None:
        u, ud, fu, arm = inputs.motor_angles, inputs.motor_velocities, inputs.control_forces, inputs.control_arms
        if inputs.external_forces is not None:
            raise ValueError("spring_rod: use control_forces (B, R, 3) on rods, not external_forces on nodes")
    x = (state.rod_positions, state.rod_orientations)
    vel = torch.cat((state.rod_velocities, state.rod_angular_velocities), dim=-1)
    acc = lambda x_, v_: _accel(c, der, params, inertia, x_, v_, u, ud, fu, arm, opts)  # noqa: E731
    if integrator == "semi_implicit":
        av, _ = acc(x, vel)
        p1, v1, q1, w1 = integrate_semi_implicit(x[0], vel[..., :3], x[1], vel[..., 3:], av[..., :3], av[..., 3:], dt)
    else:
        (p1, q1), vel1, _ = integrators.get(integrator)(x, vel, acc, dt, _xdot, _add)
        v1, w1 = vel1[..., :3], vel1[..., 3:]
    X, V, _ = rod_endpoints(c, p1, v1, q1, w1)
    return RodState(X, V, p1, v1, q1, w1)


def rod_state_from_nodes(c: RodConstants, X: torch.Tensor, V: torch.Tensor) -> RodState:
    """Rod state from node positions X (B, N, 3) m and velocities V (B, N, 3) m/s (rod lengths from the file;
    axial spin 0: w = d x (v_b - v_a) / |d|^2)."""
    c = convert_like(c, X)
    Xa, Xb = X.index_select(-2, c.rod_a), X.index_select(-2, c.rod_b)
    Va, Vb = V.index_select(-2, c.rod_a), V.index_select(-2, c.rod_b)
    d = Xb - Xa
    p = 0.5 * (Xa + Xb)
    q = quat_from_z(d / torch.linalg.vector_norm(d, dim=-1, keepdim=True))
    v = 0.5 * (Va + Vb)
    w = torch.linalg.cross(d, Vb - Va) / (d * d).sum(-1, keepdim=True)
    X1, V1, _ = rod_endpoints(c, p, v, q, w)
    return RodState(X1, V1, p, v, q, w)


@dataclass(frozen=True, eq=False)
class SpringRodEngine:
    """Spring-rod engine of one structure (free rods, simple strings, fixed anchor nodes). Pure methods."""

    topology: Topology
    constants: RodConstants
    integrator: str = "semi_implicit"
    options: RodOptions = field(default_factory=RodOptions)
    backend: str = "spring_rod"

    @classmethod
    def create(cls, structure, integrator="semi_implicit", dtype=torch.float64, device=None, **options):
        if integrator not in INTEGRATORS:
            raise ValueError(f"unknown integrator {integrator!r} (valid: {', '.join(INTEGRATORS)})")
        _check_structure(structure)
        top = build_topology(structure)
        return cls(top, build_rod_constants(top, dtype, device), integrator, RodOptions(**options))

    @property
    def structure(self):
        return self.topology.structure

    @property
    def dtype(self):
        return self.constants.half.dtype

    @property
    def device(self):
        return self.constants.half.device

    def default_params(self, batch: Optional[int] = None) -> Params:
        """Params from the file values, with control_force_scalar = 1."""
        return params_from_structure(self.structure, batch, self.dtype, self.device, control_force_scalar=1.0)

    def initial_state(self, positions=None, velocities=None, batch: int = 1) -> RodState:
        """Rod state from node positions (N, 3)/(B, N, 3) m (default: file) and velocities m/s (default 0)."""
        X = torch.as_tensor(self.topology.X0 if positions is None else positions, dtype=self.dtype,
                            device=self.device)
        X = X.unsqueeze(0) if X.dim() == 2 else X
        V = torch.zeros_like(X) if velocities is None else torch.as_tensor(velocities, dtype=X.dtype, device=X.device)
        V = V.unsqueeze(0) if V.dim() == 2 else V
        B = max(X.shape[0], V.shape[0], batch)
        return rod_state_from_nodes(self.constants, X.expand(B, *X.shape[1:]), V.expand(B, *V.shape[1:]))

    def step(self, params: Params, state: RodState, inputs: Optional[Inputs] = None, dt: float = 1e-3) -> RodState:
        """One step of ``dt`` s. inputs: motor_angles (B, A) rad, control_forces (B, R, 3) N, control_arms
        (B, R, 3) m (rod-local)."""
        return rod_step(self.constants, params, state, inputs, dt, self.integrator, self.options)

    def rollout(self, params: Params, state0: RodState, inputs: Optional[Inputs] = None, dt: float = 1e-3,
                steps: Optional[int] = None, compile: bool = False, chunk: int = 1) -> RodState:
        """T steps (inputs with a leading T axis); returns RodStates stacked on a leading T axis.
        ``compile=True`` runs every step through :attr:`compiled_step` (``chunk`` is accepted for API symmetry
        with the nodal engine and ignored)."""
        n = rollout_horizon(inputs, steps)
        stepper = self.compiled_step if compile else self.step
        out, s = [], state0
        for t in range(n):
            s = stepper(params, s, None if inputs is None else inputs[t], dt)
            out.append(s)
        return RodState(*(torch.stack(xs) for xs in zip(*(
            (o.positions, o.velocities, o.rod_positions, o.rod_velocities, o.rod_orientations,
             o.rod_angular_velocities) for o in out))))

    @property
    def compiled_step(self):
        """``torch.compile``d :meth:`step`."""
        fn = compile_fn(rod_step, dynamic=False)
        c, integ, opts = self.constants, self.integrator, self.options

        def compiled(params, state, inputs=None, dt=1e-3):
            return fn(c, params, state, inputs, dt, integ, opts)

        return compiled

    def bar_length_error(self, state: RodState) -> torch.Tensor:
        """(B,) max relative bar-length error (round-off only: rods are rigid)."""
        top = self.topology
        bn = torch.as_tensor(top.bar_nodes, device=state.positions.device)
        L = torch.as_tensor(top.bar_lengths, dtype=state.positions.dtype, device=state.positions.device)
        d = state.positions[..., bn[:, 1], :] - state.positions[..., bn[:, 0], :]
        return (torch.linalg.vector_norm(d, dim=-1) / L - 1).abs().amax(-1)

    def energy(self, params: Params, state: RodState) -> torch.Tensor:
        """(B,) kinetic (cylinder inertia) + gravity + spring potential (constant K), J."""
        c = convert_like(self.constants, state.rod_positions)
        m = params.mass
        inertia = cylinder_inertia(m, 2 * c.half, c.radius)
        n = quat_axis(state.rod_orientations)
        w = state.rod_angular_velocities
        wn = (w * n).sum(-1)
        erot = inertia[..., 0] * ((w * w).sum(-1) - wn ** 2) + inertia[..., 2] * wn ** 2
        ke = 0.5 * (m * (state.rod_velocities ** 2).sum(-1)).sum(-1) + 0.5 * erot.sum(-1)
        pe_g = -(m * (state.rod_positions @ c.gravity)).sum(-1)
        dp = state.positions.index_select(-2, c.seg_j) - state.positions.index_select(-2, c.seg_i)
        stretch = torch.linalg.vector_norm(dp, dim=-1) - params.rest_length @ c.G.T
        K = params.stiffness @ c.G.T
        if self.options.tension_only:
            stretch = torch.relu(stretch)
        return ke + pe_g + (0.5 * K * stretch ** 2).sum(-1)
