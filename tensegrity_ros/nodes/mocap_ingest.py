"""``mocap_ingest``: unlabelled mocap markers in, labelled node states out (a thin shell over
:meth:`tensegrity_ros.mocap.MocapIngest.add_frame`, the same entry point as ``tensegrity identify``'s bag
reader and the tests).

Subscribes ``/mocap/markers`` (geometry_msgs/PoseArray, one pose per marker, any frame; remap it to your
mocap driver's topic). Publishes, once per mocap frame:

* ``/tensegrity/node_states`` (tensegrity_ros/NodeStates): marker nodes in the structure frame
  (``frame_id``), velocities from the per-node Kalman filter; occluded / rejected nodes ``valid=false``
  with NaN; a velocity not yet estimated is NaN;
* ``/tensegrity/plate_c1``, ``/tensegrity/plate_c2`` (geometry_msgs/PoseStamped): the seed's plate frames
  (only while the plate's three nodes are seen);
* ``/tf`` (tf2_msgs/TFMessage): ``frame_id`` -> ``c0``, ``c1``, ``c2`` (the plates), once per frame;
* ``/tf_static`` (latched): the registration, ``mocap`` -> ``frame_id``, whenever it is found or changes (at
  start, after a refresh). ``mocap`` is the markers' ``header.frame_id`` (``mocap_frame_id`` overrides it).
  tf2_msgs has no pip wheel: ``make setup`` builds its TFMessage (docs/viz.md); a ROS machine has its own.

The markers subscription is a sensor-data reader by default (``_common.SENSOR_READER_QOS``: best effort, so it
matches best-effort and reliable mocap drivers alike, with a deep queue of its own, so a late executor loses
nothing); ``mocap_qos_reliability: reliable`` asks for retransmission too (matches reliable drivers only).

Service ``~/refresh_transform`` (std_srvs/Trigger): re-fit the mocap -> structure transform on the fixed nodes.
Diagnostics (1 Hz): registration, visible nodes, label residuals, frame rate, processing time p50/p99, input
drops.
"""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import numpy as np
from geometry_msgs.msg import PoseArray, PoseStamped
from rclpy.qos import DurabilityPolicy, QoSProfile
from std_srvs.srv import Trigger
from tf2_msgs.msg import TFMessage

from ..mocap import IngestConfig, KalmanConfig, LabellerConfig, MocapError, MocapIngest
from ..mocap.geometry import rotation_angle, same_transform
from ..model import load_structure
from . import _common as C
from .tables.mocap_ingest import PARAMS
from tensegrity_ros.msg import NodeStates

#: the markers subscription's QoS by ``mocap_qos_reliability``
MOCAP_QOS = {"best_effort": C.SENSOR_READER_QOS, "reliable": C.STREAM_QOS}
#: /tf_static as tf2's StaticTransformBroadcaster publishes it: latched, the last message only
TF_STATIC_TOPIC = "/tf_static"
TF_STATIC_QOS = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL)


class MocapIngestNode(C.GraphNode):
    DEFAULT_NAME = "mocap_ingest"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        p = self.p
        self.structure = load_structure(p["model_file"])
        labeller = LabellerConfig(
            gate_m=p["gate_m"], bar_tolerance_m=p["bar_tolerance_m"], reacquire_gate_m=p["reacquire_gate_m"],
            max_speed_mps=p["max_speed_mps"], registration_rms_m=p["registration_rms_m"],
            registration_timeout_s=p["registration_timeout_s"],
            initial_transform=C.transform_from_list(p["initial_transform"]),
            initial_transform_tolerance_deg=p["initial_transform_tolerance_deg"],
            auto_refresh_frames=p["auto_refresh_frames"] or None)
        kalman = KalmanConfig(measurement_std_m=p["measurement_std_m"], accel_psd=p["accel_psd"])
        self.ingest = MocapIngest(self.structure, IngestConfig(labeller=labeller, kalman=kalman,
                                                               frame_id=p["frame_id"]))
        self._lock = threading.Lock()
        self.seq = C.SequenceMonitor()
        self.proc_time = C.RollingStats(2000)
        self.rate = C.RateMeter()
        self.frames = 0
        self.registration_errors = 0
        self.refreshes = 0
        self.last_error = ""
        self.last_sample = None
        self.mocap_frame = ""

        self.pub_states = self.counting_publisher(NodeStates, C.TOPICS["node_states"], C.STREAM_QOS)
        self.pub_plates = {name: self.counting_publisher(PoseStamped, C.TOPICS[f"plate_{name.lower()}"],
                                                         C.STREAM_QOS) for name in ("C1", "C2")}
        self.pub_tf = self.create_publisher(TFMessage, C.TOPICS["tf"], C.STREAM_QOS)
        self.pub_tf_static = self.create_publisher(TFMessage, TF_STATIC_TOPIC, TF_STATIC_QOS)
        self.registration_sent = None      # (R, t) last put on /tf_static
        self.markers_topic = C.TOPICS["markers"]
        self.sub = self.subscribe(PoseArray, self.markers_topic, self._on_markers,
                                  MOCAP_QOS[p["mocap_qos_reliability"]], raw=True)
        self.srv = self.create_service(Trigger, "~/refresh_transform", self._on_refresh_srv)
        self.timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        self.get_logger().info(f"{self.structure.name}: {len(self.ingest.names)} marker nodes; waiting for "
                               f"markers on {self.sub.topic_name}")

    # ---- data path ----------------------------------------------------------------------------------
    def _on_markers(self, data: bytes, info=None) -> None:
        """A PoseArray, subscribed raw (serialised) and decoded with numpy (see _common's fast codecs)."""
        t_in = time.perf_counter()
        self.seq.update_info(self.markers_topic, info)
        self.rate.tick()
        stamp, markers, self.mocap_frame = C.markers_from_cdr(data)
        with self._lock:
            try:
                sample = self.ingest.add_frame(stamp, markers)
            except MocapError as e:   # no registration within the timeout: say why, start over
                self.registration_errors += 1
                self.last_error = str(e)
                self.get_logger().error(f"mocap: {e}", throttle_duration_sec=5.0)
                self.ingest.reset()
                return
        self.frames += 1
        self.last_sample = sample
        self.pub_states.publish(C.sample_to_cdr(sample))
        self._publish_plates(sample)
        if self.p["publish_tf"]:
            self._publish_registration(sample.stamp)
        self.proc_time.add(time.perf_counter() - t_in)

    def registration_matrix(self) -> Optional[np.ndarray]:
        """The structure frame's pose in the mocap frame (4x4), the inverse of the registration
        x_structure = R x_mocap + t; None before one is found."""
        tr = self.ingest.transform
        if tr is None:
            return None
        R, t = tr
        T = np.eye(4)
        T[:3, :3] = R.T
        T[:3, 3] = -R.T @ t
        return T

    def _publish_registration(self, stamp: float) -> None:
        """mocap -> structure on /tf_static when the registration is new or has changed (latched)."""
        tr = self.ingest.transform
        if tr is None or same_transform(tr, self.registration_sent):
            return
        self.registration_sent = tr
        parent = self.p["mocap_frame_id"] or self.mocap_frame or "mocap"
        self.pub_tf_static.publish(TFMessage(transforms=[C.transform_stamped_from_matrix(
            stamp, self.registration_matrix(), parent, self.p["frame_id"])]))

    def _publish_plates(self, sample) -> None:
        frame = self.p["frame_id"]
        tf = self.p["publish_tf"] and self.frames % self.p["tf_every"] == 0
        transforms = []
        for name, T in sample.plate_poses.items():
            if T is None:
                continue
            pub = self.pub_plates.get(name)
            if pub is not None:
                pub.publish(C.pose_stamped_from_matrix(sample.stamp, T, frame))
            if tf:
                transforms.append(C.transform_stamped_from_matrix(sample.stamp, T, frame, name.lower()))
        if transforms:
            self.pub_tf.publish(TFMessage(transforms=transforms))

    # ---- transform refresh ---------------------------------------------------------------------------
    def refresh_transform(self) -> str:
        """Re-fit the mocap->structure transform; returns a one-line result (raises MocapError)."""
        with self._lock:
            R, t = self.ingest.refresh_transform()
            self.refreshes += 1
        angle = np.degrees(rotation_angle(R))
        return f"transform refreshed: rotation {angle:.2f} deg, translation {np.round(t, 4).tolist()} m"

    def _on_refresh_srv(self, request, response):
        try:
            response.message = self.refresh_transform()
            response.success = True
        except MocapError as e:
            response.success, response.message = False, str(e)
        return response

    # ---- diagnostics ----------------------------------------------------------------------------------
    def _diagnostics(self) -> None:
        s = self.last_sample
        n = len(self.ingest.names)
        vals = {"frames": self.frames, "rate_hz": self.rate.rate(), "marker_nodes": n,
                "registered": bool(s is not None and s.registered),
                "input_dropped": self.seq.total_dropped, "registration_errors": self.registration_errors,
                "mocap_frame": self.mocap_frame}
        vals.update(self.proc_time.summary(1e3, "processing_ms_"))
        if s is None:
            level, message = "stale", f"no markers yet on {self.markers_topic}"
        elif not s.registered:
            level, message = ("error", self.last_error) if self.last_error else ("warn", "registering")
        else:
            seen = int(s.valid.sum())
            vals["visible_nodes"] = seen
            vals["velocity_valid_nodes"] = int(s.velocity_valid.sum())
            res = s.residuals[np.isfinite(s.residuals)]
            vals["label_residual_rms_mm"] = float(np.sqrt(np.mean(res ** 2)) * 1e3) if res.size else float("nan")
            tr = self.ingest.transform
            if tr is not None:
                vals["transform_t_m"] = np.round(tr[1], 4).tolist()
            level = "ok" if seen == n else "warn"
            message = f"tracking {seen}/{n} nodes at {vals['rate_hz']:.0f} Hz"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: mocap ingest", level, message, vals,
                                                self.structure.name)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(MocapIngestNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
