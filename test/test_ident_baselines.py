"""The black-box baselines of `make bench` (``ident.baselines.mujoco_loop``): the MuJoCo-twin-in-the-loop objective
and mujoco.sysid on it. What the bench's comparison rests on: the objective's residual is zero at the truth, its
prior rows are the identification's Gaussian prior in the residual's units, and mujoco.sysid finds the spring rod's
K/M and c/M from one twin trajectory."""
from __future__ import annotations

import numpy as np
import pytest

from tensegrity_ros.ident.baselines.mujoco_loop import (TwinObjective, TwinTrial, mujoco_sysid,
                                                        mujoco_sysid_available, twin_rollout)
from tensegrity_ros.ident.synthetic import random_initial_state
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import CONFIG_DIR

pytest.importorskip("mujoco")
GROUPS = {"K": ("s1.stiffness", "s2.stiffness"), "c": ("s1.damping", "s2.damping"), "M": ("rod.mass",)}
TRUTH = (100.0, 10.0, 10.0)       # config/models/spring_rod.yaml: K, c, M


@pytest.fixture(scope="module")
def rod_trial():
    s = load_structure(CONFIG_DIR / "models" / "spring_rod.yaml")
    X0, V0 = random_initial_state(s, np.random.default_rng(3), pos_std=0.2, vel_std=0.5)
    P, _ = twin_rollout(s, X0, V0, 200, timestep=1e-3, integrator="Euler")
    return s, TwinTrial(X0, V0, 200, 1, P)


def test_objective_is_zero_at_the_truth_and_its_prior_rows_are_the_gaussian_prior(rod_trial):
    s, trial = rod_trial
    plain = TwinObjective(s, [trial], GROUPS)
    assert plain.mse(TRUTH) < 1e-18 and plain.mse((120.0, 10.0, 10.0)) > 1.0
    centre, std = np.array([90.0, 12.0, 10.0]), np.array([18.0, 2.4, 0.2])
    with_prior = TwinObjective(s, [trial], GROUPS, prior=(centre, std), noise_mm=0.1)
    r = with_prior.residual(TRUTH)
    assert r.shape == (len(plain.residual(TRUTH)) + 3,)
    np.testing.assert_allclose(r[-3:], 0.1 * (np.array(TRUTH) - centre) / std)
    assert with_prior.mse(TRUTH) == pytest.approx(plain.mse(TRUTH), abs=1e-18)   # mse: the trajectory only


@pytest.mark.skipif(not mujoco_sysid_available()[0], reason="mujoco.sysid not importable (absl-py missing)")
def test_mujoco_sysid_finds_the_spring_rods_ratios(rod_trial):
    """Only K/M and c/M are identifiable from a free trajectory; sysid from x0 = (50, 5, 5)."""
    s, trial = rod_trial
    r = mujoco_sysid(TwinObjective(s, [trial], GROUPS), [50.0, 5.0, 5.0], max_iter=30)
    v = r.values
    assert v["K"] / v["M"] == pytest.approx(10.0, rel=1e-3)
    assert v["c"] / v["M"] == pytest.approx(1.0, rel=1e-3)
    assert r.evaluations > 0 and r.seconds > 0
