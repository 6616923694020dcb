"""``online_identifier``: keeps the model identified while the robot moves.

Subscribes ``/tensegrity/node_states`` and ``/tensegrity/motor_states`` into a sliding window (default
10 s). A timer (default 1 Hz) hands the window to a worker thread (callbacks never block; a tick while the
worker is busy is skipped and counted; an update that outlasts the period is followed by the next at once), which
runs :func:`tensegrity_ros.ident.identify`: stage 1 (closed-form
regression) and a few stage-2 iterations (multiple shooting through the engine), warm-started from the last
good set, on the GPU when present (``device: auto``). The result goes through
:func:`~tensegrity_ros.ident.online.decide`: a set with NaN, a residual jump against the recent accepted sets,
or a parameter outside its bounds is NOT published; the last good set stays active and diagnostics say why.
:class:`~tensegrity_ros.ident.online.DriftDetector` raises a WARN naming the strings whose parameters moved when
the residuals grow on a stable set. The algorithm (window, fit job, decision, drift) is
:mod:`tensegrity_ros.ident.online` (no rclpy); its names stay importable from here.

Publishes ``/tensegrity/identified_parameters`` (IdentifiedParameters, latched: the nominal set at start,
then every accepted set) and diagnostics. Services ``~/save_parameters`` (SaveParameters: a structure YAML
with the identified values and standard deviations, via ``engine.apply_to_structure`` +
``model.dump_structure``) and ``~/load_parameters`` (LoadParameters: a structure YAML becomes the active set).
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..ident.online import (NESTED_KINDS, AcceptConfig, ActiveSet, Candidate,  # noqa: F401
                            Decision, DriftDetector, FitResult, SlidingWindow, accept_config, decide,
                            fit_window, held_out_improvement, held_out_mse, parameter_bounds, update_options)
from ..model import Structure, load_structure
from . import _common as C
from .tables.online_identifier import PARAMS


class OnlineIdentifierNode(C.GraphNode):
    DEFAULT_NAME = "online_identifier"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates
        from tensegrity_ros.srv import LoadParameters, SaveParameters
        from ..engine import params_from_structure

        p = self.p
        self.structure: Structure = load_structure(p["model_file"])
        self.nominal_params = params_from_structure(self.structure)
        self.nominal = {n: float(v) for n, v in self.nominal_params.named().items()}
        self.window = SlidingWindow(self.structure.node_names, [a.name for a in self.structure.actuators],
                                    p["window_s"])
        self.drift = DriftDetector([s.name for s in self.structure.strings], p["drift_ratio"], p["drift_window"])
        self._lock = threading.Lock()
        self._counter = 0
        self.active = ActiveSet(self.nominal_params, self._record(self.nominal_params, {}, {}, math.nan, (0.0, 0.0),
                                                                  False, "nominal (not identified yet)", "nominal"))
        self.accepted_residuals: List[float] = []
        self.seq = C.SequenceMonitor()
        self.update_time = C.RollingStats(500)
        self.update_ends: Deque[float] = deque(maxlen=2000)   # monotonic s at the end of each finished update
        self.stats = {"updates": 0, "accepted": 0, "rejected": 0, "skipped_busy": 0, "skipped_duty": 0,
                      "skipped_short": 0, "skipped_no_new_data": 0}
        self._fitted_appended = -1     # SlidingWindow.appended when the last update took its snapshot
        self._last_update_s, self._last_update_end = 0.0, -math.inf
        self.last_decision: Optional[Decision] = None
        self.last_candidate: Optional[Candidate] = None
        self.last_window = (0.0, 0.0)
        self.last_samples = 0
        self.last_error = ""
        self.last_timings: Dict[str, float] = {}
        self.history: List[Tuple[float, str, Dict[str, float], float, bool]] = []   # (t, id, values, residual, accepted)
        self._pool = C.make_worker(p["worker"], C.worker_init,
                                   (p["torch_threads"], p["worker_nice"] if p["worker"] == "process" else 0))
        self.worker_pid = self._pool.submit(C.worker_pid).result()   # start it (imports) before data flows
        # the update in flight: a daemon thread that waits on the worker (never blocks the interpreter's exit;
        # the worker's future always settles, see tensegrity_ros.workers)
        self._updating: Optional[threading.Thread] = None
        self._closing = False

        self.pub = self.counting_publisher(IdentifiedParameters, C.TOPICS["identified_parameters"], C.LATCHED_QOS)
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._on_node_states, C.STREAM_QOS, raw=True)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._on_motor_states, C.SENSOR_READER_QOS, raw=True)
        self.create_service(SaveParameters, "~/save_parameters", self._on_save)
        self.create_service(LoadParameters, "~/load_parameters", self._on_load)
        self.timer = self.every(p["update_period_s"], self._on_timer)
        self.diag_timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        if p["publish_nominal"]:
            self.pub.publish(C.parameter_set_to_msg(self.active.record))

    # ---- parameters at run time --------------------------------------------------------------------------
    def on_parameter_change(self, name, value):
        if name == "window_s":
            self.window.window_s = float(value)
        return None

    def accept_config(self) -> AcceptConfig:
        return accept_config(self.p)

    # ---- inputs ---------------------------------------------------------------------------------------
    def _on_node_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["node_states"], info)
        r = C.node_states_from_cdr(data)
        self.window.add_nodes(r.stamp, r.names, r.positions, r.valid)

    def _on_motor_states(self, data: bytes, info=None) -> None:
        self.seq.update_info(C.TOPICS["motor_states"], info)
        r = C.joint_state_from_cdr(data)
        self.window.add_motors(r.stamp, r.names, r.position)

    # ---- updates ----------------------------------------------------------------------------------------
    def _on_timer(self) -> None:
        if self._updating is not None and self._updating.is_alive():
            self.stats["skipped_busy"] += 1
            return
        # duty cycle: after an update that took T, rest T (1/duty - 1) so the worker leaves CPU to the rest
        rest = self._last_update_s * (1.0 / self.p["max_duty"] - 1.0)
        if time.monotonic() - self._last_update_end < rest:
            self.stats["skipped_duty"] += 1
            return
        # no node state since the last update's snapshot (the robot stopped, mocap lost the markers, the run ended):
        # the same window would give the same fit; refitting it only took the CPU from the rest of the graph (the
        # demo's identifier refitted its last window 5 times, ~30 s, while the demo wrote its report)
        appended = self.window.appended
        if appended == self._fitted_appended:
            self.stats["skipped_no_new_data"] += 1
            return
        if self._closing:
            return
        # the window is copied in the update's thread, not here in the executor's: stacking 10 s of node states and
        # resampling the motor angles blocked every other callback of the graph for up to 52 ms (the demo, measured)
        self._updating = threading.Thread(target=self._update, args=(appended,), name="online-identifier-update",
                                          daemon=True)
        self._updating.start()

    def run_update(self, times, positions, valid, motors, timeout: Optional[float] = None):
        """One identification over the given window, in the worker; returns (candidate, params or None)."""
        fut = self._submit(times, positions, valid, motors)
        return self._collect(fut.result(timeout=timeout))

    def _submit(self, times, positions, valid, motors) -> Future:
        stages, options = update_options(self.p, self.nominal_params, first=self.stats["accepted"] == 0)
        with self._lock:
            prior = {n: float(v) for n, v in self.active.params.named().items()}
        p = self.p
        return self._pool.submit(fit_window, self.structure, times, positions, valid, motors, prior, stages,
                                 options, p["holdout_s"], p["holdout_window_s"], p["holdout_windows"],
                                 accept_config(p))

    def _collect(self, out: FitResult):
        cand = out.candidate()
        self.last_timings = dict(out.timings)
        params = None
        if out.values:
            try:
                params = self.nominal_params.with_values(out.values)
            except (ValueError, RuntimeError) as e:
                cand = Candidate({}, ok=False, error=f"{type(e).__name__}: {e}")
        return cand, params

    def _update(self, appended: int) -> None:
        """Updates back to back while each takes longer than the timer's period: the next one starts as the last
        ends instead of at the next tick (the worker sat idle for half a period on average between updates; in 3
        demos each way the update period was not told apart at the 2-core machine's spread, 2.85-4.25 s p50).
        A duty cycle below 1, no new data or a shutdown hand back to the timer."""
        while True:
            started = time.monotonic()
            self._update_once(appended)
            appended = self.window.appended
            if (self._closing or self.p["max_duty"] < 1.0 or appended == self._fitted_appended
                    or time.monotonic() - started < self.p["update_period_s"]):
                return

    def _update_once(self, appended: int) -> None:
        snap = self.window.snapshot(self.p["min_window_s"])
        if snap is None:
            self.stats["skipped_short"] += 1
            return
        self._fitted_appended = appended
        times, P, V, U = snap
        t0 = time.perf_counter()
        try:
            out = self._submit(times, P, V, U).result()
            cand, params = self._collect(out)
        except Exception as e:   # the worker died or refused: keep the last good set
            if self._closing:    # the node is shutting the worker down mid-update: nothing to decide
                return
            cand, params = Candidate({}, ok=False, error=f"{type(e).__name__}: {e}"), None
        self._last_update_s = time.perf_counter() - t0
        self._last_update_end = time.monotonic()
        self.update_ends.append(self._last_update_end)
        self.update_time.add(self._last_update_s)
        self.consider(cand, params, (float(times[0]), float(times[-1])), len(times))

    def consider(self, cand: Candidate, params, window: Tuple[float, float], samples: int = 0) -> Decision:
        """Decide on a fit, publish it if accepted, update drift and diagnostics state."""
        with self._lock:
            dec = decide(cand, self.nominal, self.accepted_residuals, self.accept_config())
            self.stats["updates"] += 1
            self.last_decision, self.last_candidate = dec, cand
            self.last_window, self.last_samples = window, samples
            if dec.accept:
                self._counter += 1
                set_id = f"{self.get_name()}-{self._counter}"
                rec = self._record(params, cand.std_devs, cand.identifiability, cand.residual_m, window, cand.converged,
                                   "; ".join(x for x in ("accepted", cand.model_check_line) if x), set_id)
                self.active = ActiveSet(params, rec)
                self.accepted_residuals.append(cand.residual_m)
                self.stats["accepted"] += 1
                self.drift.set_active(rec.as_dict())
            else:
                self.stats["rejected"] += 1
                self.last_error = dec.reason
            self.history.append((window[1], self.active.record.set_id, dict(cand.values), cand.residual_m, dec.accept))
            if len(self.history) > 10000:
                del self.history[:1000]
        if dec.accept:
            self.pub.publish(C.parameter_set_to_msg(self.active.record))
            _, figures = held_out_improvement(cand.holdout_mse, cand.active_holdout_mse, self.accept_config())
            self.get_logger().info(f"accepted {self.active.record.set_id}: {figures}")
        elif dec.routine:      # the active set predicts as well: the steady state, not a fault
            self.get_logger().info(f"fit not adopted, {self.active.record.set_id} stays active: {dec.reason}",
                                   throttle_duration_sec=5.0)
        else:
            self.get_logger().warn(f"fit rejected, keeping {self.active.record.set_id}: {dec.reason}",
                                   throttle_duration_sec=5.0)
        if cand.values:
            self.drift.update(cand.residual_m, cand.values, cand.std_devs)
        return dec

    def _record(self, params, std: Mapping[str, float], ident: Optional[Mapping[str, float]], residual: float,
                window, converged: bool, status: str, set_id: str) -> C.ParameterSet:
        named = {n: float(v) for n, v in params.named().items()}
        names = tuple(named)
        sd = np.array([float(std.get(n, math.nan)) for n in names])
        idf = np.array([float((ident or {}).get(n, 0.0)) for n in names])
        return C.ParameterSet(set_id, names, np.array([named[n] for n in names]), sd, idf, float(residual),
                              (float(window[0]), float(window[1])), bool(converged), status, self.now_s())

    # ---- services -----------------------------------------------------------------------------------------
    def save(self, path: str = "") -> str:
        """Write the active set as a structure YAML (values + finite std devs); returns the absolute path."""
        from ..engine import apply_to_structure
        from ..model import dump_structure

        with self._lock:
            active = self.active
        if not path:
            folder = self.p["save_dir"] or os.path.join("build", "identified")
            path = os.path.join(folder, f"{self.structure.name}_{active.record.set_id}.yaml")
        path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        std = {n: float(v) for n, v in zip(active.record.names, active.record.std_devs) if math.isfinite(v)}
        s = apply_to_structure(self.structure, active.params, std)
        dump_structure(s, path, header=f"identified online by {self.get_name()}: set {active.record.set_id}, "
                                       f"residual {active.record.fit_residual * 1e3:.3f} mm, window "
                                       f"{active.record.window[0]:.3f}..{active.record.window[1]:.3f} s")
        return path

    def load(self, path: str) -> str:
        """Make the parameters of a structure YAML the active set (published); returns its set id."""
        from ..engine import params_from_structure

        s = load_structure(path)
        if [x.name for x in s.strings] != [x.name for x in self.structure.strings] or \
                [x.name for x in s.bars] != [x.name for x in self.structure.bars] or \
                [x.name for x in s.actuators] != [x.name for x in self.structure.actuators]:
            raise ValueError(f"{path}: its strings/bars/actuators differ from {self.structure.name!r}")
        params = params_from_structure(s)
        std = dict(s.std_devs)
        with self._lock:
            self._counter += 1
            set_id = f"loaded-{self._counter}"
            rec = self._record(params, std, None, math.nan, (0.0, 0.0), True, f"loaded from {path}", set_id)
            self.active = ActiveSet(params, rec)
            self.accepted_residuals.clear()
            self.drift.set_active(rec.as_dict())
        self.pub.publish(C.parameter_set_to_msg(rec))
        return set_id

    def _on_save(self, request, response):
        try:
            response.path_written = self.save(request.path)
            response.success, response.message = True, f"wrote {response.path_written}"
        except (OSError, ValueError) as e:
            response.success, response.message, response.path_written = False, f"{type(e).__name__}: {e}", ""
        return response

    def _on_load(self, request, response):
        try:
            response.parameter_set_id = self.load(request.path)
            response.success, response.message = True, f"active set {response.parameter_set_id} from {request.path}"
        except (OSError, ValueError) as e:
            response.success, response.message, response.parameter_set_id = False, f"{type(e).__name__}: {e}", ""
        return response

    # ---- diagnostics -------------------------------------------------------------------------------------
    def _diagnostics(self) -> None:
        rec = self.active.record
        vals: Dict[str, object] = dict(self.stats)
        vals.update({"active_set": rec.set_id, "active_residual_mm": rec.fit_residual * 1e3,
                     "window_span_s": self.window.span(), "last_window_samples": self.last_samples,
                     "input_dropped": self.seq.total_dropped, "device": self.p["device"]})
        vals.update(self.update_time.summary(1.0, "update_s_"))
        if self.last_candidate is not None:
            vals["last_fit_residual_mm"] = self.last_candidate.residual_m * 1e3
            vals["last_fit_open_loop_rms_mm"] = self.last_candidate.window_rms_m * 1e3
            vals["active_open_loop_rms_mm"] = self.last_candidate.active_window_rms_m * 1e3
        for k, v in self.last_timings.items():
            vals[f"last_{k}_s"] = v
        level, message = "ok", f"active {rec.set_id}"
        if self.last_decision is not None and self.last_decision.routine:
            message = f"active {rec.set_id}; last fit not adopted: {self.last_decision.reason}"
        elif self.last_decision is not None and not self.last_decision.accept:
            level, message = "warn", f"last fit rejected, keeping {rec.set_id}: {self.last_decision.reason}"
        if self.drift.warning:
            level, message = "warn", self.drift.warning
            vals["drift"] = self.drift.warning
        if self.stats["updates"] == 0:
            level, message = "ok", f"collecting data ({self.window.span():.1f} s of {self.p['min_window_s']:g} s)"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: online identifier", level, message, vals,
                                                self.structure.name)])

    def update_period_p50(self, run_s: float) -> float:
        """Median time (s) between finished updates; ``run_s`` (the run's length) when fewer than two finished:
        an identifier that never updates has an update period of at least the whole run."""
        ends = np.asarray(self.update_ends, dtype=float)
        return float(np.median(np.diff(ends))) if ends.size >= 2 else float(run_s)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the running update (if any) has finished (tests, shutdown)."""
        t = self._updating
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def destroy_node(self):
        self._closing = True
        C.stop_worker(self._pool)      # settles the update's future: its thread ends
        t = self._updating
        if t is not None and t is not threading.current_thread():
            t.join(1.0)
        return super().destroy_node()


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(OnlineIdentifierNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
