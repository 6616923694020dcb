"""Nodal tensegrity dynamics in reduced coordinates (the product's main engine).

Same physics as the nodal-dynamics seed (eqs. 1-10): point-mass nodes with the bars' consistent mass
matrix, composite Kelvin-Voigt strings (pull only), bar lengths held by Lagrange multipliers, linear nodal
constraints. The linear constraints are eliminated exactly by reduced coordinates (``X = T Q + X_c``, see
:mod:`.topology`), the bar-length multipliers are solved exactly each evaluation:

    M_q Q'' = F_q + (C_b T)^T (lambda * d),          F_q = T^T (F_strings + F_gravity + F_external)
    a0 = M_q^-1 F_q,  A = G * (D D^T),  G = (C_b T) M_q^-1 (C_b T)^T   (constant per params)
    A lambda = -(|d'|^2 + d . (C_b T) a0) - (2 alpha g' + beta^2 g),   g = (|d|^2 - l^2) / 2
    Q'' = a0 + M_q^-1 (C_b T)^T (lambda * d)

lambda is the seed's bar force density (lambda_hat, eq. 5/8, up to sign). After each step, positions and
velocities are projected back onto the bar-length manifold (mass-weighted Gauss-Newton, reusing A^-1).

The equations are written once, in :mod:`.laws`, for this module's reference layout (batch first,
:class:`BatchFirst`) and for the batch-last throughput layout of :mod:`.fast`. This module holds the
reference layout's products and solvers, the reference-layout entry points (with the signatures the tangent
model and identification use), the drivers, the diagnostics and the :class:`NodalEngine`.

Everything is a pure function of (constants, params, state, inputs); the :class:`NodalEngine` only bundles
the constants of one structure.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from . import fast, integrators, laws
from ._common import convert_like, differentiated, spd_inverse, unsqueeze_batch
from .laws import (Constrained, Derived, NodalConstants, Options, StringState, prepare,  # noqa: F401 (re-exported)
                   reduced_mass_matrix)
from .params import Params, params_from_structure
from .state import Inputs, State, rollout_horizon
from .topology import Topology, build_topology


# =====================================================================================================
# the reference layout: coordinates first, nodes last (Q: (B, 3, n_free)), so every constant matrix
# multiplies from the right and batched products fold into one matrix multiply
# =====================================================================================================
def rmul(X: torch.Tensor, M: torch.Tensor, idx: Optional[torch.Tensor] = None, w: Optional[torch.Tensor] = None,
         fused: bool = False) -> torch.Tensor:
    """X (..., k_in) @ M (k_in, k_out) or batched M (Bp, k_in, k_out).

    ``fused``: as elementwise products and sums (a gather for sparse constant matrices given as idx, w),
    which torch.compile fuses into a few loops instead of calling small matrix multiplies.
    """
    if not fused:
        return X @ M
    if idx is not None:
        return (X[..., idx] * w).sum(-1)
    if M.dim() == 2:
        return (X.unsqueeze(-1) * M).sum(-2)
    return (X.unsqueeze(-1) * M.unsqueeze(-3)).sum(-2)


def _act(Y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Y (.., S, A) times x (.., A) -> (.., S)."""
    if Y.dim() == 2:
        return x @ Y.T
    return (x.unsqueeze(-2) @ Y.mT).squeeze(-2)


class BatchFirst(laws.Layout):
    """The reference layout (batch first): matrix multiplies and LAPACK (``fused``: gathers and elementwise
    products instead; ``solver``: the bar matrix's inverse, see :func:`spd_inverse`). Use :meth:`of`."""

    ent = -1

    def __init__(self, fused: bool = False, solver: str = "lapack"):
        self.fused, self.solver = fused, solver

    @staticmethod
    def of(opts: Options) -> "BatchFirst":
        return _layout(opts.fused, opts.solver)

    def const(self, t):
        return t                                                    # batch-free constants broadcast as they are

    def mul(self, X, c, name):
        if not self.fused:
            return X @ getattr(c, name)
        return rmul(X, None, getattr(c, name + "_i"), getattr(c, name + "_w"), True)

    def dense(self, X, M):
        return rmul(X, M, fused=self.fused)

    def motor(self, Y, x):
        return _act(Y, x)

    def norm(self, s):
        return super().norm(s) if self.fused else torch.linalg.vector_norm(s, dim=-2)

    def gram(self, a, b):
        if self.fused:
            return (a.unsqueeze(-1) * b.unsqueeze(-2)).sum(-3)
        return a.mT @ b

    def matvec(self, M, x):
        if self.fused:
            return (M * x.unsqueeze(-2)).sum(-1)
        return (M @ x.unsqueeze(-1)).squeeze(-1)

    def inverse(self, A):
        return spd_inverse(A, self.solver)

    def block_inverse(self, A, groups, assemble):
        """One LAPACK call on the whole matrix (its zeros between blocks stay exact zeros): block by block
        took the eager manipulator's 1-s horizon at batch 1 from 258 to 379 ms (more, smaller calls)."""
        return self.inverse(A)

    def cholesky(self, K):
        return torch.linalg.cholesky(K)

    def chol_solve(self, L, r, n=None):
        if n is not None:
            L = L[..., :n, :n]
        return torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)


@functools.lru_cache(maxsize=None)
def _layout(fused: bool = False, solver: str = "lapack") -> BatchFirst:
    return BatchFirst(fused, solver)


REFERENCE = _layout()


def _solver(L: BatchFirst, Ainv: Optional[torch.Tensor]):
    return None if Ainv is None else (lambda r: L.matvec(Ainv, r))


# ---- reference-layout entry points (the equations are :mod:`.laws`') -------------------------------
def rest_lengths(der: Derived, u: Optional[torch.Tensor], udot: Optional[torch.Tensor]):
    """xi0 = xi00 + Y (u - z) (.., S) m and xi0' = Y u' m/s (None when udot is None); batch first."""
    return laws.rest_lengths(REFERENCE, der, u, udot)


def generalized_forces(c: NodalConstants, der: Derived, Q, V, u, udot, fext, fused: bool = False,
                       with_strings: bool = False):
    """F_q^T (B, 3, n_free) N: strings + gravity + external (``fext`` already reduced, (B, 3, n_free)).
    ``with_strings``: also return the :class:`StringState` (segment unit vectors in (B, 3, n_seg))."""
    return laws.generalized_forces(_layout(fused), c, der, Q, V, u, udot, fext, with_strings)


def constrained_accelerations(c: NodalConstants, der: Derived, Q, V, F, opts: Options) -> Constrained:
    """Q'' from the generalised forces F (B, 3, n_free) with the bar-length multipliers solved exactly."""
    return laws.constrained_accelerations(BatchFirst.of(opts), c, der, Q, V, F, opts)


def accelerations(c: NodalConstants, der: Derived, Q, V, u, udot, fext, opts: Options):
    """Q'' (B, 3, n_free) m/s^2 and A^-1 (B, nba, nba) at the reduced state Q (m), V (m/s)."""
    return laws.accelerations(BatchFirst.of(opts), c, der, Q, V, u, udot, fext, opts)


def project_positions_once(c: NodalConstants, der: Derived, Q, Ainv, fused: bool = False,
                           with_multiplier: bool = False):
    """One mass-weighted Gauss-Newton step of Q towards |d_b| = l_b with the (chord) matrix A^-1.
    ``with_multiplier``: also the bar vectors d (B, 3, nba) it was taken at and y = A^-1 g (B, nba)."""
    L = _layout(fused)
    return laws.project_positions_once(L, c, der, Q, _solver(L, Ainv), with_multiplier)


def project_velocities(c: NodalConstants, der: Derived, Q, V, Ainv, fused: bool = False,
                       with_multiplier: bool = False):
    """V projected onto d_b . d_b' = 0 at the positions Q (mass-weighted, chord matrix A^-1).
    ``with_multiplier``: also the bar vectors d (B, 3, nba) at Q and nu = A^-1 (d . d') (B, nba)."""
    L = _layout(fused)
    return laws.project_velocities(L, c, der, Q, V, _solver(L, Ainv), with_multiplier)


def chord_matrix_inverse(c: NodalConstants, der: Derived, Q) -> Optional[torch.Tensor]:
    """A^-1 (B, nba, nba) of the bar constraints at the positions Q, as :meth:`NodalEngine.project` forms it
    (None without bars)."""
    if c.Cb_q.shape[0] == 0:
        return None
    return laws.chord_inverse(REFERENCE, c, laws.chord_matrix(REFERENCE, der, laws.bar_vectors(REFERENCE, c, Q)))


def project(c: NodalConstants, der: Derived, Q, V, Ainv, iters: int, fused: bool = False):
    """:func:`.laws.project` with the chord matrix A^-1 (B, nba, nba) of the step (None: no bars)."""
    L = _layout(fused)
    return laws.project(L, c, der, Q, V, _solver(L, Ainv), iters)


def step_reduced(c: NodalConstants, der: Derived, Q, V, u, udot, fext, dt: float, integrator: str,
                 opts: Options):
    """One step in reduced coordinates: (Q, V) (B, 3, n_free) -> (Q', V'). Inputs held over the step
    (:func:`.laws.step`; ``implicit``: :func:`.laws.implicit_step`)."""
    return laws.step(BatchFirst.of(opts), c, der, Q, V, u, udot, fext, dt, integrator, opts)


INTEGRATORS = integrators.INTEGRATORS


def expand(c: NodalConstants, Q: torch.Tensor) -> torch.Tensor:
    """Full node positions (..., N, 3) m from internal Q (..., 3, n_free): X = T Q + X_c."""
    return (Q @ c.Tt + c.XcT).mT


def expand_velocity(c: NodalConstants, V: torch.Tensor) -> torch.Tensor:
    """Full node velocities (..., N, 3) m/s from internal V (..., 3, n_free)."""
    return (V @ c.Tt).mT


def reduce(c: NodalConstants, X: torch.Tensor) -> torch.Tensor:
    """Internal reduced coordinates (..., 3, n_free): the independent nodes' rows of X (..., N, 3)."""
    return X.index_select(-2, c.free_idx).mT.contiguous()


def _inputs_reduced(c: NodalConstants, inputs: Optional[Inputs]):
    if inputs is None:
        return None, None, None
    fq = None
    if inputs.external_forces is not None:
        fq = inputs.external_forces.mT @ c.T                        # (.., 3, n_free)
    return inputs.motor_angles, inputs.motor_velocities, fq


def step(c: NodalConstants, params: Params, state: State, inputs: Optional[Inputs], dt: float,
         integrator: str = "semi_implicit", opts: Options = Options()) -> State:
    """Pure step: (constants, params, state (B, N, 3), inputs, dt s) -> next State."""
    c = convert_like(c, state.positions)
    params = convert_like(params, state.positions)
    inputs = convert_like(inputs, state.positions)
    der = prepare(c, params)
    Q, V = reduce(c, state.positions), reduce(c, state.velocities)
    u, ud, fq = _inputs_reduced(c, inputs)
    Q, V = step_reduced(c, der, Q, V, u, ud, fq, dt, integrator, opts)
    return State(expand(c, Q), expand_velocity(c, V))


def rollout(c: NodalConstants, params: Params, state0: State, inputs: Optional[Inputs], dt: float,
            integrator: str = "semi_implicit", opts: Options = Options(), steps: Optional[int] = None,
            cuda_graph: bool = False) -> State:
    """T steps; ``inputs`` fields carry a leading time axis T. Returns States stacked on a leading T axis
    (state after each step; state0 excluded). ``steps`` is only needed when ``inputs`` is None. ``cuda_graph``:
    the steps replayed from a CUDA graph (:func:`steps_captured`)."""
    c = convert_like(c, state0.positions)
    params = convert_like(params, state0.positions)
    inputs = convert_like(inputs, state0.positions)
    der = prepare(c, params)
    Q, V = reduce(c, state0.positions), reduce(c, state0.velocities)
    n = rollout_horizon(inputs, steps)
    u_all, ud_all, fq_all = _inputs_reduced(c, inputs)
    if cuda_graph:
        Qs, Vs = steps_captured(c, der, Q, V, u_all, ud_all, fq_all, dt, integrator, opts, n)
    else:
        Qs, Vs = laws.steps(BatchFirst.of(opts), c, der, Q, V, u_all, ud_all, fq_all, dt, integrator, opts, n)
    return State(expand(c, Qs), expand_velocity(c, Vs))


def steps_captured(c: NodalConstants, der: Derived, Q, V, u, udot, fq, dt: float, integrator: str, opts: Options,
                   n: int, capture: bool = True):
    """:func:`.laws.steps` in reduced coordinates (Q, V (B, 3, n_free); inputs time-major or None), replayed from
    a CUDA graph of :data:`.graphs.CHUNK_STEPS` steps (:func:`.graphs.chunked_steps`; ``capture=False``: the same
    data flow without a graph, for CPU tests). The bar-matrix inverse runs unrolled (:data:`.graphs.CAPTURE_SOLVER`):
    the same states as ``lapack``'s to round-off. ValueError where a graph cannot run (:func:`.graphs.unsuitable`)."""
    from . import graphs
    grad = differentiated(Q, V, u, udot, fq, *(getattr(der, f.name) for f in dataclasses.fields(der)))
    if capture:
        graphs.require(Q.device, grad, integrator)
    o = opts._replace(solver=graphs.CAPTURE_SOLVER)
    return graphs.chunked_steps("nodal.steps", _chunk_steps, Q, V, (c, der, dt, integrator, o), (u, udot, fq), n,
                                capture=capture)


def _chunk_steps(Q, V, consts, inputs, K: int):
    c, der, dt, integrator, opts = consts
    return laws.steps(BatchFirst.of(opts), c, der, Q, V, *inputs, dt, integrator, opts, K)


# =====================================================================================================
# diagnostics and identification helpers (full node space, (B, N, 3))
# =====================================================================================================
def bar_length_error(c: NodalConstants, positions: torch.Tensor) -> torch.Tensor:
    """(...,) max over bars of | |d_b| / l_b - 1 | for positions (..., N, 3) m."""
    c = convert_like(c, positions)
    if c.bar_nodes.shape[0] == 0:
        return positions.new_zeros(positions.shape[:-2])
    d = positions[..., c.bar_nodes[:, 1], :] - positions[..., c.bar_nodes[:, 0], :]
    return (torch.linalg.vector_norm(d, dim=-1) / c.bar_lengths - 1.0).abs().amax(-1)


def full_string_state(c: NodalConstants, params: Params, positions, velocities, motor_angles=None,
                      motor_velocities=None) -> StringState:
    """String lengths, stretches and tensions for full node positions (B, N, 3) m and velocities m/s."""
    c = convert_like(c, positions)
    der = prepare(c, convert_like(params, positions))
    i, j = c.seg_nodes[:, 0], c.seg_nodes[:, 1]
    s = positions[..., j, :] - positions[..., i, :]
    sd = velocities[..., j, :] - velocities[..., i, :]
    st = laws.string_law(REFERENCE, c, s.mT, sd.mT, der, motor_angles, motor_velocities)
    return st._replace(e=st.e.mT)                                   # segment unit vectors (B, n_seg, 3)


def energy(c: NodalConstants, params: Params, state: State, motor_angles=None) -> torch.Tensor:
    """(...,) total mechanical energy, J: kinetic (consistent bar mass) + gravity + string potential.

    String potential 1/2 kappa D^2 (D > 0) is exact for constant kappa (non-actuated strings, spring-law
    strings, constant u); a moving motor does work on the string, so energy is only conserved without one.
    """
    c = convert_like(c, state.positions)
    X, V = state.positions, state.velocities
    m = params.mass
    ke = 0.5 * torch.einsum("...b,...ni,bnm,...mi->...", m, V, c.E, V)
    pe_g = -torch.einsum("...b,nb,...nk,k->...", m, c.W, X, c.gravity)
    st = full_string_state(c, params, X, V, motor_angles)
    pe_s = (0.5 * st.kappa * torch.relu(st.D) ** 2).sum(-1)
    return ke + pe_g + pe_s


class StringUnitForces(NamedTuple):
    """Linear-in-parameters pieces of the nodal forces (full node space).

    stiffness: (B, S, N, 3) force on each node per unit ``stiffness`` parameter of string c, N/(N/m)
        (cord law: kappa_c = stiffness_c * rest_length_c / xi0_c(t); spring law, and every non-actuated string:
        kappa_c = stiffness_c).
    damping: (B, S, N, 3) force per unit damping zeta_c, N/(N s/m).
    gravity: (N, n_bars, 3) weight per unit bar mass, N/kg.
    active: (B, S) bool, the strings whose pull is on (D > 0 and tension > 0 at the given params).
    So F = sum_c stiffness_c A_c + damping_c B_c + sum_b m_b W_b exactly, for the given state.
    """

    stiffness: torch.Tensor
    damping: torch.Tensor
    gravity: torch.Tensor
    active: torch.Tensor


def string_unit_forces(topology_or_constants, positions: torch.Tensor, velocities: torch.Tensor,
                       motor_angles: Optional[torch.Tensor], params: Params,
                       motor_velocities: Optional[torch.Tensor] = None) -> StringUnitForces:
    """Per-string force contributions per unit stiffness / damping at full node positions (B, N, 3) m,
    velocities (B, N, 3) m/s, motor angles (B, A) rad. ``params`` supplies rest lengths, spool radii, zero
    offsets (and the gate: a string counts as active when it is taut and its tension > 0)."""
    c = topology_or_constants
    if isinstance(c, Topology):
        c = NodalConstants.build(c, positions.dtype, positions.device)
    c = convert_like(c, positions)
    params = convert_like(params, positions)
    st = full_string_state(c, params, positions, velocities, motor_angles, motor_velocities)
    active = st.tension > 0                                         # (B, S)
    N = positions.shape[-2]
    ns = c.seg_nodes.shape[0]
    Cs = torch.zeros(ns, N, dtype=positions.dtype, device=positions.device)
    ar = torch.arange(ns, device=positions.device)
    Cs[ar, c.seg_nodes[:, 0]] = -1.0
    Cs[ar, c.seg_nodes[:, 1]] = 1.0
    # unit-tension nodal force of each composite string: F_n = -sum_s G_sc (C_s)_sn e_s   (B, S, N, 3)
    pattern = -torch.einsum("sc,sn,...sk->...cnk", c.G, Cs, st.e)
    gate = active.to(positions.dtype)
    # kappa per unit stiffness parameter (the string law at k = 1): xi00/xi0 for cord strings, 1 for spring
    # strings (exactly the former xi00/xi0 for cord strings: the masks are 1.0/0.0)
    kscale = laws.string_stiffness(*laws.split_stiffness(c, torch.ones_like(params.stiffness), params.rest_length),
                                   st.xi0)
    A = (gate * kscale * st.D).unsqueeze(-1).unsqueeze(-1) * pattern
    B = (gate * st.Ddot).unsqueeze(-1).unsqueeze(-1) * pattern
    grav = c.W.unsqueeze(-1) * c.gravity                            # (N, nb, 3)
    return StringUnitForces(A, B, grav, active)


# =====================================================================================================
# engine object
# =====================================================================================================
@dataclass(frozen=True, eq=False)
class NodalEngine:
    """Nodal engine of one structure. Immutable; all methods are pure functions of their arguments.

    Create with :func:`tensegrity_ros.engine.make_engine`.
    """

    topology: Topology
    constants: NodalConstants
    integrator: str = "semi_implicit"
    options: Options = field(default_factory=Options)
    backend: str = "nodal"

    @classmethod
    def create(cls, structure, integrator="semi_implicit", dtype=torch.float64, device=None, **options):
        if integrator not in INTEGRATORS:
            raise ValueError(f"unknown integrator {integrator!r} (valid: {', '.join(INTEGRATORS)})")
        top = build_topology(structure)
        eng = cls(top, NodalConstants.build(top, dtype, device), integrator, Options(**options))
        eng._check_constraints()
        return eng

    @property
    def structure(self):
        return self.topology.structure

    @property
    def dtype(self):
        return self.constants.T.dtype

    @property
    def device(self):
        return self.constants.T.device

    def to(self, dtype=None, device=None) -> "NodalEngine":
        """The same engine with constants in another dtype/device."""
        ref = torch.empty(0, dtype=dtype or self.dtype, device=device or self.device)
        return NodalEngine(self.topology, convert_like(self.constants, ref), self.integrator, self.options)

    def _check_constraints(self) -> None:
        c = self.constants.map(lambda t: t.double() if t.is_floating_point() else t)
        if c.Cb_q.shape[0] == 0:
            return
        der = prepare(c, self.default_params().map(lambda t: t.double()))
        Q = reduce(c, torch.as_tensor(self.topology.X0, dtype=torch.float64, device=c.T.device).unsqueeze(0))
        A = laws.chord_matrix(REFERENCE, der, laws.bar_vectors(REFERENCE, c, Q))
        ev = torch.linalg.eigvalsh(A[0])
        if ev.min() <= 1e-10 * ev.max():
            raise ValueError(f"structure {self.structure.name!r}: the bar-length constraints are redundant "
                             "(singular constraint matrix); remove a redundant bar")

    # ---- API ---------------------------------------------------------------------------------
    def default_params(self, batch: Optional[int] = None) -> Params:
        """Params from the structure file values (``batch``: leading batch dim of copies)."""
        return params_from_structure(self.structure, batch, self.dtype, self.device)

    def initial_state(self, positions: Optional[torch.Tensor] = None, velocities: Optional[torch.Tensor] = None,
                      batch: int = 1) -> State:
        """State from positions (N, 3) or (B, N, 3) m (default: the file's) and velocities m/s (default 0).

        Linear constraints are enforced (X = T Q + X_c from the independent nodes' rows); bar lengths are
        not (use :meth:`project` if the positions come from measurements).
        """
        c = self.constants
        X = torch.as_tensor(self.topology.X0, dtype=self.dtype, device=self.device) if positions is None \
            else torch.as_tensor(positions, dtype=self.dtype, device=self.device)
        X = unsqueeze_batch(X, 2)
        V = torch.zeros_like(X) if velocities is None else unsqueeze_batch(
            torch.as_tensor(velocities, dtype=X.dtype, device=X.device), 2)
        B = max(X.shape[0], V.shape[0], batch)
        X, V = X.expand(B, *X.shape[1:]), V.expand(B, *V.shape[1:])
        c = convert_like(c, X)
        return State(expand(c, reduce(c, X)), expand_velocity(c, reduce(c, V)))

    def step(self, params: Params, state: State, inputs: Optional[Inputs] = None, dt: float = 1e-3) -> State:
        """One step of ``dt`` seconds. state: (B, N, 3); inputs: (B, A) / (B, N, 3) fields (or None)."""
        return step(self.constants, params, state, inputs, dt, self.integrator, self.options)

    def rollout(self, params: Params, state0: State, inputs: Optional[Inputs] = None, dt: float = 1e-3,
                steps: Optional[int] = None, compile: bool = False, chunk: int = 1,
                sub_batch: Optional[int] = None, kernel: str = "auto", cuda_graph: bool = False) -> State:
        """T steps; inputs (T, B, ...); returns states (T, B, N, 3) after each step.

        ``compile=True``: the batch-last throughput path (:mod:`.fast`), run by ``kernel`` (``fast.KERNELS``):
        ``auto`` (default) takes the semi-implicit step fused in C (:mod:`.native`) for CPU rollouts that no
        gradient is asked of, where it builds, and torch.compile (``inductor``) otherwise. Same results (float64:
        1e-12); inductor's are differentiable. Under inductor, ``chunk`` steps per compiled call (chunk > 1 cuts
        the per-call overhead at small batches but compiles a bigger graph; every distinct (chunk, batch, dtype)
        compiles once), and ``sub_batch`` runs a large batch in pieces of at most this size (faster when a
        piece's working set fits the cache; e.g. 128 for the 36-node manipulator on this CPU, without gradients:
        with them each piece keeps an autograd graph of its own and whole batches were faster, docs/engine.md).

        ``cuda_graph=True`` (CUDA, no gradient; :mod:`.graphs`): the steps' kernels are recorded once as a CUDA
        graph per chunk of steps and replayed, which removes the launches' cost from Python; eager: the reference
        layout's steps (:func:`steps_captured`); compiled: inductor's kernels (``kernel="inductor"``). ValueError
        where it cannot run (a CPU tensor, a gradient, the implicit step), saying why.
        """
        if not compile:
            return rollout(self.constants, params, state0, inputs, dt, self.integrator, self.options, steps,
                           cuda_graph)
        ref = state0.positions
        c, params, inputs = (convert_like(x, ref) for x in (self.constants, params, inputs))
        n = rollout_horizon(inputs, steps)
        u = ud = fe = None
        if inputs is not None:
            u, ud, fe = inputs.motor_angles, inputs.motor_velocities, inputs.external_forces
        X, V = fast.rollout(c, params, state0.positions, state0.velocities, u, ud, fe, n, dt, self.integrator,
                            self.options, chunk=chunk, sub_batch=sub_batch, kernel=kernel, cuda_graph=cuda_graph)
        return State(X, V)

    @property
    def compiled_step(self):
        """The compiled :meth:`step` (same signature; same results to round-off): one step of the compiled
        batch-last path, ``rollout(compile=True, chunk=1)`` (the native kernel where it applies, else the
        torch.compile'd graph; cache: build/native, build/torchinductor)."""
        eng = self

        def compiled(params, state, inputs=None, dt=1e-3):
            inp = None if inputs is None else inputs.map(lambda t: t.unsqueeze(0))
            return eng.rollout(params, state, inp, dt, steps=None if inp is not None else 1, compile=True)[0]

        return compiled

    def project(self, params: Params, state: State, iters: int = 3) -> State:
        """State projected onto the bar lengths (positions, then velocities), mass-weighted."""
        c = convert_like(self.constants, state.positions)
        der = prepare(c, convert_like(params, state.positions))
        Q, V = reduce(c, state.positions), reduce(c, state.velocities)
        for _ in range(iters):
            Q, V = project(c, der, Q, V, chord_matrix_inverse(c, der, Q), 1)
        return State(expand(c, Q), expand_velocity(c, V))

    def bar_length_error(self, state: State) -> torch.Tensor:
        """(B,) (or (T, B) for rollouts) max relative bar-length error."""
        return bar_length_error(self.constants, state.positions)

    def energy(self, params: Params, state: State, motor_angles=None) -> torch.Tensor:
        """(B,) total energy, J (see :func:`energy`)."""
        return energy(self.constants, params, state, motor_angles)

    def string_state(self, params: Params, state: State, inputs: Optional[Inputs] = None) -> StringState:
        """Lengths, stretches and tensions (B, S) of every composite string."""
        u = None if inputs is None else inputs.motor_angles
        ud = None if inputs is None else inputs.motor_velocities
        return full_string_state(self.constants, params, state.positions, state.velocities, u, ud)

    def string_unit_forces(self, params: Params, state: State, inputs: Optional[Inputs] = None) -> StringUnitForces:
        u = None if inputs is None else inputs.motor_angles
        ud = None if inputs is None else inputs.motor_velocities
        return string_unit_forces(self.constants, state.positions, state.velocities, u, params, ud)

    def mass_matrix(self, params: Params, reduced: bool = True) -> torch.Tensor:
        """M_q (..., n_free, n_free) (reduced) or M_full (..., N, N), kg."""
        c = convert_like(self.constants, params.mass)
        if reduced:
            return reduced_mass_matrix(c, params.mass)
        return torch.einsum("...b,bnm->...nm", params.mass, c.E)
