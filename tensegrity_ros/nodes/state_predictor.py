"""``state_predictor``: at every node-state message, the next ``horizon_s`` of node positions and velocities
for a controller, from the latest identified parameters and the commanded motor trajectory.

The algorithm is :mod:`tensegrity_ros.predict` (no rclpy): a background thread has a worker compute a nominal
rollout and its step Jacobians (:func:`~tensegrity_ros.predict.jobs.relinearize_job`,
:class:`~tensegrity_ros.predict.horizon.HorizonPredictor`; p50 < 5 ms per 1-s prediction on CPU),
:class:`~tensegrity_ros.predict.stream.PredictionStream` decides when and gives each message its prediction,
and :class:`~tensegrity_ros.predict.motor_future.MotorFuture` is the future motor trajectory (``motor_source``:
auto | plan | reference | hold). This node converts the messages and publishes the prediction as pre-serialised
CDR (:func:`~._common.prediction_to_cdr`). The moved names stay importable from here.

Topics: subscribes ``/tensegrity/node_states``, ``/tensegrity/motor_states``,
``/tensegrity/identified_parameters``, ``/tensegrity/motor_plan``; publishes ``/tensegrity/predicted_states``
(PredictedStates: step k at header.stamp + k dt, k = 0..K-1, header.stamp = node-state stamp + dt) and
diagnostics (latency node-state reception -> publish p50/p99, relinearisation time, motor source,
predictions along the extension, skipped messages).
Service ``~/get_linearization`` (GetLinearization): A_k, B_k along the latest predicted horizon, in the
deviation form dx[k+1] = A[k] dx[k] + B[k] du[k] about the nominal (:mod:`tensegrity_ros.predict.horizon`);
states = the independent nodes' positions then velocities, inputs = motor angles.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..model import load_structure
from ..predict import RealizedError
from ..predict.horizon import HorizonPredictor, Linearization  # noqa: F401 (Linearization: re-exported)
from ..predict.jobs import core_job, relinearize_job
from ..predict.motor_future import MotorFuture, MotorPlan, ReferenceTracker
from ..predict.stream import PredictionStream
from . import _common as C
from .tables.state_predictor import PARAMS


@dataclass
class PredictorFigures:
    """What a run's summary and health read from the state predictor, wherever it runs: taken from the node in
    this process, or pickled by value from the predictor's own process (``bringup.GraphConfig.predictor_process``).
    Statistics in seconds; counts since the start."""

    latency: C.RollingStats         # node-state reception -> prediction publication
    compute: C.RollingStats         # callback entry -> publication
    lin_time: C.RollingStats        # relinearisation wall time
    realized: RealizedError         # each scored prediction against the node states that came later
    seq: C.SequenceMonitor          # the predictor's inputs: received and dropped per topic
    published: int                  # predictions published
    due: int                        # node-state messages due a prediction
    skipped_uncovered: int          # due, but no nominal covered the stamp
    extended: int                   # published from a nominal extended past its horizon
    capped: int                     # correction held at its bound (far-off linearisation)
    dt: float                       # horizon step, s

    def predictions_per_node_state(self) -> float:
        """Predictions published per node-state message due one; NaN before any was due."""
        return self.published / self.due if self.due else math.nan


#: the predictions the 1-Hz diagnostics summarise (~10 s at 120 Hz): the callback runs in the executor's thread, so it
#: reads the newest samples only (the run's figures, for the demo's summary and health, read ``latency`` whole)
DIAGNOSTICS_SAMPLES = 1200


class StatePredictorNode(C.GraphNode):
    DEFAULT_NAME = "state_predictor"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        import torch
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates
        from tensegrity_ros.srv import GetLinearization

        p = self.p
        torch.set_num_threads(p["torch_threads"])
        self.structure = load_structure(p["model_file"])
        self.core_options = {"dt": p["dt"], "substeps": p["substeps"], "integrator": p["integrator"],
                             "nominal": p["nominal"], "jac_stride": p["jac_stride"]}
        self.core = HorizonPredictor(self.structure, **self.core_options)
        self.steps = max(1, int(round(p["horizon_s"] / p["dt"])))
        self.params = self.core.engine.default_params()
        self.set_id = "nominal"
        self._params_version = 0
        tracker = None
        if p["reference_file"]:
            from ..references import load_reference
            ref = load_reference(p["reference_file"], self.structure.actuators)
            tracker = ReferenceTracker.from_reference(ref, self.structure.actuators, self.core.actuator_names)
        if p["motor_source"] == "reference" and tracker is None:
            raise C.ParameterError("motor_source 'reference' needs reference_file")
        self.future = MotorFuture(self.core.actuator_names, p["motor_source"], tracker, p["plan_timeout_s"])

        self.stream = PredictionStream(self.core, self.steps, p["relinearize_period_s"], p["relinearize_max_age_s"],
                                       p["relinearize_deviation_m"], p["nominal_margin_s"],
                                       p["extend_max_s"])
        self._k_dt = self.core.dt * np.arange(self.steps)
        # each prediction scored against the node states that arrive later (predict/realized.py)
        self.realized = RealizedError(self.steps, self.core.dt, p["realized_memory_s"])
        self._lock = threading.Lock()
        self._latest = None              # latest node-state record
        self._last_i0 = 0
        self._last_pred_t = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._msg_count = 0
        self.due = 0                     # node-state messages due a prediction once the first nominal exists
        self.seq = C.SequenceMonitor()
        self.latency = C.RollingStats(20000)      # reception -> publish, s
        self.compute = C.RollingStats(20000)      # callback entry -> publish, s
        self.lin_time = C.RollingStats(200)
        self.lin_failures = 0
        self.last_error = ""
        self.output_names: Optional[Tuple[str, ...]] = tuple(p["output_nodes"]) or None
        bad = [n for n in (self.output_names or ()) if n not in self.core.node_names]
        if bad:
            raise C.ParameterError(f"output_nodes {bad} are not nodes of {self.structure.name}")

        self.pub = self.counting_publisher(PredictedStates, C.TOPICS["predicted_states"], C.PREDICTION_QOS)
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._on_node_states, C.STREAM_QOS, raw=True)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._on_motor_states, C.SENSOR_READER_QOS, raw=True)
        self.subscribe(IdentifiedParameters, C.TOPICS["identified_parameters"], self._on_parameters, C.LATCHED_QOS,
                       info=False)
        self._plan_type = "JointState"
        try:
            from trajectory_msgs.msg import JointTrajectory
            self.subscribe(JointTrajectory, C.TOPICS["motor_plan"], self._on_trajectory_plan, 10, info=False)
            self._plan_type = "JointTrajectory"
        except ImportError:
            self.subscribe(JointState, C.TOPICS["motor_plan"], self._on_joint_state_plan, 10, info=False)
        self.srv = self.create_service(GetLinearization, "~/get_linearization", self._on_get_linearization)
        self.timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        self._pool = C.make_worker(p["worker"], C.worker_init,
                                   (p["torch_threads"], p["worker_nice"] if p["worker"] == "process" else 0))
        self._key = id(self)
        self.worker_pid = self._pool.submit(core_job, self._key, self.structure, self.core_options).result()
        self._thread = threading.Thread(target=self._linearizer, name="state-predictor-linearizer", daemon=True)
        self._thread.start()

    # ---- inputs -------------------------------------------------------------------------------------------
    #: run-time settable parameters -> the PredictionStream attribute each one sets
    _STREAM_PARAMS = {"relinearize_period_s": "period_s", "relinearize_max_age_s": "max_age_s",
                      "relinearize_deviation_m": "deviation_m"}

    def on_parameter_change(self, name, value):
        if name in self._STREAM_PARAMS:       # read by the background thread at its next decision
            setattr(self.stream, self._STREAM_PARAMS[name], float(value))
        return None

    def _on_motor_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["motor_states"], info)
        r = C.joint_state_from_cdr(data)
        self.future.observe(r.stamp, r.names, r.position)

    def _on_parameters(self, msg) -> None:
        try:
            ps = C.parameter_set_from_msg(msg)
            params = C.params_with_set(self.core.engine.default_params(), ps)
        except (ValueError, RuntimeError) as e:
            self.get_logger().error(f"identified parameters not usable: {e}")
            return
        with self._lock:
            self.params, self.set_id = params, ps.set_id
            self._params_version += 1
        self._wake.set()

    def _on_joint_state_plan(self, msg) -> None:
        try:
            plan = MotorPlan.from_flat(C.stamp_to_sec(msg.header.stamp), self.p["plan_dt"], msg.name, msg.position,
                                       self.now_s())
        except ValueError as e:
            self.get_logger().warn(f"motor plan: {e}", throttle_duration_sec=5.0)
            return
        self._set_plan(plan)

    def _on_trajectory_plan(self, msg) -> None:  # pragma: no cover - needs trajectory_msgs
        t0 = C.stamp_to_sec(msg.header.stamp)
        times = np.array([t0 + p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points])
        angles = np.array([list(p.positions) for p in msg.points], dtype=float)
        if times.size == 0 or angles.shape[1] != len(msg.joint_names):
            return
        self._set_plan(MotorPlan(times, tuple(msg.joint_names), angles, self.now_s()))

    def _set_plan(self, plan: MotorPlan) -> None:
        self.future.set_plan(plan)
        self._wake.set()

    # ---- the nominal (background thread) -------------------------------------------------------------------
    @property
    def predictions(self) -> int:
        return self.stream.predictions

    @property
    def skipped_uncovered(self) -> int:
        return self.stream.skipped_uncovered

    def predictions_per_node_state(self) -> float:
        """Predictions published per node-state message due one (every ``publish_every``-th with valid nodes,
        from the first nominal on); NaN before any was due."""
        return self.figures().predictions_per_node_state()

    def figures(self) -> PredictorFigures:
        """This node's figures (:class:`PredictorFigures`; the live statistics objects, not copies)."""
        return PredictorFigures(self.latency, self.compute, self.lin_time, self.realized, self.seq,
                                int(self.pub.count), int(self.due), int(self.skipped_uncovered),
                                int(self.stream.extended), int(self.core.capped), float(self.core.dt))

    def _linearizer(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.02)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._lock:
                rec = self._latest
                params, set_id, pv = self.params, self.set_id, self._params_version
            if rec is None:
                continue
            now = time.monotonic()
            version = (pv, self.future.relinearize_key)
            if not self.stream.wants_relinearization(rec.stamp, now, version):
                continue
            self.stream.started(now, version)
            try:
                self._relinearize(rec, params, set_id)
            except Exception as e:   # keep predicting with the previous nominal; say why
                if self._stop.is_set():   # the worker was shut down under a running relinearisation
                    break
                self.lin_failures += 1
                self.last_error = f"relinearisation failed: {type(e).__name__}: {e}"
                self.get_logger().error(self.last_error, throttle_duration_sec=5.0)

    def _relinearize(self, rec, params, set_id: str) -> None:
        core = self.core
        self.future.update()
        t0 = rec.stamp
        P, V = self.stream.nominal_start(t0, rec.names, rec.positions, rec.velocities, rec.valid)
        K = self.stream.nominal_steps()
        u = self.future.angles(t0 + core.dt * np.arange(K + 1)) if core.n_u else None
        if core.n_u and u is None:
            return   # no motor state yet
        t_start = time.perf_counter()
        values = {n: float(v) for n, v in params.named().items()}
        new = self._pool.submit(relinearize_job, self._key, self.structure, self.core_options, values, t0, P, V, u,
                                K, set_id).result()
        wall = time.perf_counter() - t_start
        self.stream.install(new, wall)   # interpolated and extended here, before the callbacks use it
        self.lin_time.add(wall)

    # ---- per message ---------------------------------------------------------------------------------------
    def _on_node_states(self, data: bytes, info=None) -> None:
        t_in = time.perf_counter()
        t_rx_ns = time.time_ns()
        if info is not None and info.get("received_timestamp"):
            t_rx_ns = int(info["received_timestamp"])
        self.seq.update_info(C.TOPICS["node_states"], info)
        rec = C.node_states_from_cdr(data)
        # every message: subsampled in step with the scored predictions, some horizon steps were never scored
        self.realized.add_measurement(rec.stamp, rec.names, rec.positions, rec.valid)
        with self._lock:
            first = self._latest is None
            self._latest = rec
        if first:
            self._wake.set()
        self._msg_count += 1
        if (self._msg_count - 1) % self.p["publish_every"]:
            return
        if self.stream.lin is None or not rec.valid.any():
            return
        self.due += 1                    # a message that should get a prediction (health: predictions per due)
        core = self.core
        x = core.measured_state(rec.names, rec.positions, rec.velocities, rec.valid)
        u_future = self.future.angles(rec.stamp + self._k_dt) if core.n_u else None
        res = self.stream.predict(rec.stamp, x, u_future)
        if res is None or res[4]:
            self._wake.set()             # late nominal: make sure the background thread looks now
        if res is None:
            return
        q, v, i0, lin, _ = res
        out_names, T_out, Xc_out = core.output_rows(self.output_names or rec.names)
        P = np.matmul(T_out, q)
        P += Xc_out
        pred = C.Prediction(rec.stamp + core.dt, core.dt, out_names, P, np.matmul(T_out, v), lin.set_id,
                            rec.frame_id or "structure", self.realized.per_step())
        self.pub.publish(C.prediction_to_cdr(pred))
        if self.stream.predictions % self.p["realized_every"] == 0:
            self.realized.add_prediction(pred.stamp, out_names, P)
        self._last_i0, self._last_pred_t, self._last_lin = i0, rec.stamp, lin
        self.compute.add(time.perf_counter() - t_in)
        self.latency.add((time.time_ns() - t_rx_ns) * 1e-9)

    # ---- service -------------------------------------------------------------------------------------------
    def _on_get_linearization(self, request, response):
        lin = getattr(self, "_last_lin", None)
        if lin is None:
            response.success, response.message = False, "no prediction yet (waiting for node states / motor states)"
            return response
        i0 = self._last_i0
        K = self.steps if request.max_steps == 0 else min(int(request.max_steps), self.steps)
        A, B = lin.step_jacobians(i0, K)
        response.success = True
        response.message = (f"deviation form about the nominal of set {lin.set_id!r} from t = {self._last_pred_t:.3f} s: "
                            "dx[k+1] = A[k] dx[k] + B[k] du[k]")
        response.horizon_steps = int(A.shape[0])
        response.state_dim, response.input_dim = self.core.n, self.core.n_u
        response.dt = lin.dt
        response.a_matrices = A.reshape(-1).tolist()
        response.b_matrices = B.reshape(-1).tolist()
        response.state_names = list(self.core.state_names)
        response.input_names = list(self.core.input_names)
        return response

    # ---- diagnostics -------------------------------------------------------------------------------------
    def _diagnostics(self) -> None:
        vals: Dict[str, object] = {"predictions": self.predictions, "parameter_set_id": self.set_id,
                                   "horizon_steps": self.steps, "dt_s": self.core.dt,
                                   "motor_source": self.future.active, "plan_type": self._plan_type,
                                   "input_dropped": self.seq.total_dropped,
                                   "skipped_uncovered": self.skipped_uncovered,
                                   "predictions_extended": self.stream.extended,
                                   "predictions_capped": self.core.capped,
                                   "last_prediction_extended": self.stream.last_extended,
                                   "nominal_steps": self.stream.nominal_steps(),
                                   "relinearize_failures": self.lin_failures}
        lat = self.latency.summary(1e3, "latency_ms_", last=DIAGNOSTICS_SAMPLES)
        vals.update(lat)
        vals.update(self.compute.summary(1e3, "compute_ms_", last=DIAGNOSTICS_SAMPLES))
        vals.update(self.lin_time.summary(1e3, "relinearize_ms_"))
        for ahead in (0.1, 0.5, self.steps * self.core.dt):   # what the predictions turned out to be worth
            vals[f"realized_error_mm_at_{ahead:.2g}s"] = self.realized.at(ahead) * 1e3
        vals["realized_scored"] = self.realized.scored
        tr = self.future.tracker
        if tr is not None:
            vals["reference_locked"] = tr.locked
            vals["reference_residual_rad"] = tr.residual_rad
        if self.predictions == 0:
            level, message = "warn", self.last_error or "waiting for node states and motor states"
        elif self.lin_failures and self.last_error:
            level, message = "warn", self.last_error
        else:
            level, message = "ok", (f"latency p50 {lat['latency_ms_p50']:.2f} ms, p99 {lat['latency_ms_p99']:.2f} ms "
                                    f"(the last {DIAGNOSTICS_SAMPLES} predictions)")
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: state predictor", level, message, vals,
                                                self.structure.name)])

    def destroy_node(self):
        self._stop.set()
        self._wake.set()
        C.stop_worker(self._pool)       # settles a relinearisation in flight (WorkerStopped): the thread ends
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        return super().destroy_node()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(StatePredictorNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
