"""Round trips of the custom tensegrity_ros interfaces through real rclpy/DDS.

Each test publishes (or calls) from one node and receives in another node of
the same session context, then checks every field against what was sent.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from builtin_interfaces.msg import Time
from geometry_msgs.msg import Point, Vector3
from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy
from std_msgs.msg import Header

from conftest import spin_until, unique_name
from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates
from tensegrity_ros.srv import GetLinearization, LoadParameters, SaveParameters, SetCommandSource

TIMEOUT = 10.0
ROOT = Path(__file__).resolve().parents[1]
QOS = QoSProfile(
    depth=10,
    reliability=QoSReliabilityPolicy.RELIABLE,
    durability=QoSDurabilityPolicy.TRANSIENT_LOCAL,
)


# --- helpers -------------------------------------------------------------------
def assert_fields_equal(received, sent, path: str = "") -> None:
    """Recursively compare two ROS messages field by field (clear failure messages)."""
    assert type(received) is type(sent), f"{path or 'msg'}: type {type(received)} != {type(sent)}"
    for field in sent.get_fields_and_field_types():
        got, exp = getattr(received, field), getattr(sent, field)
        where = f"{path}.{field}" if path else field
        if hasattr(exp, "get_fields_and_field_types"):
            assert_fields_equal(got, exp, where)
        elif isinstance(exp, (list, tuple)) or type(exp).__name__ in ("array", "ndarray"):
            assert len(got) == len(exp), f"{where}: length {len(got)} != {len(exp)}"
            for i, (g, e) in enumerate(zip(got, exp)):
                if hasattr(e, "get_fields_and_field_types"):
                    assert_fields_equal(g, e, f"{where}[{i}]")
                else:
                    assert g == e, f"{where}[{i}]: {g!r} != {e!r}"
        else:
            assert got == exp, f"{where}: {got!r} != {exp!r}"
    assert received == sent


def header(frame: str = "world") -> Header:
    return Header(stamp=Time(sec=1_700_000_123, nanosec=456_789_012), frame_id=frame)


def roundtrip_topic(make_node, executor, msg_type, msg):
    """Publish ``msg`` from one node, receive it in another, return what arrived."""
    topic = "/" + unique_name("roundtrip")
    pub_node, sub_node = make_node(unique_name("pub")), make_node(unique_name("sub"))
    received = []
    sub_node.create_subscription(msg_type, topic, received.append, QOS)
    publisher = pub_node.create_publisher(msg_type, topic, QOS)
    assert spin_until(executor, lambda: publisher.get_subscription_count() > 0, TIMEOUT), "no discovery"
    publisher.publish(msg)
    assert spin_until(executor, lambda: bool(received), TIMEOUT), f"{msg_type.__name__} not received"
    return received[0]


# --- messages ------------------------------------------------------------------
def test_node_states_roundtrip(make_node, ros_executor):
    msg = NodeStates(
        header=header("mocap"),
        names=["r0_a", "r0_b", "r1_a"],
        positions=[Point(x=0.1, y=-0.2, z=0.3), Point(x=1e-9, y=2.5, z=-1e3), Point()],
        velocities=[Vector3(x=0.01, y=0.0, z=-0.02), Vector3(x=1.0, y=2.0, z=3.0), Vector3()],
        valid=[True, False, True],
        frame_note="mocap markers, z up (µ-accurate)",
    )
    got = roundtrip_topic(make_node, ros_executor, NodeStates, msg)
    assert_fields_equal(got, msg)
    assert list(got.valid) == [True, False, True]


def test_identified_parameters_roundtrip(make_node, ros_executor):
    msg = IdentifiedParameters(
        header=header(""),
        parameter_set_id="run-42/iter-7",
        element_names=["cable_0", "cable_0", "rod_1", "motor_2", "motor_2"],
        kinds=["stiffness", "rest_length", "mass", "spool_radius", "delay"],
        values=[1234.5, 0.215, 0.042, 0.0125, 0.018],
        std_devs=[12.0, 1e-4, 1e-3, 5e-5, 2e-3],
        identifiability=[0.95, 0.99, 0.4, 0.0, 1.0],
        fit_residual=0.0031,
        window_start=Time(sec=100, nanosec=1),
        window_end=Time(sec=110, nanosec=999_999_999),
        converged=True,
        status_message="ok",
    )
    got = roundtrip_topic(make_node, ros_executor, IdentifiedParameters, msg)
    assert_fields_equal(got, msg)


def test_predicted_states_roundtrip(make_node, ros_executor):
    nodes = ["r0_a", "r0_b"]
    steps = 3
    positions = [Point(x=0.1 * k, y=0.01 * i, z=-0.5 + k) for k in range(steps) for i in range(len(nodes))]
    velocities = [Vector3(x=float(k), y=float(i), z=0.25) for k in range(steps) for i in range(len(nodes))]
    msg = PredictedStates(
        header=header("world"),
        parameter_set_id="run-42/iter-7",
        node_names=nodes,
        dt=0.01,
        horizon_steps=steps,
        positions=positions,
        velocities=velocities,
    )
    got = roundtrip_topic(make_node, ros_executor, PredictedStates, msg)
    assert_fields_equal(got, msg)
    assert len(got.positions) == got.horizon_steps * len(got.node_names)


# --- services ------------------------------------------------------------------
def test_save_parameters_service_roundtrip(make_node, ros_executor):
    name = "/" + unique_name("save_parameters")
    server_node, client_node = make_node(unique_name("server")), make_node(unique_name("client"))
    requests = []

    def handle(request, response):
        requests.append(request)
        response.success = True
        response.message = f"saved {request.path}"
        response.path_written = "/abs" + request.path
        return response

    server_node.create_service(SaveParameters, name, handle)
    client = client_node.create_client(SaveParameters, name)
    assert spin_until(ros_executor, client.service_is_ready, TIMEOUT), "service not discovered"

    request = SaveParameters.Request(path="/params/run-42.yaml")
    future = client.call_async(request)
    assert spin_until(ros_executor, future.done, TIMEOUT), "no service response"

    assert len(requests) == 1
    assert_fields_equal(requests[0], request)
    expected = SaveParameters.Response(
        success=True, message="saved /params/run-42.yaml", path_written="/abs/params/run-42.yaml"
    )
    assert_fields_equal(future.result(), expected)


# --- interface definitions -------------------------------------------------------
@pytest.mark.parametrize(
    "srv_type, request_fields, response_fields",
    [
        (SaveParameters, ["path"], ["success", "message", "path_written"]),
        (LoadParameters, ["path"], ["success", "message", "parameter_set_id"]),
        (
            GetLinearization,
            ["max_steps"],
            ["success", "message", "horizon_steps", "state_dim", "input_dim", "dt",
             "a_matrices", "b_matrices", "state_names", "input_names"],
        ),
        (SetCommandSource, ["source"], ["success", "message"]),
    ],
)
def test_service_fields(srv_type, request_fields, response_fields):
    assert list(srv_type.Request.get_fields_and_field_types()) == request_fields
    assert list(srv_type.Response.get_fields_and_field_types()) == response_fields


_FIELD_RE = re.compile(r"^[A-Za-z][\w/]*(\[\d*\])?\s+[a-z]\w*(\s*=?\s*\S.*)?$")


@pytest.mark.parametrize("path", sorted((ROOT / "msg").glob("*.msg")) + sorted((ROOT / "srv").glob("*.srv")),
                         ids=lambda p: p.name)
def test_every_field_is_documented(path):
    """Each field line in msg/ and srv/ must be directly preceded by a comment line."""
    previous = ""
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if line and not line.startswith("#") and line != "---":
            assert _FIELD_RE.match(line), f"{path.name}:{lineno}: unexpected line {line!r}"
            assert previous.startswith("#"), f"{path.name}:{lineno}: field {line!r} has no comment above it"
        previous = line
