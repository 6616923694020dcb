"""The online identifier's updates, exactly as the node runs them (its shipped config, `fit_window` in the worker),
converge on the simulated manipulator: 0.3 mm marker noise, a true robot whose stiffnesses and dampings are ~20 %
off the nominal, successive 10-s sliding windows, each update warm-started from the last accepted set.

No rclpy here: the ROS shell around these calls is tested in test_nodes_identifier.py and test_graph_60s.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tensegrity_ros.engine import params_from_structure
from tensegrity_ros.model import load_structure
from tensegrity_ros.param_names import kind_of

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mujoco")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _node_parameters():
    from tensegrity_ros.nodes.online_identifier import PARAMS
    p = {spec.name: spec.default for spec in PARAMS}
    cfg = yaml.safe_load((ROOT / "config" / "nodes" / "online_identifier.yaml").read_text())
    p.update(cfg["online_identifier"]["ros__parameters"])
    return p


@pytest.fixture(scope="module")
def recording():
    """18 s of the simulated manipulator (the true robot ~20 % off the nominal), 0.3 mm marker noise."""
    from tensegrity_ros.ident.synthetic import perturbed_twin_recording

    nominal = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
    true, ds = perturbed_twin_recording(nominal, 18.0)          # sim_robot's defaults: 20 %, seed 0
    return nominal, true, ds


def test_updates_with_the_shipped_config_converge_on_the_stiffnesses(recording):
    from tensegrity_ros.ident.online import Candidate, accept_config, decide, fit_window, update_options

    nominal, true, ds = recording
    p = _node_parameters()
    truth = {n: float(v) for n, v in params_from_structure(true).named().items()}
    stiff = [n for n in truth if kind_of(n) == "stiffness"]

    def k_err(values):
        return float(np.median([abs(values[n] / truth[n] - 1) for n in stiff]))

    nominal_params = params_from_structure(nominal)
    nominal_values = {n: float(v) for n, v in nominal_params.named().items()}
    active = dict(nominal_values)
    errors = [k_err(active)]
    accepted = 0
    for t_end in np.arange(8.0, 18.01, 2.0):                   # an update every 2 s of data, 10-s window
        stages, options = update_options(p, nominal_params, first=accepted == 0)
        sel = (ds.times > t_end - 10.0) & (ds.times <= t_end)
        out = fit_window(nominal, ds.times[sel], ds.positions[sel], ds.valid[sel], ds.motor_angles[sel], active,
                         stages, options, p["holdout_s"], p["holdout_window_s"], p["holdout_windows"],
                         accept_config(p))
        assert out.ok, out.error
        assert len(out.holdout_mse) >= 3                       # scored on data the fit did not see
        # the node's acceptance test: better on the held-out windows by a margin the data support
        cand = Candidate(out.values, out.std_devs, residual_m=out.residual_m,
                         holdout_mse=out.holdout_mse, active_holdout_mse=out.active_holdout_mse)
        if decide(cand, nominal_values, [], accept_config(p)).accept:
            active = {**active, **out.values}
            accepted += 1
            assert out.std_devs and out.model_check           # a fit that may be published has both
        elif out.active_window_rms_m <= out.window_rms_m:       # not better held out: no covariance paid
            assert not out.std_devs and "covariance" not in out.timings
        errors.append(k_err(active))
    print("stiffness median error per update:", " ".join(f"{e:.1%}" for e in errors))
    assert errors[0] > 0.10                                    # the nominal is ~15 % off
    # the first update (8 windows of 0.2 s from the nominal) is accepted and lands within 1 % (measured 0.27 %;
    # with the 4 windows of 0.1 s of later updates, 2.07 % on this window and 7-12 % in half of the demo's runs)
    assert errors[1] < 0.01
    assert errors[-1] < 0.03                                   # measured: 14.8 % -> 0.4 % in 4 updates
    assert out.residual_m < 1.5e-3                           # the 3-D noise is 0.52 mm


def test_a_candidate_made_worse_on_purpose_is_rejected_and_a_better_one_accepted(recording):
    """Held-out scoring: the truth is the active set; the truth with its stiffnesses 5 % off (alternately up and
    down) is a candidate made worse on purpose and must be refused; the other way round it must be accepted."""
    from tensegrity_ros.ident import make_dataset
    from tensegrity_ros.ident.online import Candidate, accept_config, decide, held_out_mse, update_options

    nominal, true, ds = recording
    p = _node_parameters()
    truth = params_from_structure(true)
    values = {n: float(v) for n, v in truth.named().items()}
    worse = truth.with_values({n: v * (1.05 if i % 2 else 0.95) for i, (n, v) in
                               enumerate(x for x in values.items() if kind_of(x[0]) == "stiffness")})
    sel = ds.times > ds.times[-1] - p["holdout_s"]
    held = make_dataset(ds.times[sel], ds.positions[sel], ds.valid[sel], ds.motor_angles[sel])
    _, options = update_options(p, params_from_structure(nominal))
    mse_true, mse_worse = held_out_mse(nominal, held, (truth, worse), options, p["holdout_window_s"],
                                       p["holdout_windows"])
    cfg = accept_config(p)
    bad = decide(Candidate(worse.named(), residual_m=1e-3, holdout_mse=tuple(mse_worse),
                           active_holdout_mse=tuple(mse_true)), values, [], cfg)
    assert not bad.accept and "not better on held-out data" in bad.reason
    good = decide(Candidate(values, residual_m=1e-3, holdout_mse=tuple(mse_true),
                            active_holdout_mse=tuple(mse_worse)), values, [], cfg)
    assert good.accept, good.reason


def test_the_first_updates_fit_more_and_longer_windows():
    """Until a set is accepted (the active set is the far-off nominal) an update fits first_update_windows windows of
    first_update_window_s with first_update_iterations iterations; afterwards the lighter per-update settings."""
    from tensegrity_ros.ident.online import update_options

    nominal = load_structure(ROOT / "config" / "models" / "stacked_manipulator.yaml")
    p = {**_node_parameters(), "first_update_windows": 8, "first_update_window_s": 0.2, "stage2_max_windows": 4,
         "stage2_window_s": 0.1, "first_update_iterations": 8, "stage2_iterations": 2}
    nominal_params = params_from_structure(nominal)
    _, first = update_options(p, nominal_params, first=True)
    _, later = update_options(p, nominal_params, first=False)
    assert (first.refine.max_windows, first.refine.window_s, first.refine.max_iter) == (8, 0.2, 8)
    assert (later.refine.max_windows, later.refine.window_s, later.refine.max_iter) == (4, 0.1, 2)
