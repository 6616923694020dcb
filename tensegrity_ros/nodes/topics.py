"""Topic names and QoS profiles of the graph, and the QoS parameters of a sensor stream's publisher.

* **QoS**: reliable, keep-last, deep queues on the graph's own streams, so that a dropped message is a real drop
  (queue overflow) and is seen as a gap in the publication sequence numbers. Sensor streams (motor states, mocap)
  are sensor-data QoS by default (best effort, shallow; :data:`SENSOR_QOS`, :func:`sensor_qos`,
  :func:`sensor_qos_params`), and every reader of them uses :data:`SENSOR_READER_QOS`, which matches either kind.

Imports ``rclpy.qos`` (the profiles are rclpy objects). The topic names and the QoS parameters, which the
parameter tables need without ROS, are in :mod:`.topic_names` (re-exported here).
"""
from __future__ import annotations

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from .topic_names import QOS_RELIABILITIES, SENSOR_DEPTH, TOPICS, sensor_qos_params  # noqa: F401 (re-exported)


def _qos(depth: int, reliable: bool = True, latched: bool = False) -> QoSProfile:
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


#: The graph's own 120 Hz streams (node states, plate poses, the simulated mocap): reliable with ~8 s of queue (1000
#: messages), so nothing is lost while the executor runs late (a worker starting, a CPU shared with other work); a
#: loss (queue overflow) shows up as a publication-sequence gap. Motor states are a sensor stream (SENSOR_QOS below).
STREAM_DEPTH = 1000
STREAM_QOS = _qos(STREAM_DEPTH)
#: the same depth, best effort: for mocap drivers that publish best effort (a reliable reader would not
#: match them); drops are still counted from sequence numbers.
STREAM_QOS_BEST_EFFORT = _qos(STREAM_DEPTH, reliable=False)
#: a reader that acts on the newest message only (the plate controller's node states): reliable, keep last 1, so
#: after the executor ran late it takes the newest state, not the oldest of a queue it would drain one per wake
LATEST_QOS = _qos(1)
#: predictions (large messages): reliable, shorter queue (the predictor's publisher, and consumers that act on the
#: newest prediction; the graph's monitor, which counts every one, reads them with STREAM_QOS)
PREDICTION_QOS = _qos(32)
#: identified parameter sets: reliable and latched (a late subscriber gets the recent sets, the last one current)
LATCHED_QOS = _qos(10, latched=True)
DIAG_QOS = _qos(32)


def stream_qos(reliability: str) -> QoSProfile:
    """STREAM_QOS for ``reliable``, STREAM_QOS_BEST_EFFORT for ``best_effort``."""
    if reliability not in ("reliable", "best_effort"):
        raise ValueError(f"reliability {reliability!r} (valid: reliable, best_effort)")
    return STREAM_QOS if reliability == "reliable" else STREAM_QOS_BEST_EFFORT


#: Sensor streams (motor states, mocap): ROS' sensor-data QoS (``rclpy.qos.qos_profile_sensor_data``: best effort,
#: keep last, shallow) by default on the publisher. A late sample is worth less than the next one, and no slow or
#: lost reader makes the writer resend or hold old samples. Configurable per node (:func:`sensor_qos_params`).
SENSOR_QOS = _qos(SENSOR_DEPTH, reliable=False)
#: Every reader of a sensor stream: best effort, so it matches a best-effort AND a reliable writer (a reliable
#: reader matches no best-effort writer: it would silently receive nothing), with STREAM_DEPTH as its own queue, so
#: a reader whose executor runs late keeps the samples instead of overwriting them. What the transport loses still
#: shows as a publication-sequence gap.
SENSOR_READER_QOS = STREAM_QOS_BEST_EFFORT


def sensor_qos(reliability: str = "best_effort", depth: int = SENSOR_DEPTH) -> QoSProfile:
    """A sensor stream's publisher profile: keep last ``depth``, ``best_effort`` (default) or ``reliable``."""
    if reliability not in QOS_RELIABILITIES:
        raise ValueError(f"reliability {reliability!r} (valid: {', '.join(QOS_RELIABILITIES)})")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"QoS depth must be a positive integer, got {depth!r}")
    if reliability == "best_effort" and depth == SENSOR_DEPTH:
        return SENSOR_QOS
    return _qos(depth, reliable=reliability == "reliable")
