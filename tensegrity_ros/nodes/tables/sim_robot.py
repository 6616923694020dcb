"""``sim_robot``'s parameters (:mod:`tensegrity_ros.nodes.sim_robot`)."""
from __future__ import annotations

from ..params import ParamSpec, file_exists, required_file, transform_list

PERTURBABLE = ("stiffness", "damping", "mass")
#: perturbed by default: masses are weighed on the bench (and with motion data alone a common scale of masses,
#: stiffnesses and dampings is unobservable: the identification gauge)
DEFAULT_PERTURBED = ("stiffness", "damping")

PARAMS = (
    ParamSpec("model_file", "", "nominal structure YAML", check=required_file, read_only=True),
    ParamSpec("true_model_file", "", "structure YAML of the simulated (true) robot; '' = the perturbed nominal",
              check=file_exists, read_only=True),
    ParamSpec("perturb_fraction", 0.2, "relative spread (1 sigma) of the true robot's parameters around the "
              "nominal (model.perturb.perturb_structure)", range=(0.0, 0.9), read_only=True),
    ParamSpec("perturb_seed", 0, "seed of the perturbation", range=(0, 2 ** 31 - 1), read_only=True),
    ParamSpec("perturb_kinds", list(DEFAULT_PERTURBED), "parameter kinds perturbed", read_only=True,
              check=lambda v: None if set(v) <= set(PERTURBABLE) else f"subset of {', '.join(PERTURBABLE)}"),
    ParamSpec("link_path", "/tmp/tensegrity_ttyEMU", "symlink to the emulated bus pty ('' = none)", read_only=True),
    ParamSpec("baud", 1000000, "emulated bus baud rate", read_only=True),
    ParamSpec("motor_time_constant_s", 0.05, "emulated motor first-order time constant [s]", range=(1e-4, 10.0),
              read_only=True),
    ParamSpec("motor_max_speed_rad_s", 3.0, "emulated motor speed limit [rad/s]", range=(0.01, 100.0), read_only=True),
    ParamSpec("timestep", 0.001, "MuJoCo timestep [s]", range=(1e-5, 0.01), read_only=True),
    ParamSpec("integrator", "RK4", "MuJoCo integrator: RK4 (converged at 1 ms: the identifier's engine then "
              "models the robot to ~0.1 mm) | implicitfast (unconditionally stable with heavy damping, but "
              "its implicit damping step is mm-level off the physics at 1 ms)",
              choices=("RK4", "implicitfast"), read_only=True),
    ParamSpec("mocap_rate_hz", 120.0, "marker frame rate [Hz]", range=(1.0, 2000.0), read_only=True),
    ParamSpec("realtime_factor", 1.0, "sim time per wall time", range=(0.01, 100.0), read_only=True),
    ParamSpec("settle_s", 2.0, "sim seconds run (unpaced, motors held) before streaming", range=(0.0, 600.0),
              read_only=True),
    ParamSpec("marker_noise_m", 0.0003, "marker noise (1 sigma, per axis) [m]", range=(0.0, 0.1)),
    ParamSpec("occlusion_prob", 0.0, "probability a marker is missing in a frame", range=(0.0, 1.0)),
    ParamSpec("mocap_frame", [], "world->mocap transform: R row-major + offset (12) | 4x4 (16); [] = Y up, "
              "offset (0.4, 0.005, -0.3) m", check=transform_list, read_only=True, type_="double_array"),
    ParamSpec("mocap_frame_id", "mocap", "frame_id of the markers", read_only=True),
    ParamSpec("publish_ground_truth", True, "publish /sim/ground_truth", read_only=True),
    ParamSpec("ground_truth_every", 1, "publish /sim/ground_truth at every n-th mocap frame (its consumers "
              "interpolate; each message costs a DDS write here and a callback in every subscriber)",
              range=(1, 1000), read_only=True),
    ParamSpec("seed", 0, "seed of the marker noise / occlusion / shuffling", range=(0, 2 ** 31 - 1), read_only=True),
    ParamSpec("rt_priority", 0, "SCHED_FIFO priority of the simulation thread (0 = normal scheduling): it stands "
              "in for hardware with processors of its own. Only that periodic thread: with the whole process under "
              "SCHED_FIFO (start-up included) the kernel's real-time throttling set in once. Needs root, CAP_SYS_NICE "
              "or `ulimit -r`; refused, it is logged and the simulation runs on", range=(0, 99), read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
