"""The node graph in ONE process, without ``launch``: what ``sim.launch.py`` starts, as Python objects.

    from tensegrity_ros.bringup import GraphConfig, build_graph, run_graph
    executor, nodes = build_graph(GraphConfig())         # sim_robot, dynamixel_driver, mocap_ingest,
    ...                                                   # online_identifier, state_predictor (+ monitor)
    result = run_graph(30.0)                              # or: build, spin 30 s, collect, tear down

* ``sim_robot``: the MuJoCo twin of the TRUE robot (the nominal model perturbed by ~20 %) and an emulated
  Dynamixel bus on a pty;
* ``dynamixel_driver`` with ``bus: real`` on that pty (the real SDK code path), driving the reference;
* ``mocap_ingest``, ``online_identifier`` (starting from the nominal model), ``state_predictor``;
* a :class:`GraphMonitor` node: every topic's messages counted and checked for drops (DDS publication
  sequence numbers, and published-vs-received counts at the end), ground truth / predictions / parameter
  sets kept for scoring, optional raw recording for an MCAP bag.

Parameters come from the same ``config/nodes/*.yaml`` files as the launch files, then
``GraphConfig.overrides``. All nodes share one ``MultiThreadedExecutor``.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import rclpy
import yaml
from rclpy.executors import Executor, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter

from .machine_load import LoadMeter
from .nodes.cdr import node_states_from_cdr, prediction_from_cdr
from .nodes.convert import diag_values, parameter_set_from_msg
from .nodes.graph_node import LeanNode
from .nodes.stats import RollingStats, SequenceMonitor
from .nodes.topics import DIAG_QOS, LATCHED_QOS, SENSOR_READER_QOS, STREAM_QOS, TOPICS
from .parameter_set import ParameterSet
from .paths import CONFIG_DIR
from .workers import limit_blas_threads

CONFIG_NODES = CONFIG_DIR / "nodes"
DEFAULT_MODEL = CONFIG_DIR / "models" / "stacked_manipulator.yaml"
DEFAULT_REFERENCE = CONFIG_DIR / "references" / "seed_sinusoids.yaml"
#: what a graph starts by default; NODE_ORDER adds the nodes started only when asked for (``plate_controller``:
#: ``tensegrity demo --controller``, ``sim.launch.py controller:=true``)
DEFAULT_NODES = ("sim_robot", "dynamixel_driver", "mocap_ingest", "online_identifier", "state_predictor",
                 "visualizer")
NODE_ORDER = DEFAULT_NODES + ("plate_controller",)
#: the order in which one executor serves its nodes' ready callbacks (RankedExecutor): the latency-judged path
#: first (the predictor, then the controller that reads it), then what produces its input (ingest, the
#: robot's side), then the rest; anything not named (the monitor) last
SERVICE_ORDER = ("state_predictor", "plate_controller", "mocap_ingest", "dynamixel_driver", "sim_robot",
                 "online_identifier", "visualizer")
#: the nodes that GraphConfig.executor_rt_priority puts on a real-time executor of their own: the 120-Hz path
#: whose latency the graph's health judges (node-state reception -> prediction)
REALTIME_NODES = ("state_predictor",)


@dataclass
class GraphConfig:
    """What :func:`build_graph` starts.

    model_file: nominal structure (identifier / predictor / ingest / driver); true_model_file: the
    simulated robot ('' = the nominal perturbed by ``perturb_fraction``); reference_file: the drive;
    nodes: which nodes to start (NODE_ORDER); overrides: {node: {parameter: value}} on top of
    config/nodes/<node>.yaml; executor: ``single`` (default: every callback is short, heavy work runs in the
    nodes' threads and worker processes; rclpy's MultiThreadedExecutor costs ~2.5x the CPU per callback,
    measured 0.4 vs 0.15 ms) or ``multi`` (``threads`` threads); link_path: pty link of the emulated bus
    ('' = a unique one under /tmp); monitor: add the :class:`GraphMonitor`; record_topics: topics the
    monitor keeps raw for a bag (None: none; ["*"]: all), record_every: {topic: n} keep every n-th message;
    keep_node_states: the monitor also keeps the decoded node states; parameter_services: start each node's
    parameter services (off by default: nothing calls them in one process, and every service is one more entity
    the executor's wait set is rebuilt with; parameters are still declared, validated and settable through
    ``node.set_parameters``); robot_process: run the simulated robot's side (sim_robot, dynamixel_driver)
    in a spawned child process of its own (:class:`NodeProcess`) instead of this one. The real robot is a
    separate system with its own driver process; in one process the twin's 1-kHz stepping and the driver's
    80-Hz bus loop share the GIL with every callback (measured: driver 30-60 Hz instead of 80 on a busy
    2-core machine, 80 Hz in its own process). predictor_process: the state predictor in a spawned process of
    its own too (as ``ros2 launch`` runs it): its 120-Hz per-message path then waits for no other node's
    callback or thread in the graph's process (ingest, identifier, monitor, the demo's status line), which
    set its latency tail when they shared one interpreter (issue 16).
    """

    model_file: str = str(DEFAULT_MODEL)
    true_model_file: str = ""
    reference_file: str = str(DEFAULT_REFERENCE)
    perturb_fraction: float = 0.2
    nodes: Tuple[str, ...] = DEFAULT_NODES
    overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    threads: int = 6
    link_path: str = ""
    monitor: bool = True
    record_topics: Optional[Sequence[str]] = None
    record_every: Dict[str, int] = field(default_factory=dict)
    keep_node_states: bool = False
    executor: str = "single"
    parameter_services: bool = False
    robot_process: bool = False
    predictor_process: bool = False
    keep_predictions_every: int = 6
    switch_interval_s: Optional[float] = 0.001
    #: niceness of the simulated robot's process (twin + emulated bus + driver: the real-time part) and of the
    #: graph's process (ingest, callbacks); None = leave as is. The compute workers run at their nodes'
    #: ``worker_nice`` (the predictor's -5, the identifier's 5), below both. Raising a priority needs the right to (see workers.set_niceness); a
    #: refusal is logged and recorded (``Graph.priorities``), and the run goes on.
    robot_nice: Optional[int] = None
    graph_nice: Optional[int] = None
    #: SCHED_FIFO priority of a second executor thread that runs the callbacks of REALTIME_NODES (the state
    #: predictor's per-message path) apart from the rest of the graph; None = one executor, normal scheduling.
    #: Niceness only weights the fair scheduler's shares, so a woken executor may wait behind a compute worker's
    #: time slice (see workers.set_realtime; measured both ways, docs/nodes.md). The rest stays on the normal
    #: executor: all of it real-time took its ~800 callbacks/s one per wake-up and cost ~20 % more CPU
    executor_rt_priority: Optional[int] = None
    #: SCHED_FIFO priority of the simulated robot's simulation thread (sim_robot's ``rt_priority``; None = its
    #: yaml's). It stands in for hardware with processors of its own, so it ranks above the graph: with only
    #: the graph's executor real-time, the twin fell to 105-117 Hz of mocap (4 % of the frames never produced)
    robot_rt_priority: Optional[int] = None
    #: topics the monitor does not subscribe to (each is one more callback per message in the graph's process)
    monitor_skip: Tuple[str, ...] = ()


def yaml_parameters(node: str, config_dir: Path = CONFIG_NODES, files: Sequence[str] = ()) -> Dict[str, Any]:
    """ros__parameters for ``node`` from config/nodes/<node>.yaml (and any extra ``files``), in order."""
    out: Dict[str, Any] = {}
    for f in (f"{node}.yaml", *files):
        path = config_dir / f
        if not path.is_file():
            continue
        data = yaml.safe_load(path.read_text()) or {}
        for key, section in data.items():
            if key.lstrip("/") in (node, "**"):
                out.update((section or {}).get("ros__parameters", {}))
    return out


def _parameters(values: Mapping[str, Any]) -> List[Parameter]:
    out = []
    for k, v in values.items():
        if isinstance(v, (list, tuple)) and not v:
            continue   # an empty list has no type: keep the node's default
        if isinstance(v, tuple):
            v = list(v)
        out.append(Parameter(k, value=v))
    return out


class RankedExecutor(SingleThreadedExecutor):
    """A SingleThreadedExecutor that serves its nodes in a fixed order (``SERVICE_ORDER`` by node name).

    rclpy's executor keeps its nodes in a set and, after each wait, runs the ready callbacks node by node in
    that set's iteration order: an order set by the node objects' addresses, so from run to run the state
    predictor's node-state callback came before or after the identifier's and the monitor's callbacks of the
    same wait. Here it comes first in every wait, in every run. Kept for that determinism: no gain in the
    demo's latency tail was shown, which, traced, is mostly the executor's thread waiting for a CPU
    (docs/nodes.md, "Where the latency tail comes from")."""

    def __init__(self, order: Sequence[str] = SERVICE_ORDER, *, context=None):
        super().__init__(context=context)
        self._order = {name: i for i, name in enumerate(order)}
        self._rank: Dict[Node, int] = {}   # per node, taken once (get_nodes runs at every wait)

    def add_node(self, node: Node) -> bool:
        self._rank[node] = self._order.get(node.get_name(), len(self._order))
        return super().add_node(node)

    def get_nodes(self) -> List[Node]:
        return sorted(super().get_nodes(), key=lambda node: self._rank.get(node, len(self._order)))


# =====================================================================================================
# the monitor
# =====================================================================================================
class GraphMonitor(LeanNode):
    """Counts every topic's messages (raw subscriptions, no deserialisation), finds drops from the DDS
    publication sequence numbers, and keeps what the demo / tests score: ground truth (all of it), node
    states, identified parameter sets, every ``keep_predictions_every``-th prediction (decoded), the
    latest diagnostics per status name, and raw messages of ``record_topics`` for a bag."""

    TOPIC_TYPES = {
        TOPICS["markers"]: "geometry_msgs/msg/PoseArray",
        TOPICS["node_states"]: "tensegrity_ros/msg/NodeStates",
        TOPICS["motor_states"]: "sensor_msgs/msg/JointState",
        TOPICS["identified_parameters"]: "tensegrity_ros/msg/IdentifiedParameters",
        TOPICS["predicted_states"]: "tensegrity_ros/msg/PredictedStates",
        TOPICS["plate_c1"]: "geometry_msgs/msg/PoseStamped",
        TOPICS["plate_c2"]: "geometry_msgs/msg/PoseStamped",
        TOPICS["ground_truth"]: "tensegrity_ros/msg/NodeStates",
        TOPICS["diagnostics"]: "diagnostic_msgs/msg/DiagnosticArray",
    }

    def __init__(self, name: str = "graph_monitor", *, topics: Optional[Sequence[str]] = None,
                 record_topics: Optional[Sequence[str]] = None,
                 record_every: Optional[Mapping[str, int]] = None, keep_predictions_every: int = 6,
                 keep_node_states: bool = False, **kwargs):
        super().__init__(name, **kwargs)
        from diagnostic_msgs.msg import DiagnosticArray
        from geometry_msgs.msg import PoseArray, PoseStamped
        from sensor_msgs.msg import JointState
        from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates

        types = {"geometry_msgs/msg/PoseArray": PoseArray, "tensegrity_ros/msg/NodeStates": NodeStates,
                 "sensor_msgs/msg/JointState": JointState,
                 "tensegrity_ros/msg/IdentifiedParameters": IdentifiedParameters,
                 "tensegrity_ros/msg/PredictedStates": PredictedStates,
                 "geometry_msgs/msg/PoseStamped": PoseStamped,
                 "diagnostic_msgs/msg/DiagnosticArray": DiagnosticArray}
        self.seq = SequenceMonitor()
        self.first_rx: Dict[str, float] = {}
        rec = set(self.TOPIC_TYPES) if record_topics and "*" in record_topics else set(record_topics or ())
        self.topics = tuple(t for t in self.TOPIC_TYPES if topics is None or t in topics or t in rec)
        self.record_every = dict(record_every or {})
        self.recorded: Dict[str, List[Tuple[float, bytes]]] = {t: [] for t in rec}
        self._rec_count: Dict[str, int] = {}
        self.keep_predictions_every = max(1, int(keep_predictions_every))
        self.keep_node_states = keep_node_states
        self.ground_truth: Deque = deque(maxlen=200_000)
        self.node_states: Deque = deque(maxlen=200_000)
        self.predictions: Deque = deque(maxlen=100_000)
        self.parameter_sets: List[ParameterSet] = []
        self.diagnostics: Dict[str, Any] = {}
        self.lock = threading.Lock()
        self._n_pred = 0
        self._types = types
        for topic in self.topics:
            tname = self.TOPIC_TYPES[topic]
            # everything else, predictions included, with the streams' deep queue: the monitor counts every message,
            # so an executor running late must not overflow it (at PREDICTION_QOS's 32 it kept 32 of 180 predictions
            # through a 1.5-s stall, test_nodes_common.py)
            qos = LATCHED_QOS if topic == TOPICS["identified_parameters"] else (
                DIAG_QOS if topic == TOPICS["diagnostics"] else
                # motor states are published best effort (sensor data): a reliable reader would match nothing
                SENSOR_READER_QOS if topic == TOPICS["motor_states"] else STREAM_QOS)
            self.create_subscription(types[tname], topic, self._callback(topic, tname), qos, raw=True)

    def _callback(self, topic: str, tname: str):
        from rclpy.serialization import deserialize_message

        cls = self._types[tname]

        def cb(data: bytes, info=None):
            now = time.time()
            # /diagnostics has many publishers: their sequence numbers interleave, so only count it
            self.seq.update_info(topic, None if topic == TOPICS["diagnostics"] else info)
            self.first_rx.setdefault(topic, now)
            if topic in self.recorded:
                k = self._rec_count.get(topic, 0)
                self._rec_count[topic] = k + 1
                if k % self.record_every.get(topic, 1) == 0:
                    self.recorded[topic].append((now, bytes(data)))
            if topic == TOPICS["predicted_states"]:
                self._n_pred += 1
                if (self._n_pred - 1) % self.keep_predictions_every == 0:
                    self.predictions.append(prediction_from_cdr(bytes(data)))
            elif topic == TOPICS["ground_truth"]:
                r = node_states_from_cdr(bytes(data))
                self.ground_truth.append((r.stamp, r.positions))
            elif topic == TOPICS["node_states"] and self.keep_node_states:
                r = node_states_from_cdr(bytes(data))
                self.node_states.append((r.stamp, r.names, r.positions, r.valid))
            elif topic == TOPICS["identified_parameters"]:
                ps = parameter_set_from_msg(deserialize_message(data, cls))
                with self.lock:
                    self.parameter_sets.append(ps)
            elif topic == TOPICS["diagnostics"]:
                msg = deserialize_message(data, cls)
                with self.lock:
                    for st in msg.status:
                        self.diagnostics[st.name] = (st.level, st.message, diag_values(st))

        return cb

    @property
    def received(self) -> Dict[str, int]:
        return dict(self.seq.received)


# =====================================================================================================
# build / run
class GcPauses:
    """The garbage collector's runs in this process, timed by generation. Each is a pause of every Python
    thread (the executor's included); with torch, rclpy and the nodes loaded, a full (generation 2) collection
    walks every object the process holds. :meth:`start` moves what exists after start-up out of the
    collector's reach (``gc.freeze``), so later collections walk only what the run allocates. The demo reports
    the pauses (``gc_pauses_ms``): over a 120-s run none of generation 2, and 6 ms the longest."""

    def __init__(self):
        import gc

        self._gc = gc
        self.pauses = {g: RollingStats(5000) for g in range(3)}
        self._t0 = 0.0

    def _callback(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses[int(info.get("generation", 2))].add(time.perf_counter() - self._t0)

    def start(self) -> None:
        """Collect and freeze what start-up left (measured: 108 ms for that one collection in the demo's graph
        process), then time every collection from here on."""
        self._gc.collect()
        self._gc.freeze()
        if self._callback not in self._gc.callbacks:
            self._gc.callbacks.append(self._callback)

    def summary(self) -> Dict[str, Dict[str, float]]:
        """{"gen0" | "gen1" | "gen2": {n, p50, p99, mean, max} in ms}."""
        return {f"gen{g}": st.summary(1e3) for g, st in self.pauses.items()}

    def close(self) -> None:
        if self._callback in self._gc.callbacks:
            self._gc.callbacks.remove(self._callback)


# =====================================================================================================
@dataclass
class Graph:
    """The running graph: executor, nodes by name, the monitor, and the spin thread."""

    executor: Executor
    nodes: Dict[str, Node]
    context: Any
    monitor: Optional[GraphMonitor] = None
    thread: Optional[threading.Thread] = None
    owns_context: bool = False
    t_start: float = 0.0
    error: Optional[BaseException] = None
    stopping: bool = False
    robot: Optional["NodeProcess"] = None
    #: the state predictor's own process (GraphConfig.predictor_process), else None
    predictor_proc: Optional["NodeProcess"] = None
    #: {process: {"done", "niceness" (now), "message"}} of GraphConfig.robot_nice / graph_nice
    priorities: Dict[str, Any] = field(default_factory=dict)
    #: garbage-collector pauses of this process from the start of the run (:class:`GcPauses`)
    gc: Optional[GcPauses] = None
    #: the machine's CPU use and the executor thread's run-queue waits from the start of the run
    #: (:class:`~tensegrity_ros.machine_load.LoadMeter`, started by that thread)
    load: Optional[LoadMeter] = None
    #: the executor of REALTIME_NODES (GraphConfig.executor_rt_priority; None: they are on ``executor``), its
    #: SCHED_FIFO priority (applied by its thread to itself when it starts) and its thread
    rt_executor: Optional[Executor] = None
    executor_rt_priority: Optional[int] = None
    rt_thread: Optional[threading.Thread] = None

    def spin_in_background(self) -> None:
        """Spin the executor (and the real-time one, if any) in a thread each and start the simulation (markers
        flow from now on)."""
        self.gc = GcPauses()
        self.gc.start()
        self.t_start = time.monotonic()

        def spin(executor, rt_priority=None):
            import logging

            log = logging.getLogger("tensegrity_ros.bringup")
            if rt_priority is not None:
                from .workers import set_realtime

                done, text = set_realtime(rt_priority)
                self.priorities["realtime_executor"] = {"done": done, "message": text, "nodes": list(REALTIME_NODES)}
                if not done:
                    log.warning("the real-time executor (%s): %s", ", ".join(REALTIME_NODES), text)
            if executor is self.executor:
                self.load = LoadMeter().start(threading.get_native_id())
            try:
                executor.spin()
            except Exception as e:  # pragma: no cover - the nodes guard their callbacks
                if not self.stopping:
                    self.error = e
                    log.exception("executor stopped")

        self.thread = threading.Thread(target=spin, args=(self.executor,), name="graph-executor", daemon=True)
        self.thread.start()
        if self.rt_executor is not None:
            self.rt_thread = threading.Thread(target=spin, args=(self.rt_executor, self.executor_rt_priority),
                                              name="graph-rt-executor", daemon=True)
            self.rt_thread.start()
        drv = self.nodes.get("dynamixel_driver")
        if drv is not None:
            drv.start()
        sim = self.nodes.get("sim_robot")
        if sim is not None:
            sim.start()
        for proc in self.processes():
            proc.start()

    def processes(self) -> List["NodeProcess"]:
        """The graph's node processes besides this one."""
        return [p for p in (self.robot, self.predictor_proc) if p is not None]

    def predictor(self):
        """The state predictor's :class:`~tensegrity_ros.nodes.state_predictor.PredictorFigures`, wherever it runs
        (None without one). From its own process this is a snapshot taken now."""
        if self.predictor_proc is not None:
            return self.predictor_proc.request("figures")
        pr = self.nodes.get("state_predictor")
        return None if pr is None else pr.figures()

    def predictor_latency_recent_ms(self) -> float:
        """Median latency of the state predictor's last 240 predictions (~2 s), ms: cheap, for status lines."""
        if self.predictor_proc is not None:
            return float(self.predictor_proc.stats().get("latency_recent_ms_p50", math.nan))
        pr = self.nodes.get("state_predictor")
        return math.nan if pr is None else _recent_latency_ms(pr)

    def faults(self) -> Dict[str, str]:
        """{node or process: why it stopped} over the whole graph; empty while everything runs."""
        out = {n: f"{type(node.fault).__name__}: {node.fault}" for n, node in self.nodes.items()
               if getattr(node, "fault", None) is not None}
        for proc in self.processes():
            out.update(proc.stats()["faults"])
        return out

    # ---- the simulated robot's side, wherever it runs ------------------------------------------------
    @property
    def true_structure(self):
        """The simulated robot's true structure (None without sim_robot)."""
        if self.robot is not None:
            return self.robot.true_structure
        sim = self.nodes.get("sim_robot")
        return None if sim is None else sim.true_structure

    def robot_stats(self) -> Dict[str, Any]:
        """{"published": {topic: n}, "driver": {...}, "sim": {...}, "faults": {node: text}} of the robot side."""
        if self.robot is not None:
            return self.robot.stats()
        return _robot_stats(self.nodes)

    def published_counts(self) -> Dict[str, int]:
        """Messages published per topic by the graph's nodes (the driver: its cycles), robot process included."""
        out = _published(self.nodes)
        for proc in self.processes():
            for t, n in proc.stats()["published"].items():
                out[t] = out.get(t, 0) + n
        return out

    def subscribers(self) -> Dict[str, SequenceMonitor]:
        """Every counting subscriber of the graph: the monitor and the nodes' own input monitors."""
        out = {name: node.seq for name, node in self.nodes.items() if getattr(node, "seq", None) is not None}
        if self.predictor_proc is not None:
            out["state_predictor"] = self.predictor_proc.stats()["seq"]
        if self.monitor is not None:
            out["graph_monitor"] = self.monitor.seq
        return out

    def drops(self) -> Dict[str, Dict[str, int]]:
        """{subscriber: {topic: dropped}} over every counting subscription (the monitor's and the nodes'
        inputs): publication-sequence gaps, or published-minus-received when larger (a loss at the end
        leaves no gap). Call after :func:`stop_sources` and a drain."""
        pub = self.published_counts()
        out: Dict[str, Dict[str, int]] = {}
        for name, seq in self.subscribers().items():
            out[name] = {t: max(gaps, pub.get(t, 0) - seq.received.get(t, 0) if t in pub else 0)
                         for t, gaps in seq.dropped.items()}
        return out

    def received(self) -> Dict[str, int]:
        """Messages received per topic (the most any one subscriber got)."""
        out: Dict[str, int] = {}
        for seq in self.subscribers().values():
            for t, n in seq.received.items():
                out[t] = max(out.get(t, 0), n)
        return out

    def total_dropped(self, drops: Optional[Mapping[str, Mapping[str, int]]] = None) -> int:
        """Messages lost on any subscription: :meth:`drops` summed (``drops``: a result of it already taken)."""
        return int(sum(sum(v.values()) for v in (self.drops() if drops is None else drops).values()))

    def shutdown(self) -> None:
        """Stop everything: executor, nodes (torque off, emulator closed), context if owned."""
        self.stopping = True
        if self.gc is not None:
            self.gc.close()
        for proc in self.processes():   # the robot process turns torque off while this side tears down
            proc.begin_shutdown()
        # every part below is bounded: the whole graph is down within ~2 s, even with work in flight; the
        # executors (the real-time one too, when there is one) share 1 s
        deadline = time.monotonic() + 1.0
        for ex, th in ((self.executor, self.thread), (self.rt_executor, self.rt_thread)):
            try:
                if ex is not None:
                    ex.shutdown(timeout_sec=max(0.05, deadline - time.monotonic()))
            except Exception:
                pass
            if th is not None:
                th.join(timeout=max(0.05, deadline - time.monotonic()))
        order = ["state_predictor", "online_identifier", "mocap_ingest", "dynamixel_driver", "sim_robot"]
        for name in order + [n for n in self.nodes if n not in order]:
            node = self.nodes.get(name)
            if node is not None:
                try:
                    node.destroy_node()
                except Exception:
                    pass
        if self.monitor is not None:
            try:
                self.monitor.destroy_node()
            except Exception:
                pass
        for proc in self.processes():
            proc.shutdown()
        if self.owns_context:
            rclpy.try_shutdown(context=self.context)


def build_graph(config: Optional[GraphConfig] = None, context=None) -> Graph:
    """Create the configured nodes in one executor (not spinning yet; see :meth:`Graph.spin_in_background`).

    context: an initialised rclpy Context (default: a new one, owned by the graph).
    """
    import sys

    from .nodes.dynamixel_driver import DynamixelDriverNode
    from .nodes.mocap_ingest import MocapIngestNode
    from .nodes.online_identifier import OnlineIdentifierNode
    from .nodes.sim_robot import SimRobotNode
    from .nodes.plate_controller import PlateControllerNode
    from .nodes.state_predictor import StatePredictorNode
    from .nodes.visualizer import VisualizerNode

    cfg = config or GraphConfig()
    for f in (cfg.model_file, cfg.reference_file):
        if not Path(f).is_file():
            raise FileNotFoundError(f"{f}: no such file")
    if cfg.switch_interval_s:
        sys.setswitchinterval(cfg.switch_interval_s)   # many short callbacks + compute threads share the GIL
    limit_blas_threads(1)                            # small linear algebra: no BLAS thread pool (see there)
    priorities = {}
    if cfg.graph_nice is not None:
        priorities["graph_process"] = _renice(cfg.graph_nice, "the graph's process")
    owns = context is None
    if owns:
        from rclpy.context import Context
        from .isolation import isolated_env
        # a simulated graph never joins a real robot's: its own domain, this host only, unless the user set them
        os.environ.update(isolated_env(os.environ))
        context = Context()
        rclpy.init(args=[], context=context)
    link = cfg.link_path or f"/tmp/tensegrity_ttyEMU_{os.getpid()}_{int(time.time() * 1e3) % 100000}"
    robot_nodes = ("sim_robot", "dynamixel_driver")
    remote = cfg.robot_process and any(n in cfg.nodes for n in robot_nodes)
    predictor_remote = cfg.predictor_process and "state_predictor" in cfg.nodes
    common = {"model_file": str(cfg.model_file)}
    per_node = {
        "sim_robot": {**common, **({} if cfg.robot_rt_priority is None else {"rt_priority": cfg.robot_rt_priority}),
                      "true_model_file": cfg.true_model_file, "perturb_fraction": cfg.perturb_fraction,
                      "link_path": link},
        "dynamixel_driver": {**yaml_parameters("dynamixel_driver", files=("dynamixel_driver_sim.yaml",)),
                             **common, "reference_file": str(cfg.reference_file), "port": link},
        "mocap_ingest": common,
        "online_identifier": common,
        "state_predictor": {**common, "reference_file": str(cfg.reference_file)},
        "plate_controller": common,
        "visualizer": common,
    }
    classes = {"sim_robot": SimRobotNode, "dynamixel_driver": DynamixelDriverNode, "mocap_ingest": MocapIngestNode,
               "online_identifier": OnlineIdentifierNode, "state_predictor": StatePredictorNode,
               "plate_controller": PlateControllerNode, "visualizer": VisualizerNode}
    nodes: Dict[str, Node] = {}
    if cfg.executor not in ("single", "multi"):
        raise ValueError(f"executor {cfg.executor!r} (valid: single, multi)")
    executor = MultiThreadedExecutor(num_threads=cfg.threads, context=context) if cfg.executor == "multi" \
        else RankedExecutor(context=context)
    graph = Graph(executor, nodes, context, None, owns_context=owns, priorities=priorities,
                  executor_rt_priority=cfg.executor_rt_priority)
    if cfg.executor_rt_priority is not None and set(REALTIME_NODES) & set(cfg.nodes) and not predictor_remote:
        graph.rt_executor = SingleThreadedExecutor(context=context)
    try:
        monitor = None
        if cfg.monitor:
            consumed = set()   # topics a graph node already counts (its own input monitor)
            if "mocap_ingest" in cfg.nodes:
                consumed.add(TOPICS["markers"])
            if {"online_identifier", "state_predictor"} & set(cfg.nodes):
                consumed |= {TOPICS["node_states"], TOPICS["motor_states"]}
            if cfg.keep_node_states:
                consumed.discard(TOPICS["node_states"])
            topics = [t for t in GraphMonitor.TOPIC_TYPES if t not in consumed and t not in cfg.monitor_skip]
            record = cfg.record_topics
            if record and "*" in record:
                record = [t for t in GraphMonitor.TOPIC_TYPES if t not in cfg.monitor_skip]
            monitor = GraphMonitor(context=context, topics=topics, record_topics=record, qos_events=False,
                                   record_every=cfg.record_every,
                                   keep_predictions_every=cfg.keep_predictions_every,
                                   keep_node_states=cfg.keep_node_states)
            graph.monitor = monitor
            graph.executor.add_node(monitor)
        from dataclasses import replace
        if predictor_remote:   # spawned first: it imports torch and starts its worker while the rest is built
            graph.predictor_proc = NodeProcess(replace(cfg, nodes=("state_predictor",), robot_process=False,
                                                       predictor_process=False, monitor=False, robot_nice=None),
                                               "predictor")
        if remote:   # the robot side in its own process (its pty must exist for the driver)
            graph.robot = NodeProcess(replace(cfg, nodes=tuple(n for n in cfg.nodes if n in robot_nodes),
                                              robot_process=False, predictor_process=False, monitor=False,
                                              link_path=link, graph_nice=None, executor_rt_priority=None),
                                      "robot")
            graph.robot.wait_ready()
            if graph.robot.priority is not None:
                priorities["robot_process"] = graph.robot.priority
        elif cfg.robot_nice is not None and any(n in cfg.nodes for n in robot_nodes):
            # one process: the robot's threads share it; the graph's niceness is the most it can have
            priorities["robot_process"] = {"done": False, "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                                           "message": "the simulated robot runs in the graph's process"}
        for name in NODE_ORDER:
            if name not in cfg.nodes or (remote and name in robot_nodes) or \
                    (predictor_remote and name == "state_predictor"):
                continue
            values = {**(yaml_parameters(name) if name != "dynamixel_driver" else {}), **per_node[name],
                      **cfg.overrides.get(name, {})}
            if name == "dynamixel_driver" and "sim_robot" in nodes:
                values["port"] = nodes["sim_robot"].port
            kw = {"start": False} if name in ("sim_robot", "dynamixel_driver") else {}
            kw["start_parameter_services"] = cfg.parameter_services
            kw["qos_events"] = False         # see LeanNode: one executor polls every node's entities
            node = classes[name](context=context, parameter_overrides=_parameters(values), **kw)
            nodes[name] = node
            (graph.rt_executor if graph.rt_executor is not None and name in REALTIME_NODES
             else graph.executor).add_node(node)
        if graph.predictor_proc is not None:
            graph.predictor_proc.wait_ready()
            if graph.predictor_proc.priority is not None:
                priorities["predictor_process"] = graph.predictor_proc.priority
    except BaseException:
        graph.shutdown()
        raise
    return graph


def _published(nodes: Mapping[str, Node]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for node in nodes.values():
        for topic, pub in getattr(node, "publishers_by_topic", {}).items():
            out[topic] = out.get(topic, 0) + pub.count
    drv = nodes.get("dynamixel_driver")
    if drv is not None and drv.core is not None:
        out[TOPICS["motor_states"]] = int(drv.core.stats.cycles) + 1   # + the state published at start
    return out


def _robot_stats(nodes: Mapping[str, Node]) -> Dict[str, Any]:
    drv, sim = nodes.get("dynamixel_driver"), nodes.get("sim_robot")
    out: Dict[str, Any] = {"published": _published({k: v for k, v in nodes.items()
                                                    if k in ("sim_robot", "dynamixel_driver")}),
                           "driver": {}, "sim": {}, "faults": {}}
    if drv is not None and drv.core is not None:
        st = drv.core.stats
        out["driver"] = {"rate_hz": float(drv.core.rate_hz), "loop_rate_hz": float(st.loop_rate_hz),
                         "cycles": int(st.cycles),
                         "missed_cycles": int(st.missed_cycles), "jitter_p99_ms": float(st.jitter_p99_s * 1e3)}
    if sim is not None:
        out["sim"] = {"mocap_rate_hz": float(sim.p["mocap_rate_hz"]), "realtime_factor": float(sim.rtf),
                      "realtime": sim.rt_status,
                      "frames": int(sim.frames),
                      "skipped_frames": int(sim.skipped_frames),
                      "lag_ms_p99": sim.lag.percentile(99) * 1e3 if sim.lag.count else 0.0}
    for name, node in nodes.items():
        if getattr(node, "fault", None) is not None:
            out["faults"][name] = f"{type(node.fault).__name__}: {node.fault}"
    return out


def _renice(nice: int, what: str):
    """Set this process's niceness; a refusal is logged, not raised (see workers.set_niceness)."""
    import logging

    from .workers import set_niceness

    done, now, text = set_niceness(nice)
    if not done:
        logging.getLogger("tensegrity_ros.bringup").warning(
            f"{what}: {text}; on a busy machine it may then fall behind (the run's health figures will say)")
    return {"done": done, "niceness": now, "message": text}


def _recent_latency_ms(predictor) -> float:
    """Median latency of the predictor's last 240 predictions (~2 s), ms (nan before any)."""
    recent = predictor.latency.recent(240)
    return float(np.median(recent) * 1e3) if recent.size else math.nan


def _predictor_stats(nodes: Mapping[str, Node]) -> Dict[str, Any]:
    """The light figures of a predictor process, asked for often (drain, status lines): counts, not samples."""
    pr = nodes["state_predictor"]
    fault = getattr(pr, "fault", None)
    return {"published": _published(nodes), "seq": pr.seq, "latency_recent_ms_p50": _recent_latency_ms(pr),
            "faults": {"state_predictor": f"{type(fault).__name__}: {fault}"} if fault is not None else {}}


#: per role of a :class:`NodeProcess`: what it says about itself ("stats") and what else it answers
_ROLES: Dict[str, Dict[str, Callable[[Mapping[str, Node]], Any]]] = {
    "robot": {"stats": _robot_stats},
    "predictor": {"stats": _predictor_stats, "figures": lambda nodes: nodes["state_predictor"].figures()},
}


def _process_main(conn, cfg: GraphConfig, role: str) -> None:
    """Child process of :class:`NodeProcess`: build the role's nodes, then serve start / stop / shutdown and
    the role's requests (``_ROLES``)."""
    graph = None
    try:
        from dataclasses import replace

        nice = cfg.robot_nice if role == "robot" else cfg.graph_nice
        prio = _renice(nice, f"the {role}'s process") if nice is not None else None
        graph = build_graph(replace(cfg, robot_nice=None, graph_nice=None))   # applied above, to this process
        sim = graph.nodes.get("sim_robot")
        conn.send(("ready", {"true_structure": None if sim is None else sim.true_structure, "priority": prio}))
        answers = _ROLES[role]
        final = None     # the robot's stats once its sources stopped (nothing changes after that)
        while True:
            cmd = conn.recv()
            if cmd == "start":
                graph.spin_in_background()
                conn.send(("ok", None))
            elif cmd == "stop":
                stop_sources(graph)
                final = answers["stats"](graph.nodes)
                conn.send(("ok", final))
            elif cmd == "shutdown":
                break
            elif cmd in answers:
                conn.send(("ok", final if cmd == "stats" and final is not None else answers[cmd](graph.nodes)))
            else:
                conn.send(("error", f"unknown request {cmd!r} (valid: start, stop, shutdown, {', '.join(answers)})"))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # pragma: no cover - reported to the parent
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass
    finally:
        if graph is not None:
            graph.shutdown()
        try:
            conn.send(("bye", None))
        except Exception:
            pass


class NodeProcess:
    """Some of the graph's nodes in a spawned process with its own rclpy context, executor and GIL, controlled
    over a pipe (start, stats, stop, shutdown, and the role's requests). role ``robot``: sim_robot +
    dynamixel_driver; ``predictor``: state_predictor. Their topics are ordinary DDS topics for the rest of
    the graph. Not a daemon process: the predictor starts a worker process of its own (a daemon may not);
    :meth:`shutdown` ends it within ~2 s whatever it is doing."""

    def __init__(self, cfg: GraphConfig, role: str, timeout_s: float = 120.0):
        import multiprocessing

        if role not in _ROLES:
            raise ValueError(f"role {role!r} (valid: {', '.join(_ROLES)})")
        ctx = multiprocessing.get_context("spawn")
        self.role = role
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_process_main, args=(child, cfg, role), name=f"tensegrity-{role}",
                                daemon=False)
        self.proc.start()
        self._lock = threading.Lock()
        self._final: Optional[Dict[str, Any]] = None
        self._timeout_s = timeout_s
        self.true_structure = None
        self.priority = None
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the child has built its nodes (raises if it failed or took longer than the timeout)."""
        if self._ready:
            return
        if not self.conn.poll(self._timeout_s):
            self.shutdown()
            raise RuntimeError(f"the {self.role} process did not start within {self._timeout_s:.0f} s")
        kind, info = self.conn.recv()
        if kind != "ready":
            self.shutdown()
            raise RuntimeError(f"the {self.role} process failed: {info}")
        self.true_structure = info["true_structure"]
        self.priority = info.get("priority")
        self._ready = True

    def request(self, cmd: str):
        """One request, answered by the child (see ``_ROLES``)."""
        self.wait_ready()
        with self._lock:
            self.conn.send(cmd)
            kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{self.role} process: {value}")
        return value

    def start(self) -> None:
        self.request("start")

    def stats(self) -> Dict[str, Any]:
        """The role's stats; ``faults`` says why when the process cannot answer."""
        if self._final is not None:
            return self._final
        try:
            return self.request("stats")
        except (EOFError, OSError, RuntimeError) as e:
            empty = {"published": {}, "driver": {}, "sim": {}} if self.role == "robot" else \
                {"published": {}, "seq": SequenceMonitor()}
            return {**empty, "faults": {f"{self.role}_process": str(e)}}

    def stop(self) -> Dict[str, Any]:
        """Stop the role's sources (the robot's simulation and driver loop); its stats are final from then on."""
        if self._final is None:
            self._final = self.request("stop")
        return self._final

    def begin_shutdown(self) -> None:
        """Ask the process to stop (torque off, emulator closed, worker ended) without waiting for it."""
        if getattr(self, "_asked", False):
            return
        try:
            if self._lock.acquire(timeout=0.2):   # a request in flight holds it: do not wait for its answer
                try:
                    self.conn.send("shutdown")
                    self._asked = True
                finally:
                    self._lock.release()
        except (OSError, EOFError, ValueError):
            pass

    def shutdown(self, timeout_s: float = 1.5) -> None:
        """Stop the process (:meth:`begin_shutdown`, then wait); SIGTERM after ``timeout_s``, SIGKILL 0.5 s
        later."""
        self.begin_shutdown()
        self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=0.5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=0.5)


@dataclass
class GraphRun:
    """What :func:`run_graph` returns (the graph is shut down; the monitor's data are kept)."""

    duration_s: float
    drops: Dict[str, Dict[str, int]]
    dropped_messages: int          # lost between nodes (``drops`` summed), not the sources' shortfall
    received: Dict[str, int]
    published: Dict[str, int]
    monitor: Optional[GraphMonitor]
    nodes: Dict[str, Node]
    diagnostics: Dict[str, Any]
    robot: Dict[str, Any] = field(default_factory=dict)
    #: {stream: {expected, published, received, fraction, lost, not_produced}} (:func:`delivery`) and the run's
    #: verdict (:func:`graph_health`)
    delivery: Dict[str, Dict[str, float]] = field(default_factory=dict)
    health: Any = None
    #: whether every subscriber had received everything published when the drain ended (False: it gave up, and
    #: what was still queued counts in ``drops``)
    drained: bool = True


def run_graph(duration_s: float, config: Optional[GraphConfig] = None, *, context=None,
              on_tick: Optional[Callable[[Graph, float], None]] = None, tick_s: float = 1.0,
              drain_s: float = 15.0) -> GraphRun:
    """Build the graph, spin it for ``duration_s`` seconds (``on_tick(graph, elapsed)`` every ``tick_s``),
    stop the streams at their sources, let every queued message be delivered (:func:`drain`, at most
    ``drain_s``), count drops and what was delivered against rate x duration, judge the run's health
    (``GraphRun.health``: config/health.yaml, section graph), shut down."""
    graph = build_graph(config, context)
    try:
        graph.spin_in_background()
        t0 = time.monotonic()
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= duration_s:
                break
            time.sleep(min(tick_s, duration_s - elapsed))
            if on_tick is not None:
                on_tick(graph, time.monotonic() - t0)
            faults = graph.faults()
            if faults:
                raise RuntimeError(f"stopped: {faults}")
        elapsed = time.monotonic() - t0
        stop_sources(graph)
        drained = drain(graph, drain_s)
        drops = graph.drops()
        mon = graph.monitor
        return GraphRun(duration_s=elapsed, drops=drops,
                        dropped_messages=graph.total_dropped(drops),
                        received=graph.received(), published=graph.published_counts(), monitor=mon,
                        nodes=graph.nodes, diagnostics=dict(mon.diagnostics) if mon else {},
                        robot=graph.robot_stats(), delivery=delivery(graph, elapsed),
                        health=graph_health(graph, elapsed), drained=drained)
    finally:
        graph.shutdown()


# =====================================================================================================
# health: what was delivered against what should have been (tensegrity_ros.health judges)
# =====================================================================================================
def delivery(graph: Graph, duration_s: float) -> Dict[str, Dict[str, float]]:
    """{stream: {expected, published, received, fraction, lost, not_produced}} for the streams with a nominal
    rate: mocap frames (received by mocap_ingest), motor states and node states (the least any consumer of the
    graph received). Expected = the source's nominal rate x ``duration_s``; published = what its source sent.
    So a message not delivered was either lost between nodes (``lost`` = published - received) or never
    produced (``not_produced`` = expected - published: a mocap frame the simulated robot skipped when it fell
    behind real time, as a mocap system drops frames; the node states of frames never received).
    Call after :func:`stop_sources` and :func:`drain`."""
    from .health import delivered_fraction, expected_count

    robot = graph.robot_stats()
    mocap_hz = robot["sim"].get("mocap_rate_hz", math.nan)
    motor_hz = robot["driver"].get("rate_hz", math.nan)
    nodes = graph.nodes
    subs = graph.subscribers()
    consumers = [subs[n] for n in ("online_identifier", "state_predictor") if n in subs]

    def least(topic):
        got = [seq.received.get(topic, 0) for seq in consumers]
        return min(got) if got else 0

    ing = nodes.get("mocap_ingest")
    received = {"mocap_frames": ing.seq.received.get(TOPICS["markers"], 0) if ing is not None else 0,
                "motor_states": least(TOPICS["motor_states"]), "node_states": least(TOPICS["node_states"])}
    rates = {"mocap_frames": mocap_hz, "motor_states": motor_hz, "node_states": mocap_hz}
    pub = graph.published_counts()
    published = {k: int(pub.get(TOPICS[t], 0)) for k, t in
                 (("mocap_frames", "markers"), ("motor_states", "motor_states"), ("node_states", "node_states"))}
    out = {}
    for k in received:
        expected = expected_count(rates[k], duration_s)
        out[k] = {"expected": expected, "published": published[k], "received": int(received[k]),
                  "fraction": delivered_fraction(received[k], rates[k], duration_s),
                  "lost": max(0, published[k] - int(received[k])),
                  "not_produced": max(0, expected - max(published[k], int(received[k])))}
    return out


def delivery_summary(deliv: Mapping[str, Mapping[str, float]], drained: bool) -> Dict[str, Any]:
    """The summary keys the demo and the graph bench write over :func:`delivery`'s streams: ``dropped_messages``
    (not delivered: expected - received, lost anywhere), of them ``lost_messages`` between nodes (published, not
    received) and ``not_produced_messages`` by their sources; ``all_delivered``: the queues drained (``drained``,
    :func:`drain`'s result) and every stream delivered its rate x duration."""
    return {"dropped_messages": int(sum(max(0, d["expected"] - d["received"]) for d in deliv.values())),
            "lost_messages": int(sum(d["lost"] for d in deliv.values())),
            "not_produced_messages": int(sum(d["not_produced"] for d in deliv.values())),
            "all_delivered": bool(drained) and all(d["received"] >= d["expected"] for d in deliv.values())}


def health_figures(graph: Graph, duration_s: float) -> Dict[str, float]:
    """The graph's health figures (``config/health.yaml``, section ``graph``) over a run of ``duration_s``."""
    nodes = graph.nodes
    out: Dict[str, float] = {f"{k}_delivered": v["fraction"] for k, v in delivery(graph, duration_s).items()}
    pr, idn = graph.predictor(), nodes.get("online_identifier")
    out["predictions_per_node_state"] = pr.predictions_per_node_state() if pr is not None else math.nan
    out["prediction_latency_ms_p99"] = pr.latency.percentile(99) * 1e3 if pr is not None and pr.latency.count \
        else math.nan
    out["identifier_update_period_s_p50"] = idn.update_period_p50(duration_s) if idn is not None else math.nan
    out["sim_realtime_factor"] = float(graph.robot_stats()["sim"].get("realtime_factor", math.nan))
    return out


def graph_health(graph: Graph, duration_s: float, extra: Optional[Mapping[str, float]] = None,
                 sections: Sequence[str] = ("graph",)):
    """:class:`tensegrity_ros.health.Health` of the run: :func:`health_figures` + ``extra`` figures, judged
    against ``config/health.yaml``'s ``sections``."""
    from .health import evaluate, load_thresholds

    thresholds = {}
    for sec in sections:
        thresholds.update(load_thresholds(section=sec))
    return evaluate({**health_figures(graph, duration_s), **dict(extra or {})}, thresholds)


#: how long :func:`drain` waits with no message arriving anywhere before it calls what is missing lost. A
#: subscriber in a process of its own (the state predictor's, as ``test_graph_60s.py`` runs it) can sit that long
#: behind on a loaded 2-core machine: at 2 s the test once counted 38 node states as dropped in a full-suite CI run
#: (stop 43) and none when run alone right after
DRAIN_STALL_S = 5.0


def drain(graph: Graph, timeout_s: float = 15.0, settle_s: float = 0.5) -> bool:
    """Wait until every counting subscriber has received what was published on its topics (a reliable
    queue still being worked off is a backlog, not a drop), or nothing arrived for :data:`DRAIN_STALL_S`, or
    ``timeout_s``. Returns True when fully delivered."""
    deadline = time.monotonic() + timeout_s
    last, last_change = None, time.monotonic()
    while time.monotonic() < deadline:
        pub = graph.published_counts()
        state = {(n, t): seq.received.get(t, 0) for n, seq in graph.subscribers().items() for t in seq.received}
        if all(v >= pub.get(t, 0) for (n, t), v in state.items()):
            time.sleep(settle_s)
            return True
        if state != last:
            last, last_change = state, time.monotonic()
        elif time.monotonic() - last_change > DRAIN_STALL_S:
            return False
        time.sleep(0.1)
    return False


def stop_sources(graph: Graph) -> None:
    """Stop the streams at their sources (simulation thread, driver loop), keep the executor spinning so
    queued messages are delivered (used before counting drops). The run ends here: the load meter too (its
    figures are the run's, not the drain's and the reports' after it)."""
    if graph.load is not None:
        graph.load.stop()
    if graph.robot is not None:
        graph.robot.stop()
    sim = graph.nodes.get("sim_robot")
    if sim is not None:
        sim._stop.set()
        if sim._thread is not None:
            sim._thread.join(timeout=5.0)
    drv = graph.nodes.get("dynamixel_driver")
    if drv is not None:
        drv._stop.set()
        if drv._thread is not None:
            drv._thread.join(timeout=5.0)
