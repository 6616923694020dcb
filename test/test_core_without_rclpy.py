"""The algorithm moved out of the node files imports no rclpy: a worker process that unpickles the predictor's jobs
(or the online identifier's fit) stays free of ROS, and the node modules still re-export the moved names."""
from __future__ import annotations

import subprocess
import sys
import textwrap

#: (slow subprocess start-ups on a shared CPU, which may also be paused for minutes)
TIMEOUT_S = 1200
MODULES = ["tensegrity_ros.param_names", "tensegrity_ros.paths", "tensegrity_ros.parameter_set",
           "tensegrity_ros.predict.jobs", "tensegrity_ros.predict", "tensegrity_ros.ident.online",
           "tensegrity_ros.viz.markers", "tensegrity_ros.viz.render"]
#: the parts of the nodes' shared code that need no rclpy (their docstrings say so): importable without it
NODE_MODULES = ["tensegrity_ros.nodes.params", "tensegrity_ros.nodes.stats", "tensegrity_ros.nodes.records",
                "tensegrity_ros.nodes.cdr", "tensegrity_ros.nodes.convert"]


def test_importing_the_core_does_not_import_rclpy():
    """One fresh interpreter, the modules imported one after the other, checked after each."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for module in {MODULES!r}:
            importlib.import_module(module)
            bad = sorted(m for m in sys.modules if m == "rclpy" or m.startswith(("rclpy.", "tensegrity_ros.nodes")))
            assert not bad, (module, bad)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr


def test_the_rclpy_free_node_helpers_do_not_import_rclpy():
    """Parameter specs, statistics, records, conversions and the CDR codec: no rclpy, and no node shell."""
    code = textwrap.dedent(f"""
        import importlib, sys
        allowed = {{"tensegrity_ros.nodes"}} | set({NODE_MODULES!r})
        for module in {NODE_MODULES!r}:
            importlib.import_module(module)
            bad = sorted(m for m in sys.modules if m == "rclpy" or m.startswith("rclpy.")
                         or (m.startswith("tensegrity_ros.nodes") and m not in allowed))
            assert not bad, (module, bad)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr


def test_a_worker_job_unpickles_without_rclpy():
    """What a spawned worker does with a submitted job: look the function up by its module and name."""
    code = textwrap.dedent("""
        import pickle, sys
        from tensegrity_ros.predict.jobs import core_job, relinearize_job
        from tensegrity_ros.ident.online import fit_window
        blobs = [pickle.dumps(f) for f in (core_job, relinearize_job, fit_window)]
        for m in [m for m in sys.modules if m.startswith("tensegrity_ros")]:
            del sys.modules[m]
        fns = [pickle.loads(b) for b in blobs]
        assert [f.__module__ for f in fns] == ["tensegrity_ros.predict.jobs"] * 2 + ["tensegrity_ros.ident.online"]
        assert "rclpy" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr


def test_the_node_modules_re_export_the_moved_names():
    from tensegrity_ros import ident, predict
    from tensegrity_ros.nodes import _common as C
    from tensegrity_ros.nodes import online_identifier as OI
    from tensegrity_ros.nodes import state_predictor as SP
    from tensegrity_ros.parameter_set import ParameterSet, split_name

    for name in ("ReferenceTracker", "MotorPlan", "MotorFuture", "Linearization", "HorizonPredictor",
                 "PredictionStream", "core_job", "relinearize_job"):
        assert getattr(SP, name) is getattr(predict, name)
    for name in ("Candidate", "AcceptConfig", "Decision", "parameter_bounds", "decide", "held_out_improvement",
                 "DriftDetector", "SlidingWindow", "fit_window", "FitResult", "held_out_mse", "accept_config",
                 "update_options", "ActiveSet", "NESTED_KINDS"):
        assert getattr(OI, name) is getattr(ident.online, name)
    assert C.ParameterSet is ParameterSet and C.split_name is split_name
