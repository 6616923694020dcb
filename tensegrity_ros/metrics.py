"""Error figures written once (numpy only): :func:`rms_error`, the root mean square of position errors that the
identify report, the demo's prediction scores, the controller demo and the benches give in mm."""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np


def rms_error(errors, axis: Optional[int] = None, *, skip_missing: bool = False) -> Union[float, np.ndarray]:
    """Root mean square of ``errors`` (e.g. 3-D node-position errors, m), over all of them (a float) or along
    ``axis`` (an array); NaN where there are none.

    skip_missing: non-finite entries (samples not measured: an occluded node, a frame without a prediction) are
    left out instead of making the result NaN."""
    e = np.asarray(errors, dtype=float)
    if axis is None:
        e = e.ravel()
        if skip_missing:
            e = e[np.isfinite(e)]
        return float(np.sqrt(np.mean(e ** 2))) if e.size else math.nan
    if not skip_missing:
        return np.sqrt(np.mean(e ** 2, axis=axis))
    ok = np.isfinite(e)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt((np.where(ok, e, 0.0) ** 2).sum(axis=axis) / ok.sum(axis=axis))
