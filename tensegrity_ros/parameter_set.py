"""An identified parameter set as plain arrays (no rclpy, no torch): :class:`ParameterSet`, what an
``IdentifiedParameters`` message carries (:func:`split_name` is re-exported from its owner,
:mod:`tensegrity_ros.param_names`).

The online identifier (:mod:`tensegrity_ros.ident.online`) builds and judges these; the message conversions
live with the nodes (``nodes._common.parameter_set_to_msg`` / ``parameter_set_from_msg``), which re-export
both names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import numpy as np

from .param_names import split_name  # noqa: F401  (re-exported: nodes._common, older callers)


@dataclass(frozen=True)
class ParameterSet:
    """One identified parameter set (what IdentifiedParameters carries), as plain arrays.

    names: (P,) engine parameter names ``<element>.<kind>``; values / std_devs / identifiability: (P,);
    fit_residual: RMS node-position error of the fit over the window, m; window: (start, end) s;
    stamp: when the fit finished, s.
    """

    set_id: str
    names: Tuple[str, ...]
    values: np.ndarray
    std_devs: np.ndarray
    identifiability: np.ndarray
    fit_residual: float = math.nan
    window: Tuple[float, float] = (0.0, 0.0)
    converged: bool = False
    status: str = ""
    stamp: float = 0.0

    def as_dict(self) -> Dict[str, float]:
        return {n: float(v) for n, v in zip(self.names, self.values)}

    def std_dict(self) -> Dict[str, float]:
        return {n: float(v) for n, v in zip(self.names, self.std_devs)}

