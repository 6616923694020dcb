"""The GPU path (issue 20 item 4): the engine, stage 2 of the identification and `tensegrity identify` on CUDA give
the CPU's numbers, and stage 2 keeps its windows in one process there (a CUDA context does not survive a fork:
windows are batched, not sharded over workers). Every test but the first skips cleanly without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tensegrity_ros.engine import make_engine, params_from_structure
from tensegrity_ros.ident import RefineOptions, refine
from tensegrity_ros.ident.synthetic import actuated_pendulum, pendulum_drive, random_initial_state, simulate_dataset
from tensegrity_ros.ident.workers import can_fork, window_workers
from tensegrity_ros.model import load_structure
from tensegrity_ros.paths import CONFIG_DIR

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")


def test_windows_are_never_forked_for_a_cuda_problem():
    """Decided from the device alone, so it holds (and is checked) on a machine without CUDA too."""
    assert not can_fork(torch.device("cuda"))

    class _Problem:                     # the two attributes window_workers reads
        B_win = 8
        device = torch.device("cuda")
    with window_workers(_Problem(), 4) as workers:
        assert workers is None


@needs_cuda
def test_engine_rollout_on_cuda_matches_cpu():
    s = load_structure(CONFIG_DIR / "models" / "icosahedron.yaml")
    out = {}
    for dev in ("cpu", "cuda"):
        eng = make_engine(s, "nodal", "semi_implicit", dtype=torch.float64, device=dev)
        p = eng.default_params()
        s0 = eng.initial_state(batch=64)
        torch.manual_seed(0)
        s0 = eng.project(p, s0.replace(velocities=s0.velocities + 0.05 * torch.randn_like(s0.velocities)))
        out[dev] = eng.rollout(p, s0, None, 1e-3, steps=500).positions.cpu().numpy()
    np.testing.assert_allclose(out["cuda"], out["cpu"], atol=1e-9)


@needs_cuda
def test_stage_2_on_cuda_gives_the_cpu_fit():
    s = actuated_pendulum()
    nominal = params_from_structure(s)
    true = nominal.with_values({"s3.rest_length": 1.085, "m1.spool_radius": 0.012, "m2.spool_radius": 0.009})
    X0, V0 = random_initial_state(s, np.random.default_rng(1), params=true)
    ds = simulate_dataset(s, true, X0, V0, dt=2e-3, steps=1000, every=5, motor_fn=pendulum_drive)
    fits = {dev: refine(s, ds, nominal, RefineOptions(kinds=("rest_length", "spool_radius"), window_s=0.3,
                                                      max_iter=10, device=dev, workers=2))
            for dev in ("cpu", "cuda")}
    assert fits["cuda"].problem.device.type == "cuda"
    for (n, a), b in zip(fits["cuda"].params.named().items(), fits["cpu"].params.named().values()):
        assert float(a) == pytest.approx(float(b), rel=1e-8, abs=1e-12), n
    assert float(fits["cuda"].params.named()["s3.rest_length"]) == pytest.approx(1.085, abs=3e-4)


@needs_cuda
def test_identify_command_runs_on_cuda(tmp_path):
    """`tensegrity identify --device cuda` on a short simulated bag: exit 0 and the CPU's values."""
    from tensegrity_ros.cli import main
    model = str(CONFIG_DIR / "models" / "icosahedron.yaml")
    assert main(["simulate", model, "--duration", "3", "--out", str(tmp_path / "sim"), "--bag",
                 str(tmp_path / "sim" / "bag"), "--perturb", "0.1"]) == 0
    vals = {}
    for dev in ("cpu", "cuda"):
        out = tmp_path / f"{dev}.yaml"
        assert main(["identify", str(tmp_path / "sim" / "bag"), "--model", model, "--out", str(out), "--device", dev,
                     "--longer-windows", "none", "--holdout", "0", "--workers", "1"]) in (0, 3)
        vals[dev] = params_from_structure(load_structure(out)).named()
    for n, v in vals["cpu"].items():
        assert float(vals["cuda"][n]) == pytest.approx(float(v), rel=1e-6, abs=1e-9), n
