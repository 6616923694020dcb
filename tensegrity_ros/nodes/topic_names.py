"""The graph's topic names and the parameters of a sensor stream's publisher QoS (names, choices, default depth).

ROS-free, so that the parameter tables (:mod:`.tables`) can be read without a ROS installation; the QoS profiles
built from these parameters are rclpy objects (:mod:`.topics`, which re-exports the names here).
"""
from __future__ import annotations

from typing import Tuple

from .params import ParamSpec

#: default topic names (all remappable with the usual ``--ros-args -r from:=to``)
TOPICS = {
    "markers": "/mocap/markers",
    "node_states": "/tensegrity/node_states",
    "motor_states": "/tensegrity/motor_states",
    "motor_commands": "/tensegrity/motor_commands",
    "motor_plan": "/tensegrity/motor_plan",
    "identified_parameters": "/tensegrity/identified_parameters",
    "predicted_states": "/tensegrity/predicted_states",
    "plate_c1": "/tensegrity/plate_c1",
    "plate_c2": "/tensegrity/plate_c2",
    "ground_truth": "/sim/ground_truth",
    "diagnostics": "/diagnostics",
    "tf": "/tf",
}

#: keep-last depth of a sensor stream's publisher by default (ROS' sensor-data QoS: shallow; :data:`.topics.SENSOR_QOS`)
SENSOR_DEPTH = 10
QOS_RELIABILITIES = ("best_effort", "reliable")


def sensor_qos_params(prefix: str, what: str) -> Tuple[ParamSpec, ...]:
    """The two parameters of a sensor stream's publisher QoS, ``<prefix>_reliability`` (best_effort | reliable)
    and ``<prefix>_depth`` (keep last), read-only (a profile is fixed when the publisher is made); the node builds
    the profile with ``sensor_qos(p[prefix + "_reliability"], p[prefix + "_depth"])``."""
    return (ParamSpec(f"{prefix}_reliability", "best_effort",
                      f"QoS reliability of {what}: best_effort (sensor data; readers of either kind match) or "
                      "reliable (only for readers that must not miss a sample, over a lossy link)",
                      choices=QOS_RELIABILITIES, read_only=True),
            ParamSpec(f"{prefix}_depth", SENSOR_DEPTH, f"QoS history depth (keep last) of {what}", range=(1, 10000),
                      read_only=True))
