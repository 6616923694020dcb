"""`tensegrity emulate-bus --link PATH --ids 1,2,3 --model xm430`: a Protocol 2.0 device set on a pty."""
from ..hardware.dynamixel.emulator import add_arguments, run

__all__ = ["add_arguments", "run"]
