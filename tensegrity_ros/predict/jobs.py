"""The predictor's worker jobs (no rclpy): what runs in the worker (a spawned process by default) of the state
predictor and of the plate controller. Importing this module imports neither rclpy nor ``tensegrity_ros.nodes``,
so a worker that unpickles these functions stays free of ROS.

The predictor core (``HorizonPredictor(structure, **options)``) is built once per worker and ``key``
(:func:`core_job`, ahead of the first job) and reused by every :func:`relinearize_job`.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..model import Structure
from .horizon import HorizonPredictor, Linearization

_WORKER_CORES: Dict[int, HorizonPredictor] = {}


def core_job(key: int, structure: Structure, options: Dict[str, object]) -> int:
    """Build the worker's predictor core ahead of the first relinearisation; returns the worker's pid."""
    import os
    if key not in _WORKER_CORES:
        core = _WORKER_CORES[key] = HorizonPredictor(structure, **options)
        # warm up: torch's first calls of each op and the stable substep count of the nominal parameters
        n_u = core.n_u
        core.linearize(core.engine.default_params(), 0.0, core.X0, np.zeros_like(core.X0),
                       np.repeat(np.array([[a.zero_offset for a in structure.actuators]]), 12, axis=0) if n_u else None,
                       11)
    return os.getpid()


def relinearize_job(key: int, structure: Structure, options: Dict[str, object], values: Dict[str, float], t0: float,
                    P: np.ndarray, V: np.ndarray, u: Optional[np.ndarray], steps: int, set_id: str) -> Linearization:
    """Nominal + Jacobians from full-node positions / velocities (N, 3) at t0 with parameter values by name.
    The predictor core (``HorizonPredictor(structure, **options)``) is built once per worker (``key``)."""
    core = _WORKER_CORES.get(key)
    if core is None:
        core = _WORKER_CORES[key] = HorizonPredictor(structure, **options)
    params = core.engine.default_params().with_values(values)
    return core.linearize(params, t0, P, V, u, steps, set_id)
