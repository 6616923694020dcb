"""Typed errors of the identification package (all are ValueErrors, so callers may catch broadly)."""
from __future__ import annotations

__all__ = ["IdentificationError", "DataError", "NotEnoughDataError", "DivergenceError"]


class IdentificationError(ValueError):
    """Identification could not produce a trustworthy estimate."""


class DataError(IdentificationError):
    """Unusable identification data (wrong shapes, non-finite stamps or values, no valid samples)."""


class NotEnoughDataError(DataError):
    """Too few usable samples (after masking invalid and outlying samples) for the requested parameters."""


class DivergenceError(IdentificationError):
    """The refinement produced non-finite losses or parameters (poisoned window, unstable rollout)."""
