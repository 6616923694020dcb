"""Prediction core (no rclpy), what the ``state_predictor`` node (and the plate controller) run:

* :mod:`.motor_future` -- the commanded motor trajectory over the horizon: :class:`MotorPlan`,
  :class:`ReferenceTracker` (the driver's reference phase-locked to the measured angles), :class:`MotorFuture`;
* :mod:`.horizon` -- the linearised horizon predictor: :class:`HorizonPredictor`, :class:`Linearization`;
* :mod:`.stream` -- :class:`PredictionStream`: when to relinearise, and each message's prediction;
* :mod:`.jobs` -- :func:`core_job`, :func:`relinearize_job`: what runs in the worker process;
* :mod:`.realized` -- how the predictions are scored after the fact (:class:`RealizedError`).
"""
from .horizon import HorizonPredictor, Linearization
from .jobs import core_job, relinearize_job
from .motor_future import MotorFuture, MotorPlan, ReferenceTracker
from .realized import RealizedError
from .stream import PredictionStream

__all__ = ["HorizonPredictor", "Linearization", "MotorFuture", "MotorPlan", "PredictionStream", "RealizedError",
           "ReferenceTracker", "core_job", "relinearize_job"]
