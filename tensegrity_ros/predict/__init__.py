"""Prediction core (no rclpy): how the predictions are scored after the fact (:mod:`.realized`)."""
from .realized import RealizedError

__all__ = ["RealizedError"]
