"""The dynamixel_driver ROS node against the emulated bus (real SDK, real pty)."""
import os
import time

import pytest

pytest.importorskip("rclpy")
from rclpy.parameter import Parameter  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402

from conftest import spin_until  # noqa: E402
from tensegrity_ros.nodes import _common as C  # noqa: E402
from tensegrity_ros.nodes.dynamixel_driver import DynamixelDriverNode  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU_CFG = os.path.join(REPO, "config", "hardware", "emulated_bus.yaml")


def _node(ctx, **params):
    overrides = [Parameter("bus_config", value=EMU_CFG)] + [Parameter(k, value=v) for k, v in params.items()]
    return DynamixelDriverNode(context=ctx, parameter_overrides=overrides)


def test_node_topics_service_and_torque_off(rclpy_context, ros_executor, make_node):
    node = _node(rclpy_context, command_source="topic", max_rate=3.0)
    ros_executor.add_node(node)
    try:
        emu = node.emulator
        assert all(emu.torque_enabled().values())
        probe = make_node("probe")
        states, diags = [], []
        probe.create_subscription(JointState, "/tensegrity/motor_states", states.append, C.SENSOR_READER_QOS)
        probe.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        pub = probe.create_publisher(JointState, "/tensegrity/motor_commands", 10)

        last = [0.0]

        def command():
            # Publish at 10 Hz like a real commander: republishing on every spin turns the executor into a
            # busy ping-pong that holds the GIL against the in-process emulator and the driver's loop thread.
            if time.monotonic() - last[0] > 0.1:
                last[0] = time.monotonic()
                msg = JointState()
                msg.name = ["m1", "m4"]
                msg.position = [0.3, -0.2]
                pub.publish(msg)
            return bool(states) and abs(states[-1].position[0] - 0.3) < 0.02 \
                and abs(states[-1].position[3] + 0.2) < 0.02

        assert spin_until(ros_executor, command, timeout=15.0)
        assert list(states[-1].name) == ["m1", "m2", "m3", "m4", "m5", "m6"]
        assert len(states[-1].velocity) == 6 and len(states[-1].effort) == 6
        assert spin_until(ros_executor, lambda: bool(diags), timeout=5.0)
        keys = {kv.key for kv in diags[-1].status[0].values}
        assert {"loop_rate_hz", "missed_cycles", "motor_1", "topic_commands", "command_publishers"} <= keys
        # one commander: its commands are taken, and /diagnostics names it (see test_driver_isolation.py for two)
        assert node.command_publishers.accept and node.command_publishers.publishers == ("/probe",)
        assert node.refused_commands == 0
        assert spin_until(ros_executor, lambda: {kv.key: kv.value for kv in diags[-1].status[0].values}.get(
            "command_publishers") == "/probe", timeout=5.0)

        from tensegrity_ros.srv import SetCommandSource
        cli = probe.create_client(SetCommandSource, "/dynamixel_driver/set_command_source")
        assert cli.wait_for_service(timeout_sec=5.0)
        for source, ok in (("hold", True), ("bogus", False)):
            fut = cli.call_async(SetCommandSource.Request(source=source))
            assert spin_until(ros_executor, fut.done, timeout=5.0)
            assert fut.result().success is ok
        assert node.core.command_source == "hold"
        # run-time parameters, checked as every node checks them (nodes.params.check_changes): a new source takes
        # effect in the core; a value outside the choices, or one the core refuses, is refused with its reason
        assert node.set_parameters([Parameter("command_source", value="topic")])[0].successful
        assert node.core.command_source == "topic" and node.p["command_source"] == "topic"
        for value, why in (("bogus", "must be one of"), ("reference", "no reference loaded")):
            res = node.set_parameters([Parameter("command_source", value=value)])[0]
            assert not res.successful and why in res.reason, res.reason
        assert node.core.command_source == "topic" and node.p["command_source"] == "topic"
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
    assert not any(emu.torque_enabled().values())


def test_node_rejects_bad_parameters(rclpy_context):
    with pytest.raises(ValueError, match="bus"):
        _node(rclpy_context, bus="bogus")
    with pytest.raises(ValueError, match="reference_file"):
        _node(rclpy_context, command_source="reference")


def _spawn_node(port, extra=()):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "tensegrity_ros.nodes.dynamixel_driver", "--ros-args",
           "-p", f"bus_config:={os.path.join(REPO, 'config', 'hardware', 'manipulator_bus.yaml')}",
           "-p", f"port:={port}", "-p", "baud:=1000000", "-p", "command_source:=hold", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("how", ["sigterm", "hardware_error"])
def test_node_process_turns_torque_off_on_exit(how):
    """main(): SIGTERM -> exit 0; a hardware error -> exit 1; torque off on the (emulated) motors both ways."""
    import signal
    import time

    from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus

    models = {1: "l54-50-s290-r", 2: "l54-50-s290-r", 3: "l54-50-s290-r",
              4: "m42-10-s260-r", 5: "m42-10-s260-r", 6: "m42-10-s260-r"}
    emu = EmulatedBus(list(models), models, baud=1_000_000)
    proc = _spawn_node(emu.port)
    try:
        deadline = time.monotonic() + 60
        while not all(emu.torque_enabled().values()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "driver did not enable torque"
            time.sleep(0.05)
        time.sleep(0.3)  # a few cycles
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            expected = 0
        else:
            emu.inject_hardware_error(6, 0x20)
            expected = 1
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == expected, out
        assert not any(emu.torque_enabled().values()), out
        if how == "hardware_error":
            assert "overload" in out and "Hint" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        emu.stop()


@pytest.mark.timeout(90)
def test_motor_states_sensor_qos_reach_best_effort_readers_at_80hz(rclpy_context, ros_executor, make_node):
    """Sensor-data QoS on /tensegrity/motor_states (issue 18 item 6): for 3 s at 80 Hz, a best-effort reader with the
    stream depth (C.SENSOR_READER_QOS, every reader of the graph) and one with the publisher's own shallow profile
    (C.SENSOR_QOS) receive what the driver published, counted by DDS publication sequence number (the n-th message
    published is number n); a reliable reader matches no best-effort writer: it gets nothing, which is why every
    reader takes its profile from _common. ``states_qos_reliability: reliable`` serves the reliable reader too."""
    node = _node(rclpy_context, command_source="hold")
    ros_executor.add_node(node)
    try:
        probe = make_node("qos_probe")
        seqs = {"reader": [], "shallow": [], "reliable": []}
        for key, qos in (("reader", C.SENSOR_READER_QOS), ("shallow", C.SENSOR_QOS), ("reliable", C.STREAM_QOS)):
            probe.create_subscription(JointState, "/tensegrity/motor_states",
                                      lambda msg, info, k=key: seqs[k].append(info["publication_sequence_number"]),
                                      qos)
        assert spin_until(ros_executor, lambda: seqs["reader"] and seqs["shallow"], timeout=10.0)
        spin_until(ros_executor, lambda: False, timeout=3.0)
        node._stop.set()                                   # stop the source, then drain the queues
        node._thread.join(timeout=5.0)
        spin_until(ros_executor, lambda: False, timeout=1.0)
        published = node.core.stats.cycles + 1            # + the state published at activation
        counts = {k: (v[0], len(v)) for k, v in seqs.items() if v}
        print(f"\n80 Hz: published {published}; (first sequence number, received) per reader: {counts}")
        first, n = counts["reader"]
        assert seqs["reader"] == list(range(first, published + 1)), "the best-effort reader lost messages"
        assert n >= 0.25 * 80 * 3.0                        # 3 s at a quarter of the rate at least (a loaded machine)
        first, n = counts["shallow"]
        assert n >= 0.95 * (published + 1 - first), counts
        assert not seqs["reliable"]
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()

    node = _node(rclpy_context, command_source="hold", states_qos_reliability="reliable", states_qos_depth=50)
    ros_executor.add_node(node)
    try:
        assert spin_until(ros_executor, lambda: len(seqs["reliable"]) > 10, timeout=10.0)
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()


def test_sensor_qos_profiles_and_parameters():
    """One owner of the sensor-stream profiles (nodes/_common.py): best effort, shallow publishers by default; every
    reader best effort (matches either writer); the node parameters that choose the publisher's profile."""
    from rclpy.qos import HistoryPolicy, ReliabilityPolicy

    assert C.SENSOR_QOS.reliability == ReliabilityPolicy.BEST_EFFORT and C.SENSOR_QOS.depth == C.SENSOR_DEPTH <= 10
    assert C.SENSOR_QOS.history == HistoryPolicy.KEEP_LAST
    assert C.SENSOR_READER_QOS.reliability == ReliabilityPolicy.BEST_EFFORT
    assert C.sensor_qos() is C.SENSOR_QOS
    q = C.sensor_qos("reliable", 50)
    assert q.reliability == ReliabilityPolicy.RELIABLE and q.depth == 50
    for bad in (("bogus", 10), ("best_effort", 0), ("reliable", True)):
        with pytest.raises(ValueError):
            C.sensor_qos(*bad)
    rel, depth = C.sensor_qos_params("states_qos", "/tensegrity/motor_states")
    assert (rel.name, rel.default, depth.name, depth.default) == ("states_qos_reliability", "best_effort",
                                                                  "states_qos_depth", C.SENSOR_DEPTH)
    assert rel.problem("reliable") is None and rel.problem("sometimes") and depth.problem(0)
    from tensegrity_ros.nodes.dynamixel_driver import PARAMS
    assert {"states_qos_reliability", "states_qos_depth", "managed"} <= {s.name for s in PARAMS}
