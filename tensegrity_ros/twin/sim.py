"""Stepping the MuJoCo twin in nodal terms: node states in, motor angles in, node states and tensions out.

The string law is the contract's (``docs/CONTRACTS.md``): composite length L, rest length
xi0 = xi00 + direction * spool_radius * (u - zero_offset), kappa = EA / xi0 with EA = stiffness * xi00
(``cord`` strings) or kappa = stiffness (``spring`` strings, see ``String.stiffness_law``),
tension T = max(0, kappa D + zeta D') if D = L - xi0 > 0 else 0. MuJoCo applies it through one general
actuator per tendon (force = kappa (ctrl - L) - zeta L', clamped pull-only); :class:`TwinSim` updates kappa of
actuated strings every step and, with ``gate_slack`` (default), zeroes the gains of strings that are slack at
the start of a step so that a slack string that lengthens quickly pulls nothing (the seed's D > 0 gate).

The gate holds for RK4 too (since stop 39): MuJoCo cannot split an RK4 step, so the tendon lengths at the step's
start are computed first (``mj_fwdPosition``) and the gains set for the whole step. Until then RK4 ran ungated,
and a slack string pulled whenever kappa D + zeta D' > 0 (D < 0, lengthening fast). On the test hoist, whose
lateral strings are slack 60 % of the time, that put the RK4 twin 0.39 mm RMS off the engine over 0.5-s windows
from the twin's own states at 0.25-ms engine steps; gated (implicitfast at 0.1 ms), 0.06 mm.
"""
from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import mujoco
import numpy as np

from ..frames import cross3, fit_rigid_transform
from ..model.schema import Structure
from .mjcf import DEFAULT_SOLIMP, DEFAULT_SOLREF, TwinLayout, build_layout, build_mjcf, frame_along

MotorAngleFn = Callable[[float], Sequence[float]]


def _rot_to_quat(rot: np.ndarray) -> np.ndarray:
    q = np.empty(4)
    mujoco.mju_mat2Quat(q, np.ascontiguousarray(rot, dtype=float).ravel())
    return q


@dataclass
class Trajectory:
    """Sampled twin motion. ``positions``/``velocities``: (T, N, 3) in structure node order."""

    times: np.ndarray
    positions: np.ndarray
    velocities: np.ndarray
    motor_angles: np.ndarray  # (T, A)
    tensions: np.ndarray  # (T, S)
    node_names: Tuple[str, ...]
    string_names: Tuple[str, ...]


class TwinSim:
    """A MuJoCo model of ``structure`` driven by motor angles (rad), observed as nodes (m, m/s) and tensions (N).

    ``integrator``: ``implicitfast`` (default, stable with stiff damped strings) or ``RK4`` (converged at 1 ms on
    the manipulator; energy checks). ``gate_slack``: the seed's D > 0 gate, decided at each step's start, for
    either integrator (module docstring).
    """

    def __init__(self, structure: Structure, timestep: float = 0.001, *, integrator: str = "implicitfast",
                 ground: bool = False, damping: bool = True, gravity: Optional[Sequence[float]] = None,
                 gate_slack: bool = True, solref: Sequence[float] = DEFAULT_SOLREF,
                 solimp: Sequence[float] = DEFAULT_SOLIMP):
        self.structure = structure
        self.layout: TwinLayout = build_layout(structure)
        self.xml = build_mjcf(structure, timestep=timestep, ground=ground, integrator=integrator, solref=solref,
                              solimp=solimp, gravity=gravity, damping=damping, layout=self.layout)
        self.model = mujoco.MjModel.from_xml_string(self.xml)
        self.data = mujoco.MjData(self.model)
        self._rk4 = integrator.upper() == "RK4"
        self.gate_slack = bool(gate_slack)
        m = self.model
        s = structure
        self._site_ids = np.array([mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, self.layout.node_site[n])
                                   for n in s.node_names])
        self._act_ids = np.array([mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_ACTUATOR, st.name) for st in s.strings])
        self._ten_ids = np.array([mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_TENDON, st.name) for st in s.strings])
        self._xi00 = np.array([st.rest_length for st in s.strings])
        # kappa = EA / xi0 + kc, as the engine (nodal.prepare): cord strings EA = stiffness * xi00, kc = 0;
        # spring strings EA = 0, kc = stiffness (their stiffness does not follow the rest length)
        spring = np.array([st.stiffness_law == "spring" for st in s.strings], dtype=bool)
        self._ea = np.array([0.0 if sp else st.stiffness * st.rest_length for st, sp in zip(s.strings, spring)])
        self._kc = np.array([st.stiffness if sp else 0.0 for st, sp in zip(s.strings, spring)])
        self._zeta = np.array([st.damping if damping else 0.0 for st in s.strings])
        by_name = {st.actuator: i for i, st in enumerate(s.strings) if st.actuator}
        self._act_string = np.array([by_name.get(a.name, -1) for a in s.actuators], dtype=int)
        self._spool = np.array([a.spool_radius * a.direction for a in s.actuators])
        self._zero = np.array([a.zero_offset for a in s.actuators])
        self._body_ids = [mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, b.name) for b in self.layout.bodies]
        self._qadr = [m.jnt_qposadr[m.body_jntadr[b]] for b in self._body_ids]
        self._dadr = [m.jnt_dofadr[m.body_jntadr[b]] for b in self._body_ids]
        self.xi0 = self._xi00.copy()
        self.xi0_dot = np.zeros_like(self.xi0)
        self.kappa = self._ea / self._xi00 + self._kc
        self.motor_angles = self._zero.copy()
        self._last_cmd: Optional[Tuple[float, np.ndarray]] = None
        mujoco.mj_resetDataKeyframe(m, self.data, 0)
        self._apply_strings()
        mujoco.mj_forward(m, self.data)

    # ---- basic properties ----------------------------------------------------------------------------
    @property
    def time(self) -> float:
        return float(self.data.time)

    @property
    def dt(self) -> float:
        return float(self.model.opt.timestep)

    @property
    def node_names(self) -> Tuple[str, ...]:
        return self.structure.node_names

    # ---- strings ------------------------------------------------------------------------------------
    def rest_lengths_for(self, motor_angles: Sequence[float]) -> np.ndarray:
        """Composite rest lengths for motor angles (rad), contract law."""
        xi0 = self._xi00.copy()
        u = np.asarray(motor_angles, dtype=float)
        ok = self._act_string >= 0
        xi0[self._act_string[ok]] += self._spool[ok] * (u[ok] - self._zero[ok])
        return xi0

    def _apply_strings(self) -> None:
        m, d = self.model, self.data
        self.kappa = self._ea / self.xi0 + self._kc
        m.actuator_gainprm[self._act_ids, 0] = self.kappa
        m.actuator_biasprm[self._act_ids, 1] = -self.kappa
        m.actuator_biasprm[self._act_ids, 2] = -self._zeta
        d.ctrl[self._act_ids] = self.xi0 + self._zeta / self.kappa * self.xi0_dot

    def _gate(self) -> None:
        """Zero the gains of strings slack now (called between mj_step1 and mj_step2)."""
        m = self.model
        slack = self.data.ten_length[self._ten_ids] <= self.xi0
        k = np.where(slack, 0.0, self.kappa)
        m.actuator_gainprm[self._act_ids, 0] = k
        m.actuator_biasprm[self._act_ids, 1] = -k
        m.actuator_biasprm[self._act_ids, 2] = np.where(slack, 0.0, -self._zeta)

    def set_motor_angles(self, motor_angles: Sequence[float], motor_velocities: Optional[Sequence[float]] = None
                         ) -> None:
        """Set the actuated rest lengths (and their rates) from motor angles (rad) and velocities (rad/s).

        Without velocities the rate is the finite difference to the previous command (zero the first time).
        """
        u = np.asarray(motor_angles, dtype=float).reshape(len(self.structure.actuators))
        if motor_velocities is not None:
            du = np.asarray(motor_velocities, dtype=float).reshape(u.shape)
        elif self._last_cmd is not None and self.time > self._last_cmd[0]:
            du = (u - self._last_cmd[1]) / (self.time - self._last_cmd[0])
        else:
            du = np.zeros_like(u)
        self._last_cmd = (self.time, u.copy())
        self.motor_angles = u
        self.xi0 = self.rest_lengths_for(u)
        rate = np.zeros_like(self.xi0)
        ok = self._act_string >= 0
        rate[self._act_string[ok]] = self._spool[ok] * du[ok]
        self.xi0_dot = rate
        self._apply_strings()

    def step(self, motor_angles: Optional[Sequence[float]] = None, n_steps: int = 1,
             motor_velocities: Optional[Sequence[float]] = None, observe: bool = True) -> None:
        """Advance ``n_steps`` timesteps holding the given motor angles (None: keep the last ones).

        ``observe=False`` skips the closing forward pass that makes positions, velocities and tensions current
        for reading (the next step computes its own, so the motion is the same): for a caller that steps again
        before it reads, e.g. the predictor's nominal between its motor-angle updates."""
        if motor_angles is not None and len(self.structure.actuators):
            self.set_motor_angles(motor_angles, motor_velocities)
        m, d = self.model, self.data
        if self.gate_slack and self._rk4:
            # an RK4 step cannot be split: the step start's tendon lengths first, then the gains for the step
            for _ in range(int(n_steps)):
                mujoco.mj_fwdPosition(m, d)
                self._gate()
                mujoco.mj_step(m, d)
            self._apply_strings()
        elif self.gate_slack:
            for _ in range(int(n_steps)):
                mujoco.mj_step1(m, d)
                self._gate()
                mujoco.mj_step2(m, d)
            self._apply_strings()
        else:
            mujoco.mj_step(m, d, nstep=int(n_steps))
        if observe:
            mujoco.mj_forward(m, d)

    def settle(self, seconds: float) -> None:
        """Run ``seconds`` with the motors held."""
        self.step(None, n_steps=int(round(seconds / self.dt)))

    # ---- observations -------------------------------------------------------------------------------
    def node_positions(self) -> np.ndarray:
        """(N, 3) positions of every structure node, in structure order (virtual nodes included)."""
        return self.data.site_xpos[self._site_ids].copy()

    def node_velocities(self) -> np.ndarray:
        """(N, 3) velocities of every structure node (rigid-body velocity of the site on its body).

        What ``mj_objectVelocity`` gives per site, for all sites in one vectorised expression (the simulated
        robot calls this at 120 Hz: the per-site Python loop was a tenth of its process): MuJoCo's ``cvel``
        is the body's spatial velocity [omega; v] at the subtree centre of mass of its root body, so a point p
        on the body moves with v + omega x (p - subtree_com[root])."""
        m, d = self.model, self.data
        body = m.site_bodyid[self._site_ids]
        cvel = d.cvel[body]
        offset = d.site_xpos[self._site_ids] - d.subtree_com[m.body_rootid[body]]
        out = cvel[:, 3:] + cross3(cvel[:, :3], offset)     # (np.cross: a tenth of a twin nominal's time)
        out[body == 0] = 0.0
        return out

    def string_lengths(self) -> np.ndarray:
        return self.data.ten_length[self._ten_ids].copy()

    def string_tensions(self) -> np.ndarray:
        """(S,) composite string tensions by the contract law from MuJoCo's tendon lengths and rates (N)."""
        d = self.data
        stretch = d.ten_length[self._ten_ids] - self.xi0
        rate = d.ten_velocity[self._ten_ids] - self.xi0_dot
        t = self.kappa * stretch + self._zeta * rate
        return np.where(stretch > 0, np.maximum(t, 0.0), 0.0)

    def actuator_tensions(self) -> np.ndarray:
        """(S,) tensions MuJoCo actually applied in the last forward pass (N)."""
        return -self.data.actuator_force[self._act_ids].copy()

    def string_energy(self) -> float:
        """Elastic energy of the strings, sum 0.5 kappa max(D, 0)^2 (J)."""
        stretch = np.maximum(self.data.ten_length[self._ten_ids] - self.xi0, 0.0)
        return float(0.5 * np.sum(self.kappa * stretch ** 2))

    def kinetic_energy(self) -> float:
        """Kinetic energy of all bodies (J), 0.5 qvel^T M qvel."""
        m, d = self.model, self.data
        mv = np.zeros(m.nv)
        mujoco.mj_mulM(m, d, mv, d.qvel)
        return float(0.5 * d.qvel @ mv)

    def constraint_error(self) -> float:
        """Largest gap of any connect equality (m)."""
        d, m = self.data, self.model
        worst = 0.0
        for s1, s2, _ in self.layout.connects:
            a = d.site_xpos[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, s1)]
            b = d.site_xpos[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, s2)]
            worst = max(worst, float(np.linalg.norm(a - b)))
        return worst

    # ---- state --------------------------------------------------------------------------------------
    def set_node_state(self, positions, velocities=None) -> None:
        """Put every body where the given node positions say (least squares per body), with velocities.

        ``positions``/``velocities``: (N, 3) in structure node order. A bar takes the midpoint and direction of
        its two end nodes; a rigid cluster takes the Kabsch fit of its nodes. Velocities are fitted the same
        way (v_com, omega) by least squares. Time and motor commands are left as they are.
        """
        s = self.structure
        p = np.asarray(positions, dtype=float).reshape(len(s.nodes), 3)
        v = np.zeros_like(p) if velocities is None else np.asarray(velocities, dtype=float).reshape(p.shape)
        idx = {n: i for i, n in enumerate(s.node_names)}
        d = self.data
        for body, qa, da in zip(self.layout.bodies, self._qadr, self._dadr):
            names = list(body.nodes)
            local = np.array([body.nodes[n] for n in names])
            world = p[[idx[n] for n in names]]
            vel = v[[idx[n] for n in names]]
            if not body.rigid_cluster:
                a, b = (p[idx[n]] for n in s.bar(body.bars[0]).nodes)
                va, vb = (v[idx[n]] for n in s.bar(body.bars[0]).nodes)
                rot = frame_along(b - a)
                com = 0.5 * (a + b)
                axis = (b - a) / np.linalg.norm(b - a)
                vcom = 0.5 * (va + vb)
                omega = np.cross(axis, vb - va) / np.linalg.norm(b - a)
            else:
                rot, t = fit_rigid_transform(local, world)
                com = t
                r = world - com
                # v_i = vcom + omega x r_i  ->  [I, -[r_i]x] [vcom; omega] = v_i
                rows = []
                for ri in r:
                    rows.append(np.hstack([np.eye(3), -np.array([[0, -ri[2], ri[1]], [ri[2], 0, -ri[0]],
                                                                  [-ri[1], ri[0], 0]])]))
                sol, *_ = np.linalg.lstsq(np.vstack(rows), vel.ravel(), rcond=None)
                vcom, omega = sol[:3], sol[3:]
            d.qpos[qa:qa + 3] = com
            d.qpos[qa + 3:qa + 7] = _rot_to_quat(rot)
            d.qvel[da:da + 3] = vcom
            d.qvel[da + 3:da + 6] = rot.T @ omega
        mujoco.mj_forward(self.model, d)

    def reset(self) -> None:
        """Back to the structure file's pose at rest, motors at their zero offsets, time 0."""
        mujoco.mj_resetDataKeyframe(self.model, self.data, 0)
        self.xi0, self.xi0_dot, self._last_cmd = self._xi00.copy(), np.zeros_like(self._xi00), None
        self.motor_angles = self._zero.copy()
        self._apply_strings()
        mujoco.mj_forward(self.model, self.data)

    # ---- real-time driving (for a ROS sim_robot node) -------------------------------------------------
    def run(self, duration: float, realtime_factor: float = 1.0, motor_angle_fn: Optional[MotorAngleFn] = None,
            tick_hz: float = 100.0, on_tick: Optional[Callable[["TwinSim"], None]] = None,
            should_stop: Optional[Callable[[], bool]] = None, clock: Callable[[], float] = _time.monotonic,
            sleep: Callable[[float], None] = _time.sleep) -> float:
        """Advance ``duration`` seconds of sim time, paced at ``realtime_factor`` x wall time (inf: unpaced).

        Every tick (``tick_hz``) the motor angles come from ``motor_angle_fn(sim_time)`` and ``on_tick(self)``
        is called (publish states there). Returns the achieved realtime factor.
        """
        n_per_tick = max(1, int(round(1.0 / (tick_hz * self.dt))))
        t0_sim, t0_wall = self.time, clock()
        n_ticks = int(math.ceil(duration / (n_per_tick * self.dt) - 1e-9))
        for _ in range(n_ticks):
            if should_stop is not None and should_stop():
                break
            angles = motor_angle_fn(self.time) if motor_angle_fn is not None else None
            self.step(angles, n_steps=n_per_tick)
            if on_tick is not None:
                on_tick(self)
            if math.isfinite(realtime_factor) and realtime_factor > 0:
                ahead = (self.time - t0_sim) / realtime_factor - (clock() - t0_wall)
                if ahead > 0:
                    sleep(ahead)
        wall = clock() - t0_wall
        return (self.time - t0_sim) / wall if wall > 0 else math.inf


def simulate(structure: Structure, motor_angle_fn: Optional[MotorAngleFn], duration: float,
             record_hz: float = 120.0, *, timestep: float = 0.001, initial_positions=None,
             initial_velocities=None, settle: float = 0.0, progress: Optional[bool] = None,
             sim: Optional[TwinSim] = None, **sim_kwargs) -> Trajectory:
    """Run the twin for ``duration`` s and record nodes, velocities, motor angles and tensions at ``record_hz``.

    ``motor_angle_fn(t)`` gives the motor angles (rad) at sim time t (None: motors at zero offset). Each timestep
    holds the drive's mid-step value and mean rate; ``motor_angles`` records the drive at the sample times.
    ``settle`` seconds are run first with the motors at ``fn(0)`` (not recorded; time restarts at 0). A tqdm bar is
    shown for runs over 2000 steps (``progress`` forces it).
    """
    sim = sim or TwinSim(structure, timestep=timestep, **sim_kwargs)
    if initial_positions is not None:
        sim.set_node_state(initial_positions, initial_velocities)
    n_act = len(structure.actuators)
    fn = motor_angle_fn or (lambda t: [a.zero_offset for a in structure.actuators])
    if settle > 0:
        sim.step(fn(0.0) if n_act else None, n_steps=int(round(settle / sim.dt)))
        sim.data.time = 0.0
        sim._last_cmd = None
    n_steps = int(round(duration / sim.dt))
    n_rec = int(math.floor(duration * record_hz + 1e-9)) + 1
    # sample k is taken at the step nearest to k / record_hz (times are exact multiples of dt)
    at_step = np.minimum(np.round(np.arange(n_rec) / record_hz / sim.dt).astype(int), n_steps)
    N, S = len(structure.nodes), len(structure.strings)
    out_t = np.zeros(n_rec)
    out_p, out_v = np.zeros((n_rec, N, 3)), np.zeros((n_rec, N, 3))
    out_u, out_T = np.zeros((n_rec, n_act)), np.zeros((n_rec, S))
    t0 = sim.time

    # The drive over a step [t, t + dt] is held at its mid-step value with the step's mean rate: MuJoCo holds ctrl
    # over a step, and holding the value at the step's end (as until stop 40) ran the drive half a step (0.5 ms at
    # 1 ms) ahead of the angles recorded, which are the continuous drive's at the sample times (an encoder's).
    end = np.asarray(fn(0.0), dtype=float)          # the drive at the current step's start, then at its end

    def record(k):
        out_t[k] = sim.time - t0
        out_p[k], out_v[k] = sim.node_positions(), sim.node_velocities()
        out_u[k] = end if n_act else out_u[k]
        out_T[k] = sim.string_tensions()

    if n_act:
        sim.set_motor_angles(end)
        sim.step(None, n_steps=0)
    record(0)
    show = progress if progress is not None else n_steps > 2000
    bar = None
    if show:
        from tqdm import tqdm
        bar = tqdm(total=n_steps, desc=f"twin {structure.name}", unit="step", leave=False)
    done = 0
    for k in range(1, n_rec):
        while done < at_step[k]:
            if n_act:
                start, ts = end, sim.time - t0
                end = np.asarray(fn(ts + sim.dt), dtype=float)
                sim.step(fn(ts + 0.5 * sim.dt), n_steps=1, motor_velocities=(end - start) / sim.dt)
            else:
                sim.step(None, n_steps=1)
            done += 1
        record(k)
        if bar is not None:
            bar.update(int(at_step[k] - at_step[k - 1]))
    if bar is not None:
        bar.close()
    return Trajectory(out_t, out_p, out_v, out_u, out_T, structure.node_names,
                      tuple(st.name for st in structure.strings))
