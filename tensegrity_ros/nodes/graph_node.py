"""The node base and ``main``: :class:`LeanNode` (publishers / subscriptions without rclpy's QoS-event handlers),
:class:`GraphNode` (declared + validated parameters, guarded callbacks, /diagnostics, counted publishers),
:class:`CountingPublisher`, and :func:`run_node` with clean shutdown on SIGINT / SIGTERM.

Nothing here knows a particular node; the node modules are thin shells over the functional core.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.event_handler import PublisherEventCallbacks, SubscriptionEventCallbacks
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile

from ..workers import limit_blas_threads
from .params import ParamSpec, check_changes, declare_parameters, spec_table
from .topics import DIAG_QOS, TOPICS


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
        why, values = check_changes(self._specs, params, self.on_parameter_change)
        if why:
            return SetParametersResult(successful=False, reason=why)
        self.p.update(values)
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
# main
# =====================================================================================================
def realtime_thread(node: Node, priority: int, what: str) -> Dict[str, Any]:
    """Put the calling thread under SCHED_FIFO at ``priority`` (workers.set_realtime) and log the outcome on
    ``node``'s logger as "<what>: ..." (a refusal as a warning). Returns {"done", "message"}."""
    from ..workers import set_realtime

    done, text = set_realtime(priority)
    (node.get_logger().info if done else node.get_logger().warning)(f"{what}: {text}")
    return {"done": done, "message": text}


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
        rt = int(getattr(node, "p", {}).get("rt_priority", 0) or 0)
        if rt:   # this thread spins the executor below; the threads the node already started stay normal
            realtime_thread(node, rt, "callbacks' thread")
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
