"""``plate_controller``'s parameters (:mod:`tensegrity_ros.nodes.plate_controller`)."""
from __future__ import annotations

from ...control.mpc import DISTURBANCES
from ...workers import WORKER_KINDS
from ..params import ParamSpec, required_file

PARAMS = (
    ParamSpec("model_file", "", "structure YAML (nominal model; identified values replace its parameters)",
              check=required_file, read_only=True),
    ParamSpec("control_period_s", 0.05, "control cycle [s] (= plan knot spacing)", range=(0.005, 1.0), read_only=True),
    ParamSpec("dt", 0.01, "prediction step [s]", range=(1e-3, 0.1), read_only=True),
    ParamSpec("horizon_s", 0.5, "MPC horizon [s]", range=(0.02, 5.0), read_only=True),
    ParamSpec("nominal_margin_s", 0.3, "nominal length beyond the horizon, so one linearisation serves several "
              "cycles [s]", range=(0.0, 10.0), read_only=True),
    ParamSpec("extension_s", 1.0, "a late linearisation's nominal is continued along its frozen last-step model for "
              "up to this long past its end (bounded by the nominal's own range of motion) before the plate "
              "holds [s]", range=(0.0, 10.0), read_only=True),
    ParamSpec("relinearize_period_s", 0.1, "shortest time between the starts of two linearisations [s] (each "
              "costs ~0.11 s of a core alone with the default nominal, 0.2-0.3 s in the demo's control phases)",
              range=(0.0, 10.0), read_only=True),
    ParamSpec("jac_stride", 10, "step Jacobians every n prediction steps, linear in between", range=(1, 100),
              read_only=True),
    ParamSpec("position_tol_m", 0.002, "plate position error that costs 1 per step [m]", range=(1e-5, 1.0)),
    ParamSpec("angle_tol_rad", 0.01745, "plate angle error that costs 1 per step [rad]", range=(1e-5, 1.0)),
    ParamSpec("max_rate_rad_s", 1.0, "plan rate limit [rad/s] (<= the driver's max_rate)", range=(1e-3, 20.0),
              read_only=True),
    ParamSpec("limit_margin_rad", 0.0, "keep this far inside the actuator limits [rad]", range=(0.0, 1.0),
              read_only=True),
    ParamSpec("disturbance", "velocity", "steady model error: disturbance estimate velocity | state | none",
              choices=DISTURBANCES, read_only=True),
    ParamSpec("input_model", "ramp", "motor motion between plan knots: ramp | hold", choices=("ramp", "hold"),
              read_only=True),
    ParamSpec("rate_scale_rad_s", 0.5, "a plan knot-to-knot speed that costs 1 (smoothness of the plans) [rad/s]",
              range=(1e-3, 100.0), read_only=True),
    ParamSpec("actuator_lag_s", 0.0, "the servos' first-order lag behind the goal, modelled by the MPC [s] (0: "
              "none; the emulated bus's is sim_robot's motor_time_constant_s)", range=(0.0, 1.0), read_only=True),
    ParamSpec("keep_applied", True, "keep the previous plan's commands from the state's stamp until the new plan "
              "reaches the driver (now + plan_latency_s) and ramp on from them", read_only=True),
    ParamSpec("plan_latency_s", 0.02, "expected time from a cycle's tick until its plan reaches the driver (solve, "
              "DDS) [s] (keep_applied)", range=(0.0, 0.5)),
    ParamSpec("measured_velocity_weight", 0.2, "share of the measured node velocities in the MPC's initial state, "
              "the rest its own prediction of now (the ingest's filtered velocities lag; 1 = as measured)",
              range=(0.0, 1.0), read_only=True),
    ParamSpec("max_input_age_s", 0.25, "older node states make the plan hold (stale) [s]", range=(0.01, 10.0)),
    ParamSpec("target_frame", "C0", "frame_id plate targets must carry", read_only=True),
    ParamSpec("target_trajectory_dt", 0.05, "time between the poses of a target trajectory (PoseArray) [s]",
              range=(1e-3, 10.0)),
    ParamSpec("model", "identified", "parameters of the model: identified (latest set) | nominal (the file's)",
              choices=("identified", "nominal")),
    ParamSpec("max_target_offset_m", 0.1, "reject targets farther from the plate than this [m]", range=(0.0, 2.0)),
    ParamSpec("max_target_angle_rad", 0.5, "reject targets turned more than this from the plate [rad]",
              range=(0.0, 3.2)),
    ParamSpec("worker", "process", "where linearisations run: process | thread", choices=WORKER_KINDS,
              read_only=True),
    ParamSpec("torch_threads", 1, "torch threads of the worker", range=(1, 64), read_only=True),
    ParamSpec("worker_nice", -5, "niceness of the linearisation worker, absolute, never above the node's own "
              "priority (0 = the node's own)", range=(-20, 19), read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
