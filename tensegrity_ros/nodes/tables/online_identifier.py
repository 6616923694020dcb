"""``online_identifier``'s parameters (:mod:`tensegrity_ros.nodes.online_identifier`)."""
from __future__ import annotations

from ...workers import WORKER_KINDS
from ..params import ParamSpec, required_file

PARAMS = (
    ParamSpec("model_file", "", "nominal structure YAML (the start values and the bounds)", check=required_file,
              read_only=True),
    ParamSpec("window_s", 10.0, "sliding window length [s]", range=(0.5, 600.0)),
    ParamSpec("update_period_s", 1.0, "re-identification period [s] (ticks skipped while the worker is busy; an "
              "update that outlasts it is followed by the next at once)",
              range=(0.05, 3600.0), read_only=True),
    ParamSpec("min_window_s", 3.0, "identify only once the window spans this long [s]", range=(0.1, 600.0)),
    ParamSpec("estimate", ["stiffness"], "kinds identified (stage 1 and stage 2); with mass, the "
              "scale is anchored on the nominal total mass; damping: see config/nodes/online_identifier.yaml",
              read_only=True, check=lambda v: None if set(v) <= {"mass", "stiffness", "damping", "rest_length"}
              and v else "subset of mass, stiffness, damping, rest_length"),
    ParamSpec("stage1", True, "run the closed-form stage 1 first (stage 2 then starts from whichever of stage 1 "
              "and the active set predicts the window better: stage 1 is biased by marker noise on stiff "
              "strings)", read_only=True),
    ParamSpec("stage1_max_samples", 300, "samples of the window used by stage 1 (random subset; bounds its time)",
              range=(10, 1000000)),
    ParamSpec("stage2_iterations", 2, "stage-2 (Levenberg-Marquardt) iterations per update; 0 = stage 1 only",
              range=(0, 1000)),
    ParamSpec("first_update_iterations", 8, "stage-2 iterations of the updates before the first set is accepted "
              "(from the nominal, far off: converge further before the held-out test)", range=(1, 1000)),
    ParamSpec("first_update_windows", 8, "stage-2 windows of the updates before the first set is accepted (more "
              "data for the fit from the far-off nominal)", range=(1, 1000)),
    ParamSpec("first_update_window_s", 0.2, "stage-2 window of the updates before the first set is accepted [s]",
              range=(0.01, 10.0)),
    ParamSpec("first_update_max_s", 90.0, "wall-time budget of stage 2 until the first set is accepted [s]",
              range=(0.1, 3600.0)),
    ParamSpec("stage2_window_s", 0.1, "stage-2 multiple-shooting window [s] (short windows keep the problem "
              "nearly linear from a 20 %-off start)", range=(0.01, 10.0)),
    ParamSpec("stage2_max_windows", 4, "stage-2 windows per update (spread over the sliding window)",
              range=(1, 1000)),
    ParamSpec("stage2_jacobian", "auto", "stage-2 Jacobian: auto (tangent where the engine has a tangent-linear "
              "model, else central) | tangent (exact, one rollout) | forward | central (finite differences in one "
              "batched rollout) | forward_ad (dual numbers)",
              choices=("auto", "tangent", "forward", "central", "forward_ad")),
    ParamSpec("prior_std", [0.3, 0.2, 0.2, 0.003], "stage-2 Gaussian prior around the NOMINAL model (each update "
              "starts from the active set), per kind: stiffness, damping, mass (relative), rest length [m]; "
              "0 = none. Damping is weakly seen in short windows: the prior keeps it near the nominal value "
              "instead of letting it random-walk from update to update",
              check=lambda v: None if len(v) == 4 and all(x >= 0 for x in v) else "4 values >= 0"),
    ParamSpec("max_update_s", 20.0, "wall-time budget of stage 2 per update [s]", range=(0.1, 3600.0)),
    ParamSpec("max_duty", 0.8, "largest share of the time the worker computes (after an update of T s it rests "
              "T (1/duty - 1) s)", range=(0.01, 1.0)),
    ParamSpec("delay_s", 0.0, "motor-to-mocap delay [s]", range=(0.0, 1.0)),
    ParamSpec("noise_std_m", 3e-4, "marker noise of the mocap system [m]: weighs the data against prior_std "
              "(0 = 1 mm)", range=(0.0, 0.1)),
    ParamSpec("device", "auto", "stage-2 device: auto (cuda when present) | cpu | cuda",
              choices=("auto", "cpu", "cuda"), read_only=True),
    ParamSpec("torch_threads", 1, "torch intra-op threads during an update", range=(1, 256), read_only=True),
    ParamSpec("worker", "process", "where updates run: process (a spawned child: never holds the callbacks' "
              "GIL) | thread", choices=WORKER_KINDS, read_only=True),
    ParamSpec("worker_nice", 5, "niceness of the worker process (background work)", range=(0, 19),
              read_only=True),
    ParamSpec("holdout_s", 2.0, "the most recent part of the window held out of each fit, to score the fit against "
              "the active set on data it did not see [s]", range=(0.2, 60.0)),
    ParamSpec("holdout_window_s", 0.25, "open-loop windows of the held-out scoring [s]", range=(0.02, 10.0)),
    ParamSpec("holdout_windows", 8, "held-out windows per update (at least 3)", range=(3, 1000)),
    ParamSpec("accept_margin_sigma", 3.0, "accept a fit only if it predicts the held-out windows better than the "
              "active set by more than this many standard errors of the paired improvement", range=(0.0, 100.0)),
    ParamSpec("accept_min_improvement", 0.25, "... and by at least this fraction of the active set's held-out mean "
              "squared error", range=(0.0, 1.0)),
    ParamSpec("max_residual_ratio", 3.0, "reject a fit whose residual exceeds this x the recent accepted ones",
              range=(1.0, 1000.0)),
    ParamSpec("residual_floor_m", 2e-3, "residuals below this are never a jump [m]", range=(0.0, 1.0)),
    ParamSpec("bounds_factor", 3.0, "scale parameters must stay within nominal / f .. nominal x f",
              range=(1.01, 1000.0)),
    ParamSpec("drift_ratio", 1.5, "drift warning when residuals grow by this factor on a stable set",
              range=(1.0, 1000.0)),
    ParamSpec("drift_window", 5, "fits per drift baseline / recent median", range=(1, 1000)),
    ParamSpec("save_dir", "", "default folder of ~/save_parameters ('' = build/identified)", read_only=True),
    ParamSpec("publish_nominal", True, "publish the nominal set at start (latched)", read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
