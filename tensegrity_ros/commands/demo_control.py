"""`tensegrity demo --controller`: the loop closed without a robot (issue #19 item 3).

The demo's graph (:mod:`tensegrity_ros.bringup`: the MuJoCo twin of a TRUE robot whose stiffnesses and
dampings are ~20 % off the nominal, the driver on the emulated bus, mocap, ingest, online identifier, predictor)
plus the ``plate_controller``, in three phases:

1. **Identification** (``--duration`` s): the driver runs the seed's open-loop sinusoids; the identifier
   identifies. The plate's motion under them is the open-loop reference figure (how far the drive moves it).
2. **Identified model**: the controller (``model: identified``, the latest accepted set) gets a target
   trajectory on ``/tensegrity/plate_target_trajectory``; its plans go to ``/tensegrity/motor_plan`` and the
   driver follows them through its safety clamps (a plan preempts the reference). The target: ``SETTLE_S`` on the
   circle's start point (not scored), then ``TRACK_S`` scored: C2 on a circle of ``RADIUS_M`` in C0's x-y
   plane around the plate's rest pose (measured from mocap with the motors held at zero before this phase,
   :func:`_measure_rest_pose`), one lap every ``PERIOD_S``, and a pitch step of ``TILT_DEG`` at ``TILT_AT_S``.
   The background is quieted for phases 2 and 3 (:func:`_quiet_background`).
3. **Nominal model**, paired: the same controller with ``model: nominal`` (the structure file's parameters; the
   MPC's disturbance estimate, integral and warm start reset at the switch), the same settle and the same
   target.

Scored on the twin's ground truth (never on what the controller measures): the RMSE of C2's position against the
target over each tracking window (mm), the angle RMSE (deg), and for reference what holding the plate at the
circle's start would score. The controller's figures: plans from a solve per second, solve time p50 / p99 (the
node's own timing of ``PlateMPC.solve``), and limit violations: plan points outside the actuator limits or
faster than the plan's rate limit (checked on every plan by a probe in the graph, independent of the MPC's own
projection), plus goals the driver had to clamp during the control phases (its ``safety_clamped`` counter).

``summary.json`` gets a ``control`` block; the health gains config/health.yaml's ``control`` section (issue 19's
targets: identified RMSE < 2 mm and at most half the nominal's, >= 20 Hz, solve p99 < 25 ms, 0 violations), so
a missed target makes the run DEGRADED (exit 3). The report gains ``control_tracking.png``: target and tracked
plate pose, identified and nominal.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from . import UserError
from ..metrics import rms_error

SETTLE_S = 6.0          # on the circle's start point before each scored window (not scored)
TRACK_S = 30.0          # the scored window of each model
RADIUS_M = 0.01         # the circle (C2 in C0's x-y plane)
PERIOD_S = 10.0         # one lap (6.3 mm/s)
TILT_DEG = 0.5          # the pitch step ...
TILT_AT_S = 15.0        # ... this far into the scored window
TRAJ_DT = 0.05          # spacing of the published target poses (= plate_controller's target_trajectory_dt)
TRAJ_AHEAD_S = 2.0      # each published trajectory covers [now - 0.1 s, now + this]
PUBLISH_HZ = 10.0


@dataclass(frozen=True)
class ControlTarget:
    """The target of one control phase, as a function of the time since the phase began (pure)."""

    center: np.ndarray                       # (6,) the circle's centre pose [x, y, z, yaw, pitch, roll]
    radius_m: float = RADIUS_M
    period_s: float = PERIOD_S
    settle_s: float = SETTLE_S
    tilt_rad: float = math.radians(TILT_DEG)
    tilt_at_s: float = TILT_AT_S

    def pose(self, t) -> np.ndarray:
        """(T, 6) target poses at ``t`` (T,) s since the phase began."""
        t = np.atleast_1d(np.asarray(t, dtype=float))
        s = np.clip(t - self.settle_s, 0.0, None)               # tracking time (0 while settling)
        out = np.repeat(np.asarray(self.center, dtype=float)[None], t.size, 0)
        w = 2 * np.pi * s / self.period_s
        out[:, 0] += self.radius_m * np.cos(w)
        out[:, 1] += self.radius_m * np.sin(w)
        out[:, 4] += np.where(s >= self.tilt_at_s, self.tilt_rad, 0.0)
        return out

    def as_dict(self) -> dict:
        return {"center": [round(float(v), 6) for v in self.center], "radius_mm": self.radius_m * 1e3,
                "period_s": self.period_s, "settle_s": self.settle_s, "tilt_deg": math.degrees(self.tilt_rad),
                "tilt_axis": "pitch", "tilt_at_s": self.tilt_at_s, "plane": "C0 x-y", "track_s": TRACK_S}


def tracking_errors(stamps, poses, target: ControlTarget, t0: float, window=(0.0, math.inf)):
    """Ground-truth plate poses (T, 6) at ``stamps`` (T,) against the target of a phase that began at ``t0``,
    inside ``window`` (s since the phase's scored start). Returns (times (K,), position error (K,) m, angle error
    (K, 3) rad wrapped)."""
    stamps = np.asarray(stamps, dtype=float)
    rel = stamps - t0 - target.settle_s
    keep = (rel >= window[0]) & (rel <= window[1])
    if not keep.any():
        return np.zeros(0), np.zeros(0), np.zeros((0, 3))
    y = np.asarray(poses, dtype=float)[keep]
    r = target.pose(stamps[keep] - t0)
    d = y - r
    ang = (d[:, 3:] + np.pi) % (2 * np.pi) - np.pi
    return rel[keep], np.linalg.norm(d[:, :3], axis=1), ang


def mean_pose(poses) -> np.ndarray:
    """(6,) mean of plate poses (T, 6) [x, y, z, yaw, pitch, roll]; the angles averaged as wrapped deviations
    from the first pose (a yaw near +-pi must not average to 0)."""
    p = np.asarray(poses, dtype=float)
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] != 6:
        raise ValueError(f"poses must be (T, 6) with T >= 1, got {p.shape}")
    out = p.mean(axis=0)
    d = (p[:, 3:] - p[0, 3:] + np.pi) % (2 * np.pi) - np.pi
    out[3:] = (p[0, 3:] + d.mean(axis=0) + np.pi) % (2 * np.pi) - np.pi
    return out


def plan_violations(angles: np.ndarray, dt: float, lower, upper, max_rate: float, tol: float = 1e-9) -> int:
    """Plan points (K, A) outside [lower, upper] plus consecutive steps faster than ``max_rate`` (rad/s)."""
    a = np.asarray(angles, dtype=float)
    out = int(np.count_nonzero((a < np.asarray(lower) - tol) | (a > np.asarray(upper) + tol)))
    if a.shape[0] > 1:
        out += int(np.count_nonzero(np.abs(np.diff(a, axis=0)) > max_rate * dt * (1 + 1e-6) + tol))
    return out



# =====================================================================================================
# the probe: publishes the target, checks every plan
# =====================================================================================================
def _make_probe(graph, controller, structure):
    from geometry_msgs.msg import Pose, PoseArray

    from .. import frames as F
    from ..hardware.plan import PlanError, plan_from_message
    from ..nodes.convert import sec_to_stamp
    from ..nodes.graph_node import LeanNode
    from ..nodes.topics import TOPICS

    lo = np.array([a.limits[0] for a in structure.actuators])
    hi = np.array([a.limits[1] for a in structure.actuators])
    names = [a.name for a in structure.actuators]
    max_rate = float(controller.p["max_rate_rad_s"])

    class ControlProbe(LeanNode):
        def __init__(self):
            super().__init__("control_demo_probe", context=graph.context, qos_events=False)
            self.target: Optional[ControlTarget] = None
            self.t0 = math.nan
            self.plans = 0
            self.violations = 0
            self.bad_plans = 0
            self.pub = self.create_publisher(PoseArray, "/tensegrity/plate_target_trajectory", 10)
            self.pub_plan = self.create_publisher(controller._plan_cls, TOPICS["motor_plan"], 10)
            self.hold_angles: Optional[np.ndarray] = None     # the rest-pose measurement's held angles
            self.error = ""
            self.create_subscription(controller._plan_cls, TOPICS["motor_plan"], self._guard(self._on_plan), 10)
            self.create_timer(1.0 / PUBLISH_HZ, self._guard(self._publish))

        def _guard(self, fn):
            def call(*a):
                try:
                    fn(*a)
                except Exception as e:  # noqa: BLE001 - never stop the graph's executor; the summary says it
                    self.error = f"{type(e).__name__}: {e}"
            return call

        def start(self, target: ControlTarget, t0: float) -> None:
            self.target, self.t0 = target, t0

        def hold(self, angles: Optional[np.ndarray]) -> None:
            """Publish plans that hold ``angles`` (A,) rad (None: stop), 10 Hz, each 2 s long: the rest-pose
            measurement before the control phases."""
            self.hold_angles = None if angles is None else np.asarray(angles, dtype=float)

        def _publish(self) -> None:
            if self.hold_angles is not None:
                now = self.get_clock().now().nanoseconds * 1e-9
                steps = int(round(2.0 / controller.core.dt))
                self.pub_plan.publish(controller._plan_msg(now, np.repeat(self.hold_angles[None], steps, 0)))
                return
            if self.target is None:
                return
            now = self.get_clock().now().nanoseconds * 1e-9
            ts = now - 0.1 + TRAJ_DT * np.arange(int(round((TRAJ_AHEAD_S + 0.1) / TRAJ_DT)) + 1)
            msg = PoseArray()
            msg.header.stamp = sec_to_stamp(float(ts[0]))
            msg.header.frame_id = "C0"
            for y in self.target.pose(ts - self.t0):
                p = Pose()
                p.position.x, p.position.y, p.position.z = (float(v) for v in y[:3])
                qx, qy, qz, qw = F.quaternion_from_matrix(F.rotation_zyx(y[3:]))
                p.orientation.x, p.orientation.y, p.orientation.z, p.orientation.w = qx, qy, qz, qw
                msg.poses.append(p)
            self.pub.publish(msg)

        def _on_plan(self, msg) -> None:
            try:
                _, offsets, angles = plan_from_message(msg, names, controller.core.dt)
            except PlanError:
                self.bad_plans += 1
                return
            self.plans += 1
            dt = float(np.median(np.diff(offsets))) if offsets.size > 1 else controller.core.dt
            self.violations += plan_violations(angles, dt, lo, hi, max_rate)

    return ControlProbe()


# =====================================================================================================
# the run
# =====================================================================================================
def _driver_clamped(graph) -> float:
    for name, (_, _, vals) in dict(graph.monitor.diagnostics).items():
        if name.endswith("dynamixel bus") and "safety_clamped" in vals:
            return float(vals["safety_clamped"])
    return math.nan


def _plate_pose_series(mon, names, since: float):
    from .. import frames as F

    gt = [g for g in list(mon.ground_truth) if g[0] >= since]
    if not gt:
        return np.zeros(0), np.zeros((0, 6))
    stamps = np.array([g[0] for g in gt])
    poses = np.stack([F.manipulator_relative_poses(g[1], names)["0C2"] for g in gt])
    return stamps, poses


#: the online identifier's duty cycle during the control phases: after an update of T s it rests 99 T
PAUSED_DUTY = 0.01
#: the state predictor's relinearisation period during the control phases (its yaml: 2 s)
CONTROL_PREDICTOR_PERIOD_S = 6.0
#: the state predictor's worker's niceness during the control phases (its yaml: -5): below the controller's (-5)
CONTROL_PREDICTOR_NICE = 10


def _quiet_background(graph) -> None:
    """Free the 2 cores for the control path during the scored phases.

    The online identifier pauses: the controller's "identified" model stays the set identification ended with
    (a set accepted mid-phase would change the model being scored), and its worker leaves its share of the
    cores. Measured once each way (2026-11-26, nothing else running): motor states delivered 98.6 -> 99.7 %,
    predictions per node state 92.4 -> 99.5 %, prediction latency p99 35.6 -> 28.2 ms.

    The state predictor relinearises every CONTROL_PREDICTOR_PERIOD_S instead of 2 s: the controller takes its
    own linearisation, and the predictor's predictions (still published for every node state, scored by the
    health) are not on the control path, and its worker drops below the controller's (CONTROL_PREDICTOR_NICE;
    the controller's is at -5, below the graph's callbacks at -10). Why (2026-11-26, per-thread CPU): the
    graph's executor thread ran at 0.70-0.78 of a core, its fair share next to the simulated robot (-10) and two
    always-runnable workers at -5, and node states reached the controller 0.25 s (up to 4 s) after their stamps;
    before the control phases they took 6-9 ms. With both workers at 5 the states were on time (20 ms p50) but
    the controller's linearisations took 1.2 s (p50) and 49 % of its cycles held on a linearisation too old."""
    from rclpy.parameter import Parameter
    node = graph.nodes.get("online_identifier")
    if node is not None:
        node.set_parameters([Parameter("max_duty", value=PAUSED_DUTY)])
    pred = graph.nodes.get("state_predictor")
    nice = ""
    if pred is not None:
        pred.set_parameters([Parameter("relinearize_period_s", value=CONTROL_PREDICTOR_PERIOD_S),
                             Parameter("relinearize_max_age_s", value=CONTROL_PREDICTOR_PERIOD_S + 2.0)])
        if pred.p["worker"] == "process":     # a thread worker's pid is the graph's own: leave it
            from ..workers import set_niceness
            nice = f", its worker's {set_niceness(CONTROL_PREDICTOR_NICE, pred.worker_pid)[2]}"
    if pred is not None:
        predictor = f"the state predictor relinearising every {CONTROL_PREDICTOR_PERIOD_S:g} s{nice}"
    elif graph.predictor_proc is not None:   # --predictor-process: its yaml settings stay
        predictor = "the state predictor (in its own process) left as it is"
    else:
        predictor = "no state predictor"
    sys.stderr.write(f"tensegrity demo --controller: for the control phases, identification paused (online "
                     f"identifier max_duty {PAUSED_DUTY}; the identified set is frozen) and {predictor}\n")


#: the rest-pose measurement: the motors held at zero this long, the plate's pose averaged over the last
#: REST_AVERAGE_S of it (the strings' modes are 4-37 Hz and damped: settled well before)
REST_HOLD_S = 5.0
REST_AVERAGE_S = 1.5


def _measure_rest_pose(controller, probe, angles: np.ndarray, progress) -> np.ndarray:
    """The plate's rest pose as a lab measures it: the motors held at ``angles`` through the driver (plans on
    /tensegrity/motor_plan), C2's pose in C0 from the node states (mocap) averaged over the last seconds.

    Why not the nominal model's rest pose: with the true robot's stiffnesses ~20 % off, it sits 30-32 mm and
    2.6-3.1 deg (yaw) from the true rest pose (seed 0: the twin settled; as measured here), and the yaw moves
    2-7 mrad per rad of motor: a target circle about
    the nominal pose needs motor angles far past the limits. The first runs with that centre held 40-56 limit
    rows active on every cycle and a 3-deg angle error that no model could remove."""
    probe.hold(angles)
    wall0 = time.monotonic()
    samples = []
    try:
        while (left := REST_HOLD_S - (time.monotonic() - wall0)) > 0:
            time.sleep(min(0.05, left))
            if left <= REST_AVERAGE_S:
                y = controller._present()
                if y is not None and np.all(np.isfinite(y)):
                    samples.append(y)
    finally:
        probe.hold(None)
    if len(samples) < 5:
        raise UserError(f"the plate's rest pose could not be measured: {len(samples)} complete node-state "
                        f"samples in {REST_AVERAGE_S:g} s (needs 5; are the plate's markers tracked?)")
    rest = mean_pose(samples)
    spread = np.max(np.linalg.norm(np.asarray(samples)[:, :3] - rest[:3], axis=1))
    progress.line(f"control: the plate's rest pose (motors at zero), measured over {REST_AVERAGE_S:g} s: C2 at "
                  f"({', '.join(f'{v * 1e3:.1f}' for v in rest[:3])}) mm in C0, spread {spread * 1e3:.2f} mm",
                  final=True)
    return rest


def _control_phase(graph, controller, probe, model: str, target: ControlTarget, progress, label: str) -> dict:
    """Run one control phase: switch the model, publish the target, wait settle + track; returns its raw figures
    (times in the graph's ROS clock)."""
    from rclpy.parameter import Parameter

    controller.set_parameters([Parameter("model", value=model)])
    t0 = controller.now_s()
    probe.start(target, t0)
    wall0 = time.monotonic()
    marks = {}
    for mark, at in (("track_start", target.settle_s), ("track_end", target.settle_s + TRACK_S)):
        while True:
            left = at - (time.monotonic() - wall0)
            if left <= 0:
                break
            time.sleep(min(1.0, left))
            faults = graph.faults() if hasattr(graph, "faults") else {}
            if faults:
                raise UserError(f"stopped: {faults}")
            err = controller.plate_error
            last = controller.last
            progress.line(f"control [{label}] t={time.monotonic() - wall0:5.1f}s | plate error now "
                          f"{err[0] * 1e3:6.2f} mm / {math.degrees(err[1]):5.2f} deg | status "
                          f"{last.status.value if last else 'waiting'} | solve p50 "
                          f"{controller.solve.percentile(50) * 1e3:5.1f} ms | target {controller.target_reason}"
                          + (f" | {last.message}" if last is not None and last.message else ""))
        marks[mark] = {"t": controller.now_s(), "solves": controller.solve.count, "cycles": controller.cycles,
                       "linearizations": controller.lin_time.count, "hold_causes": dict(controller.holds),
                       "plans": probe.plans, "violations": probe.violations, "clamped": _driver_clamped(graph),
                       "set_id": controller.set_id}
    n_new = marks["track_end"]["solves"] - marks["track_start"]["solves"]
    n_lin = marks["track_end"]["linearizations"] - marks["track_start"]["linearizations"]

    def last(stats, n):
        return stats.values()[-n:] if n > 0 else np.zeros(0)
    span = marks["track_end"]["t"] - marks["track_start"]["t"]
    return {"model": model, "t0": t0, "marks": marks, "solve_s": last(controller.solve, n_new),
            "state_age_s": last(controller.state_age, n_new), "linearization_age_s": last(controller.lin_age, n_new),
            "linearize_s": last(controller.lin_time, n_lin), "linearize_worker_s": last(controller.lin_worker, n_lin),
            "rate_hz": n_new / span if span > 0 else math.nan,
            "holds": (marks["track_end"]["cycles"] - marks["track_start"]["cycles"]) - n_new,
            "hold_causes": {c: n - marks["track_start"]["hold_causes"].get(c, 0)
                            for c, n in marks["track_end"]["hold_causes"].items()
                            if n > marks["track_start"]["hold_causes"].get(c, 0)},
            "plans": marks["track_end"]["plans"] - marks["track_start"]["plans"],
            "violations": marks["track_end"]["violations"] - marks["track_start"]["violations"],
            "set_id": marks["track_end"]["set_id"] if model == "identified" else "nominal",
            "last_status": "" if controller.last is None else
            f"{controller.last.status.value}: {controller.last.message}".rstrip(": ")}


def _score(phase: dict, target: ControlTarget, stamps, poses) -> dict:
    _, pos, ang = tracking_errors(stamps, poses, target, phase["t0"], (0.0, TRACK_S))
    ms = {}
    for key, name in (("solve_s", "solve_ms"), ("state_age_s", "state_age_ms"),
                      ("linearization_age_s", "linearization_age_ms"), ("linearize_s", "linearize_ms"),
                      ("linearize_worker_s", "linearize_worker_ms")):
        v = phase[key] * 1e3
        for q in (50, 99):
            ms[f"{name}_p{q}"] = float(np.percentile(v, q)) if v.size else math.nan
    return {"rmse_mm": rms_error(pos) * 1e3, "max_error_mm": float(pos.max() * 1e3) if pos.size else math.nan,
            "angle_rmse_deg": math.degrees(rms_error(ang)) if ang.size else math.nan, "samples": int(pos.size),
            "controller_rate_hz": phase["rate_hz"], "holds": int(phase["holds"]), "hold_causes": phase["hold_causes"],
            **ms,
            "linearizations": int(phase["linearize_s"].size),
            "plans_checked": int(phase["plans"]), "plan_violations": int(phase["violations"]),
            "parameter_set_id": phase["set_id"], "last_status": phase["last_status"]}


def _open_loop_reference(stamps, poses, t_end: float, seconds: float = 20.0) -> dict:
    """How the seed's open-loop sinusoids move the plate over the identification phase's last ``seconds``."""
    keep = (stamps >= t_end - seconds) & (stamps <= t_end)
    if not keep.any():
        return {"seconds": 0.0}
    p = poses[keep]
    d = p[:, :3] - p[:, :3].mean(0)
    a = (p[:, 3:] - p[:, 3:].mean(0) + np.pi) % (2 * np.pi) - np.pi
    return {"seconds": float(stamps[keep][-1] - stamps[keep][0]),
            "plate_motion_rms_mm": rms_error(np.linalg.norm(d, axis=1)) * 1e3,
            "plate_motion_peak_mm": float(np.linalg.norm(d, axis=1).max() * 1e3),
            "plate_angle_rms_deg": math.degrees(rms_error(a)),
            "what": "the plate's motion about its mean under the seed's phase-shifted sinusoids (open loop)"}


def _plot(path: Path, target: ControlTarget, runs: Dict[str, tuple]) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover
        return None
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    t = np.linspace(0.0, TRACK_S, 600)
    ref = target.pose(t + target.settle_s)
    rows = ((0, "x [mm]", 1e3), (1, "y [mm]", 1e3), (4, "pitch [deg]", 180 / np.pi))
    for ax, (j, lab, sc) in zip(axes, rows):
        ax.plot(t, (ref[:, j] - target.center[j]) * sc, "k--", lw=1.5, label="target")
        for (name, (tt, y)), col in zip(runs.items(), ("tab:green", "tab:red")):
            if tt.size:
                ax.plot(tt, (y[:, j] - target.center[j]) * sc, color=col, lw=1, label=f"tracked ({name} model)")
        ax.set_ylabel(lab + " (rel. centre)")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("s into the scored window")
    fig.suptitle("plate C2 in C0: target vs twin ground truth, identified and nominal model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def control_figures(control: dict) -> Dict[str, float]:
    """The health figures (config/health.yaml, section control) of a summary's ``control`` block."""
    idn, nom = control["identified"], control["nominal"]
    return {"control_rmse_identified_mm": idn["rmse_mm"],
            "control_rmse_ratio_identified_to_nominal": control["ratio_identified_to_nominal"],
            "controller_rate_hz": min(idn["controller_rate_hz"], nom["controller_rate_hz"]),
            "controller_solve_ms_p99": control["solve_ms_p99"],
            "control_limit_violations": control["limit_violations"]["total"]}


def run(args) -> int:
    from ..bringup import NODE_ORDER, build_graph, drain, graph_health, stop_sources
    from . import demo as D
    from ._common import atomic_output

    nominal, out, force = D.checked_inputs(args, "controller demo")
    overrides = {"sim_robot": {"perturb_seed": int(args.seed)},
                 "plate_controller": {"target_trajectory_dt": TRAJ_DT, "model": "identified"}}
    cfg = D.graph_config(args, nodes=D.demo_nodes(args, NODE_ORDER), overrides=overrides)
    import signal

    def _on_signal(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    progress = D.Progress()
    sys.stderr.write(f"tensegrity demo --controller: starting the graph ({nominal.name}, worker processes warm "
                     f"up ~10 s); {args.duration:g} s of identification, {REST_HOLD_S:g} s measuring the plate's "
                     f"rest pose, then {SETTLE_S + TRACK_S:g} s of control with the identified model and as long "
                     "with the nominal one...\n")
    # the nominal model's rest pose (motors at zero): for the summary only. The target's centre is the TRUE
    # plate's rest pose, measured from mocap before the control phases (_measure_rest_pose: why)
    from .. import frames as F
    from ..twin.sim import TwinSim

    sim = TwinSim(nominal)
    zero = np.array([a.zero_offset for a in nominal.actuators])
    sim.step(zero, 1)
    sim.settle(3.0)
    nominal_rest = F.manipulator_relative_poses(sim.node_positions(), nominal.node_names)["0C2"]

    graph = build_graph(cfg)
    try:
        controller = graph.nodes["plate_controller"]
        probe = _make_probe(graph, controller, nominal)
        graph.executor.add_node(probe)
        graph.nodes[probe.get_name()] = probe               # destroyed with the graph
        true_structure, truth, nom, est_names, nominal_err = D.scoring_baseline(graph, nominal)
        graph.spin_in_background()
        t0 = time.monotonic()
        t0_ros = controller.now_s()
        history = []
        while time.monotonic() - t0 < args.duration:                      # 1. identification
            time.sleep(min(1.0, args.duration - (time.monotonic() - t0)))
            faults = graph.faults() if hasattr(graph, "faults") else {}
            if faults:
                raise UserError(f"stopped: {faults}")
            text, vals = D.status_line(graph, truth, est_names, t0_ros, time.monotonic() - t0, nominal_err)
            history.append(vals)
            progress.line(text)
        progress.line(text, final=True)
        t_ident_end = controller.now_s()
        _quiet_background(graph)
        target = ControlTarget(center=_measure_rest_pose(controller, probe, zero, progress))
        phases = {"identified": _control_phase(graph, controller, probe, "identified", target, progress,
                                               "identified model")}                              # 2.
        progress.line("", final=True)
        phases["nominal"] = _control_phase(graph, controller, probe, "nominal", target, progress,
                                           "nominal model")                                      # 3.
        progress.line("", final=True)
        probe.target = None
        duration = time.monotonic() - t0
        stop_sources(graph)
        drained = drain(graph, 20.0)

        stamps, poses = _plate_pose_series(graph.monitor, true_structure.node_names, t0_ros)
        scores = {k: _score(p, target, stamps, poses) for k, p in phases.items()}
        hold = target.pose(np.linspace(0, TRACK_S, 601) + target.settle_s)
        # NaN when the driver's diagnostics never arrived: then the health check fails as "no data"
        driver_clamped = sum(p["marks"]["track_end"]["clamped"] - p["marks"]["track_start"]["clamped"]
                             for p in phases.values())
        plan_v = sum(s["plan_violations"] for s in scores.values())
        solve_all = np.concatenate([p["solve_s"] for p in phases.values()]) * 1e3
        control = {
            "identified": scores["identified"], "nominal": scores["nominal"],
            "ratio_identified_to_nominal": scores["identified"]["rmse_mm"] / scores["nominal"]["rmse_mm"]
            if scores["nominal"]["rmse_mm"] > 0 else math.nan,
            "solve_ms_p50": float(np.percentile(solve_all, 50)) if solve_all.size else math.nan,
            "solve_ms_p99": float(np.percentile(solve_all, 99)) if solve_all.size else math.nan,
            "controller_rate_hz": min(scores["identified"]["controller_rate_hz"],
                                      scores["nominal"]["controller_rate_hz"]),
            "limit_violations": {"plan_points": plan_v, "driver_clamped": driver_clamped,
                                 "total": plan_v + driver_clamped},
            "open_loop_reference": _open_loop_reference(stamps, poses, t_ident_end),
            "hold_at_start_rmse_mm": rms_error(np.linalg.norm(hold[:, :3] - hold[0, :3], axis=1)) * 1e3,
            "target": {**target.as_dict(),
                       "center_from": "the plate's rest pose measured from mocap, motors at zero",
                       "nominal_rest_offset_mm": float(np.linalg.norm(target.center[:3] - nominal_rest[:3]) * 1e3),
                       "nominal_rest_offset_deg": [round(math.degrees(v), 3) for v in
                                                   (target.center[3:] - nominal_rest[3:] + np.pi) % (2 * np.pi)
                                                   - np.pi]},
            "identification_s": float(args.duration),
            "probe_error": probe.error,          # "" unless the target publisher / plan checker failed
        }
        sys.stderr.write("tensegrity demo --controller: writing the summary, report and bag...\n")
        with atomic_output(args.out, "dir", force=force, flag="--out") as tmp:
            summary = D.summarise(graph, truth, nom, est_names, nominal_err, duration, drained, t0_ros, tmp,
                                   history)
            summary["control"] = control
            worse = summary.get("accepted_worse_than_previous", 0)
            health = graph_health(graph, duration, {"accepted_worse_than_previous": worse, **control_figures(control)},
                                  sections=("graph", "demo", "control"))
            summary["health"] = health.as_dict()
            D.write_report(graph, summary, truth, nom, est_names, t0_ros, tmp, nominal, true_structure)
            runs = {}
            for k, p in phases.items():
                rel, _, _ = tracking_errors(stamps, poses, target, p["t0"], (0.0, TRACK_S))
                keep = (stamps - p["t0"] - target.settle_s >= 0) & (stamps - p["t0"] - target.settle_s <= TRACK_S)
                runs[k] = (rel, poses[keep])
            plot = _plot(tmp / "control_tracking.png", target, runs)
            with open(tmp / "report.md", "a") as f:
                f.write("\n" + "\n".join(_report_lines(control, plot)) + "\n")
            if not args.no_bag:
                D.write_bag(graph, tmp / "bag")
                summary["bag"] = str(out / "bag")
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
            (tmp / D.MARKER).write_text("written by `tensegrity demo`: the next demo may replace this folder\n")
    finally:
        graph.shutdown()      # before the verdict: no node logs after the last line
    for line in _report_lines(control, None, console=True):
        sys.stderr.write(line + "\n")
    sys.stderr.write(f"tensegrity demo --controller: wrote {out / 'summary.json'}, {out / 'report.md'}\n")
    return D.report_health(summary["health"])


def _holds(phase: dict) -> str:
    """'12 (linearization 9, node_states 3)': held cycles and their causes."""
    causes = ", ".join(f"{c} {n}" for c, n in sorted(phase.get("hold_causes", {}).items()))
    return f"{phase['holds']}" + (f" ({causes})" if causes else "")


def _report_lines(c: dict, plot: Optional[Path], console: bool = False) -> List[str]:
    i, n, o = c["identified"], c["nominal"], c["open_loop_reference"]
    t = c["target"]
    rows = [("plate position RMSE [mm]", f"{i['rmse_mm']:.2f}", f"{n['rmse_mm']:.2f}"),
            ("plate position max error [mm]", f"{i['max_error_mm']:.2f}", f"{n['max_error_mm']:.2f}"),
            ("plate angle RMSE [deg]", f"{i['angle_rmse_deg']:.3f}", f"{n['angle_rmse_deg']:.3f}"),
            ("controller rate [Hz]", f"{i['controller_rate_hz']:.1f}", f"{n['controller_rate_hz']:.1f}"),
            ("solve p50 / p99 [ms]", f"{i['solve_ms_p50']:.1f} / {i['solve_ms_p99']:.1f}",
             f"{n['solve_ms_p50']:.1f} / {n['solve_ms_p99']:.1f}"),
            ("holds (cycles without a solve)", _holds(i), _holds(n)),
            # where the cycles' time went (graph delays, worker under load): what explains a missed rate or RMSE
            ("node-state age at solve p50 / p99 [ms]", f"{i['state_age_ms_p50']:.0f} / {i['state_age_ms_p99']:.0f}",
             f"{n['state_age_ms_p50']:.0f} / {n['state_age_ms_p99']:.0f}"),
            ("linearisation age at solve p50 / p99 [ms]",
             f"{i['linearization_age_ms_p50']:.0f} / {i['linearization_age_ms_p99']:.0f}",
             f"{n['linearization_age_ms_p50']:.0f} / {n['linearization_age_ms_p99']:.0f}"),
            ("linearisations: count, round trip p50, worker p50 [ms]",
             f"{i['linearizations']}, {i['linearize_ms_p50']:.0f}, {i['linearize_worker_ms_p50']:.0f}",
             f"{n['linearizations']}, {n['linearize_ms_p50']:.0f}, {n['linearize_worker_ms_p50']:.0f}"),
            ("plan points over limits / rate", str(i["plan_violations"]), str(n["plan_violations"])),
            ("parameter set", str(i["parameter_set_id"]), "nominal")]
    head = (f"target: circle r {t['radius_mm']:.0f} mm, {t['period_s']:g} s per lap in {t['plane']} + pitch step "
            f"{t['tilt_deg']:g} deg at {t['tilt_at_s']:g} s, {t['track_s']:g} s scored after {t['settle_s']:g} s "
            f"settling; identified / nominal RMSE ratio {c['ratio_identified_to_nominal']:.2f}; driver clamps "
            f"{c['limit_violations']['driver_clamped']}; holding the start point would score "
            f"{c['hold_at_start_rmse_mm']:.1f} mm; open-loop sinusoids move the plate "
            f"{o.get('plate_motion_rms_mm', math.nan):.1f} mm RMS ({o.get('plate_motion_peak_mm', math.nan):.1f} mm "
            "peak)")
    if console:
        return ["tensegrity demo --controller: " + head] + [f"  {a:<34} identified {b:>14}   nominal {c_:>14}"
                                                            for a, b, c_ in rows]
    lines = ["## Control (tensegrity demo --controller)", "", head + ".", "",
             "| figure | identified model | nominal model |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c_} |" for a, b, c_ in rows]
    if plot:
        lines += ["", f"![control]({plot.name})"]
    return lines
