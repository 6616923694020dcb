"""Black-box identification baselines with the MuJoCo twin in the loop (the spring-rod seed's comparisons).

* :func:`least_squares_lbfgsb` -- scipy L-BFGS-B on the trajectory MSE, bounds [0.1, 1000], finite-difference
  gradients (the seed's "LS").
* :func:`cma_es` -- the ``cma`` package's CMA-ES, bounds [0.1, 1000], ``tolfun`` 1 (the seed's "CMA-ES").
* :func:`mujoco_minimize` -- ``mujoco.minimize.least_squares`` (Levenberg-Marquardt with finite-difference
  Jacobians), the default backend of ``mujoco.sysid.optimize``.
* :func:`mujoco_sysid` -- ``mujoco.sysid.optimize`` itself with its ``Parameter``/``ParameterDict`` (needs
  absl-py, colorama, tabulate, pinned in requirements/lock.txt; :func:`mujoco_sysid_available` says whether it
  imports). bench/bench_sysid_baseline.py sets it beside ours.

All share :class:`TwinObjective`: parameter groups (one value per group, e.g. one K for all strings) are
written into the structure, the twin is rebuilt and simulated from each trajectory's recorded initial
node state with its recorded motor angles, and the node positions are compared with the recording.
"""
from .mujoco_loop import (BaselineResult, TwinObjective, cma_es, least_squares_lbfgsb, mujoco_minimize,
                          mujoco_sysid, mujoco_sysid_available)

__all__ = ["BaselineResult", "TwinObjective", "cma_es", "least_squares_lbfgsb", "mujoco_minimize", "mujoco_sysid",
           "mujoco_sysid_available"]
