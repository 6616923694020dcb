"""``dynamixel_driver``'s parameters (:mod:`tensegrity_ros.nodes.dynamixel_driver`; a ``bus_config`` file's values
replace the defaults of the bus parameters when the node declares them)."""
from __future__ import annotations

from typing import Tuple

from ...hardware.driver_core import COMMAND_SOURCES
from ...hardware.dynamixel.bus import SDK_BAUDS
from ..params import ParamSpec, file_exists
from ..topic_names import TOPICS, sensor_qos_params

PARAMS: Tuple[ParamSpec, ...] = (
    ParamSpec("bus_config", "", "bus YAML whose values are the defaults of the other parameters", check=file_exists,
              read_only=True),
    ParamSpec("managed", False, "lifecycle node driven by a manager (the launch files); false: configure and "
              "activate at start (tensegrity demo)", read_only=True),
    ParamSpec("bus", "real", "real | emulated", choices=("real", "emulated"), read_only=True),
    ParamSpec("port", "/dev/ttyUSB0", "serial device (real) or optional pty symlink (emulated)", read_only=True),
    ParamSpec("baud", 1_000_000, f"baud rate, one of {SDK_BAUDS}", read_only=True,
              check=lambda v: None if v in SDK_BAUDS else f"not a standard rate the SDK accepts: {SDK_BAUDS}"),
    ParamSpec("rate_hz", 80.0, "control loop rate [Hz]", range=(1.0, 1000.0), read_only=True),
    ParamSpec("model_file", "", "structure YAML with the actuators", check=file_exists, read_only=True),
    ParamSpec("reference_file", "", "reference YAML for command_source=reference", check=file_exists, read_only=True),
    ParamSpec("command_source", "hold", "reference | topic | hold | plan", choices=COMMAND_SOURCES),
    ParamSpec("plan_timeout_s", 0.25, "motor plans older than this are stale: hold [s]", range=(0.001, 60.0),
              read_only=True),
    ParamSpec("plan_dt", 0.01, "step of a JointState motor plan [s]", range=(1e-4, 10.0), read_only=True),
    ParamSpec("watchdog_s", 0.25, "topic commands older than this are ignored [s]", range=(0.001, 60.0),
              read_only=True),
    ParamSpec("max_rate", 1.0, "goal slew-rate limit [rad/s]", range=(0.001, 100.0), read_only=True),
    ParamSpec("ramp_s", 1.0, "blend time after a command-source switch [s]", range=(0.0, 60.0), read_only=True),
    *sensor_qos_params("states_qos", TOPICS["motor_states"]),
)
