"""Prediction of a recording by a model, the way a controller uses it: from a measured state, one horizon
ahead, driven by the recorded motor angles; restarted from the measurement every horizon."""
from __future__ import annotations

import numpy as np
import torch

from ..engine import Inputs, make_engine
from ..mocap import smooth_derivatives


def horizon_prediction(structure, dataset, horizon_s: float = 1.0, sim_dt: float = 1e-3) -> np.ndarray:
    """Predict ``dataset`` piecewise: every ``horizon_s`` restart from the measured state.

    dataset: an identification Dataset (times (T,), positions (T, N, 3), valid (T, N), motor_angles (T, A)).
    Returns (T, N, 3) predicted node positions in m at the dataset's stamps, NaN where no segment could
    start (a segment starts at the first frame whose independent nodes are all measured). Initial
    velocities come from a local polynomial fit of the measured positions. All segments run as one batch.
    """
    engine = make_engine(structure)
    free = np.asarray(engine.topology.free_nodes, dtype=int)
    out = np.full(dataset.positions.shape, np.nan)
    t = dataset.times
    complete = dataset.valid[:, free].all(axis=1)
    starts, next_t = [], t[0]
    for k in np.flatnonzero(complete):
        if t[k] >= next_t:
            starts.append(int(k))
            next_t = t[k] + horizon_s
    if not starts:
        return out
    deriv = smooth_derivatives(t, dataset.positions, dataset.valid)
    x0 = np.nan_to_num(dataset.positions[starts])
    v0 = np.nan_to_num(deriv.velocities[starts])
    params = engine.default_params()
    state = engine.project(params, engine.initial_state(torch.as_tensor(x0), torch.as_tensor(v0)))
    n_steps = int(round(horizon_s / sim_dt))
    inputs = None
    if dataset.motor_angles is not None and dataset.motor_angles.shape[1]:
        tt = t[starts][None, :] + sim_dt * np.arange(1, n_steps + 1)[:, None]  # (steps, B)
        u = np.stack([np.interp(tt, t, dataset.motor_angles[:, j]) for j in range(dataset.motor_angles.shape[1])], -1)
        inputs = Inputs(motor_angles=torch.as_tensor(u))
    with torch.no_grad():
        X = engine.rollout(params, state, inputs, dt=sim_dt, steps=n_steps).positions.numpy()  # (steps, B, N, 3)
    X = np.concatenate([state.positions.numpy()[None], X], axis=0)
    for b, k0 in enumerate(starts):
        ks = np.flatnonzero((t >= t[k0]) & (t < t[k0] + horizon_s))
        idx = np.clip(np.round((t[ks] - t[k0]) / sim_dt).astype(int), 0, n_steps)
        out[ks] = X[idx, b]
    return out
