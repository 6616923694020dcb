"""Model-based control of the plate on the identified model (pure: no rclpy). See ``docs/control.md``.

:mod:`.outputs`: what is tracked (the plate pose 0C2, chosen node positions) as functions of the predictor's
state; :mod:`.mpc`: linear time-varying MPC on the predictor's linearisation, a QP solved by OSQP;
:mod:`.targets`: plate targets from poses, validated with a reason.
"""
from .mpc import MPCOptions, MPCResult, PlateMPC, Status, output_tolerances, project_plan
from .outputs import LinearOutputMap, PlateOutputMap, wrap_angle
from .targets import target_from_pose

__all__ = ["MPCOptions", "MPCResult", "PlateMPC", "Status", "output_tolerances", "project_plan",
           "LinearOutputMap", "PlateOutputMap", "wrap_angle", "target_from_pose"]
