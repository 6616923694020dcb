"""Conversions between messages and arrays / records: NodeStates, JointState, PoseArray, PoseStamped,
TransformStamped, PredictedStates and IdentifiedParameters; stamps; DiagnosticStatus from key-values.

The fast CDR codec of the streamed messages is in :mod:`.cdr`, the records in :mod:`.records`, the quaternion
maths in :mod:`tensegrity_ros.frames`. Imports message classes only, no rclpy.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point, Pose, PoseArray, PoseStamped, Quaternion, TransformStamped, Vector3
from sensor_msgs.msg import JointState

from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates

from ..frames import matrix_from_quaternion, quaternion_from_matrix
from ..param_names import join_name, split_name
from ..parameter_set import ParameterSet
from .records import JointRecord, NodeStatesRecord, Prediction


# =====================================================================================================
# diagnostics
# =====================================================================================================
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
def prediction_to_msg(pred: Prediction) -> PredictedStates:
    """The plain (slow for long horizons) conversion; :func:`.cdr.prediction_to_cdr` is the fast one."""
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


# ---- identified parameters -----------------------------------------------------------------------------
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
    names = tuple(join_name(e, k) for e, k in zip(msg.element_names, msg.kinds))
    ident = np.asarray(msg.identifiability, dtype=float) if len(msg.identifiability) == n else np.full(n, np.nan)
    return ParameterSet(msg.parameter_set_id, names, np.asarray(msg.values, dtype=float),
                        np.asarray(msg.std_devs, dtype=float), ident, float(msg.fit_residual),
                        (stamp_to_sec(msg.window_start), stamp_to_sec(msg.window_end)), bool(msg.converged),
                        msg.status_message, stamp_to_sec(msg.header.stamp))


def params_with_set(template, ps: ParameterSet):
    """Engine ``Params`` = ``template`` with the values of ``ps`` (names the template lacks are ignored)."""
    known = set(template.named())
    return template.with_values({n: float(v) for n, v in zip(ps.names, ps.values) if n in known})
