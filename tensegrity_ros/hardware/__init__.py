"""Hardware layer: Dynamixel bus (real or emulated), safety clamps and the driver loop core.

Never imports rclpy; the ROS shell is ``tensegrity_ros/nodes/dynamixel_driver.py``.
"""
from .driver_core import (BusConfig, DriverCore, DriverStats, MotorSpec, MotorStates, RateScheduler,
                          load_bus_config, make_bus, resolve_actuators)
from .dynamixel.bus import DynamixelBus, MotorReading
from .dynamixel.emulator import EmulatedBus, FaultConfig, emulate_bus_main
from .dynamixel.errors import (BaudMismatch, CommError, DynamixelError, HardwareError, ModelMismatch,
                               MotorMissing, NoResponse, PacketError, PortNotFound)
from .dynamixel.tables import ControlTable, get_table
from .safety import (Action, SafetyConfig, SafetyFilter, blend, blend_weight, clamp_goals,
                     hardware_error_policy, rate_limit, watchdog)

__all__ = [
    "Action", "BaudMismatch", "BusConfig", "CommError", "ControlTable", "DriverCore", "DriverStats",
    "DynamixelBus", "DynamixelError", "EmulatedBus", "FaultConfig", "HardwareError", "ModelMismatch",
    "MotorMissing", "MotorReading", "MotorSpec", "MotorStates", "NoResponse", "PacketError", "PortNotFound",
    "RateScheduler", "SafetyConfig", "SafetyFilter", "blend", "blend_weight", "clamp_goals", "emulate_bus_main",
    "get_table", "hardware_error_policy", "load_bus_config", "make_bus", "rate_limit", "resolve_actuators",
    "watchdog",
]
