"""What every node of the graph shares, written once.

* **Parameters**: a table of :class:`ParamSpec` per node (name, default, description, check). The node
  declares them with ParameterDescriptors (:func:`declare_parameters`), validates the start values (a bad
  value fails node creation with every problem listed) and rejects bad run-time changes with a reason
  (:meth:`GraphNode._on_set_parameters`, as in ros2/demos ``set_parameters_callback.py``). The launch-file
  test reads the same tables (``<node module>.PARAMS``).
* **Conversions** between messages and arrays/records: NodeStates, JointState, PoseArray, PoseStamped,
  PredictedStates (with a fast CDR codec: a 1-s horizon is thousands of Points, too slow as Python
  objects) and IdentifiedParameters.
* **Diagnostics**: :func:`diag_status` (DiagnosticStatus with key-values), :class:`RollingStats`
  (percentiles of latencies / update times), :class:`SequenceMonitor` (drops from the DDS publication
  sequence numbers) and :class:`CountingPublisher` (messages sent per topic).
* **QoS**: reliable, keep-last, deep queues on every stream, so that a dropped message is a real drop
  (queue overflow) and is seen as a gap in the publication sequence numbers.
* **main**: :func:`run_node` with clean shutdown on SIGINT / SIGTERM.

Nothing here knows a particular node; the node modules are thin shells over the functional core.
"""
from __future__ import annotations

import itertools
import math
import signal
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point, Pose, PoseArray, PoseStamped, Quaternion, TransformStamped, Vector3
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState

from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates

from ..frames import matrix_from_quaternion, quaternion_from_matrix  # noqa: F401 (C.* users)

# =====================================================================================================
# topics and QoS
# =====================================================================================================
#: default topic names (all remappable with the usual ``--ros-args -r from:=to``)
TOPICS = {
    "markers": "/mocap/markers",
    "node_states": "/tensegrity/node_states",
    "motor_states": "/tensegrity/motor_states",
    "motor_commands": "/tensegrity/motor_commands",
    "motor_plan": "/tensegrity/motor_plan",
    "identified_parameters": "/tensegrity/identified_parameters",
    "predicted_states": "/tensegrity/predicted_states",
    "plate_c1": "/tensegrity/plate_c1",
    "plate_c2": "/tensegrity/plate_c2",
    "ground_truth": "/sim/ground_truth",
    "diagnostics": "/diagnostics",
    "tf": "/tf",
}


def _qos(depth: int, reliable: bool = True, latched: bool = False) -> QoSProfile:
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth,
                      reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


#: 120 Hz mocap / node states, 80 Hz motor states: reliable with ~8 s of queue (1000 messages), so nothing is
#: lost while the executor runs late (a worker starting, a CPU shared with other work); a loss (queue overflow)
#: shows up as a publication-sequence gap.
STREAM_DEPTH = 1000
STREAM_QOS = _qos(STREAM_DEPTH)
#: the same depth, best effort: for mocap drivers that publish best effort (a reliable reader would not
#: match them); drops are still counted from sequence numbers.
STREAM_QOS_BEST_EFFORT = _qos(STREAM_DEPTH, reliable=False)
#: predictions (large messages): reliable, shorter queue
PREDICTION_QOS = _qos(32)
#: identified parameter sets: reliable and latched (a late subscriber gets the recent sets, the last one current)
LATCHED_QOS = _qos(10, latched=True)
DIAG_QOS = _qos(32)


def stream_qos(reliability: str) -> QoSProfile:
    """STREAM_QOS for ``reliable``, STREAM_QOS_BEST_EFFORT for ``best_effort``."""
    if reliability not in ("reliable", "best_effort"):
        raise ValueError(f"reliability {reliability!r} (valid: reliable, best_effort)")
    return STREAM_QOS if reliability == "reliable" else STREAM_QOS_BEST_EFFORT


# =====================================================================================================
# parameters
# =====================================================================================================
class ParameterError(ValueError):
    """Start values of a node's parameters that are not usable (every problem is in the message)."""


Check = Callable[[Any], Optional[str]]   # value -> None if fine, else what is wrong


@dataclass(frozen=True)
class ParamSpec:
    """One declared parameter.

    default: its value (its Python type is the parameter type); use ``type_`` for an empty list default
    ("double_array" | "string_array" | "integer_array"). range: inclusive (lo, hi), also put in the
    descriptor; choices: allowed strings; check: value -> error text or None; read_only: only settable at
    start (from YAML / launch / ``-p``).
    """

    name: str
    default: Any
    description: str
    range: Optional[Tuple[float, float]] = None
    choices: Optional[Tuple[str, ...]] = None
    check: Optional[Check] = None
    read_only: bool = False
    type_: Optional[str] = None

    def problem(self, value: Any) -> Optional[str]:
        """None if ``value`` is acceptable, else the reason (``name = value: reason``)."""
        def bad(why):
            return f"{self.name} = {value!r}: {why}"

        expect = type(self.default)
        if self.type_ is not None or isinstance(self.default, (list, tuple)):
            if not isinstance(value, (list, tuple)):
                return bad("expected a list")
        elif expect is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return bad("expected a number")
            if not math.isfinite(float(value)):
                return bad("must be finite")
        elif expect is int and (isinstance(value, bool) or not isinstance(value, int)):
            return bad("expected an integer")
        elif expect is bool and not isinstance(value, bool):
            return bad("expected true or false")
        elif expect is str and not isinstance(value, str):
            return bad("expected a string")
        if self.range is not None and not (self.range[0] <= value <= self.range[1]):
            return bad(f"must be within [{self.range[0]:g}, {self.range[1]:g}]")
        if self.choices is not None and value not in self.choices:
            return bad(f"must be one of {', '.join(self.choices)}")
        if self.check is not None:
            why = self.check(value)
            if why:
                return bad(why)
        return None

    def descriptor(self) -> ParameterDescriptor:
        d = ParameterDescriptor(description=self.description, read_only=self.read_only)
        if self.choices:
            d.additional_constraints = "one of: " + ", ".join(self.choices)
        if self.range is not None:
            if type(self.default) is float:
                d.floating_point_range = [FloatingPointRange(from_value=float(self.range[0]),
                                                             to_value=float(self.range[1]), step=0.0)]
            elif type(self.default) is int:
                d.integer_range = [IntegerRange(from_value=int(self.range[0]), to_value=int(self.range[1]), step=0)]
        return d


_ARRAY_TYPES = {"double_array": Parameter.Type.DOUBLE_ARRAY, "string_array": Parameter.Type.STRING_ARRAY,
                "integer_array": Parameter.Type.INTEGER_ARRAY}


# ---- reusable checks ---------------------------------------------------------------------------------
def positive(value) -> Optional[str]:
    return None if value > 0 else "must be > 0"


def nonnegative(value) -> Optional[str]:
    return None if value >= 0 else "must be >= 0"


def file_exists(value: str) -> Optional[str]:
    import os
    return None if value == "" or os.path.isfile(value) else "no such file"


def required_file(value: str) -> Optional[str]:
    import os
    if not value:
        return "required (a path)"
    return None if os.path.isfile(value) else "no such file"


def transform_list(value) -> Optional[str]:
    """[] (none), 12 values (R row-major, then t) or 16 values (4x4 row-major)."""
    if len(value) not in (0, 12, 16):
        return "expected [] or 12 values (R row-major, t) or 16 values (4x4 row-major)"
    if not all(math.isfinite(float(v)) for v in value):
        return "values must be finite"
    return None


def transform_from_list(value: Sequence[float]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(R (3, 3), t (3,)) from a :func:`transform_list` parameter, or None for []."""
    v = np.asarray(list(value), dtype=float)
    if v.size == 0:
        return None
    if v.size == 16:
        M = v.reshape(4, 4)
        return M[:3, :3].copy(), M[:3, 3].copy()
    return v[:9].reshape(3, 3).copy(), v[9:12].copy()


def declare_parameters(node: Node, specs: Sequence[ParamSpec]) -> Dict[str, Any]:
    """Declare every spec on ``node`` (with its descriptor) and return {name: value}.

    Raises :class:`ParameterError` listing every start value that fails its spec.
    """
    values: Dict[str, Any] = {}
    for s in specs:
        default = _ARRAY_TYPES[s.type_] if (s.type_ and not s.default) else s.default
        p = node.declare_parameter(s.name, default, s.descriptor())
        v = p.value
        if v is None and s.type_:
            v = list(s.default) if s.default is not None else []
        if isinstance(v, (list, tuple)) or type(v).__name__ == "array":
            v = list(v)
        if type(s.default) is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        values[s.name] = v
    problems = [why for s in specs if (why := s.problem(values[s.name]))]
    if problems:
        raise ParameterError(f"{node.get_name()}: bad parameter value(s): " + "; ".join(problems))
    return values


def spec_table(specs: Sequence[ParamSpec]) -> Dict[str, ParamSpec]:
    return {s.name: s for s in specs}


# =====================================================================================================
# the node base
# =====================================================================================================
class LeanNode(Node):
    """A Node whose publishers and subscriptions can go without rclpy's default QoS-event handlers.

    rclpy gives every publisher and subscription two event handlers (incompatible QoS, incompatible type) that
    only log a warning. Each is a waitable that the Python executor adds to its wait set, checks and enters on
    every spin: with the whole simulated graph in one executor, ~8 % of the executor thread's samples (py-spy,
    the demo). ``qos_events=False`` (what :mod:`tensegrity_ros.bringup` passes) leaves them out: the graph's QoS
    are ours and compatible by construction. A node launched on its own keeps them (the default), so a user's
    incompatible subscriber is still reported.
    """

    def __init__(self, node_name: str, *, qos_events: bool = True, **kwargs):
        self._qos_events = bool(qos_events)      # set first: Node.__init__ already creates publishers
        super().__init__(node_name, **kwargs)

    def create_publisher(self, *args, **kwargs):
        if not getattr(self, "_qos_events", True) and kwargs.get("event_callbacks") is None:
            kwargs["event_callbacks"] = PublisherEventCallbacks(use_default_callbacks=False)
        return super().create_publisher(*args, **kwargs)

    def create_subscription(self, *args, **kwargs):
        if not getattr(self, "_qos_events", True) and kwargs.get("event_callbacks") is None:
            kwargs["event_callbacks"] = SubscriptionEventCallbacks(use_default_callbacks=False)
        return super().create_subscription(*args, **kwargs)


class GraphNode(LeanNode):
    """Base of the graph's nodes: declared + validated parameters, a /diagnostics publisher, counters.

    Subclasses set ``PARAMS`` (a tuple of :class:`ParamSpec`) and may override
    :meth:`on_parameter_change` to apply an accepted run-time change (or veto it with a reason).
    ``self.p`` holds the current parameter values by name.
    """

    PARAMS: Tuple[ParamSpec, ...] = ()

    def __init__(self, node_name: str, **kwargs):
        super().__init__(node_name, **kwargs)
        self._specs = spec_table(self.PARAMS)
        self.p: Dict[str, Any] = declare_parameters(self, self.PARAMS)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._diag_pub = self.create_publisher(DiagnosticArray, TOPICS["diagnostics"], DIAG_QOS)
        self.publishers_by_topic: Dict[str, CountingPublisher] = {}
        self.fault: Optional[BaseException] = None
        self.callback_errors = 0
        self.last_callback_error = ""

    # ---- parameters -------------------------------------------------------------------------
    def on_parameter_change(self, name: str, value: Any) -> Optional[str]:
        """Called for each accepted run-time change before it takes effect; return a reason to veto."""
        return None

    def _on_set_parameters(self, params: List[Parameter]) -> SetParametersResult:
        for prm in params:
            spec = self._specs.get(prm.name)
            if spec is None:
                continue   # use_sim_time and other non-table parameters
            value = list(prm.value) if isinstance(prm.value, (list, tuple)) else prm.value
            if type(spec.default) is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            why = spec.problem(value)
            if why is None:
                why = self.on_parameter_change(prm.name, value)
            if why:
                return SetParametersResult(successful=False, reason=why)
        for prm in params:
            if prm.name in self._specs:
                self.p[prm.name] = list(prm.value) if isinstance(prm.value, (list, tuple)) else prm.value
        return SetParametersResult(successful=True)

    # ---- guarded callbacks --------------------------------------------------------------------
    def guard(self, fn: Callable, arity: int) -> Callable:
        """``fn`` wrapped so that an exception is logged and counted (``callback_errors``, shown in the
        node's diagnostics) instead of escaping into the executor, where it would stop every node's
        callbacks. ``arity``: 0 (timer), 1 (message) or 2 (message, MessageInfo: rclpy passes the info to
        two-parameter callbacks)."""
        def report(e: Exception) -> None:
            self.callback_errors += 1
            self.last_callback_error = f"{getattr(fn, '__name__', 'callback')}: {type(e).__name__}: {e}"
            self.get_logger().error(self.last_callback_error, throttle_duration_sec=5.0)

        if arity == 0:
            def wrapped():
                try:
                    return fn()
                except Exception as e:  # noqa: BLE001 - reported, never kills the executor
                    report(e)
        elif arity == 1:
            def wrapped(msg):
                try:
                    return fn(msg)
                except Exception as e:  # noqa: BLE001
                    report(e)
        else:
            def wrapped(msg, info):
                try:
                    return fn(msg, info)
                except Exception as e:  # noqa: BLE001
                    report(e)
        return wrapped

    def subscribe(self, msg_type, topic: str, callback: Callable, qos, *, raw: bool = False, info: bool = True):
        """A guarded subscription; ``callback(msg, info)`` (MessageInfo: sequence numbers for drop counting)
        unless ``info`` is False."""
        return self.create_subscription(msg_type, topic, self.guard(callback, 2 if info else 1), qos, raw=raw)

    def every(self, period_s: float, callback: Callable):
        """A guarded timer."""
        return self.create_timer(period_s, self.guard(callback, 0))

    # ---- publishing --------------------------------------------------------------------------
    def counting_publisher(self, msg_type, topic: str, qos: QoSProfile) -> "CountingPublisher":
        pub = CountingPublisher(self.create_publisher(msg_type, topic, qos))
        self.publishers_by_topic[pub.topic_name] = pub
        return pub

    def publish_diagnostics(self, statuses: Iterable[DiagnosticStatus]) -> None:
        """Publish on /diagnostics; a node whose callbacks raised says so (count, last error, level >= WARN)."""
        arr = DiagnosticArray()
        arr.header.stamp = self.get_clock().now().to_msg()
        arr.status = list(statuses)
        for st in arr.status:
            st.values.append(KeyValue(key="callback_errors", value=str(self.callback_errors)))
            if self.callback_errors:
                st.values.append(KeyValue(key="last_callback_error", value=self.last_callback_error))
                if st.level == DiagnosticStatus.OK:
                    st.level = DiagnosticStatus.WARN
                    st.message = f"{st.message}; {self.callback_errors} callback error(s)"
        self._diag_pub.publish(arr)

    def now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9


class CountingPublisher:
    """A publisher that counts what it sent (``count``), for drop accounting."""

    def __init__(self, pub):
        self.pub = pub
        self.count = 0
        self.topic_name = pub.topic_name

    def publish(self, msg) -> None:
        self.pub.publish(msg)
        self.count += 1

    def get_subscription_count(self) -> int:
        return self.pub.get_subscription_count()


# =====================================================================================================
# statistics and diagnostics
# =====================================================================================================
class RollingStats:
    """The last ``size`` samples of a quantity (e.g. a latency in s): percentiles, mean, count."""

    def __init__(self, size: int = 2000):
        self._d: deque = deque(maxlen=size)
        self.count = 0
        self.max = -math.inf
        self._lock = threading.Lock()

    def __getstate__(self):      # pickles by value (a snapshot sent from another process); the lock is not
        with self._lock:
            return {"_d": deque(self._d, maxlen=self._d.maxlen), "count": self.count, "max": self.max}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._d.append(float(value))
            self.count += 1
            self.max = max(self.max, float(value))

    def values(self) -> np.ndarray:
        with self._lock:
            return np.array(self._d, dtype=float)

    def recent(self, n: int) -> np.ndarray:
        """The last ``n`` samples, oldest first (cheap: a status line's figure without copying the window)."""
        with self._lock:
            out = list(itertools.islice(reversed(self._d), n))
        return np.array(out[::-1], dtype=float)

    def percentile(self, q: float) -> float:
        v = self.values()
        return float(np.percentile(v, q)) if v.size else math.nan

    def summary(self, scale: float = 1.0, prefix: str = "") -> Dict[str, float]:
        v = self.values() * scale
        if not v.size:
            return {f"{prefix}n": 0}
        return {f"{prefix}n": self.count, f"{prefix}p50": float(np.percentile(v, 50)),
                f"{prefix}p99": float(np.percentile(v, 99)), f"{prefix}mean": float(v.mean()),
                f"{prefix}max": float(v.max())}


class RateMeter:
    """Message rate over a sliding window of arrival times (s)."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._t: deque = deque()
        self.count = 0

    def tick(self, t: Optional[float] = None) -> None:
        t = time.monotonic() if t is None else t
        self._t.append(t)
        self.count += 1
        while self._t and t - self._t[0] > self.window_s:
            self._t.popleft()

    def rate(self) -> float:
        if len(self._t) < 2:
            return 0.0
        span = self._t[-1] - self._t[0]
        return (len(self._t) - 1) / span if span > 0 else 0.0


class SequenceMonitor:
    """Drops per topic from DDS publication sequence numbers (``MessageInfo['publication_sequence_number']``).

    One publisher per topic is assumed; a sequence number that goes back (a restarted publisher) starts
    a new count. ``received`` / ``dropped`` per topic; pure Python, no rclpy.
    """

    def __init__(self):
        self.received: Dict[str, int] = {}
        self.dropped: Dict[str, int] = {}
        self._last: Dict[str, int] = {}
        self.restarts: Dict[str, int] = {}

    def update(self, topic: str, seq: Optional[int]) -> int:
        """Record one message; returns the number of messages found missing just before it."""
        self.received[topic] = self.received.get(topic, 0) + 1
        self.dropped.setdefault(topic, 0)
        if seq is None or seq <= 0:
            return 0
        last = self._last.get(topic)
        self._last[topic] = seq
        if last is None:
            return 0
        if seq <= last:
            self.restarts[topic] = self.restarts.get(topic, 0) + 1
            return 0
        gap = seq - last - 1
        self.dropped[topic] += gap
        return gap

    def update_info(self, topic: str, info: Optional[Mapping[str, Any]]) -> int:
        seq = None if info is None else info.get("publication_sequence_number")
        return self.update(topic, seq)

    @property
    def total_dropped(self) -> int:
        return int(sum(self.dropped.values()))


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


LEVELS = {"ok": DiagnosticStatus.OK, "warn": DiagnosticStatus.WARN, "error": DiagnosticStatus.ERROR,
          "stale": DiagnosticStatus.STALE}


def diag_status(name: str, level: str, message: str, values: Mapping[str, Any] = (),
                hardware_id: str = "") -> DiagnosticStatus:
    """DiagnosticStatus with level ``ok|warn|error|stale`` and key-values (floats as %.6g)."""
    st = DiagnosticStatus()
    st.name, st.level, st.message, st.hardware_id = name, LEVELS[level], message, hardware_id
    st.values = [KeyValue(key=str(k), value=_fmt(v)) for k, v in dict(values).items()]
    return st


def diag_values(status: DiagnosticStatus) -> Dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


# =====================================================================================================
# time
# =====================================================================================================
def stamp_to_sec(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


def sec_to_stamp(t: float) -> Time:
    ns = int(round(float(t) * 1e9))
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


# =====================================================================================================
# message <-> array conversions
# =====================================================================================================
def _points(a: np.ndarray, cls=Point) -> list:
    return [cls(x=x, y=y, z=z) for x, y, z in np.asarray(a, dtype=float).reshape(-1, 3).tolist()]


def _xyz(items) -> np.ndarray:
    return np.array([(p.x, p.y, p.z) for p in items], dtype=float).reshape(-1, 3)


class NodeStatesRecord(NamedTuple):
    """A NodeStates message as arrays: stamp s, names (N,), positions / velocities (N, 3) (m, m/s; NaN
    where unknown), valid (N,) bool, frame_id."""

    stamp: float
    names: Tuple[str, ...]
    positions: np.ndarray
    velocities: np.ndarray
    valid: np.ndarray
    frame_id: str = ""

    @property
    def velocity_valid(self) -> np.ndarray:
        return self.valid & np.all(np.isfinite(self.velocities), axis=1)


def node_states_to_msg(stamp: float, names: Sequence[str], positions, velocities, valid, frame_id: str = "structure",
                       note: str = "") -> NodeStates:
    """NodeStates from arrays. Invalid nodes are sent as NaN; a velocity not yet estimated (filter not
    converged, e.g. right after an occlusion) is sent as NaN too (never invented)."""
    msg = NodeStates()
    msg.header.stamp = sec_to_stamp(stamp)
    msg.header.frame_id = frame_id
    msg.names = list(names)
    msg.positions = _points(positions)
    msg.velocities = _points(velocities, Vector3)
    msg.valid = [bool(v) for v in np.asarray(valid).reshape(-1)]
    msg.frame_note = note
    return msg


def node_states_from_msg(msg: NodeStates) -> NodeStatesRecord:
    n = len(msg.names)
    P, V = _xyz(msg.positions), _xyz(msg.velocities)
    if P.shape[0] != n or len(msg.valid) != n or V.shape[0] not in (0, n):
        raise ValueError(f"NodeStates with {n} names but {P.shape[0]} positions, {V.shape[0]} velocities, "
                         f"{len(msg.valid)} valid flags")
    if V.shape[0] == 0:
        V = np.full((n, 3), np.nan)
    valid = np.asarray(msg.valid, dtype=bool) & np.all(np.isfinite(P), axis=1)
    return NodeStatesRecord(stamp_to_sec(msg.header.stamp), tuple(msg.names), P, V, valid, msg.header.frame_id)


def sample_to_node_states(sample, note: str = "") -> NodeStates:
    """NodeStates from a :class:`tensegrity_ros.mocap.NodeStateSample`."""
    vel = np.where(sample.velocity_valid[:, None], sample.velocities, np.nan)
    return node_states_to_msg(sample.stamp, sample.names, sample.positions, vel, sample.valid, sample.frame_id, note)


class JointRecord(NamedTuple):
    """A JointState as arrays: stamp s, names (A,), position / velocity / effort (A,) (NaN if absent)."""

    stamp: float
    names: Tuple[str, ...]
    position: np.ndarray
    velocity: np.ndarray
    effort: np.ndarray


def joint_state_from_msg(msg: JointState) -> JointRecord:
    n = len(msg.name)

    def arr(x):
        a = np.asarray(x, dtype=float).reshape(-1)
        return a if a.size == n else np.full(n, np.nan)

    return JointRecord(stamp_to_sec(msg.header.stamp), tuple(msg.name), arr(msg.position), arr(msg.velocity),
                       arr(msg.effort))


def joint_state_to_msg(stamp: float, names: Sequence[str], position, velocity=None, effort=None) -> JointState:
    msg = JointState()
    msg.header.stamp = sec_to_stamp(stamp)
    msg.name = list(names)
    msg.position = [float(x) for x in np.asarray(position, dtype=float).reshape(-1)]
    if velocity is not None:
        msg.velocity = [float(x) for x in np.asarray(velocity, dtype=float).reshape(-1)]
    if effort is not None:
        msg.effort = [float(x) for x in np.asarray(effort, dtype=float).reshape(-1)]
    return msg


def markers_from_pose_array(msg: PoseArray) -> Tuple[float, np.ndarray]:
    """(stamp s, markers (M, 3) m in the message's frame)."""
    return stamp_to_sec(msg.header.stamp), np.array(
        [(p.position.x, p.position.y, p.position.z) for p in msg.poses], dtype=float).reshape(-1, 3)


def markers_to_pose_array(stamp: float, markers, frame_id: str = "mocap") -> PoseArray:
    msg = PoseArray()
    msg.header.stamp = sec_to_stamp(stamp)
    msg.header.frame_id = frame_id
    msg.poses = [Pose(position=Point(x=x, y=y, z=z), orientation=Quaternion(w=1.0))
                 for x, y, z in np.asarray(markers, dtype=float).reshape(-1, 3).tolist()]
    return msg


def pose_from_matrix(T: np.ndarray) -> Pose:
    T = np.asarray(T, dtype=float)
    qx, qy, qz, qw = quaternion_from_matrix(T[:3, :3])
    return Pose(position=Point(x=float(T[0, 3]), y=float(T[1, 3]), z=float(T[2, 3])),
                orientation=Quaternion(x=qx, y=qy, z=qz, w=qw))


def matrix_from_pose(pose: Pose) -> np.ndarray:
    T = np.eye(4)
    o = pose.orientation
    T[:3, :3] = matrix_from_quaternion(o.x, o.y, o.z, o.w)
    T[:3, 3] = (pose.position.x, pose.position.y, pose.position.z)
    return T


def pose_stamped_from_matrix(stamp: float, T: np.ndarray, frame_id: str) -> PoseStamped:
    msg = PoseStamped()
    msg.header.stamp = sec_to_stamp(stamp)
    msg.header.frame_id = frame_id
    msg.pose = pose_from_matrix(T)
    return msg


def transform_stamped_from_matrix(stamp: float, T: np.ndarray, parent: str, child: str) -> TransformStamped:
    msg = TransformStamped()
    msg.header.stamp = sec_to_stamp(stamp)
    msg.header.frame_id = parent
    msg.child_frame_id = child
    p = pose_from_matrix(T)
    msg.transform.translation = Vector3(x=p.position.x, y=p.position.y, z=p.position.z)
    msg.transform.rotation = p.orientation
    return msg


# ---- predictions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """A predicted horizon: step k (0..K-1) is at ``stamp + k * dt``.

    positions / velocities: (K, N, 3) m, m/s in ``frame_id``; node_names (N,); parameter_set_id: the
    IdentifiedParameters set used.
    """

    stamp: float
    dt: float
    node_names: Tuple[str, ...]
    positions: np.ndarray
    velocities: np.ndarray
    parameter_set_id: str = ""
    frame_id: str = "structure"
    #: (K,) RMS error (m) of the predictor's recent predictions at each step, measured afterwards (empty: none)
    realized_error: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def horizon_steps(self) -> int:
        return int(self.positions.shape[0])

    @property
    def times(self) -> np.ndarray:
        return self.stamp + self.dt * np.arange(self.horizon_steps)


def prediction_to_msg(pred: Prediction) -> PredictedStates:
    """The plain (slow for long horizons) conversion; :func:`prediction_to_cdr` is the fast one."""
    msg = PredictedStates()
    msg.header.stamp = sec_to_stamp(pred.stamp)
    msg.header.frame_id = pred.frame_id
    msg.parameter_set_id = pred.parameter_set_id
    msg.node_names = list(pred.node_names)
    msg.dt = float(pred.dt)
    msg.horizon_steps = pred.horizon_steps
    msg.positions = _points(pred.positions)
    msg.velocities = _points(pred.velocities, Vector3)
    msg.realized_error = [float(x) for x in np.asarray(pred.realized_error, dtype=float).reshape(-1)]
    return msg


def prediction_from_msg(msg: PredictedStates) -> Prediction:
    K, N = int(msg.horizon_steps), len(msg.node_names)
    P, V = _xyz(msg.positions), _xyz(msg.velocities)
    if P.shape[0] != K * N or V.shape[0] != K * N:
        raise ValueError(f"PredictedStates: {K} steps x {N} nodes but {P.shape[0]} positions / "
                         f"{V.shape[0]} velocities")
    return Prediction(stamp_to_sec(msg.header.stamp), float(msg.dt), tuple(msg.node_names), P.reshape(K, N, 3),
                      V.reshape(K, N, 3), msg.parameter_set_id, msg.header.frame_id,
                      np.asarray(msg.realized_error, dtype=float))


class _CdrWriter:
    """Little-endian plain CDR (XCDR1, as rmw_fastrtps writes it); alignment from the payload start."""

    def __init__(self):
        self.parts: List[bytes] = [b"\x00\x01\x00\x00"]
        self.pos = 0

    def _align(self, n: int) -> None:
        pad = (-self.pos) % n
        if pad:
            self.parts.append(b"\x00" * pad)
            self.pos += pad

    def _put(self, b: bytes) -> None:
        self.parts.append(b)
        self.pos += len(b)

    def u32(self, v: int) -> None:
        self._align(4)
        self._put(struct.pack("<I", v))

    def i32(self, v: int) -> None:
        self._align(4)
        self._put(struct.pack("<i", v))

    def f64(self, v: float) -> None:
        self._align(8)
        self._put(struct.pack("<d", v))

    def string(self, s: str) -> None:
        b = s.encode("utf-8") + b"\x00"
        self.u32(len(b))
        self._put(b)

    def strings(self, items: Sequence[str]) -> None:
        self.u32(len(items))
        for s in items:
            self.string(s)

    def f64_seq(self, a) -> None:
        """float64[]: count, then the values (aligned to 8)."""
        a = np.ascontiguousarray(np.asarray(a, dtype=float).reshape(-1), dtype="<f8")
        self.u32(a.size)
        if a.size:
            self._align(8)
            self._put(a.tobytes())

    def bool_seq(self, a) -> None:
        a = np.asarray(a, dtype=bool).reshape(-1)
        self.u32(a.size)
        self._put(a.astype(np.uint8).tobytes())

    def f64_struct_seq(self, a: np.ndarray) -> None:
        """A sequence of structs of float64s (Point[], Vector3[]): count, then the values."""
        a = np.ascontiguousarray(a, dtype="<f8")
        self.u32(a.shape[0])
        if a.shape[0]:
            self._align(8)
            self._put(a.tobytes())

    def bytes(self) -> bytes:
        return b"".join(self.parts)


#: payload offset -> (raw bytes, decoded string[] , end offset) of recently decoded string sequences
_STRINGS_CACHE: Dict[int, Tuple[bytes, List[str], int]] = {}


class _CdrReader:
    def __init__(self, data: bytes):
        if len(data) < 4 or data[1] != 1:
            raise ValueError("not a little-endian plain CDR payload")
        self.buf = memoryview(data)[4:]
        self.pos = 0

    def _align(self, n: int) -> None:
        self.pos += (-self.pos) % n

    def u32(self) -> int:
        self._align(4)
        v = struct.unpack_from("<I", self.buf, self.pos)[0]
        self.pos += 4
        return v

    def i32(self) -> int:
        self._align(4)
        v = struct.unpack_from("<i", self.buf, self.pos)[0]
        self.pos += 4
        return v

    def f64(self) -> float:
        self._align(8)
        v = struct.unpack_from("<d", self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u32()
        s = bytes(self.buf[self.pos:self.pos + n - 1]).decode("utf-8")
        self.pos += n
        return s

    def strings(self) -> List[str]:
        """string[]; a block equal to a recently decoded one (node names repeat in every message) is reused."""
        start = self.pos
        key = _STRINGS_CACHE.get(start)
        if key is not None:
            raw, names, end = key
            if self.buf[start:end] == raw:
                self.pos = end
                return names
        names = [self.string() for _ in range(self.u32())]
        if len(_STRINGS_CACHE) > 64:
            _STRINGS_CACHE.clear()
        _STRINGS_CACHE[start] = (bytes(self.buf[start:self.pos]), names, self.pos)
        return names

    def f64_seq(self) -> np.ndarray:
        n = self.u32()
        if n == 0:
            return np.zeros(0)
        self._align(8)
        a = np.frombuffer(self.buf, dtype="<f8", count=n, offset=self.pos).copy()
        self.pos += n * 8
        return a

    def bool_seq(self) -> np.ndarray:
        n = self.u32()
        a = np.frombuffer(self.buf, dtype=np.uint8, count=n, offset=self.pos).astype(bool)
        self.pos += n
        return a

    def f64_struct_seq(self, width: int = 3) -> np.ndarray:
        n = self.u32()
        if n == 0:
            return np.zeros((0, width))
        self._align(8)
        a = np.frombuffer(self.buf, dtype="<f8", count=n * width, offset=self.pos).reshape(n, width).copy()
        self.pos += n * width * 8
        return a


def prediction_to_cdr(pred: Prediction) -> bytes:
    """Serialised PredictedStates (what rclpy's ``serialize_message`` gives, padding zeroed): publish it with
    ``publisher.publish(bytes)``; ~50x faster than building and converting thousands of Point objects."""
    ns = int(round(pred.stamp * 1e9))
    w = _CdrWriter()
    w.i32(ns // 1_000_000_000)
    w.u32(ns % 1_000_000_000)
    w.string(pred.frame_id)
    w.string(pred.parameter_set_id)
    w.strings(list(pred.node_names))
    w.f64(float(pred.dt))
    w.u32(pred.horizon_steps)
    w.f64_struct_seq(np.asarray(pred.positions, dtype=float).reshape(-1, 3))
    w.f64_struct_seq(np.asarray(pred.velocities, dtype=float).reshape(-1, 3))
    w.f64_seq(np.asarray(pred.realized_error, dtype=float).reshape(-1))
    return w.bytes()


def prediction_from_cdr(data: bytes) -> Prediction:
    """Inverse of :func:`prediction_to_cdr` (for a raw subscription: ``create_subscription(..., raw=True)``)."""
    r = _CdrReader(data)
    sec, nsec = r.i32(), r.u32()
    frame = r.string()
    set_id = r.string()
    names = tuple(r.strings())
    dt = r.f64()
    K = r.u32()
    N = len(names)
    P = r.f64_struct_seq().reshape(K, N, 3)
    V = r.f64_struct_seq().reshape(K, N, 3)
    return Prediction(sec + nsec * 1e-9, dt, names, P, V, set_id, frame, r.f64_seq())


# ---- fast codecs of the streamed messages (publish / subscribe raw) ---------------------------------------
# At 120 Hz with ~1000 callbacks/s in one Python process, building and (de)serialising nested Python message
# objects (a PoseArray of 24 markers: ~0.8 ms) is a large share of the CPU; these write / read the CDR bytes
# directly with numpy (tested byte-compatible with rclpy's serialisation).
def _header(w: _CdrWriter, stamp: float, frame_id: str) -> None:
    ns = int(round(float(stamp) * 1e9))
    w.i32(ns // 1_000_000_000)
    w.u32(ns % 1_000_000_000)
    w.string(frame_id)


def _read_header(r: _CdrReader) -> Tuple[float, str]:
    sec, nsec = r.i32(), r.u32()
    return sec + nsec * 1e-9, r.string()


def pose_array_to_cdr(stamp: float, markers, frame_id: str = "mocap") -> bytes:
    """Serialised geometry_msgs/PoseArray: one pose per marker (M, 3), identity orientation."""
    m = np.asarray(markers, dtype=float).reshape(-1, 3)
    poses = np.zeros((m.shape[0], 7))
    poses[:, :3], poses[:, 6] = m, 1.0
    w = _CdrWriter()
    _header(w, stamp, frame_id)
    w.f64_struct_seq(poses)
    return w.bytes()


def markers_from_cdr(data: bytes) -> Tuple[float, np.ndarray, str]:
    """(stamp s, markers (M, 3), frame_id) of a serialised PoseArray."""
    r = _CdrReader(data)
    stamp, frame = _read_header(r)
    return stamp, r.f64_struct_seq(7)[:, :3].copy(), frame


def node_states_to_cdr(stamp: float, names: Sequence[str], positions, velocities, valid,
                       frame_id: str = "structure", note: str = "") -> bytes:
    """Serialised NodeStates (same content as :func:`node_states_to_msg`)."""
    w = _CdrWriter()
    _header(w, stamp, frame_id)
    w.strings(list(names))
    w.f64_struct_seq(np.asarray(positions, dtype=float).reshape(-1, 3))
    w.f64_struct_seq(np.asarray(velocities, dtype=float).reshape(-1, 3))
    w.bool_seq(valid)
    w.string(note)
    return w.bytes()


def sample_to_cdr(sample, note: str = "") -> bytes:
    """Serialised NodeStates from a :class:`tensegrity_ros.mocap.NodeStateSample`."""
    vel = np.where(sample.velocity_valid[:, None], sample.velocities, np.nan)
    return node_states_to_cdr(sample.stamp, sample.names, sample.positions, vel, sample.valid, sample.frame_id, note)


def node_states_from_cdr(data: bytes) -> NodeStatesRecord:
    r = _CdrReader(data)
    stamp, frame = _read_header(r)
    names = tuple(r.strings())
    P, V, valid = r.f64_struct_seq(), r.f64_struct_seq(), r.bool_seq()
    n = len(names)
    if P.shape[0] != n or valid.size != n or V.shape[0] not in (0, n):
        raise ValueError(f"NodeStates with {n} names but {P.shape[0]} positions, {V.shape[0]} velocities, "
                         f"{valid.size} valid flags")
    if V.shape[0] == 0:
        V = np.full((n, 3), np.nan)
    return NodeStatesRecord(stamp, names, P, V, valid & np.all(np.isfinite(P), axis=1), frame)


def joint_state_from_cdr(data: bytes) -> JointRecord:
    r = _CdrReader(data)
    stamp, _ = _read_header(r)
    names = tuple(r.strings())
    n = len(names)
    arrs = [r.f64_seq() for _ in range(3)]
    arrs = [a if a.size == n else np.full(n, np.nan) for a in arrs]
    return JointRecord(stamp, names, *arrs)


# ---- identified parameters -----------------------------------------------------------------------------
from ..parameter_set import ParameterSet, split_name  # noqa: E402,F401 (rclpy-free, re-exported)


def parameter_set_to_msg(ps: ParameterSet) -> IdentifiedParameters:
    msg = IdentifiedParameters()
    msg.header.stamp = sec_to_stamp(ps.stamp)
    msg.parameter_set_id = ps.set_id
    parts = [split_name(n) for n in ps.names]
    msg.element_names = [e for e, _ in parts]
    msg.kinds = [k for _, k in parts]
    msg.values = [float(v) for v in ps.values]
    msg.std_devs = [float(v) for v in ps.std_devs]
    msg.identifiability = [float(v) for v in ps.identifiability]
    msg.fit_residual = float(ps.fit_residual)
    msg.window_start = sec_to_stamp(max(ps.window[0], 0.0))
    msg.window_end = sec_to_stamp(max(ps.window[1], 0.0))
    msg.converged = bool(ps.converged)
    msg.status_message = ps.status
    return msg


def parameter_set_from_msg(msg: IdentifiedParameters) -> ParameterSet:
    n = len(msg.values)
    if not (len(msg.element_names) == len(msg.kinds) == n == len(msg.std_devs)):
        raise ValueError("IdentifiedParameters: element_names, kinds, values and std_devs differ in length")
    names = tuple(f"{e}.{k}" if e else k for e, k in zip(msg.element_names, msg.kinds))
    ident = np.asarray(msg.identifiability, dtype=float) if len(msg.identifiability) == n else np.full(n, np.nan)
    return ParameterSet(msg.parameter_set_id, names, np.asarray(msg.values, dtype=float),
                        np.asarray(msg.std_devs, dtype=float), ident, float(msg.fit_residual),
                        (stamp_to_sec(msg.window_start), stamp_to_sec(msg.window_end)), bool(msg.converged),
                        msg.status_message, stamp_to_sec(msg.header.stamp))


def params_with_set(template, ps: ParameterSet):
    """Engine ``Params`` = ``template`` with the values of ``ps`` (names the template lacks are ignored)."""
    known = set(template.named())
    return template.with_values({n: float(v) for n, v in zip(ps.names, ps.values) if n in known})


# =====================================================================================================
# compute workers and BLAS threads: rclpy-free, in :mod:`tensegrity_ros.workers`
# =====================================================================================================
from ..workers import (WORKER_KINDS, WorkerStopped, limit_blas_threads, make_worker, stop_worker,  # noqa: E402,F401
                       worker_init, worker_pid)


# =====================================================================================================
# main
# =====================================================================================================
def run_node(node_cls, argv: Optional[Sequence[str]] = None, *, threads: int = 1) -> int:
    """``main`` of a node: init, construct, spin until SIGINT/SIGTERM (or ``node.fault``), clean up.

    A construction error (bad parameters, missing file) prints one line and returns 1. Signals are
    handled here (rclpy's own handlers are off), so ``destroy_node`` always runs.
    """
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    args = list(sys.argv if argv is None else argv)
    limit_blas_threads(1)
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()

    def _on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    node = None
    code = 0
    name = getattr(node_cls, "DEFAULT_NAME", node_cls.__name__)
    try:
        try:
            node = node_cls()
        except (ValueError, OSError, KeyError, RuntimeError) as e:
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        executor = MultiThreadedExecutor(num_threads=threads) if threads > 1 else SingleThreadedExecutor()
        executor.add_node(node)
        while not stop.is_set() and node.fault is None and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
        if node.fault is not None:
            print(f"{name}: stopped on {type(node.fault).__name__}: {node.fault}", file=sys.stderr)
            code = 1
        executor.remove_node(node)
        executor.shutdown(timeout_sec=1.0)
    finally:
        if node is not None:
            node.destroy_node()
        for s, h in old.items():
            signal.signal(s, h)
        rclpy.try_shutdown()
    return code
