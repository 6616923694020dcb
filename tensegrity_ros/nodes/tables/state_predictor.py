"""``state_predictor``'s parameters (:mod:`tensegrity_ros.nodes.state_predictor`)."""
from __future__ import annotations

from ...predict.horizon import HorizonPredictor
from ...workers import WORKER_KINDS
from ..params import ParamSpec, file_exists, required_file

PARAMS = (
    ParamSpec("model_file", "", "structure YAML (nominal model; identified values replace its parameters)",
              check=required_file, read_only=True),
    ParamSpec("integrator", "semi_implicit", "engine integrator", choices=("semi_implicit", "rk4"), read_only=True),
    ParamSpec("horizon_s", 1.0, "prediction horizon [s]", range=(0.01, 10.0), read_only=True),
    ParamSpec("dt", 0.01, "prediction step [s]", range=(1e-4, 0.1), read_only=True),
    ParamSpec("relinearize_period_s", 1.0, "shortest time between two relinearisations [s]", range=(0.02, 60.0)),
    ParamSpec("relinearize_max_age_s", 3.0, "relinearise when the nominal is this old [s]", range=(0.05, 600.0)),
    ParamSpec("relinearize_deviation_m", 0.005, "relinearise (after relinearize_period_s) when a measured state is "
              "this far from the nominal [m]", range=(0.0, 10.0)),
    ParamSpec("nominal_margin_s", 0.0, "nominal horizon beyond horizon_s [s]; 0 = automatic: min(relinearize_period_s, "
              "relinearize_max_age_s) + 1.5 x the relinearisation time (p90) + 0.3 s", range=(0.0, 60.0)),
    ParamSpec("extend_max_s", 0.25, "when the next nominal is late, predict along the current one's frozen-Jacobian "
              "extension for up to this long past its end [s] (0 = skip those messages)", range=(0.0, 10.0),
              read_only=True),
    ParamSpec("substeps", 0, "engine steps per prediction step for the Jacobians (0 = automatic: the shortest "
              "power of two that is stable)", range=(0, 4096), read_only=True),
    ParamSpec("nominal", "twin", "nominal rollout: twin (MuJoCo model of the current parameters) | engine",
              choices=HorizonPredictor.NOMINALS, read_only=True),
    ParamSpec("jac_stride", 10, "Jacobians every n prediction steps, interpolated in between", range=(1, 100),
              read_only=True),
    ParamSpec("motor_source", "auto", "future motor angles: auto | plan | reference | hold",
              choices=("auto", "plan", "reference", "hold")),
    ParamSpec("reference_file", "", "reference YAML the driver runs (for motor_source reference/auto)",
              check=file_exists, read_only=True),
    ParamSpec("plan_dt", 0.01, "step of a JointState motor plan [s]", range=(1e-4, 1.0)),
    ParamSpec("plan_timeout_s", 1.0, "a plan older than this (and ended) is ignored [s]", range=(0.0, 3600.0)),
    ParamSpec("output_nodes", [], "nodes to publish ([] = those of the node-state messages)", read_only=True,
              type_="string_array"),
    ParamSpec("publish_every", 1, "predict at every n-th node-state message", range=(1, 1000)),
    ParamSpec("torch_threads", 1, "torch intra-op threads (process-wide)", range=(1, 256), read_only=True),
    ParamSpec("worker", "process", "where relinearisations run: process (a spawned child: never holds the "
              "callbacks' GIL) | thread", choices=WORKER_KINDS, read_only=True),
    ParamSpec("worker_nice", 5, "niceness of the worker process, absolute, never above the node's own priority "
              "(raise it to favour the per-message path; 0 = the node's own)",
              range=(-20, 19), read_only=True),
    ParamSpec("rt_priority", 0, "SCHED_FIFO priority of the thread that runs this node's callbacks when it runs "
              "as its own executable (ros2 launch; 0 = normal scheduling). Its threads and workers stay normal. "
              "Needs root, CAP_SYS_NICE or `ulimit -r`; refused, it is logged and the node runs on",
              range=(0, 99), read_only=True),
    ParamSpec("realized_every", 24, "score every n-th published prediction against the node states that arrive "
              "later (the realized error in /diagnostics and in each prediction's realized_error)",
              range=(1, 100000), read_only=True),
    ParamSpec("realized_memory_s", 10.0, "memory (time constant) of the realized error [s]", range=(0.1, 3600.0),
              read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
