"""Every node's parameter table (tensegrity_ros.nodes.tables) reads without ROS: in a process where rclpy,
rcl_interfaces, rosidl*, every message package and this package's generated messages refuse to import, each table
is a non-empty tuple of ParamSpec, and the names are those the node declares and its config/nodes YAML sets."""
from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from no_ros import HOOK

ROOT = Path(__file__).resolve().parents[1]
#: (slow subprocess start-ups on a shared CPU, which may also be paused for minutes)
TIMEOUT_S = 600
ALWAYS_DECLARED = {"use_sim_time"}   # declared by rclpy itself


def executables() -> List[str]:
    """setup.py's NODES: every node executable, named as its module."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NODES" for t in node.targets):
            return [e.value for e in node.value.elts]
    raise AssertionError("setup.py has no NODES tuple")


def _tables_without_ros(nodes: List[str]) -> Dict[str, List[str]]:
    """{node: its table's parameter names}, read in a process that refuses every ROS import."""
    code = HOOK + textwrap.dedent(f"""
        from tensegrity_ros.nodes.params import ParamSpec
        out = {{}}
        for node in {nodes!r}:
            table = importlib.import_module("tensegrity_ros.nodes.tables." + node).PARAMS
            assert isinstance(table, (tuple, list)) and table, (node, table)
            assert all(isinstance(s, ParamSpec) for s in table), (node, table)
            out[node] = [s.name for s in table]
        ros = sorted(m for m in sys.modules if is_ros(m))
        assert not ros, ros
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tables() -> Dict[str, List[str]]:
    return _tables_without_ros(executables())


def test_the_hook_refuses_ros():
    """The refusal is real: rclpy, rcl_interfaces and the generated messages do not import under it."""
    code = HOOK + textwrap.dedent("""
        for name in ("rclpy", "rcl_interfaces.msg", "rosidl_runtime_py", "sensor_msgs.msg", "tensegrity_ros.msg"):
            try:
                importlib.import_module(name)
            except ImportError:
                continue
            raise SystemExit("imported " + name)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_every_node_has_a_table_without_ros(tables):
    assert set(tables) == set(executables())
    for node, names in tables.items():
        assert names and len(names) == len(set(names)), (node, names)


def test_the_tables_hold_every_parameter_the_config_files_set(tables):
    """config/nodes/*.yaml (what the launch files pass) sets only parameters the tables hold."""
    seen = set()
    for f in sorted((ROOT / "config" / "nodes").glob("*.yaml")):
        for node_name, section in (yaml.safe_load(f.read_text()) or {}).items():
            node = node_name.lstrip("/")
            assert node in tables, f"{f.name}: no table for {node}"
            bad = set(section["ros__parameters"]) - set(tables[node]) - ALWAYS_DECLARED
            assert not bad, f"{f.name}: {node}'s table lacks {sorted(bad)}"
            seen.add(node)
    assert seen == set(tables), f"no config/nodes file sets {sorted(set(tables) - seen)}"


def test_the_nodes_declare_their_tables(tables):
    """With ROS: each node module's PARAMS (what it declares) is its table, the same object."""
    pytest.importorskip("rclpy")
    for node, names in tables.items():
        shell = importlib.import_module(f"tensegrity_ros.nodes.{node}")
        table = importlib.import_module(f"tensegrity_ros.nodes.tables.{node}")
        assert shell.PARAMS is table.PARAMS, node
        assert [s.name for s in shell.PARAMS] == names, node
        for cls in vars(shell).values():
            if isinstance(cls, type) and cls.__module__ == shell.__name__ and "PARAMS" in vars(cls):
                assert cls.PARAMS is table.PARAMS, (node, cls)
