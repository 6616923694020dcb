"""``plate_controller``: model-based control of the top plate's pose (docs/control.md).

Every ``control_period_s`` it solves the LTV MPC of :mod:`tensegrity_ros.control` from the latest node states,
along the latest linearisation, towards the latest target, and publishes the plan. The linearisation is the
predictor's own job (:func:`~.state_predictor.relinearize_job`: twin nominal + engine Jacobians, with the
identified parameters) run by this node's worker from the latest measured state, with the controller's own
plan as the motor future -- the predictor's ``~/get_linearization`` service carries A_k, B_k but not the nominal
states, and shipping 50 x 108 x 114 doubles per cycle over DDS costs more than computing them here.

Topics: subscribes ``/tensegrity/node_states``, ``/tensegrity/motor_states`` (the present angles before the first
plan), ``/tensegrity/identified_parameters``, ``/tensegrity/plate_target`` (geometry_msgs/PoseStamped: C2 in
``target_frame``, default "C0") or ``/tensegrity/plate_target_trajectory`` (geometry_msgs/PoseArray: poses
``target_trajectory_dt`` apart from header.stamp, the horizon samples it; the latest of the two kinds wins);
publishes ``/tensegrity/motor_plan`` (trajectory_msgs/JointTrajectory when
installed, else sensor_msgs/JointState with position = N x A angles row-major, one prediction step (``dt``) apart,
header.stamp = the time of the first: the state_predictor's plan convention) and ``/diagnostics`` (status, reason,
solve time p50/p99, tracking error, limits active). Stale inputs: the plan holds the present command and the
status says ``stale``; rejected targets (NaN, other frame, out of the workspace) keep the previous target and
the diagnostics give the reason. ``model`` (run-time settable): ``identified`` = the latest identified parameters,
``nominal`` = the structure file's (the paired run of ``tensegrity demo --controller``); a change resets the MPC's
disturbance estimate, integral and warm start.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from typing import Optional

import numpy as np

from ..control import MPCOptions, PlateMPC, PlateOutputMap, Status
from ..control.targets import target_from_pose, trajectory_from_poses
from ..model import load_structure
from . import _common as C
from .state_predictor import HorizonPredictor, MotorPlan, core_job, relinearize_job
from .tables.plate_controller import PARAMS


class PlateControllerNode(C.GraphNode):
    DEFAULT_NAME = "plate_controller"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        from geometry_msgs.msg import PoseStamped
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates

        p = self.p
        self.structure = load_structure(p["model_file"])
        self.core_options = {"dt": p["dt"], "nominal": "twin", "jac_stride": p["jac_stride"]}
        self.core = HorizonPredictor(self.structure, **self.core_options)
        self.N = max(1, int(round(p["horizon_s"] / p["dt"])))
        self.block = max(1, int(round(p["control_period_s"] / p["dt"])))
        self.lin_steps = self.N + max(self.block, int(round(p["nominal_margin_s"] / p["dt"])))
        self.ext_steps = max(self.N, int(round(p["extension_s"] / p["dt"])))
        self.options = MPCOptions(horizon_steps=self.N, block_steps=self.block, position_tol_m=p["position_tol_m"],
                                  angle_tol_rad=p["angle_tol_rad"], max_rate_rad_s=p["max_rate_rad_s"],
                                  limit_margin_rad=p["limit_margin_rad"], disturbance=p["disturbance"],
                                  input_model=p["input_model"], max_input_age_s=p["max_input_age_s"],
                                  measured_velocity_weight=p["measured_velocity_weight"],
                                  rate_scale_rad_s=p["rate_scale_rad_s"], actuator_lag_s=p["actuator_lag_s"])
        self.output = PlateOutputMap.from_structure(self.structure)
        self.mpc = PlateMPC.from_structure(self.structure, self.output, self.options)
        self.motor_names = self.mpc.motor_names
        self.values = {n: float(v) for n, v in self.core.engine.default_params().named().items()}
        self.nominal_values = dict(self.values)
        self.set_id = "nominal"
        self.trajectory = None              # TargetTrajectory (latest kind of target wins)
        self._lock = threading.Lock()
        self._state = None                  # latest NodeStatesRecord
        self._angles: Optional[np.ndarray] = None
        self._plan: Optional[MotorPlan] = None
        self._lin = None
        self.target: Optional[np.ndarray] = None
        self.target_reason = "no target yet"
        self.rejected = 0
        self.last = None                    # last MPCResult
        self._last_stamp = None
        self.solve = C.RollingStats(2000)
        # where a cycle's time went, one sample per solve: how old the node states were at the tick (mocap ->
        # ingest -> DDS -> this callback) and how old the linearisation it solved along was (its start state's
        # stamp to the state's), beside each linearisation's compute time (submit to result, worker included)
        self.state_age = C.RollingStats(2000)
        self.lin_age = C.RollingStats(2000)
        self.lin_time = C.RollingStats(2000)
        self.lin_worker = C.RollingStats(2000)   # of which the worker's own compute (the rest: transfer, tables)
        self.holds = Counter()     # held cycles by cause: linearization (too old), node_states (stale), failed
        self.cycles = 0
        self.plate_error = (math.nan, math.nan)

        # serialised, decoded with numpy (nodes/cdr.py), and only the newest node state: a cycle uses the latest
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._on_states, C.LATEST_QOS, raw=True, info=False)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._on_motors, C.SENSOR_READER_QOS, raw=True,
                       info=False)
        self.subscribe(IdentifiedParameters, C.TOPICS["identified_parameters"], self._on_params, C.LATCHED_QOS,
                       info=False)
        from geometry_msgs.msg import PoseArray
        self.subscribe(PoseStamped, "/tensegrity/plate_target", self._on_target, 10, info=False)
        self.subscribe(PoseArray, "/tensegrity/plate_target_trajectory", self._on_trajectory, 10, info=False)
        try:
            from trajectory_msgs.msg import JointTrajectory
            self._plan_cls = JointTrajectory
        except ImportError:
            self._plan_cls = JointState
        self.pub = self.counting_publisher(self._plan_cls, C.TOPICS["motor_plan"], 10)
        # the linearisation is on the control path: a linearisation older than nominal_margin_s holds the plate.
        # worker_nice: below the demo's callbacks (-10), above the predictor's worker during control: why in
        # config/nodes/plate_controller.yaml
        nice = p["worker_nice"] if p["worker"] == "process" else 0
        self._pool = C.make_worker(p["worker"], C.worker_init, (p["torch_threads"], nice))
        self._key = id(self)
        self._pool.submit(core_job, self._key, self.structure, self.core_options).result()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._linearizer, name="plate-controller-linearizer", daemon=True)
        self._thread.start()
        self.every(p["control_period_s"], self._cycle)
        self.every(p["diagnostics_period_s"], self._diagnostics)

    # ---- inputs -----------------------------------------------------------------------------------------
    def _on_states(self, data: bytes) -> None:
        rec = C.node_states_from_cdr(data)
        with self._lock:
            self._state = rec
        self._wake.set()

    def _on_motors(self, data: bytes) -> None:
        r = C.joint_state_from_cdr(data)
        idx = {n: i for i, n in enumerate(r.names)}
        if all(n in idx for n in self.motor_names):
            self._angles = np.array([r.position[idx[n]] for n in self.motor_names])

    def _on_params(self, msg) -> None:
        ps = C.parameter_set_from_msg(msg)
        known = set(self.values)
        with self._lock:
            self.values.update({n: float(v) for n, v in zip(ps.names, ps.values) if n in known})
            self.set_id = ps.set_id

    def _on_target(self, msg) -> None:
        o, q = msg.pose.position, msg.pose.orientation
        present = self._present()
        y, why = target_from_pose((o.x, o.y, o.z), (q.x, q.y, q.z, q.w), msg.header.frame_id, present,
                                  self.p["target_frame"], self.p["max_target_offset_m"], self.p["max_target_angle_rad"])
        if y is None:
            self.rejected += 1
            self.target_reason = f"rejected: {why}"
            self.get_logger().warn(f"plate target {self.target_reason}", throttle_duration_sec=2.0)
            return
        self.target, self.trajectory, self.target_reason = y, None, "accepted"

    def _on_trajectory(self, msg) -> None:
        poses = list(msg.poses)
        traj, why = trajectory_from_poses(
            C.stamp_to_sec(msg.header.stamp), self.p["target_trajectory_dt"],
            [(q.position.x, q.position.y, q.position.z) for q in poses],
            [(q.orientation.x, q.orientation.y, q.orientation.z, q.orientation.w) for q in poses],
            msg.header.frame_id, self.now_s(), self._present(), self.p["target_frame"],
            self.p["max_target_offset_m"], self.p["max_target_angle_rad"])
        if traj is None:
            self.rejected += 1
            self.target_reason = f"rejected: {why}"
            self.get_logger().warn(f"plate target trajectory {self.target_reason}", throttle_duration_sec=2.0)
            return
        self.trajectory, self.target, self.target_reason = traj, None, "accepted (trajectory)"

    def on_parameter_change(self, name, value):
        if name == "model" and value != self.p["model"]:
            self.mpc.reset()              # the disturbance estimate and warm start belong to the other model
            self._lin = None              # and so does the linearisation: hold until one with the new model
            self._wake.set()
        return None

    def _present(self) -> Optional[np.ndarray]:
        st = self._state
        if st is None:
            return None
        x = self.core.measured_state(st.names, st.positions, st.velocities, st.valid)
        return self.output.value(x) if np.all(np.isfinite(x[:x.size // 2])) else None

    def _command_now(self, t: float) -> Optional[np.ndarray]:
        """The angles commanded now: the last plan at t, else the measured angles."""
        if self._plan is not None:
            return self._plan.at([t], self.motor_names, self._angles if self._angles is not None
                                 else np.zeros(len(self.motor_names)))[0]
        return self._angles

    # ---- the linearisation (background thread, worker) ----------------------------------------------------------
    def _linearizer(self) -> None:
        started = -math.inf
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            # at most one linearisation per relinearize_period_s; its nominal (nominal_margin_s beyond the
            # horizon) serves the cycles in between (a model switch clears _lin: then at once)
            if self._lin is not None and self._stop.wait(max(0.0, started + self.p["relinearize_period_s"]
                                                                 - time.monotonic())):
                break
            started = time.monotonic()
            with self._lock:
                st, values, set_id = self._state, dict(self.values), self.set_id
            model = self.p["model"]
            if model == "nominal":
                values, set_id = dict(self.nominal_values), "nominal"
            u0 = None if st is None else self._command_now(st.stamp)
            if st is None or u0 is None or (self.target is None and self.trajectory is None):
                continue              # nothing to control (yet): no linearisation, the worker's core stays free
            # the message's nodes (any order, some occluded) -> all structure nodes, as the predictor does:
            # unseen free nodes from the current nominal, else the file pose; dependent nodes from the free ones
            core, lin = self.core, self._lin
            x = core.measured_state(st.names, st.positions, st.velocities, st.valid)
            if lin is not None and core.covers(lin, st.stamp, 0, extended=True):
                x = np.where(np.isfinite(x), x, lin.xe[min(int(round((st.stamp - lin.t0) / lin.dt)),
                                                           lin.xe.shape[0] - 1)])
            q, v = core.split(x)
            P = core.full_positions(np.where(np.isfinite(q), q, core.X0[core.free]))
            V = core.full_velocities(np.where(np.isfinite(v), v, 0.0))
            times = st.stamp + core.dt * np.arange(self.lin_steps + 1)
            u = self._plan.at(times, self.motor_names, u0) if self._plan is not None else \
                np.repeat(u0[None], times.size, 0)
            try:
                t_start = time.perf_counter()
                lin = self._pool.submit(relinearize_job, self._key, self.structure, self.core_options, values,
                                        st.stamp, P, V, u, self.lin_steps, set_id).result()
                if self.p["model"] != model:        # the model changed meanwhile: this one is of the old
                    continue
                # a late next linearisation: continue this one with its frozen last-step model (bounded, see
                # Linearization.expand) rather than hold; the float32 per-message table is the predictor's, not
                # built here
                lin.extend(self.ext_steps).tabulate_steps()    # the per-step tables, here and not in a cycle
                self._lin = lin
                self.lin_time.add(time.perf_counter() - t_start)
                self.lin_worker.add(lin.compute_s)
            except Exception as e:  # noqa: BLE001 - a failed linearisation makes the next cycles stale, said so
                self.get_logger().error(f"linearisation failed: {e}", throttle_duration_sec=5.0)

    # ---- the cycle ----------------------------------------------------------------------------------------
    def _cycle(self) -> None:
        st, lin, target, traj = self._state, self._lin, self.target, self.trajectory
        if st is None or (target is None and traj is None):
            return
        now = self.now_s()
        u_now = self._command_now(now)
        if u_now is None:
            return
        dt = self.core.dt
        applied = None
        i0 = int(round((st.stamp - lin.t0) / dt)) if lin is not None else -1
        if lin is None or i0 < 0 or i0 + self.N > lin.steps + lin.ext_steps:
            why = "no linearisation yet" if lin is None else \
                f"the latest linearisation ({st.stamp - lin.t0:.2f} s old) does not cover the horizon"
            res = self.mpc.hold(u_now, dt, Status.STALE, why + ": holding")
            self.holds["linearization"] += 1
        else:
            x = self.core.measured_state(st.names, st.positions, st.velocities, st.valid)
            A, B = lin.step_jacobians(i0, self.N)
            if traj is not None:                    # the target at the horizon's steps (k dt after the state)
                target = traj.sample(st.stamp + dt * np.arange(self.N + 1))
            elapsed = st.stamp - self._last_stamp if self._last_stamp is not None else 0.0
            if self.p["keep_applied"] and self._plan is not None:
                # the plan starts at the state's stamp, but the driver follows the previous plan until this one
                # arrives (now + plan_latency_s): those commands are fixed, the new plan ramps on from them
                k = min(max(int(math.ceil((now - st.stamp + self.p["plan_latency_s"]) / dt - 1e-9)), 0), self.N - 1)
                if k > 0:
                    applied = self._plan.at_grid(st.stamp, dt, k + 1, self.motor_names, u_now)
            res = self.mpc.solve(x, lin.xe[i0:], lin.ue[i0:], A, B, target, u_now, dt, age_s=now - st.stamp,
                                 elapsed_s=max(elapsed, 0.0), u_applied=applied)
            self._last_stamp = st.stamp
            if res.ok:                 # a computed plan (a stale or failed answer returns before the QP: no solve)
                self.solve.add(res.solve_s)
                self.state_age.add(now - st.stamp)
                self.lin_age.add(st.stamp - lin.t0)
            else:
                self.holds["node_states" if res.status is Status.STALE else res.status.value] += 1
        self.last, self.cycles = res, self.cycles + 1
        if res.error_now is not None:
            self.plate_error = (float(np.linalg.norm(res.error_now[:3])), float(np.abs(res.error_now[3:6]).max()))
        t_first = (st.stamp if res.ok else now) + dt     # step_plan[k]: the angle at t_first + k dt
        # kept with its start for _command_now: where the ramp begins at t_first - dt, the present command, or
        # with the applied commands (keep_applied) the one at the state's stamp: with u_now there, the kept plan
        # jumped by the state's age times the motors' speed in its first step
        start = applied[0] if res.ok and applied is not None else u_now
        self._plan = MotorPlan.on_grid(t_first - dt, dt, self.motor_names, np.vstack([start[None], res.step_plan]),
                                       now)
        self.pub.publish(self._plan_msg(t_first, res.step_plan))

    def _plan_msg(self, t0: float, angles: np.ndarray):
        msg = self._plan_cls()
        msg.header.stamp = C.sec_to_stamp(t0)
        if self._plan_cls.__name__ == "JointState":
            msg.name = list(self.motor_names)
            msg.position = angles.reshape(-1).tolist()
            return msg
        from builtin_interfaces.msg import Duration  # pragma: no cover - needs trajectory_msgs
        from trajectory_msgs.msg import JointTrajectoryPoint
        msg.joint_names = list(self.motor_names)
        for k, a in enumerate(angles):
            s = k * self.core.dt
            msg.points.append(JointTrajectoryPoint(positions=a.tolist(), time_from_start=Duration(
                sec=int(s), nanosec=int(round((s - int(s)) * 1e9)))))
        return msg

    def _diagnostics(self) -> None:
        r = self.last
        status = "waiting" if r is None else r.status.value
        level = "ok" if status in ("solved", "waiting") else "warn"
        vals = {"status": status, "reason": "" if r is None else r.message, "target": self.target_reason,
                "targets_rejected": self.rejected, "cycles": self.cycles, "plans_published": self.pub.count,
                "parameter_set_id": self.set_id if self.p["model"] == "identified" else "nominal (model: nominal)",
                "plate_error_mm": self.plate_error[0] * 1e3,
                "plate_error_deg": math.degrees(self.plate_error[1]),
                "limits_active": 0 if r is None else r.active_limits,
                **{f"holds_{cause}": n for cause, n in sorted(self.holds.items())}}
        vals.update(self.solve.summary(1e3, "solve_ms_"))
        vals.update(self.lin_time.summary(1e3, "linearize_ms_"))
        vals.update(self.lin_worker.summary(1e3, "linearize_worker_ms_"))
        vals.update(self.lin_age.summary(1e3, "linearization_age_ms_"))
        vals.update(self.state_age.summary(1e3, "state_age_ms_"))
        self.publish_diagnostics([C.diag_status(self.get_name(), level, f"{status}; target {self.target_reason}",
                                                vals)])

    def destroy_node(self):
        self._stop.set()
        self._wake.set()
        C.stop_worker(self._pool)
        return super().destroy_node()


def main(argv=None) -> int:  # pragma: no cover - entry point
    return C.run_node(PlateControllerNode, argv)
