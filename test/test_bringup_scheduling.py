"""How the in-process graph runs its callbacks: the order in which one executor serves its nodes
(:class:`~tensegrity_ros.bringup.RankedExecutor`, a real rclpy round trip) and the load meter that the executor's
thread starts on itself (``Graph.load``)."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import unique_name
from tensegrity_ros.bringup import SERVICE_ORDER, Graph, RankedExecutor


def test_ranked_executor_serves_the_predictor_first_whatever_the_order_nodes_were_added(rclpy_context):
    from std_msgs.msg import Empty

    from tensegrity_ros.nodes.graph_node import LeanNode

    executor = RankedExecutor(context=rclpy_context)
    topic = "/" + unique_name("ranked")
    served = []
    # added in the reverse of the service order, the monitor (not named in SERVICE_ORDER) first
    names = ("graph_monitor", "online_identifier", "mocap_ingest", "state_predictor")
    nodes = [LeanNode(name, context=rclpy_context, qos_events=False) for name in names]
    try:
        for node in nodes:
            node.create_subscription(Empty, topic, lambda _m, n=node.get_name(): served.append(n), 10)
            executor.add_node(node)
        assert [n.get_name() for n in executor.get_nodes()] == \
            ["state_predictor", "mocap_ingest", "online_identifier", "graph_monitor"]
        pub = nodes[0].create_publisher(Empty, topic, 10)
        deadline = time.monotonic() + 10.0
        while pub.get_subscription_count() < len(nodes) and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        for _ in range(3):
            pub.publish(Empty())
            time.sleep(0.3)          # every subscription holds the message before the executor waits
            for _ in range(len(nodes)):
                executor.spin_once(timeout_sec=1.0)
        assert len(served) == 3 * len(nodes)
        # each wait found all four ready and ran them in SERVICE_ORDER, the unnamed monitor last
        assert served == ["state_predictor", "mocap_ingest", "online_identifier", "graph_monitor"] * 3
        assert SERVICE_ORDER[0] == "state_predictor"
    finally:
        for node in nodes:
            executor.remove_node(node)
            node.destroy_node()
        executor.shutdown(timeout_sec=1.0)


class _BusyExecutor:
    """Stands in for the graph's executor: its spin computes for ``seconds`` of thread CPU time, then returns."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.tid = None
        self.computed, self.release = threading.Event(), threading.Event()

    def spin(self):
        self.tid = threading.get_native_id()
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.seconds:
            pass
        self.computed.set()
        self.release.wait(60)     # alive until read: a thread's schedstat goes with it


def test_the_load_meter_follows_the_thread_that_spins_the_executor():
    ex = _BusyExecutor(0.3)
    graph = Graph(ex, {}, None)
    try:
        graph.spin_in_background()
        assert ex.computed.wait(60)
        assert graph.load is not None and graph.load._tid == ex.tid != threading.get_native_id()
        load = graph.load.summary()
    finally:
        ex.release.set()
        graph.thread.join(60)
        graph.gc.close()
    if load["thread_cpu_fraction"] is None:
        pytest.skip("no per-thread schedstat here")
    # the executor's thread computed 0.3 s of CPU time; the meter read that thread, not the test's (idle in join)
    assert load["thread_cpu_fraction"] * load["wall_s"] == pytest.approx(0.3, abs=0.05)
