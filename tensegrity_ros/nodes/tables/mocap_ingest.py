"""``mocap_ingest``'s parameters (:mod:`tensegrity_ros.nodes.mocap_ingest`): the labelling and filtering defaults
are :class:`~tensegrity_ros.mocap.LabellerConfig`'s and :class:`~tensegrity_ros.mocap.KalmanConfig`'s."""
from __future__ import annotations

from ...mocap import KalmanConfig, LabellerConfig
from ..params import ParamSpec, required_file, transform_list
from ..topic_names import QOS_RELIABILITIES

_L, _K = LabellerConfig(), KalmanConfig()

PARAMS = (
    ParamSpec("model_file", "", "structure YAML (node names, bars, fixed nodes)", check=required_file,
              read_only=True),
    ParamSpec("frame_id", "structure", "frame of the published node states and plate poses", read_only=True),
    ParamSpec("initial_transform", [], "rough mocap->structure transform ([] | R row-major + t (12) | 4x4 "
              "row-major (16)); picks the labelling of a symmetric structure", check=transform_list,
              read_only=True, type_="double_array"),
    ParamSpec("initial_transform_tolerance_deg", _L.initial_transform_tolerance_deg, "how far initial_transform's "
              "rotation may be off [deg]: only labellings within it compete at registration", range=(1.0, 180.0),
              read_only=True),
    ParamSpec("mocap_qos_reliability", "best_effort", "QoS of the markers subscription: best_effort (sensor data: "
              "matches any mocap driver) | reliable (retransmitted; matches reliable drivers only); keep last 1000",
              choices=QOS_RELIABILITIES, read_only=True),
    ParamSpec("mocap_frame_id", "", "parent frame of the registration on /tf_static ('' = the markers' "
              "header.frame_id, 'mocap' where that is empty)", read_only=True),
    ParamSpec("publish_tf", True, "publish the plates (c0/c1/c2) on /tf and the registration on /tf_static"),
    # /tf at the full 120 Hz cost the demo's one process its prediction latency (p99 17.8-27 ms against 9.4 ms
    # without it, 2026-11-26): the TransformStamped objects are built in Python under the GIL. RViz draws at
    # ~30 Hz; every node state still carries the plates at 120 Hz
    ParamSpec("tf_every", 4, "publish the plates on /tf every n-th frame (4: 30 Hz at 120-Hz mocap)",
              range=(1, 1000)),
    ParamSpec("gate_m", _L.gate_m, "tracking gate around each predicted node [m]", range=(1e-4, 1.0),
              read_only=True),
    ParamSpec("bar_tolerance_m", _L.bar_tolerance_m, "rigid-pair length tolerance [m]", range=(1e-4, 0.5),
              read_only=True),
    ParamSpec("reacquire_gate_m", _L.reacquire_gate_m, "largest re-acquisition radius after an occlusion [m]",
              range=(1e-3, 5.0), read_only=True),
    ParamSpec("max_speed_mps", _L.max_speed_mps, "node speed bound for re-acquisition [m/s]", range=(1e-3, 20.0),
              read_only=True),
    ParamSpec("registration_rms_m", _L.registration_rms_m, "largest RMS of an accepted registration [m]",
              range=(1e-4, 1.0), read_only=True),
    ParamSpec("registration_timeout_s", _L.registration_timeout_s, "report an error after this long without a "
              "registration [s]", range=(0.0, 600.0), read_only=True),
    ParamSpec("auto_refresh_frames", 120, "re-fit the transform on the fixed nodes' mean position at every frame "
              "until this many frames (0 = never)", range=(0, 100000), read_only=True),
    ParamSpec("measurement_std_m", _K.measurement_std_m, "marker noise for the velocity filter [m]",
              range=(1e-6, 0.1), read_only=True),
    ParamSpec("accel_psd", _K.accel_psd, "velocity filter process noise [m^2/s^3]", range=(1e-9, 1e3),
              read_only=True),
    ParamSpec("diagnostics_period_s", 1.0, "diagnostics period [s]", range=(0.05, 60.0), read_only=True),
)
