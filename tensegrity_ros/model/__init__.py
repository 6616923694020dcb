"""Structure files: schema, validated loading and writing. Never imports torch, mujoco or rclpy."""
from .errors import StructureError
from .loader import dump_structure, load_structure, structure_from_dict, structure_to_dict
from .schema import (Actuator, Bar, CoincidentConstraint, Constraint, MidpointConstraint, Node, String,
                     Structure)

__all__ = ["Actuator", "Bar", "CoincidentConstraint", "Constraint", "MidpointConstraint", "Node", "String",
           "Structure", "StructureError", "dump_structure", "load_structure", "structure_from_dict",
           "structure_to_dict"]
