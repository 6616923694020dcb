"""Linearised horizon prediction (pure, no rclpy): :class:`HorizonPredictor` and its :class:`Linearization`.

How it stays fast (p50 < 5 ms for a 1-s horizon on CPU): a worker (:mod:`.jobs`) rolls the nonlinear engine's
model (the MuJoCo twin of the current parameters, or ``tensegrity_ros.engine``) out from a recent measured state
over the horizon plus a margin (the *nominal*), and takes the Jacobians A_k = dx_{k+1}/dx_k, B_k = dx_{k+1}/du_k
of one engine step along it from the engine's tangent-linear model (``engine.tangent.step_jacobians``;
forward-mode autograd for the integrators it does not cover), every ``jac_stride`` steps, interpolated in
between. Each node-state message then only propagates its deviation from the nominal through the linear
time-varying model, ``x_{k+1} = xbar_{k+1} + A_k (x_k - xbar_k) + B_k (u_k - ubar_k)``: 100
in-place matrix-vector products. The deviation stays small, so the first-order correction is accurate (checked
against full nonlinear rollouts in the tests). When and how long a nominal is computed, and what a message gets
when the next one is late, is :class:`~.stream.PredictionStream`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..model import Structure


@dataclass
class Linearization:
    """A nominal trajectory and its step Jacobians, sampled every ``dt`` from ``t0``.

    x: (K+1, n) nominal states [free-node positions (nf, 3) flattened, then velocities], m and m/s;
    u: (K+1, A) motor angles held over each step (rad); ks: (P,) steps at which the Jacobians J (P, n, n + A)
    = [A_k | B_k] were taken. :meth:`expand` interpolates them linearly to every step, in float32 (``Jk32``
    (K, n, n + A): what the per-message recurrence streams) and appends the frozen-Jacobian extension of the
    nominal (``xe``, ``ue``: ``ext_steps`` more steps, see :meth:`expand`) -- done where they are used, so a
    worker process ships only the P sampled Jacobians. Float64 Jacobians of chosen steps, for the
    linearisation service: :meth:`jacobians_at` (``A``, ``B``: all steps).
    """

    t0: float
    dt: float
    x: np.ndarray
    u: np.ndarray
    ks: np.ndarray
    J: np.ndarray
    set_id: str
    compute_s: float
    Jk32: Optional[np.ndarray] = None
    xe: Optional[np.ndarray] = None
    ue: Optional[np.ndarray] = None
    ext_steps: int = 0
    AB64: Optional[Tuple[np.ndarray, np.ndarray]] = None

    @property
    def steps(self) -> int:
        return int(self.x.shape[0] - 1)

    @property
    def t_end(self) -> float:
        return self.t0 + self.steps * self.dt

    def expand(self, extend_steps: int = 0) -> "Linearization":
        """Per-step Jacobians, and the nominal extended by up to ``extend_steps`` steps past its end.

        Interpolation: :meth:`_per_step`, into float32 (``Jk32``).

        Extension (what a message gets when the next nominal is late, instead of nothing): the nominal is
        continued with the affine model of its last step, x_{K+j+1} = x_K + A_{K-1} (x_{K+j} - x_{K-1})
        + B_{K-1} (u_K - u_{K-1}), the motors held at u_K, and the last step's Jacobians are used along it.
        That is the first-order model the LTV prediction already is, frozen at the last point instead of
        re-taken every ``jac_stride`` steps: for the taut-string oscillations of the robots here it tracks the
        nonlinear rollout to a few mm over a few hundred ms (tested), where holding the state or the last
        prediction would be off by the whole motion. It is not allowed to become garbage: it stops at the
        first step that is not finite or that leaves the nominal's own range of motion over its last horizon
        (positions by more than 50 % of that range + 5 mm, velocities likewise + 50 mm/s) -- an unstable or
        drifting frozen model ends the extension, and messages that would need more are still skipped."""
        if self.Jk32 is None:
            # float32: the per-message recurrence streams K x n x (n+A) of Jacobians (17 MB even so for a 3.5-s
            # nominal of the manipulator: out of cache, memory-bound) and its deviations are mm-scale (7 digits
            # are plenty). Measured: 0.75 -> 0.24 ms per 1-s prediction alone, 1.9 -> 0.43 ms with the caches
            # polluted as in the demo; interpolating straight into float32 also halves this step's writes
            self.Jk32 = self._per_step(np.float32)
        return self.extend(extend_steps)

    def extend(self, extend_steps: int) -> "Linearization":
        """Only the nominal's extension (``xe``, ``ue``) of :meth:`expand`, without the float32 per-step table:
        for a user that reads the Jacobians from :meth:`tabulate_steps` (the controller)."""
        if self.xe is None or self.ext_steps < extend_steps:
            self._extend(extend_steps)
        return self

    def _per_step(self, dtype) -> np.ndarray:
        """(K, n, n + A) [A_k | B_k] of every step in ``dtype``, linear between the sampled steps: written
        segment by segment into one preallocated array (fancy-indexed ``(1 - w) J[j] + w J[j + 1]`` allocates
        five such arrays: 0.4 s for a 6-s nominal of the manipulator, in the node's process)."""
        K, ks, J = self.steps, self.ks, self.J
        if ks.size == K:
            return np.ascontiguousarray(J, dtype=dtype)
        out = np.empty((K,) + J.shape[1:], dtype=dtype)
        dJ = np.empty(J.shape[1:])
        for j in range(ks.size - 1):
            k0, k1 = int(ks[j]), (int(ks[j + 1]) if j + 2 < ks.size else K)
            w = (np.arange(k0, k1) - ks[j]) / (ks[j + 1] - ks[j])
            np.subtract(J[j + 1], J[j], out=dJ)
            np.multiply(w[:, None, None], dJ, out=out[k0:k1], casting="same_kind")
            out[k0:k1] += J[j].astype(dtype, copy=False)
        return out

    def _extend(self, E: int) -> None:
        K, n = self.steps, self.x.shape[1]
        x, u = self.x, self.u
        xe = np.empty((K + 1 + E, n))
        ue = np.empty((K + 1 + E, u.shape[1]))
        xe[:K + 1], ue[:K + 1] = x, u
        ue[K + 1:] = u[K]
        ok = 0
        if E > 0 and K >= 2:
            Jl = self.jacobians_at(np.array([K - 1]))[0]
            A, B = Jl[:, :n], Jl[:, n:]
            c = x[K] + B @ (u[K] - u[K - 1]) - A @ x[K - 1]
            npos = n // 2
            tail = x[max(0, K - E):]
            span_p = np.abs(tail[:, :npos] - x[K, :npos]).max(initial=0.0) * 1.5 + 5e-3
            span_v = np.abs(tail[:, npos:]).max(initial=0.0) * 1.5 + 5e-2
            for j in range(E):
                nxt = A @ xe[K + j] + c
                if not (np.all(np.isfinite(nxt)) and np.abs(nxt[:npos] - x[K, :npos]).max() <= span_p
                        and np.abs(nxt[npos:]).max() <= span_v):
                    break
                xe[K + 1 + j] = nxt
                ok += 1
        self.xe, self.ue, self.ext_steps = xe[:K + 1 + ok], ue[:K + 1 + ok], ok

    @property
    def A(self) -> np.ndarray:
        """(K, n, n) step Jacobians dx_{k+1}/dx_k (float64, interpolated: the table of :meth:`tabulate_steps`)."""
        return self.tabulate_steps().AB64[0]

    @property
    def B(self) -> np.ndarray:
        """(K, n, A) step Jacobians dx_{k+1}/du_k (float64, interpolated: the table of :meth:`tabulate_steps`)."""
        return self.tabulate_steps().AB64[1]

    def jacobians_at(self, idx: np.ndarray) -> np.ndarray:
        """(len(idx), n, n + A) float64 [A_k | B_k] at steps ``idx`` (0..K-1), linear between the sampled ones."""
        idx = np.asarray(idx, dtype=float)
        ks = self.ks.astype(float)
        if ks.size == 1:
            return np.repeat(self.J[:1], idx.size, axis=0)
        j = np.clip(np.searchsorted(ks, idx, side="right") - 1, 0, ks.size - 2)
        w = np.clip((idx - ks[j]) / (ks[j + 1] - ks[j]), 0.0, 1.0)[:, None, None]
        return (1.0 - w) * self.J[j] + w * self.J[j + 1]

    def tabulate_steps(self) -> "Linearization":
        """Interpolate every step's A_k and B_k once (``AB64``, float64, contiguous), for a user that asks
        :meth:`step_jacobians` for many windows of the same linearisation: the controller, every cycle
        (interpolating its window anew each time was 4.5 ms of a 20-ms cycle, 2026-11-26). Costs the memory of
        all K steps (7.9 MB for the controller's 80), so the predictor's long nominals do not do it."""
        if self.AB64 is None:
            J = self._per_step(np.float64)
            n = self.x.shape[1]
            self.AB64 = (np.ascontiguousarray(J[:, :, :n]), np.ascontiguousarray(J[:, :, n:]))
            for table in self.AB64:            # shared by every window handed out: read-only
                table.flags.writeable = False
        return self

    def step_jacobians(self, i0: int, steps: int) -> Tuple[np.ndarray, np.ndarray]:
        """A_k, B_k for k = i0 .. i0+steps-1; past the nominal's end: the last step's (the extension's model).
        Slices of the table when :meth:`tabulate_steps` made one, else interpolated for this window."""
        idx = np.minimum(np.arange(i0, i0 + steps), self.steps - 1)
        if self.AB64 is not None:
            A, B = self.AB64
            if i0 >= 0 and i0 + steps <= self.steps:
                return A[i0:i0 + steps], B[i0:i0 + steps]
            return A[idx], B[idx]
        Jk = self.jacobians_at(idx)
        n = self.x.shape[1]
        return Jk[:, :, :n], Jk[:, :, n:]


class HorizonPredictor:
    """Linearised horizon prediction for one structure. See the module docstring.

    structure: the model; dt: prediction step, s, made of ``substeps`` engine steps (0 = automatic: the
    semi-implicit Euler step is explicit in the string damping and must be short on stiff, damped strings, see
    :meth:`stable_substeps`); integrator: engine integrator;
    nominal: ``twin`` (the nominal rollout runs in the MuJoCo twin built from the current parameters: same
    string law, ~15x cheaper per second of motion than the batch-1 torch engine) or ``engine`` (the torch
    engine itself); the Jacobians always come from the engine (its tangent-linear model, else autograd).
    jac_stride: Jacobians every jac_stride prediction steps, interpolated linearly in between; jac_chunk:
    Jacobian time points per batched evaluation (memory bound).
    """

    NOMINALS = ("twin", "engine")

    def __init__(self, structure: Structure, dt: float = 0.01, substeps: int = 0, integrator: str = "semi_implicit",
                 nominal: str = "engine", jac_stride: int = 1, jac_chunk: int = 64, twin_timestep: float = 0.001):
        import torch
        from ..engine import make_engine

        if nominal not in self.NOMINALS:
            raise ValueError(f"nominal {nominal!r} (valid: {', '.join(self.NOMINALS)})")
        self.torch = torch
        self.structure = structure
        self.engine = make_engine(structure, "nodal", integrator, dtype=torch.float64)
        top = self.engine.topology
        self.dt = float(dt)
        self.substeps = max(0, int(substeps))
        self.nominal = nominal
        self.twin_timestep = float(twin_timestep)
        self.node_names = top.node_names
        self.free = np.asarray(top.free_nodes, dtype=int)
        self.free_names = tuple(top.node_names[i] for i in self.free)
        self.nf = len(self.free)
        self.n = 6 * self.nf
        self.actuator_names = top.actuator_names
        self.n_u = len(self.actuator_names)
        self.T = np.asarray(top.T, dtype=float)            # (N, nf)
        self.Xc = np.asarray(top.Xc, dtype=float)          # (N, 3)
        self.X0 = np.asarray(top.X0, dtype=float)
        self.jac_chunk = int(jac_chunk)
        self.jac_stride = max(1, int(jac_stride))
        self.state_names = tuple(f"{n}.{a}" for n in self.free_names for a in "xyz") + \
            tuple(f"{n}.v{a}" for n in self.free_names for a in "xyz")
        self.input_names = tuple(f"{a}.angle" for a in self.actuator_names)
        self._twin = None
        self._twin_key = None
        self._auto_substeps: Dict[tuple, int] = {}
        # 10/s: at 100/s the manipulator got 8 substeps whose Jacobian grows 53/s (rho 1.066 per 1.25-ms substep,
        # 1.66 per 10-ms step: the explicit-damping instability, not physics); 16 give rho 0.997 per step, so the
        # first-order correction of a deviation no longer explodes into the 3x cap (the Jacobians cost the same)
        self.max_growth_per_s = 10.0
        self.capped = 0
        self.last_deviation = 0.0   # largest |measured - nominal| position component of the last prediction, m
        self.last_substeps = self.substeps
        self._name_maps: Dict[tuple, Tuple[np.ndarray, np.ndarray]] = {}
        self._out_maps: Dict[tuple, tuple] = {}

    # ---- helpers -----------------------------------------------------------------------------------
    def full_positions(self, Q: np.ndarray) -> np.ndarray:
        """(..., nf, 3) free-node positions -> (..., N, 3) all nodes (X = T Q + X_c)."""
        return np.matmul(self.T, Q) + self.Xc

    def full_velocities(self, V: np.ndarray) -> np.ndarray:
        return np.matmul(self.T, V)

    def split(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(..., n) state -> free-node positions, velocities (..., nf, 3); a torch tensor stays one (and keeps its
        autograd and dual-number tangents)."""
        x = x if hasattr(x, "reshape") else np.asarray(x)
        return x[..., :3 * self.nf].reshape(*x.shape[:-1], self.nf, 3), \
            x[..., 3 * self.nf:].reshape(*x.shape[:-1], self.nf, 3)

    def _engine_state(self, x):
        """(B, n) predictor states (node-major, see :attr:`state_names`) -> the engine's reduced Q, V (B, 3, nf)."""
        q, v = self.split(x)
        return q.mT, v.mT

    def _step_fn(self, params, n_sub: int):
        """``n_sub`` engine steps of dt / n_sub: f(x (B, n), u, ud (B, A) or None) -> (B, n)."""
        from ..engine.nodal import prepare, step_reduced

        eng = self.engine
        c = eng.constants
        der = prepare(c, params)
        integ, opts = eng.integrator, eng.options
        h = self.dt / n_sub

        def f(x, u, ud, steps: int = n_sub):
            B = x.shape[0]
            Q, V = self._engine_state(x)
            for _ in range(steps):
                Q, V = step_reduced(c, der, Q, V, u, ud, None, h, integ, opts)
            return self.torch.cat([Q.mT.reshape(B, -1), V.mT.reshape(B, -1)], dim=1)

        return f

    def _substep_jacobians(self, params, n_sub: int, X, Us, Uds, ks: np.ndarray) -> np.ndarray:
        """(len(ks), n, n + A) Jacobians [a | b] of ONE engine substep (dt / n_sub) at the nominal points ks:
        from the engine's tangent-linear model (:func:`..engine.tangent.step_jacobians`) where it covers the
        engine's step, else by forward-mode autograd (:meth:`_substep_jacobians_ad`). The two agree to
        round-off (test_predict_jacobians.py); the tangent model took 5.8 ms where autograd took 41.7 ms for the
        manipulator's 9 points (one thread, 2026-11-28): autograd was about half of a controller's linearisation
        (79-84 ms in all)."""
        from ..engine import tangent

        if not tangent.supports(self.engine):
            return self._substep_jacobians_ad(params, n_sub, X, Us, Uds, ks)
        from ..engine.nodal import prepare

        torch, n = self.torch, self.n
        c = self.engine.constants
        der = prepare(c, params)
        p = self._coordinate_major
        Js = np.empty((ks.size, n, n + self.n_u))
        for s in range(0, ks.size, self.jac_chunk):
            kk = torch.as_tensor(ks[s:s + self.jac_chunk])
            B = kk.numel()
            Q, V = self._engine_state(X[kk])
            u = ud = None
            if self.n_u:
                u, ud = Us[kk], Uds[kk]
            with torch.no_grad():
                Ja, Jb = tangent.step_jacobians(c, der, Q, V, u, ud, self.dt / n_sub, self.engine.options)
            # the engine's coordinate-major state vec -> the predictor's node-major one
            Js[s:s + B, :, :n] = Ja[:, p][:, :, p].numpy()
            if self.n_u:
                Js[s:s + B, :, n:] = Jb[:, p].numpy()
        return Js

    @property
    def _coordinate_major(self) -> np.ndarray:
        """Index map: the predictor's state entry i (node-major: node j's x, y, z, positions then velocities)
        sits at entry p[i] of the engine's coordinate-major vec (x of every node, then y, then z)."""
        nf = self.nf
        half = (np.arange(3)[None, :] * nf + np.arange(nf)[:, None]).reshape(-1)
        return np.concatenate([half, half + 3 * nf])

    def _substep_jacobians_ad(self, params, n_sub: int, X, Us, Uds, ks: np.ndarray) -> np.ndarray:
        """:meth:`_substep_jacobians` by forward-mode autograd: ``vmap(jacfwd)`` over the points (``jac_chunk``
        per call), for the engines the tangent model does not cover (other integrators, Baumgarte terms).

        Why vmap and not one big ``jvp`` on a (tangents x points) batch: under a plain forward-mode batch, the
        engine's ``X (B, 3, nf) @ M (nf, k)`` products are not folded into one matrix multiply but run as a
        batched ``bmm`` against an expanded M, one small GEMM per batch row (profiled: ~75 % of the time on
        the manipulator); vmap's batching rules fold them. 2.2x faster, identical to round-off."""
        torch = self.torch
        f = self._step_fn(params, n_sub)
        A_, n = self.n_u, self.n
        if A_:
            jac = torch.func.vmap(torch.func.jacfwd(lambda x, u, ud: f(x[None], u[None], ud[None], 1)[0],
                                                    argnums=(0, 1)))
        else:
            jac = torch.func.vmap(torch.func.jacfwd(lambda x: f(x[None], None, None, 1)[0]))
        Js = np.empty((ks.size, n, n + A_))
        for s in range(0, ks.size, self.jac_chunk):
            kk = torch.as_tensor(ks[s:s + self.jac_chunk])
            if A_:
                Ja, Jb = jac(X[kk], Us[kk], Uds[kk])
                Js[s:s + kk.numel(), :, :n] = Ja.numpy()
                Js[s:s + kk.numel(), :, n:] = Jb.numpy()
            else:
                Js[s:s + kk.numel()] = jac(X[kk]).numpy()
        return Js

    @staticmethod
    def compose(J: np.ndarray, n_sub: int, n: int) -> np.ndarray:
        """[A | B] of ``n_sub`` repetitions of a substep with Jacobian J = [a | b] (..., n, n + A), the input
        held: A = a^n_sub, B = sum_j a^j b (binary exponentiation: (A1, B1) o (A2, B2) = (A1 A2, A1 B2 + B1);
        torch matmul: one thread, no BLAS thread pool spinning next to the graph)."""
        import torch

        Jt = torch.as_tensor(J)
        PA, PB = Jt[..., :n], Jt[..., n:]
        RA = RB = None
        k = int(n_sub)
        while k:
            if k & 1:
                RA, RB = (PA, PB) if RA is None else (PA @ RA, PA @ RB + PB)
            k >>= 1
            if k:
                PA, PB = PA @ PA, PA @ PB + PB
        return torch.cat([RA, RB], dim=-1).numpy()

    def stable_substeps(self, params, X, Us, Uds) -> int:
        """Engine substeps per prediction step: the configured number, or (``substeps=0``) the smallest power
        of two (<= 1024) whose substep Jacobian at the nominal's start is numerically stable (semi-implicit Euler
        is explicit in the string damping: stiff, heavily damped strings need a short step). Stable means a
        spectral radius rho with (rho - 1) / h <= ``max_growth_per_s``: an integrator instability gives
        rho - 1 = O(1), whereas a physical growth rate of the linearisation (a state away from equilibrium)
        gives rho - 1 = O(h) and is not removed by shorter steps. Cached per params."""
        if self.substeps:
            return self.substeps
        key = tuple(float(v) for v in self.torch.cat([getattr(params, k).reshape(-1) for k in params.kinds()]))
        if key in self._auto_substeps:
            return self._auto_substeps[key]
        def stable(n):
            J = self._substep_jacobians(params, n, X, Us, Uds, np.array([0]))[0, :, :self.n]
            rho = np.abs(np.linalg.eigvals(J)).max()
            return (rho - 1.0) * n / self.dt <= self.max_growth_per_s

        n_sub = self.last_substeps or 1     # parameters change a little between sets: start from the last count
        while n_sub < 1024 and not stable(n_sub):
            n_sub *= 2
        while n_sub > 1 and stable(n_sub // 2):
            n_sub //= 2
        self._auto_substeps = {key: n_sub}
        return n_sub

    def initial_state(self, params, positions: np.ndarray, velocities: np.ndarray) -> np.ndarray:
        """(n,) state from full-node positions / velocities (N, 3) (NaN rows: file position / zero),
        projected onto the bar lengths."""
        X = np.where(np.isfinite(positions), positions, self.X0)
        V = np.where(np.isfinite(velocities), velocities, 0.0)
        st = self.engine.initial_state(self.torch.as_tensor(X), self.torch.as_tensor(V))
        st = self.engine.project(params, st)
        q = st.positions[0, self.free].numpy()
        v = st.velocities[0, self.free].numpy()
        return np.concatenate([q.reshape(-1), v.reshape(-1)])

    # ---- the nominal and its Jacobians --------------------------------------------------------------------
    def _motor_inputs(self, u: Optional[np.ndarray], steps: int):
        torch = self.torch
        if not self.n_u:
            return None, None
        if u is None:
            raise ValueError("motor angles are needed for an actuated structure")
        from ..engine import inputs_from_angles
        U = torch.as_tensor(np.asarray(u, dtype=float)[: steps + 1]).unsqueeze(1)              # (K+1, 1, A)
        inp = inputs_from_angles(U, self.dt)
        return inp.motor_angles[:, 0], inp.motor_velocities[:, 0]                                # (K+1, A)

    def _nominal_engine(self, params, x0: np.ndarray, Us, Uds, steps: int, n_sub: int):
        torch = self.torch
        f = self._step_fn(params, n_sub)
        with torch.no_grad():
            xs = [torch.as_tensor(x0).unsqueeze(0)]
            for k in range(steps):
                xs.append(f(xs[-1], None if Us is None else Us[k:k + 1], None if Uds is None else Uds[k:k + 1]))
        return torch.cat(xs)

    def _nominal_twin(self, params, P: np.ndarray, V: np.ndarray, Us, Uds, steps: int):
        """The nominal from the MuJoCo twin of the current parameters. Returns states (K+1, n)."""
        from ..engine import apply_to_structure
        from ..twin.sim import TwinSim

        key = tuple(float(v) for v in self.torch.cat([getattr(params, k).reshape(-1) for k in params.kinds()]))
        if self._twin is None or key != self._twin_key:
            # ungated (one MuJoCo call per chunk instead of a Python loop per millisecond): the gate only
            # matters for slack strings that lengthen fast (docs/CONTRACTS.md)
            self._twin = TwinSim(apply_to_structure(self.structure, params), timestep=self.twin_timestep,
                                 gate_slack=False)
            self._twin_key = key
        sim = self._twin
        sim.reset()
        sim.set_node_state(P, V)
        import mujoco
        bad = (mujoco.mjtWarning.mjWARN_BADQACC, mujoco.mjtWarning.mjWARN_BADQVEL, mujoco.mjtWarning.mjWARN_BADQPOS)
        warnings0 = [int(sim.data.warning[w].number) for w in bad]
        n_sub = max(1, int(round(self.dt / sim.dt)))
        u = None if Us is None else Us.numpy()
        ud = None if Uds is None else Uds.numpy()
        out = np.empty((steps + 1, self.n))
        P1, V1 = sim.node_positions(), sim.node_velocities()
        out[0] = np.concatenate([P1[self.free].reshape(-1), V1[self.free].reshape(-1)])
        chunks = max(1, min(n_sub, int(round(self.dt / 0.005))))   # motor angles refreshed every ~5 ms
        bounds = np.linspace(0, n_sub, chunks + 1).round().astype(int)
        for k in range(steps):
            for c in range(chunks):
                last = c == chunks - 1          # read after the last chunk only
                if u is None:
                    sim.step(None, int(bounds[c + 1] - bounds[c]), observe=last)
                else:   # linear between the prediction steps (the motors move continuously)
                    w = bounds[c] / n_sub
                    sim.step((1 - w) * u[k] + w * u[k + 1], int(bounds[c + 1] - bounds[c]),
                             (1 - w) * ud[k] + w * ud[k + 1], observe=last)
            P1, V1 = sim.node_positions(), sim.node_velocities()
            out[k + 1] = np.concatenate([P1[self.free].reshape(-1), V1[self.free].reshape(-1)])
        if [int(sim.data.warning[w].number) for w in bad] != warnings0:
            raise FloatingPointError("the twin nominal went unstable (MuJoCo reset it); parameters implausible?")
        return self.torch.as_tensor(out)

    def linearize(self, params, t0: float, positions: np.ndarray, velocities: np.ndarray, u: Optional[np.ndarray],
                  steps: int, set_id: str = "") -> Linearization:
        """The nominal over ``steps`` prediction steps from full-node positions / velocities (N, 3) at t0
        (consistent with the linear constraints, e.g. from :meth:`full_positions`) with motor angles u
        (steps+1, A) (None without actuators), then A_k, B_k of the engine step (:meth:`_substep_jacobians`),
        batched over time points and tangents."""
        torch = self.torch
        t_start = time.perf_counter()
        Us, Uds = self._motor_inputs(u, steps)
        A_ = self.n_u
        if self.nominal == "twin":
            X = self._nominal_twin(params, positions, velocities, Us, Uds, steps)
            n_sub = self.stable_substeps(params, X, Us, Uds)
        else:
            x0 = self.initial_state(params, positions, velocities)
            n_sub = self.stable_substeps(params, torch.as_tensor(x0).unsqueeze(0), Us, Uds)
            X = self._nominal_engine(params, x0, Us, Uds, steps, n_sub)
        if not torch.all(torch.isfinite(X)):
            raise FloatingPointError("nominal rollout diverged (non-finite states)")
        # Jacobians of ONE engine substep at every jac_stride-th prediction step (and the last), composed over
        # the substeps of a prediction step (the substep Jacobian varies little within one prediction step)
        # and interpolated linearly between those time points
        ks = np.unique(np.r_[np.arange(0, steps, self.jac_stride), steps - 1])
        Js = self.compose(self._substep_jacobians(params, n_sub, X, Us, Uds, ks), n_sub, self.n)
        self.last_substeps = n_sub
        Un = Us.numpy() if A_ else np.zeros((steps + 1, 0))
        return Linearization(t0=float(t0), dt=self.dt, x=X.numpy(), u=Un, ks=ks, J=Js, set_id=set_id,
                             compute_s=time.perf_counter() - t_start)

    # ---- per message ----------------------------------------------------------------------------------------
    def covers(self, lin: Linearization, t: float, steps: int, extended: bool = False) -> bool:
        """Whether ``lin`` holds t and ``steps`` steps after it (``extended``: counting the nominal's
        extension, see :meth:`Linearization.expand`)."""
        i = (t - lin.t0) / lin.dt
        end = lin.steps + (lin.ext_steps if extended else 0)
        return i >= -1e-9 and math.floor(i + 1e-9) + steps + 1 <= end

    def predict(self, lin: Linearization, t: float, x_meas: np.ndarray, steps: int,
                u_future: Optional[np.ndarray] = None, extended: bool = False) -> Tuple[np.ndarray, np.ndarray, int]:
        """States at t + k dt, k = 1..steps, from the measured state x_meas (n,) at t (NaN entries: no
        measurement, the nominal is used there). u_future: (steps, A) motor angles over the steps (None:
        the nominal's). ``extended``: steps past the nominal's end may use its extension
        (:meth:`Linearization.expand`). Returns free-node positions (steps, nf, 3), velocities (steps, nf, 3)
        and the nominal index of t (for :meth:`Linearization.step_jacobians`)."""
        lin.expand()
        i = (t - lin.t0) / lin.dt
        i0 = int(math.floor(i + 1e-9))
        f = min(max(i - i0, 0.0), 1.0)
        if not self.covers(lin, t, steps, extended):
            raise ValueError(f"the nominal [{lin.t0:.3f}, {lin.t_end:.3f}] s (+{lin.ext_steps if extended else 0} "
                             f"extension steps) does not cover t = {t:.3f} s + {steps} steps")
        X, U, Jk, K = lin.xe, lin.ue, lin.Jk32, lin.steps
        n, A_ = self.n, self.n_u
        xb = (1 - f) * X[i0] + f * X[i0 + 1]
        # Z[k] = [x_k - xbar_k | u_k - ubar_k]: one (n, n + A) matrix-vector product per step gives the next
        # deviation, written in place (no per-step temporaries)
        Z = np.zeros((steps + 1, n + A_), dtype=np.float32)
        d = Z[0, :n]
        np.subtract(x_meas, xb, out=d)
        d[~np.isfinite(d)] = 0.0
        if A_ and u_future is not None:
            du = np.asarray(u_future, dtype=float)[:steps] - ((1 - f) * U[i0:i0 + steps] + f * U[i0 + 1:i0 + steps + 1])
            if np.all(np.isfinite(du)):
                Z[:steps, n:] = du
        out = (1 - f) * X[i0 + 1:i0 + steps + 1]
        out += f * X[i0 + 2:i0 + steps + 2]
        last = K - 1
        for k in range(steps):           # the recurrence: one matrix-vector product per step (the hot loop)
            np.matmul(Jk[min(i0 + k, last)], Z[k], out=Z[k + 1, :n])
        D = Z[1:, :n]
        # the correction is first order: bounded to 3x the initial deviation (min 5 mm, 50 mm/s), so a
        # linearisation about a far-off nominal (wrong parameters, a violent transient) cannot blow up
        npos = 3 * self.nf
        self.last_deviation = float(np.abs(d[:npos]).max(initial=0.0))
        cap_p = max(3.0 * self.last_deviation, 5e-3)
        cap_v = max(3.0 * float(np.abs(d[npos:]).max(initial=0.0)), 5e-2)
        peak_p, peak_v = np.abs(D[:, :npos]).max(axis=1), np.abs(D[:, npos:]).max(axis=1)
        over = ~((peak_p <= cap_p) & (peak_v <= cap_v))          # NaN compares False: over
        if over.any():
            # each step's correction is scaled back to the bound, and a step that is not finite contributes
            # nothing. Not rare: with the demo's 20 %-off nominal most messages hit the bound until the first
            # set is accepted. (This was a second, step-by-step recurrence with the bound inside, holding the
            # GIL for ~3x the prediction's own time: 16 % of the graph process's GIL samples, py-spy --gil.)
            self.capped += 1
            bad = ~(np.isfinite(peak_p) & np.isfinite(peak_v))
            D[bad] = 0.0
            D[:, :npos] *= np.minimum(1.0, cap_p / np.maximum(np.where(bad, 1.0, peak_p), 1e-300))[:, None]
            D[:, npos:] *= np.minimum(1.0, cap_v / np.maximum(np.where(bad, 1.0, peak_v), 1e-300))[:, None]
        out += D
        nf = self.nf
        return out[:, :3 * nf].reshape(steps, nf, 3), out[:, 3 * nf:].reshape(steps, nf, 3), i0

    def measured_state(self, names: Sequence[str], positions: np.ndarray, velocities: np.ndarray,
                       valid: np.ndarray) -> np.ndarray:
        """(n,) state of the free nodes from a node-state record (NaN where unknown)."""
        names = tuple(names)
        m = self._name_maps.get(names)
        if m is None:                    # once per node-name list (the stream's names never change)
            idx = {nm: i for i, nm in enumerate(names)}
            dst = np.array([j for j, nm in enumerate(self.free_names) if nm in idx], dtype=int)
            src = np.array([idx[self.free_names[j]] for j in dst], dtype=int)
            m = self._name_maps[names] = (src, dst)
        src, dst = m
        q = np.full((self.nf, 3), np.nan)
        v = np.full((self.nf, 3), np.nan)
        ok = np.asarray(valid, dtype=bool)[src]
        q[dst[ok]] = positions[src[ok]]
        v[dst[ok]] = velocities[src[ok]]
        return np.concatenate([q.reshape(-1), v.reshape(-1)])

    def output_rows(self, names: Tuple[str, ...]) -> Tuple[Tuple[str, ...], np.ndarray, np.ndarray]:
        """(the model's nodes among ``names``, their rows of T, of X_c): the published nodes' positions are
        ``T_out Q + Xc_out`` for free-node positions Q (nf, 3)."""
        m = self._out_maps.get(names)
        if m is None:                    # once per node-name list: output rows of X = T Q + X_c
            idx = [self.node_names.index(n) for n in names if n in self.node_names]
            m = self._out_maps[names] = (tuple(self.node_names[i] for i in idx), self.T[idx], self.Xc[idx])
        return m
