"""The dynamixel_driver as a lifecycle (managed) node, against an emulated bus through the real SDK and a pty, driven
over its ROS services (lifecycle_msgs ChangeState, std_srvs SetBool / Trigger) by a probe node: every transition,
with the torque state read from the emulated motors' Torque Enable registers (issue 18 items 3 and 4).

The emulator lives outside the driver (``bus: real`` on its pty), so it survives cleanup and a new configure, and
its registers can be read between every step."""
import os
import time

import pytest

pytest.importorskip("rclpy")
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from std_srvs.srv import SetBool, Trigger  # noqa: E402

from conftest import spin_until, unique_name  # noqa: E402
from tensegrity_ros.hardware.dynamixel.emulator import EmulatedBus  # noqa: E402
from tensegrity_ros.hardware.dynamixel.errors import HardwareError, PortNotFound  # noqa: E402
from tensegrity_ros.nodes import _common as C  # noqa: E402
from tensegrity_ros.nodes.dynamixel_driver import DynamixelDriverNode  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUS_CFG = os.path.join(REPO, "config", "hardware", "manipulator_bus.yaml")
MODELS = {1: "l54-50-s290-r", 2: "l54-50-s290-r", 3: "l54-50-s290-r",
          4: "m42-10-s260-r", 5: "m42-10-s260-r", 6: "m42-10-s260-r"}


@pytest.fixture
def emu():
    e = EmulatedBus(list(MODELS), MODELS, baud=1_000_000)
    try:
        yield e
    finally:
        e.stop()


def torque(emu):
    """{id: Torque Enable register} of the emulated motors."""
    return {i: emu.register(i, "torque_enable") for i in MODELS}


def all_torque(emu, value):
    return set(torque(emu).values()) == {value}


def _driver(ctx, port, **params):
    values = {"bus_config": BUS_CFG, "port": port, "baud": 1_000_000, "command_source": "hold", **params}
    return DynamixelDriverNode(unique_name("driver"), context=ctx,
                               parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])


class Services:
    """The driver's services, called from a probe node."""

    def __init__(self, executor, probe, name):
        self.executor = executor
        self.clients = {"change": probe.create_client(ChangeState, f"{name}/change_state"),
                        "get": probe.create_client(GetState, f"{name}/get_state"),
                        "torque": probe.create_client(SetBool, f"{name}/set_torque"),
                        "reboot": probe.create_client(Trigger, f"{name}/reboot")}

    def call(self, which, request, timeout=20.0):
        cli = self.clients[which]
        assert cli.wait_for_service(timeout_sec=30.0), which
        fut = cli.call_async(request)
        assert spin_until(self.executor, fut.done, timeout=timeout), f"{which}: no answer"
        return fut.result()

    def transition(self, label):
        return self.call("change", ChangeState.Request(transition=Transition(label=label))).success

    def state(self):
        return self.call("get", GetState.Request()).current_state.label

    def torque(self, on):
        return self.call("torque", SetBool.Request(data=on))

    def reboot(self):
        return self.call("reboot", Trigger.Request())


@pytest.mark.timeout(120)
def test_every_transition_sets_the_torque_registers(rclpy_context, ros_executor, make_node, emu):
    node = _driver(rclpy_context, emu.port, managed=True)
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe"))
        states = []
        probe.create_subscription(JointState, C.TOPICS["motor_states"], states.append, C.SENSOR_READER_QOS)
        srv = Services(ros_executor, probe, node.get_fully_qualified_name())
        # constructed: unconfigured, port closed, nothing touched
        assert srv.state() == "unconfigured" and node.core is None and all_torque(emu, 0)
        r = srv.torque(True)
        assert not r.success and "unconfigured" in r.message
        r = srv.reboot()
        assert not r.success and "configure" in r.message

        # configure: port open, motors checked, torque still off
        assert srv.transition("configure") and srv.state() == "inactive"
        assert node.core.connected and all_torque(emu, 0)
        assert node.core.effort_unit == "A"         # PRO motors: no torque constant in the e-Manual
        r = srv.torque(True)                        # torque goes on with the loop only
        assert not r.success and "activate" in r.message and all_torque(emu, 0)

        # activate: torque on, holding, states flowing
        assert srv.transition("activate") and srv.state() == "active" and all_torque(emu, 1)
        assert spin_until(ros_executor, lambda: len(states) > 20, timeout=10.0)
        present, goal = emu.present_positions_rad(), emu.goal_positions_rad()
        assert all(abs(present[i] - goal[i]) < 0.01 for i in MODELS)       # held where they were: no jump

        # ~/set_torque false while active: limp, the states are still published; true: holding again
        r = srv.torque(False)
        assert r.success and "limp" in r.message and all_torque(emu, 0)
        n = len(states)
        assert spin_until(ros_executor, lambda: len(states) > n + 10, timeout=10.0)
        r = srv.torque(True)
        assert r.success and all_torque(emu, 1)
        assert srv.torque(True).message == "torque already on"

        # deactivate: loop stopped, torque off, port still open
        assert srv.transition("deactivate") and srv.state() == "inactive" and all_torque(emu, 0)
        assert node.core.connected
        spin_until(ros_executor, lambda: False, timeout=0.3)
        n = len(states)
        spin_until(ros_executor, lambda: False, timeout=0.5)
        assert len(states) == n, "states published while inactive"

        # activate again, deactivate, cleanup: port closed, torque off
        assert srv.transition("activate") and all_torque(emu, 1)
        assert srv.transition("deactivate") and all_torque(emu, 0)
        assert srv.transition("cleanup") and srv.state() == "unconfigured"
        assert not node.core.connected and all_torque(emu, 0)

        # configure + activate once more (a new port session), then shutdown straight from active
        assert srv.transition("configure") and srv.transition("activate") and all_torque(emu, 1)
        assert srv.transition("shutdown") and srv.state() == "finalized"
        assert all_torque(emu, 0) and not node.core.connected
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
    assert all_torque(emu, 0)


@pytest.mark.timeout(120)
def test_a_fault_deactivates_reboot_clears_it_and_a_followed_plan_refuses_reboot(rclpy_context, ros_executor,
                                                                               make_node, emu):
    from builtin_interfaces.msg import Duration
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    node = _driver(rclpy_context, emu.port, managed=True, command_source="plan", plan_timeout_s=0.5)
    ros_executor.add_node(node)
    try:
        probe = make_node(unique_name("probe"))
        srv = Services(ros_executor, probe, node.get_fully_qualified_name())
        assert srv.transition("configure") and srv.transition("activate") and all_torque(emu, 1)

        # a hardware error in the loop: torque off, the node deactivates itself
        emu.inject_hardware_error(3, 0x20)                                  # overload on motor 3
        assert spin_until(ros_executor, lambda: node.lifecycle_state == "inactive", timeout=10.0)
        assert isinstance(node.loop_fault, HardwareError) and node.loop_fault.motor_id == 3
        assert all_torque(emu, 0) and node.core.connected
        # activate is refused while the error bit is set (the typed error says to reboot)
        assert not srv.transition("activate") and srv.state() == "inactive" and all_torque(emu, 0)
        assert isinstance(node.transition_error, HardwareError)
        # ~/reboot: torque off, reboot, re-check: the error is gone; activate works again
        r = srv.reboot()
        assert r.success, r.message
        assert "rebooted" in r.message and emu.register(3, "hardware_error_status") == 0
        assert srv.transition("activate") and all_torque(emu, 1)

        # a controller's plan is being followed: reboot refused (it would drop the motors mid-motion)
        pub = probe.create_publisher(JointTrajectory, C.TOPICS["motor_plan"], 10)
        last = [0.0]

        def controller():
            if time.monotonic() - last[0] > 0.1:
                last[0] = time.monotonic()
                msg = JointTrajectory(joint_names=[f"m{i}" for i in MODELS])
                msg.header.stamp = probe.get_clock().now().to_msg()
                msg.points = [JointTrajectoryPoint(positions=[0.1] * 6, time_from_start=Duration(sec=s))
                              for s in (0, 1)]
                pub.publish(msg)
            return node.core.stats.plan_state == "following"

        assert spin_until(ros_executor, controller, timeout=10.0)
        fut = srv.clients["reboot"].call_async(Trigger.Request())
        assert spin_until(ros_executor, lambda: controller() and fut.done(), timeout=10.0)
        r = fut.result()
        assert not r.success and "plan" in r.message and all_torque(emu, 1)
        # torque off first: then the reboot goes ahead, and torque stays off
        fut = srv.clients["torque"].call_async(SetBool.Request(data=False))
        assert spin_until(ros_executor, lambda: controller() and fut.done(), timeout=10.0)
        assert fut.result().success and all_torque(emu, 0)
        fut = srv.clients["reboot"].call_async(Trigger.Request())
        assert spin_until(ros_executor, lambda: (controller() or True) and fut.done(), timeout=15.0)
        assert fut.result().success, fut.result().message
        assert "~/set_torque true" in fut.result().message and all_torque(emu, 0)
        assert node.lifecycle_state == "active" and node.loop_fault is None
    finally:
        ros_executor.remove_node(node)
        node.destroy_node()
    assert all_torque(emu, 0)


def test_plain_mode_configures_and_activates_itself_and_raises_typed_errors(rclpy_context, emu):
    node = _driver(rclpy_context, emu.port)
    try:
        assert not node.managed and node.lifecycle_state == "active" and all_torque(emu, 1)
        assert not any(n.endswith("/change_state") for n, _ in node.get_service_names_and_types_by_node(
            node.get_name(), node.get_namespace()))          # no manager: no lifecycle services
    finally:
        node.destroy_node()
    assert all_torque(emu, 0)
    # a bad port: the constructor raises the typed error (run_node prints it and exits 1)
    with pytest.raises(PortNotFound):
        _driver(rclpy_context, "/nonexistent/ttyUSB9")
    # managed: the same error fails configure and leaves the node unconfigured, saying why
    node = _driver(rclpy_context, "/nonexistent/ttyUSB9", managed=True)
    try:
        node.trigger_configure()
        assert node.lifecycle_state == "unconfigured" and isinstance(node.transition_error, PortNotFound)
    finally:
        node.destroy_node()


@pytest.mark.timeout(150)
def test_managed_process_waits_for_its_manager_and_sigterm_turns_torque_off(rclpy_context, ros_executor, make_node,
                                                                           emu):
    """``managed:=true`` as a process (what the launch files start): unconfigured until told, configured and
    activated over its services, torque off and exit status 0 on SIGTERM (run_node -> destroy_node)."""
    import signal
    import subprocess
    import sys

    name = unique_name("managed_driver")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tensegrity_ros.nodes.dynamixel_driver", "--ros-args",
                             "-r", f"__node:={name}", "-p", f"bus_config:={BUS_CFG}", "-p", f"port:={emu.port}",
                             "-p", "baud:=1000000", "-p", "command_source:=hold", "-p", "managed:=true"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        srv = Services(ros_executor, make_node(unique_name("probe")), f"/{name}")
        assert srv.state() == "unconfigured" and all_torque(emu, 0)
        assert srv.transition("configure") and all_torque(emu, 0)
        assert srv.transition("activate") and all_torque(emu, 1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert all_torque(emu, 0), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
