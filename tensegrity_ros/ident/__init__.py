"""System identification of tensegrity structures (functional core, no ROS).

* :mod:`.data` -- the :class:`Dataset` record (mocap times, node positions, valid mask, motor angles),
  windows, derivative estimates, screening of poisoned samples.
* :mod:`.regression` -- stage 1: closed-form (weighted) least squares of masses, stiffnesses, dampings
  (and rest-length offsets), bar-length multipliers eliminated by a null-space projection.
* :mod:`.refine` -- stage 2: all parameters (plus actuator mapping and motor delay) through engine
  rollouts, multiple shooting, L-BFGS / Adam.
* :mod:`.uncertainty` -- Gauss-Newton covariance (sandwich-calibrated by default), identifiability,
  identifiable ratios.
* :mod:`.mismatch` -- can the fitted model explain the data? (residual vs the noise estimated from the tracks,
  structure of the residual in time).
* :mod:`.heldout` -- held-out windows set aside before the fit; fit vs nominal on them; parameters the data
  cannot move.
* :mod:`.lawcheck` -- which stiffness law the actuated strings follow: the file's, refitted against the other.
* :mod:`.jackknife` -- standard deviations widened by how much each window moves the fit (``--jackknife``).
* :mod:`.pipeline` -- :func:`identify`, the single entry point.
* :mod:`.online` -- the online identifier's core: sliding window, the worker's fit (:func:`~.online.fit_window`),
  accept / reject (:func:`~.online.decide`) and drift.
* :mod:`.baselines` -- least squares (L-BFGS-B) and CMA-ES with MuJoCo in the loop, ``mujoco.sysid``.

See docs/identification.md.
"""
from .data import Dataset, Window, add_marker_noise, cut_windows, derivatives, drop_frames, make_dataset, screen_dataset
from .errors import DataError, DivergenceError, IdentificationError, NotEnoughDataError
from .pipeline import LONGER_WINDOWS_LADDER, STAGES, IdentificationResult, IdentifyOptions, identify
from .refine import RefineOptions, RefineResult, refine
from .regression import RegressionOptions, RegressionResult, regress

__all__ = ["DataError", "Dataset", "DivergenceError", "IdentificationError", "IdentificationResult", "IdentifyOptions",
           "LONGER_WINDOWS_LADDER", "NotEnoughDataError", "RefineOptions", "RefineResult", "RegressionOptions",
           "RegressionResult", "STAGES", "Window", "add_marker_noise", "cut_windows", "derivatives", "drop_frames",
           "identify", "make_dataset", "refine", "regress", "screen_dataset"]
