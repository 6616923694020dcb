"""One commander at a time: the driver refuses /tensegrity/motor_commands while more than one node publishes
them (the pure rule in driver_core, and the rclpy round trip against the emulated bus)."""
import os
import threading
import time

import pytest

from tensegrity_ros.hardware.driver_core import COMMANDS_TOPIC, check_command_publishers

UNKNOWN = "_NODE_NAMESPACE_UNKNOWN_/_NODE_NAME_UNKNOWN_"   # how an endpoint without node info reads


@pytest.mark.parametrize("publishers", [[], ["/commander"], ["/commander", "/commander"], ["/ns/a"]])
def test_none_or_one_publishing_node_is_accepted(publishers):
    check = check_command_publishers(publishers)
    assert check.accept and check.reason == ""
    assert check.publishers == tuple(sorted(set(publishers)))


def test_two_publishing_nodes_are_refused_and_named():
    check = check_command_publishers(["/lab/sim_commander", "/robot/commander", "/lab/sim_commander"])
    assert not check.accept
    assert check.publishers == ("/lab/sim_commander", "/robot/commander")
    assert check.reason.startswith(f"2 nodes publish {COMMANDS_TOPIC} (/lab/sim_commander, /robot/commander)")
    assert "refused" in check.reason
    assert "/other/topic" in check_command_publishers(["/a", "/b"], "/other/topic").reason


@pytest.mark.parametrize("publishers", [[UNKNOWN, UNKNOWN], ["", "/a"], [UNKNOWN, "/a"]])
def test_publishers_of_unknown_nodes_count_one_each(publishers):
    check = check_command_publishers(publishers)
    assert not check.accept and len(check.publishers) == 2


# ---- rclpy round trip ---------------------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU_CFG = os.path.join(REPO, "config", "hardware", "emulated_bus.yaml")
TARGET = 0.3   # rad on m1


def _level(diag):
    return diag.status[0].level


def _values(diag):
    return {kv.key: kv.value for kv in diag.status[0].values}


def test_driver_refuses_commands_while_two_nodes_publish_and_resumes_with_one(rclpy_context, ros_executor, capsys):
    pytest.importorskip("rclpy")
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from rclpy.node import Node
    from rclpy.parameter import Parameter
    from sensor_msgs.msg import JointState

    from conftest import spin_until, unique_name
    from tensegrity_ros.nodes._common import SENSOR_READER_QOS   # the driver publishes best effort
    from tensegrity_ros.nodes.dynamixel_driver import DynamixelDriverNode

    threads_before = set(threading.enumerate())
    driver = DynamixelDriverNode(context=rclpy_context, parameter_overrides=[
        Parameter("bus_config", value=EMU_CFG), Parameter("command_source", value="topic"),
        Parameter("max_rate", value=3.0)])
    emu = driver.emulator
    a = Node(unique_name("commander_a"), context=rclpy_context)
    b = Node(unique_name("commander_b"), context=rclpy_context)
    nodes = [driver, a, b]
    for n in nodes:
        ros_executor.add_node(n)
    try:
        states, diags = [], []
        a.create_subscription(JointState, "/tensegrity/motor_states", states.append, SENSOR_READER_QOS)
        a.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
        pub_a = a.create_publisher(JointState, COMMANDS_TOPIC, 10)
        b.create_publisher(JointState, COMMANDS_TOPIC, 10)
        name_a, name_b = a.get_fully_qualified_name(), b.get_fully_qualified_name()
        last = [0.0]

        def command():   # 10 Hz from commander a, like a real commander (see test_hardware_driver_node)
            if time.monotonic() - last[0] > 0.1:
                last[0] = time.monotonic()
                msg = JointState()
                msg.name, msg.position = ["m1"], [TARGET]
                pub_a.publish(msg)

        # two publishers: refused, both named, in the verdict and in /diagnostics (ERROR: source is topic)
        assert spin_until(ros_executor, lambda: not driver.command_publishers.accept and bool(states), timeout=15.0)
        check = driver.command_publishers
        assert set(check.publishers) == {name_a, name_b}, check
        with capsys.disabled():
            print(f"\nrefusal: {check.reason}")
        p0 = states[-1].position[0]
        assert abs(p0 - TARGET) > 0.1
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            command()
            ros_executor.spin_once(timeout_sec=0.05)
            assert abs(states[-1].position[0] - p0) < 0.02, "a refused command moved the motor"
        assert driver.refused_commands > 0
        assert spin_until(ros_executor, lambda: bool(diags) and _values(diags[-1])["topic_commands"] == "refused",
                          timeout=5.0)
        assert _level(diags[-1]) == DiagnosticStatus.ERROR
        assert name_a in diags[-1].status[0].message and name_b in diags[-1].status[0].message
        assert _values(diags[-1])["command_publishers"] == ", ".join(sorted([name_a, name_b]))

        # commander b leaves: one publisher, commands taken again and the motor follows them
        ros_executor.remove_node(b)
        b.destroy_node()
        nodes.remove(b)

        def follows():
            command()
            return driver.command_publishers.accept and abs(states[-1].position[0] - TARGET) < 0.02

        assert spin_until(ros_executor, follows, timeout=15.0)
        assert driver.command_publishers.publishers == (name_a,)

        def accepted_in_diagnostics():
            command()   # keep the command fresh (a stale one makes the driver hold: WARN)
            return _values(diags[-1])["topic_commands"] == "accepted"

        assert spin_until(ros_executor, accepted_in_diagnostics, timeout=5.0)
        assert _level(diags[-1]) != DiagnosticStatus.ERROR and "refused" not in diags[-1].status[0].message
        assert _values(diags[-1])["command_publishers"] == name_a
    finally:
        for n in nodes:
            ros_executor.remove_node(n)
            n.destroy_node()
    assert not any(emu.torque_enabled().values())
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads_before, "threads left behind"
