"""MuJoCo digital twin: MJCF generation from structure files, a stepping simulator, and mocap marker synthesis.

``build_mjcf(structure) -> str``; ``TwinSim(structure)``; ``simulate(structure, motor_angle_fn, duration)``;
``markers(node_positions, MocapFrame(), noise_std, occlusion_prob, rng)``. See ``docs/twin.md``.
"""
from .markers import MocapFrame, markers, physical_node_indices
from .mjcf import TwinBuildError, TwinLayout, build_layout, build_mjcf, string_kappa
from .sim import Trajectory, TwinSim, simulate

__all__ = ["MocapFrame", "Trajectory", "TwinBuildError", "TwinLayout", "TwinSim", "build_layout", "build_mjcf",
           "markers", "physical_node_indices", "simulate", "string_kappa"]
