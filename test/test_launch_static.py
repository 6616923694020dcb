"""Static checks of launch/*.launch.py without importing `launch` (not installed here): parsed with ast.

* every executable a Node / `ros2 run` names is a console script of setup.py and a launcher in scripts/;
* every file they reference (config/nodes, config/models, config/hardware, config/references, included
  launch files) exists;
* every parameter they set (inline dicts and the ros__parameters of the YAML files, for the node name they
  launch) is declared by that node (its PARAMS table, read from the ROS-free tensegrity_ros.nodes.tables: every
  node declares its parameters through the ParamSpec tables, none with its own declare_parameter calls);
* the driver is a lifecycle node (managed) that the real robot's launch files configure and then activate;
* every LaunchConfiguration is declared, every argument passed to an included file is declared there;
* the record option is `ros2 bag record -s mcap -a`; every config/nodes/*.yaml only sets declared parameters;
* no cross-talk with a real robot: sim/replay set ROS_DOMAIN_ID and ROS_AUTOMATIC_DISCOVERY_RANGE (launch
  arguments domain_id / discovery_range, defaults from tensegrity_ros.isolation) before any node starts,
  manipulator/graph do not. These run generate_launch_description() with `launch`/`launch_ros` replaced by
  recorders, to see the actions in their real order.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = sorted((ROOT / "launch").glob("*.launch.py"))
ALWAYS_DECLARED = {"use_sim_time"}   # declared by rclpy itself
NODE_ACTIONS = ("Node", "LifecycleNode")   # launch_ros actions that start one of our executables


def _const(node) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else "")


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def setup_executables() -> Set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NODES" for t in node.targets):
            return {_const(e) for e in node.value.elts}
    raise AssertionError("setup.py has no NODES tuple")


def declared_parameters(executable: str) -> Set[str]:
    """Parameter names a node declares: its PARAMS table (ParamSpec), from tensegrity_ros.nodes.tables, which
    needs no ROS."""
    mod = importlib.import_module(f"tensegrity_ros.nodes.tables.{executable}")
    assert hasattr(mod, "PARAMS"), f"{executable} has no PARAMS table (ParamSpec, nodes/params.py)"
    return {s.name for s in mod.PARAMS} | ALWAYS_DECLARED


class LaunchFile:
    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.calls = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)]
        consts = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and _const(node.value) is not None:
                consts[getattr(node.targets[0], "id", "")] = _const(node.value)
        self.consts = consts

    def value(self, node) -> Optional[str]:
        if isinstance(node, ast.Name):
            return self.consts.get(node.id)
        return _const(node)

    def of(self, *names: str) -> List[ast.Call]:
        return [c for c in self.calls if _call_name(c) in names]

    def share_paths(self) -> List[Path]:
        """Files named by _share(...)/_config(...) calls (installed share dir = the source tree)."""
        out = []
        for c in self.of("_share", "_config"):
            parts = [self.value(a) for a in c.args]
            if c.args and all(parts):
                out.append(ROOT.joinpath(*(["config", "nodes"] if _call_name(c) == "_config" else []), *parts))
        return out

    def declared_arguments(self) -> Set[str]:
        return {self.value(c.args[0]) for c in self.of("DeclareLaunchArgument")}

    def used_configurations(self) -> Set[str]:
        return {self.value(c.args[0]) for c in self.of("LaunchConfiguration")}


def _yaml_parameters(path: Path, node_name: str) -> Dict[str, object]:
    data = yaml.safe_load(path.read_text()) or {}
    out = {}
    for key, section in data.items():
        if key.lstrip("/") in (node_name, "**"):
            out.update((section or {}).get("ros__parameters", {}))
    return out


@pytest.fixture(scope="module")
def launch_files():
    assert LAUNCH, "no launch files"
    return {p.name: LaunchFile(p) for p in LAUNCH}


def test_expected_launch_files_exist(launch_files):
    assert {"manipulator.launch.py", "sim.launch.py", "replay.launch.py"} <= set(launch_files)
    for lf in launch_files.values():   # they are real launch files
        src = lf.path.read_text()
        assert "def generate_launch_description" in src and "from launch" in src


def test_executables_exist(launch_files):
    exes = setup_executables()
    scripts = {p.name for p in (ROOT / "scripts").iterdir()}
    seen = set()
    for lf in launch_files.values():
        for c in lf.of(*NODE_ACTIONS):
            assert lf.value(_kw(c, "package")) == "tensegrity_ros", lf.path.name
            exe = lf.value(_kw(c, "executable"))
            assert exe in exes, f"{lf.path.name}: executable {exe!r} is not a setup.py entry point {sorted(exes)}"
            assert exe in scripts, f"{lf.path.name}: no launcher scripts/{exe}"
            seen.add(exe)
    assert seen == exes, f"launch files start {sorted(seen)}, setup.py has {sorted(exes)}"


def test_referenced_files_exist(launch_files):
    for lf in launch_files.values():
        paths = lf.share_paths()
        assert paths, lf.path.name
        for p in paths:
            assert p.is_file(), f"{lf.path.name} references {p.relative_to(ROOT)}, which does not exist"


def test_parameters_are_declared_by_the_nodes(launch_files):
    for lf in launch_files.values():
        for c in lf.of(*NODE_ACTIONS):
            exe, name = lf.value(_kw(c, "executable")), lf.value(_kw(c, "name"))
            declared = declared_parameters(exe)
            params = _kw(c, "parameters")
            assert isinstance(params, ast.List), f"{lf.path.name}: {exe} parameters must be a list"
            for item in params.elts:
                if isinstance(item, ast.Dict):
                    keys = {lf.value(k) for k in item.keys}
                    bad = keys - declared
                    assert not bad, f"{lf.path.name}: {exe} does not declare {sorted(bad)}"
                elif isinstance(item, ast.Call) and _call_name(item) == "_config":
                    f = ROOT / "config" / "nodes" / lf.value(item.args[0])
                    keys = set(_yaml_parameters(f, name))
                    assert keys, f"{f.name} has no ros__parameters for node {name!r}"
                    bad = keys - declared
                    assert not bad, f"{f.name}: {exe} does not declare {sorted(bad)}"
                else:
                    raise AssertionError(f"{lf.path.name}: unexpected parameters entry {ast.dump(item)[:80]}")


def test_every_node_config_sets_only_declared_parameters():
    for f in sorted((ROOT / "config" / "nodes").glob("*.yaml")):
        data = yaml.safe_load(f.read_text())
        assert isinstance(data, dict) and data, f.name
        for node_name, section in data.items():
            assert "ros__parameters" in section, f"{f.name}: {node_name} lacks ros__parameters"
            exe = node_name.lstrip("/")
            bad = set(section["ros__parameters"]) - declared_parameters(exe)
            assert not bad, f"{f.name}: {exe} does not declare {sorted(bad)}"


def test_launch_configurations_are_declared_and_includes_match(launch_files):
    for lf in launch_files.values():
        missing = lf.used_configurations() - lf.declared_arguments()
        assert not missing, f"{lf.path.name}: LaunchConfiguration {sorted(missing)} not declared"
        for inc in lf.of("IncludeLaunchDescription"):
            src = inc.args[0]
            target = [lf.value(a) for a in src.args[0].args][-1]
            assert target in launch_files, f"{lf.path.name} includes {target}, which does not exist"
            args = _kw(inc, "launch_arguments")
            keys = {lf.value(k) for k in args.func.value.keys}
            bad = keys - launch_files[target].declared_arguments()
            assert not bad, f"{lf.path.name} passes {sorted(bad)} that {target} does not declare"


def test_record_option_records_everything_to_mcap(launch_files):
    recorders = []
    for lf in launch_files.values():
        for c in lf.of("ExecuteProcess"):
            cmd = [lf.value(e) for e in _kw(c, "cmd").elts]
            if cmd[:3] == ["ros2", "bag", "record"]:
                assert cmd[3:6] == ["-s", "mcap", "-a"], cmd
                cond = _kw(c, "condition")
                assert cond is not None and _call_name(cond) == "IfCondition"
                recorders.append(lf.path.name)
    assert recorders
    for name in ("manipulator.launch.py", "sim.launch.py", "replay.launch.py"):   # all reach it through the include
        lf = launch_files[name]
        assert name in recorders or "record" in lf.declared_arguments()


def test_mocap_topic_is_remappable(launch_files):
    lf = launch_files["graph.launch.py"]
    ingest = next(c for c in lf.of("Node") if lf.value(_kw(c, "executable")) == "mocap_ingest")
    remaps = _kw(ingest, "remappings")
    assert remaps is not None and lf.value(remaps.elts[0].elts[0]) == "/mocap/markers"
    assert "mocap_topic" in launch_files["manipulator.launch.py"].declared_arguments()


# ---- no cross-talk with a real robot: simulated graphs run isolated, the real one does not ---------------------
ISOLATION_VARS = ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")
STARTERS = {"Node", "LifecycleNode", "ExecuteProcess", "IncludeLaunchDescription", "TimerAction", "GroupAction"}


class _Recorded:
    """Stand-in for a launch class: keeps its arguments."""

    kind = ""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __repr__(self):
        return f"{self.kind}{self.args}"


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Recorded,), {"kind": name})


def _run_launch_file(path: Path, monkeypatch, environ: Dict[str, str]):
    """generate_launch_description() of a launch file with `launch`/`launch_ros` replaced by recorders and
    os.environ = environ (minus the isolation variables unless given): the actions, in order."""
    for mod in ("launch", "launch.actions", "launch.conditions", "launch.events", "launch.launch_description_sources",
                "launch.substitutions", "launch_ros", "launch_ros.actions", "launch_ros.event_handlers",
                "launch_ros.events", "launch_ros.events.lifecycle", "launch_ros.substitutions"):
        monkeypatch.setitem(sys.modules, mod, _StubModule(mod))
    for var in ISOLATION_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    spec = importlib.util.spec_from_file_location(path.stem.replace(".", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    desc = mod.generate_launch_description()
    assert desc.kind == "LaunchDescription"
    return list(desc.args[0])


def _set_env(actions) -> Dict[str, object]:
    return {a.args[0]: a.args[1] for a in actions if a.kind == "SetEnvironmentVariable"}


def _defaults(actions) -> Dict[str, object]:
    return {a.args[0]: a.kwargs.get("default_value") for a in actions if a.kind == "DeclareLaunchArgument"}


@pytest.mark.parametrize("name", ["sim.launch.py", "replay.launch.py"])
def test_simulated_graphs_set_domain_and_localhost_before_any_node(name, monkeypatch):
    from tensegrity_ros.isolation import DEMO_DOMAIN_ID

    actions = _run_launch_file(ROOT / "launch" / name, monkeypatch, {})
    kinds = [a.kind for a in actions]
    first_start = min(i for i, k in enumerate(kinds) if k in STARTERS)
    sets = {a.args[0]: i for i, a in enumerate(actions) if a.kind == "SetEnvironmentVariable"}
    assert set(ISOLATION_VARS) <= set(sets), f"{name} does not set {ISOLATION_VARS}: {kinds}"
    assert all(sets[v] < first_start for v in ISOLATION_VARS), f"{name}: set after a node starts: {kinds}"
    # the values are the launch arguments, declared before they are applied, defaulting to domain 42 + LOCALHOST
    env = _set_env(actions)
    assert env["ROS_DOMAIN_ID"].kind == "LaunchConfiguration" and env["ROS_DOMAIN_ID"].args == ("domain_id",)
    assert env["ROS_AUTOMATIC_DISCOVERY_RANGE"].args == ("discovery_range",)
    declared = {a.args[0]: i for i, a in enumerate(actions) if a.kind == "DeclareLaunchArgument"}
    assert declared["domain_id"] < sets["ROS_DOMAIN_ID"] and declared["discovery_range"] < sets[
        "ROS_AUTOMATIC_DISCOVERY_RANGE"]
    assert _defaults(actions)["domain_id"] == str(DEMO_DOMAIN_ID) == "42"
    assert _defaults(actions)["discovery_range"] == "LOCALHOST"


@pytest.mark.parametrize("name", ["sim.launch.py", "replay.launch.py"])
def test_simulated_graphs_respect_an_explicit_user_setting(name, monkeypatch):
    actions = _run_launch_file(ROOT / "launch" / name, monkeypatch,
                               {"ROS_DOMAIN_ID": "7", "ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"})
    assert _defaults(actions)["domain_id"] == "7" and _defaults(actions)["discovery_range"] == "SUBNET"
    actions = _run_launch_file(ROOT / "launch" / name, monkeypatch, {"ROS_DOMAIN_ID": "3"})
    assert _defaults(actions)["domain_id"] == "3" and _defaults(actions)["discovery_range"] == "LOCALHOST"


@pytest.mark.parametrize("name", ["manipulator.launch.py", "graph.launch.py"])
def test_real_robot_launch_does_not_force_localhost_or_a_domain(name, monkeypatch):
    """The real robot's graph (and graph.launch.py, which it includes) keeps the environment's settings:
    the mocap and the operator's machines must reach it."""
    actions = _run_launch_file(ROOT / "launch" / name, monkeypatch, {})
    assert not set(_set_env(actions)) & set(ISOLATION_VARS), name
    assert "LOCALHOST" not in (ROOT / "launch" / name).read_text()
    assert any(a.kind in STARTERS for a in actions)


def test_isolated_env_defaults_and_precedence():
    from tensegrity_ros.isolation import DEMO_DOMAIN_ID, LOCALHOST_ONLY_ENV, isolated_env

    assert isolated_env({}) == {"ROS_DOMAIN_ID": str(DEMO_DOMAIN_ID), **LOCALHOST_ONLY_ENV}
    assert LOCALHOST_ONLY_ENV == {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    user = {"ROS_DOMAIN_ID": "7", "ROS_AUTOMATIC_DISCOVERY_RANGE": "subnet"}
    assert isolated_env(user) == {"ROS_DOMAIN_ID": "7", "ROS_AUTOMATIC_DISCOVERY_RANGE": "SUBNET"}
    assert user["ROS_DOMAIN_ID"] == "7" and user["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "subnet"   # not modified
    assert isolated_env(user, domain_id=12, discovery_range="OFF") == {
        "ROS_DOMAIN_ID": "12", "ROS_AUTOMATIC_DISCOVERY_RANGE": "OFF"}
    assert isolated_env({"ROS_DOMAIN_ID": " ", "ROS_AUTOMATIC_DISCOVERY_RANGE": ""})["ROS_DOMAIN_ID"] == "42"
    assert isolated_env({"ROS_DOMAIN_ID": "0"})["ROS_DOMAIN_ID"] == "0"   # an explicit 0 is the user's choice
    for bad in ({"ROS_DOMAIN_ID": "robot"}, {"ROS_DOMAIN_ID": "233"}, {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LAN"}):
        with pytest.raises(ValueError, match="ROS_"):
            isolated_env(bad)
    with pytest.raises(ValueError, match="domain_id"):
        isolated_env({}, domain_id=-1)


def test_isolation_module_is_rclpy_free():
    tree = ast.parse((ROOT / "tensegrity_ros" / "isolation.py").read_text())

    def modules(nodes):
        return {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [None])}

    assert modules(tree.body) <= {"__future__", "typing"}, modules(tree.body)     # at import time
    inside = modules(ast.walk(tree)) - modules(tree.body)                           # only when a launch file calls
    assert {m.split(".")[0] for m in inside} <= {"launch"}, inside
    import tensegrity_ros.isolation                                                # launch is not installed here
    assert callable(tensegrity_ros.isolation.launch_actions)


# ---- the driver is managed on the robot: configured, then activated, by the launch file ---------------------------
def _flatten(actions):
    """The actions with those inside TimerAction / GroupAction in place."""
    out = []
    for a in actions:
        out.append(a)
        if a.kind in ("TimerAction", "GroupAction"):
            out += _flatten(a.kwargs.get("actions") or (a.args[0] if a.args else []))
    return out


@pytest.mark.parametrize("name", ["manipulator.launch.py", "sim.launch.py"])
def test_the_driver_is_a_lifecycle_node_configured_then_activated(name, monkeypatch):
    """A LifecycleNode with managed: true (torque stays off until activate), a configure event for it, and an
    activate event on its configuring -> inactive transition, the first time only (a later deactivate or cleanup is
    the operator's), both under the driver_autostart argument (default true)."""
    from lifecycle_msgs.msg import Transition

    actions = _flatten(_run_launch_file(ROOT / "launch" / name, monkeypatch, {}))
    drivers = [a for a in actions if a.kwargs.get("executable") == "dynamixel_driver"]
    assert [a.kind for a in drivers] == ["LifecycleNode"], drivers
    driver = drivers[0]
    assert driver.kwargs.get("namespace") == "" and driver.kwargs["name"] == "dynamixel_driver"
    inline = [p for p in driver.kwargs["parameters"] if isinstance(p, dict)]
    assert inline and all(p.get("managed") is True for p in inline)

    def change_events(transition_id, entities):
        return [a for a in entities if a.kind == "EmitEvent" and a.kwargs["event"].kind == "ChangeState"
                and a.kwargs["event"].kwargs["transition_id"] == transition_id
                and a.kwargs["event"].kwargs["lifecycle_node_matcher"].args == (driver,)]

    def under_autostart(a):
        cond = a.kwargs.get("condition")
        return cond is not None and cond.kind == "IfCondition" and cond.args[0].args == ("driver_autostart",)

    configure = change_events(Transition.TRANSITION_CONFIGURE, actions)
    assert len(configure) == 1 and under_autostart(configure[0])
    handlers = [a for a in actions if a.kind == "RegisterEventHandler" and a.args[0].kind == "OnStateTransition"]
    assert len(handlers) == 1 and under_autostart(handlers[0])
    on = handlers[0].args[0].kwargs
    assert on["target_lifecycle_node"] is driver
    assert (on["start_state"], on["goal_state"]) == ("configuring", "inactive")
    assert on["handle_once"] is True and len(change_events(Transition.TRANSITION_ACTIVATE, on["entities"])) == 1
    assert actions.index(handlers[0]) < actions.index(configure[0])   # listening before the configure is sent
    assert _defaults(actions)["driver_autostart"] == "true"
