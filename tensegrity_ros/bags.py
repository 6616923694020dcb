"""rosbag2 recordings (MCAP or sqlite3) written and read with ``rosbags``: no ROS runtime needed.

A robot recording holds three topics (names configurable through :class:`TopicNames`):

=============================  ==========================  ===============================================
topic                          type                        content
=============================  ==========================  ===============================================
``/tensegrity/motor_states``   sensor_msgs/msg/JointState  name = actuator names, position = motor angles
                                                           [rad], velocity [rad/s], effort (driver units)
``/mocap/markers``             geometry_msgs/msg/PoseArray one pose per (unlabelled) marker: position [m] in
                                                           the mocap frame, orientation identity,
                                                           header.frame_id = "mocap"
``/tensegrity/motor_commands`` sensor_msgs/msg/JointState  optional: commanded angles (position) [rad]
=============================  ==========================  ===============================================

Times are the messages' ``header.stamp`` (when the sample was taken), never the receive time; the bag's
own record timestamps are set to the same value on writing. Bags are rosbag2 directories (metadata.yaml +
one .mcap or .db3 file, CDR serialisation, metadata version 8) that ``ros2 bag info/play`` accept.
Writing is atomic: the bag is built under a temporary name next to the target and renamed into place
only when complete.

Every problem reading a recording raises a :class:`BagError` subclass whose message names the path, the
topic, what was expected and what was found.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["TopicNames", "JointSeries", "MarkerSeries", "RobotRecording", "write_robot_bag", "read_robot_bag",
           "write_topics", "read_topics", "bag_topics", "make_typestore", "package_msg_dirs", "BagError",
           "BagNotFoundError",
           "BagCorruptError", "BagTopicMissingError", "BagTopicTypeError", "BagTooShortError", "BagStampError",
           "BagActuatorError", "BagWriteError", "JOINT_STATE", "POSE_ARRAY"]

JOINT_STATE = "sensor_msgs/msg/JointState"
POSE_ARRAY = "geometry_msgs/msg/PoseArray"
#: rosbag2 metadata version written (8 is read by Iron, Jazzy and later).
BAG_VERSION = 8


# ---- errors --------------------------------------------------------------------------------------------
class BagError(Exception):
    """Base class: a recording that cannot be used. ``path`` and ``topic`` are set where known."""

    def __init__(self, message: str, path: Union[str, Path, None] = None, topic: Optional[str] = None):
        self.path, self.topic = (str(path) if path is not None else None), topic
        super().__init__(message)


class BagNotFoundError(BagError):
    """No bag at the path."""


class BagCorruptError(BagError):
    """Truncated or corrupt file, unreadable metadata, or messages that do not deserialise."""


class BagTopicMissingError(BagError):
    """A required topic is not in the bag."""


class BagTopicTypeError(BagError):
    """A topic exists but carries another message type."""


class BagTooShortError(BagError):
    """Too few samples or too short a time span to identify anything."""


class BagStampError(BagError):
    """Header stamps that are unusable (all zero, not finite)."""


class BagActuatorError(BagError):
    """The model's actuator names are not (all) in the motor-state messages."""


class BagWriteError(BagError):
    """The bag could not be written (nothing is left at the target path)."""


# ---- data ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopicNames:
    motor_states: str = "/tensegrity/motor_states"
    markers: str = "/mocap/markers"
    motor_commands: str = "/tensegrity/motor_commands"


@dataclass(frozen=True)
class JointSeries:
    """Joint samples: times (T,) s, names (A,), positions (T, A) rad, velocities / efforts (T, A) or None."""

    times: np.ndarray
    names: Tuple[str, ...]
    positions: np.ndarray
    velocities: Optional[np.ndarray] = None
    efforts: Optional[np.ndarray] = None

    @classmethod
    def coerce(cls, value, what: str) -> "JointSeries":
        if isinstance(value, JointSeries):
            js = value
        elif isinstance(value, (tuple, list)) and 3 <= len(value) <= 5:
            js = JointSeries(*value)
        else:
            raise ValueError(f"{what}: expected JointSeries or (times, names, positions[, velocities[, efforts]])")
        t = np.asarray(js.times, dtype=float).reshape(-1)
        names = tuple(str(n) for n in js.names)
        pos = np.asarray(js.positions, dtype=float).reshape(t.size, len(names))
        opt = [None if a is None else np.asarray(a, dtype=float).reshape(t.size, len(names))
               for a in (js.velocities, js.efforts)]
        if len(set(names)) != len(names):
            raise ValueError(f"{what}: duplicate joint names {names}")
        return JointSeries(t, names, pos, *opt)


@dataclass(frozen=True)
class MarkerSeries:
    """Mocap frames: times (T,) s and T arrays (M_k, 3) of marker positions [m] in frame ``frame_id``."""

    times: np.ndarray
    markers: Sequence[np.ndarray]
    frame_id: str = "mocap"

    @classmethod
    def coerce(cls, value, what: str = "markers") -> "MarkerSeries":
        if isinstance(value, MarkerSeries):
            ms = value
        elif isinstance(value, (tuple, list)) and len(value) in (2, 3):
            ms = MarkerSeries(*value)
        else:
            raise ValueError(f"{what}: expected MarkerSeries or (times, [ (M_k, 3) arrays ])")
        t = np.asarray(ms.times, dtype=float).reshape(-1)
        if len(ms.markers) != t.size:
            raise ValueError(f"{what}: {t.size} times but {len(ms.markers)} marker frames")
        frames = [np.asarray(m, dtype=float).reshape(-1, 3) for m in ms.markers]
        return MarkerSeries(t, frames, ms.frame_id)


@dataclass(frozen=True)
class RobotRecording:
    """What :func:`read_robot_bag` returns; times are header stamps in s, sorted.

    motor_angles / motor_velocities / motor_efforts: (T, A) in ``motor_names`` order (NaN where a message
    lacked that joint or field); markers: list of (M_k, 3) arrays in ``marker_frame_id``; commands: (Tc, A)
    in ``command_names`` order or None when the bag has no command topic.
    """

    path: str
    motor_times: np.ndarray
    motor_names: Tuple[str, ...]
    motor_angles: np.ndarray
    motor_velocities: np.ndarray
    motor_efforts: np.ndarray
    marker_times: np.ndarray
    markers: List[np.ndarray]
    marker_frame_id: str = "mocap"
    command_times: Optional[np.ndarray] = None
    command_names: Optional[Tuple[str, ...]] = None
    commands: Optional[np.ndarray] = None
    notes: Tuple[str, ...] = field(default=())

    @property
    def start_s(self) -> float:
        return float(min(a[0] for a in (self.motor_times, self.marker_times) if a.size))

    @property
    def duration_s(self) -> float:
        ends = [a[-1] for a in (self.motor_times, self.marker_times) if a.size]
        return float(max(ends) - self.start_s) if ends else 0.0


# ---- type store ----------------------------------------------------------------------------------------
def package_msg_dirs() -> List[Path]:
    """Folders holding this package's .msg files: the source tree's msg/, then installed share/ folders."""
    out = []
    from .paths import REPO_ROOT

    src = REPO_ROOT / "msg"
    if src.is_dir():
        out.append(src)
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        d = Path(prefix) / "share" / "tensegrity_ros" / "msg" if prefix else None
        if d is not None and d.is_dir() and d not in out:
            out.append(d)
    return out


def make_typestore(msg_dirs: Optional[Sequence[Union[str, Path]]] = None, package: str = "tensegrity_ros"):
    """A ROS 2 Jazzy typestore plus the messages in ``msg_dirs`` (default: :func:`package_msg_dirs`),
    registered as ``<package>/msg/<Name>``."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    ts = get_typestore(Stores.ROS2_JAZZY)
    types: Dict[str, Any] = {}
    for d in (package_msg_dirs() if msg_dirs is None else [Path(x) for x in msg_dirs]):
        for f in sorted(Path(d).glob("*.msg")):
            name = f"{package}/msg/{f.stem}"
            if name not in types:
                types.update(get_types_from_msg(f.read_text(), name))
    if types:
        ts.register(types)
    return ts


_TYPESTORE = None


def _default_typestore():
    global _TYPESTORE
    if _TYPESTORE is None:
        _TYPESTORE = make_typestore()
    return _TYPESTORE


# ---- message construction ------------------------------------------------------------------------------
_NP = {"bool": np.bool_, "byte": np.uint8, "char": np.uint8, "int8": np.int8, "uint8": np.uint8,
       "int16": np.int16, "uint16": np.uint16, "int32": np.int32, "uint32": np.uint32, "int64": np.int64,
       "uint64": np.uint64, "float32": np.float32, "float64": np.float64}


def _stamp(ts, t: float):
    ns = int(round(float(t) * 1e9))
    return ts.types["builtin_interfaces/msg/Time"](sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def _build(ts, msgtype: str, value):
    """A message instance from a dict (missing fields get defaults), or the instance itself."""
    cls = ts.types[msgtype]
    if isinstance(value, cls):
        return value
    if msgtype == "builtin_interfaces/msg/Time" and isinstance(value, (int, float)):
        return _stamp(ts, value)
    if not isinstance(value, Mapping):
        raise TypeError(f"{msgtype}: expected a dict or a message instance, got {type(value).__name__}")
    _, fields = ts.fielddefs[msgtype]
    unknown = set(value) - {f for f, _ in fields}
    if unknown:
        raise TypeError(f"{msgtype}: unknown fields {sorted(unknown)} (fields: {[f for f, _ in fields]})")
    kwargs = {}
    for fname, (kind, detail) in fields:
        v = value.get(fname)
        kwargs[fname] = _field(ts, msgtype, fname, int(kind), detail, v)
    return cls(**kwargs)


def _field(ts, msgtype, fname, kind, detail, v):
    if kind == 1:  # BASE
        typ = detail[0]
        if v is None:
            return "" if typ == "string" else (False if typ == "bool" else 0)
        return str(v) if typ == "string" else (bool(v) if typ == "bool" else
                                                 (float(v) if typ.startswith("float") else int(v)))
    if kind == 2:  # NAME
        return _build(ts, detail, {} if v is None else v)
    # ARRAY (3) or SEQUENCE (4): detail = ((kind, sub), length)
    (sub_kind, sub), length = detail
    items = [] if v is None else v
    if int(sub_kind) == 1:
        typ = sub[0]
        if typ == "string":
            out = [str(x) for x in items]
            return out + [""] * (length - len(out)) if kind == 3 and length else out
        arr = np.asarray(items, dtype=_NP[typ]).reshape(-1)
        if kind == 3 and length and arr.size != length:
            arr = np.zeros(length, dtype=_NP[typ]) if arr.size == 0 else arr
            if arr.size != length:
                raise ValueError(f"{msgtype}.{fname}: expected {length} values, got {arr.size}")
        return arr
    return [_build(ts, sub, x) for x in items]


def _joint_state(ts, t: float, names, pos, vel, eff):
    JS = ts.types[JOINT_STATE]
    Header = ts.types["std_msgs/msg/Header"]
    f64 = lambda a: np.zeros(0) if a is None else np.asarray(a, dtype=np.float64)  # noqa: E731
    return JS(header=Header(stamp=_stamp(ts, t), frame_id=""), name=list(names), position=f64(pos),
              velocity=f64(vel), effort=f64(eff))


def _pose_array(ts, t: float, pts: np.ndarray, frame_id: str):
    PA, Pose = ts.types[POSE_ARRAY], ts.types["geometry_msgs/msg/Pose"]
    Point, Quat = ts.types["geometry_msgs/msg/Point"], ts.types["geometry_msgs/msg/Quaternion"]
    Header = ts.types["std_msgs/msg/Header"]
    poses = [Pose(position=Point(x=float(p[0]), y=float(p[1]), z=float(p[2])),
                  orientation=Quat(x=0.0, y=0.0, z=0.0, w=1.0)) for p in pts]
    return PA(header=Header(stamp=_stamp(ts, t), frame_id=frame_id), poses=poses)


# ---- writing -------------------------------------------------------------------------------------------
def _storage_plugin(storage: str):
    from rosbags.rosbag2 import StoragePlugin
    plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
    if storage not in plugins:
        raise ValueError(f"storage {storage!r}: valid storages are {', '.join(plugins)}")
    return plugins[storage]


def _write(path: Union[str, Path], streams: Mapping[str, Tuple[str, Sequence[Tuple[float, Any]]]], storage: str,
           typestore, overwrite: bool) -> Path:
    """Write {topic: (msgtype, [(t_s, message)])} atomically; messages already built or dicts."""
    from rosbags.rosbag2 import Writer

    path = Path(path)
    plugin = _storage_plugin(storage)
    if path.exists() and not overwrite:
        raise BagWriteError(f"{path}: exists already (pass overwrite=True to replace it)", path)
    ts = typestore or _default_typestore()
    for topic, (msgtype, _) in streams.items():
        if msgtype not in ts.types:
            raise BagWriteError(f"{path}: topic {topic}: unknown message type {msgtype!r} (register its .msg "
                                f"with make_typestore)", path, topic)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    tmp = tmp_root / path.name
    try:
        with Writer(tmp, version=BAG_VERSION, storage_plugin=plugin) as writer:
            conns = {topic: writer.add_connection(topic, msgtype, typestore=ts)
                     for topic, (msgtype, _) in streams.items()}
            merged = sorted(((float(t), topic, msg) for topic, (_, msgs) in streams.items() for t, msg in msgs),
                            key=lambda x: x[0])
            for t, topic, msg in merged:
                msgtype = streams[topic][0]
                ns = int(round(t * 1e9))
                if ns < 0:
                    raise ValueError(f"topic {topic}: negative time {t} s")
                writer.write(conns[topic], ns, bytes(ts.serialize_cdr(_build(ts, msgtype, msg), msgtype)))
        if path.exists():  # overwrite: move the old bag aside first, drop it once the new one is in place
            old = tmp_root / (path.name + ".old")
            os.replace(path, old)
        os.replace(tmp, path)
    except BagError:
        raise
    except Exception as err:
        raise BagWriteError(f"{path}: could not write the bag ({type(err).__name__}: {err}); nothing was left "
                            f"at the target", path) from err
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return path


def write_topics(path: Union[str, Path], topics: Mapping[str, Tuple[str, Sequence[Tuple[float, Any]]]], *,
                 storage: str = "mcap", typestore=None, overwrite: bool = False) -> Path:
    """Write any topics: {topic: (msgtype, [(t_s, msg)])}, msg a message instance or a dict of its fields
    (nested dicts for nested messages, lists/arrays for sequences; a float is accepted for a
    builtin_interfaces/msg/Time). Custom types need a typestore that knows them (:func:`make_typestore`
    registers this package's msg/*.msg by default). The record time of each message is t_s."""
    return _write(path, topics, storage, typestore, overwrite)


def write_robot_bag(path: Union[str, Path], *, motor_states, markers, motor_commands=None, storage: str = "mcap",
                    topics: TopicNames = TopicNames(), overwrite: bool = False, typestore=None,
                    extra_topics: Optional[Mapping[str, Tuple[str, Sequence[Tuple[float, Any]]]]] = None) -> Path:
    """Write a robot recording (see the module docstring for topics and types).

    motor_states: :class:`JointSeries` or (times (T,), names (A,), angles (T, A), velocities, efforts);
    markers: :class:`MarkerSeries` or (times (K,), [(M_k, 3) arrays]); motor_commands: optional JointSeries
    (positions = commanded angles). storage: "mcap" | "sqlite3". Returns the bag directory.
    """
    ts = typestore or _default_typestore()
    ms = JointSeries.coerce(motor_states, "motor_states")
    mk = MarkerSeries.coerce(markers)
    streams: Dict[str, Tuple[str, list]] = {
        topics.motor_states: (JOINT_STATE, [
            (t, _joint_state(ts, t, ms.names, ms.positions[k],
                             None if ms.velocities is None else ms.velocities[k],
                             None if ms.efforts is None else ms.efforts[k])) for k, t in enumerate(ms.times)]),
        topics.markers: (POSE_ARRAY, [(t, _pose_array(ts, t, m, mk.frame_id)) for t, m in zip(mk.times, mk.markers)]),
    }
    if motor_commands is not None:
        mc = JointSeries.coerce(motor_commands, "motor_commands")
        streams[topics.motor_commands] = (JOINT_STATE, [
            (t, _joint_state(ts, t, mc.names, mc.positions[k], None if mc.velocities is None else mc.velocities[k],
                             None)) for k, t in enumerate(mc.times)])
    for topic, stream in (extra_topics or {}).items():
        if topic in streams:
            raise ValueError(f"extra_topics: {topic} is already written by write_robot_bag")
        streams[topic] = stream
    return _write(path, streams, storage, ts, overwrite)


# ---- reading -------------------------------------------------------------------------------------------
def _open_reader(path: Path, typestore):
    from rosbags.highlevel import AnyReader

    if not path.exists():
        raise BagNotFoundError(f"{path}: no such bag (expected a rosbag2 directory with metadata.yaml)", path)
    if path.is_dir() and not (path / "metadata.yaml").exists():
        raise BagCorruptError(f"{path}: not a rosbag2 directory (metadata.yaml is missing)", path)
    reader = AnyReader([path], default_typestore=typestore)
    try:
        reader.open()
    except Exception as err:  # rosbags raises several types for broken files
        raise BagCorruptError(f"{path}: cannot open the bag, truncated or corrupt? ({type(err).__name__}: {err}). "
                              f"A recording cut short by a crash can often be repaired with `ros2 bag reindex` "
                              f"(sqlite3) or `mcap recover` (MCAP)", path) from None
    return reader


def _expected_counts(path: Path) -> Dict[str, int]:
    """Per-topic message counts promised by metadata.yaml (empty if unavailable)."""
    meta = path / "metadata.yaml" if path.is_dir() else None
    if meta is None or not meta.exists():
        return {}
    try:
        import yaml
        info = yaml.safe_load(meta.read_text())["rosbag2_bagfile_information"]
        return {x["topic_metadata"]["name"]: int(x["message_count"]) for x in info["topics_with_message_count"]}
    except Exception:
        return {}


def bag_topics(path: Union[str, Path], *, typestore=None) -> Dict[str, str]:
    """{topic: message type} of a bag (a topic recorded with several types lists them comma-separated)."""
    path = Path(path)
    reader = _open_reader(path, typestore or _default_typestore())
    try:
        out: Dict[str, set] = {}
        for c in reader.connections:
            out.setdefault(c.topic, set()).add(c.msgtype)
    finally:
        reader.close()
    return {t: ", ".join(sorted(v)) for t, v in out.items()}


def read_topics(path: Union[str, Path], topics: Optional[Sequence[str]] = None, *, typestore=None,
                expected_types: Optional[Mapping[str, str]] = None) -> Dict[str, Tuple[str, List[Tuple[int, Any]]]]:
    """Read topics (all when ``topics`` is None): {topic: (msgtype, [(record time ns, message)])}.

    Types come from the definitions stored in the bag (falling back to ``typestore``). Raises
    :class:`BagTopicMissingError`, :class:`BagTopicTypeError` (``expected_types``) or
    :class:`BagCorruptError` (unreadable file, undecodable message, fewer messages than metadata.yaml says).
    """
    path = Path(path)
    ts = typestore or _default_typestore()
    reader = _open_reader(path, ts)
    try:
        by_topic: Dict[str, list] = {}
        for c in reader.connections:
            by_topic.setdefault(c.topic, []).append(c)
        present = ", ".join(f"{t} ({cs[0].msgtype})" for t, cs in sorted(by_topic.items())) or "none"
        wanted = list(by_topic) if topics is None else list(topics)
        for topic in wanted:
            if topic not in by_topic:
                raise BagTopicMissingError(f"{path}: topic {topic} is missing (the bag has: {present})", path, topic)
            exp = (expected_types or {}).get(topic)
            found = {c.msgtype for c in by_topic[topic]}
            if exp is not None and found != {exp}:
                raise BagTopicTypeError(f"{path}: topic {topic} has type {', '.join(sorted(found))}, expected {exp}",
                                        path, topic)
        out: Dict[str, Tuple[str, list]] = {t: (by_topic[t][0].msgtype, []) for t in wanted}
        conns = [c for t in wanted for c in by_topic[t]]
        current = None
        try:
            for conn, ns, raw in reader.messages(connections=conns):
                current = conn.topic
                out[conn.topic][1].append((ns, reader.deserialize(raw, conn.msgtype)))
        except Exception as err:
            n = len(out[current][1]) if current in out else 0
            raise BagCorruptError(f"{path}: reading {current or 'the first message'} failed after {n} messages, "
                                  f"truncated or corrupt? ({type(err).__name__}: {err})", path, current) from None
    finally:
        reader.close()
    expected = _expected_counts(path)
    for topic, (_, msgs) in out.items():
        if topic in expected and len(msgs) < expected[topic]:
            raise BagCorruptError(f"{path}: topic {topic} has {len(msgs)} readable messages but metadata.yaml "
                                  f"lists {expected[topic]}: the file is truncated", path, topic)
    return out


def _header_times(path, topic, msgs) -> np.ndarray:
    t = np.array([m.header.stamp.sec + 1e-9 * m.header.stamp.nanosec for _, m in msgs], dtype=float)
    if t.size and not np.all(np.isfinite(t)):
        raise BagStampError(f"{path}: topic {topic}: non-finite header stamps", path, topic)
    if t.size > 1 and np.all(t == 0):
        recv = [ns * 1e-9 for ns, _ in msgs[:3]]
        raise BagStampError(f"{path}: topic {topic}: every header.stamp is zero (receive times start "
                            f"{', '.join(f'{r:.3f}' for r in recv)} s): the publisher must stamp its samples",
                            path, topic)
    return t


def _joint_table(msgs, names: Sequence[str]):
    """(T, A) position, velocity, effort tables in ``names`` order (NaN where missing)."""
    T, A = len(msgs), len(names)
    col = {n: i for i, n in enumerate(names)}
    out = [np.full((T, A), np.nan) for _ in range(3)]
    for k, (_, m) in enumerate(msgs):
        for field_i, arr in enumerate((m.position, m.velocity, m.effort)):
            arr = np.asarray(arr, dtype=float)
            if arr.size != len(m.name):
                continue  # ROS allows empty velocity/effort arrays
            for j, n in enumerate(m.name):
                if n in col:
                    out[field_i][k, col[n]] = arr[j]
    return out


def _check_length(path, topic, t, min_samples, min_duration_s):
    span = float(t[-1] - t[0]) if t.size else 0.0
    if t.size < min_samples or span < min_duration_s:
        raise BagTooShortError(f"{path}: topic {topic} has {t.size} samples over {span:.3f} s; identification "
                               f"needs at least {min_samples} samples over {min_duration_s:g} s", path, topic)


def read_robot_bag(path: Union[str, Path], topics: TopicNames = TopicNames(), required_actuators=None, *,
                   min_duration_s: float = 1.0, min_samples: int = 10, typestore=None) -> RobotRecording:
    """Read a robot recording written by :func:`write_robot_bag` or recorded with ``ros2 bag record``.

    required_actuators: actuator names (or a Structure / actuator records) the model needs; they must all
    be joints of the motor-state messages, and the output columns follow their order. Otherwise the
    columns follow the first motor-state message's names.
    Raises the :class:`BagError` subclasses listed in the module docstring.
    """
    path = Path(path)
    available = bag_topics(path, typestore=typestore)
    present = ", ".join(f"{t} ({v})" for t, v in sorted(available.items())) or "none"
    expected = {topics.motor_states: JOINT_STATE, topics.markers: POSE_ARRAY}
    for topic, exp in expected.items():
        if topic not in available:
            raise BagTopicMissingError(f"{path}: topic {topic} ({exp}) is missing (the bag has: {present})",
                                       path, topic)
    has_cmd = topics.motor_commands in available
    if has_cmd:
        expected[topics.motor_commands] = JOINT_STATE
    found = read_topics(path, list(expected), typestore=typestore, expected_types=expected)
    notes = []

    def sorted_msgs(topic):
        msgs = found[topic][1]
        t = _header_times(path, topic, msgs)
        order = np.argsort(t, kind="stable")
        if np.any(np.diff(order) < 0):
            notes.append(f"{topic}: {int(np.sum(np.diff(t) < 0))} messages out of stamp order, sorted")
        return t[order], [msgs[i] for i in order]

    mt, mmsgs = sorted_msgs(topics.motor_states)
    _check_length(path, topics.motor_states, mt, min_samples, min_duration_s)
    bag_names: List[str] = []
    for _, m in mmsgs:
        bag_names += [n for n in m.name if n not in bag_names]
    if required_actuators is not None:
        req = [getattr(a, "name", a) for a in getattr(required_actuators, "actuators", required_actuators)]
        missing = [n for n in req if n not in bag_names]
        if missing:
            raise BagActuatorError(f"{path}: topic {topics.motor_states}: the model's actuators {missing} are not in "
                                   f"the bag (its joints: {', '.join(bag_names) or 'none'})", path,
                                   topics.motor_states)
        names = tuple(req)
    else:
        names = tuple(bag_names)
    pos, vel, eff = _joint_table(mmsgs, names)
    kt, kmsgs = sorted_msgs(topics.markers)
    _check_length(path, topics.markers, kt, min_samples, min_duration_s)
    frame_ids = {m.header.frame_id for _, m in kmsgs}
    markers = [np.array([[p.position.x, p.position.y, p.position.z] for p in m.poses], dtype=float).reshape(-1, 3)
               for _, m in kmsgs]
    if len(frame_ids) > 1:
        notes.append(f"{topics.markers}: several frame_ids {sorted(frame_ids)}")
    ct = cnames = cpos = None
    if has_cmd:
        ct, cmsgs = sorted_msgs(topics.motor_commands)
        cn: List[str] = []
        for _, m in cmsgs:
            cn += [n for n in m.name if n not in cn]
        cnames = tuple(n for n in names if n in cn) + tuple(n for n in cn if n not in names)
        cpos = _joint_table(cmsgs, cnames)[0]
    return RobotRecording(path=str(path), motor_times=mt, motor_names=names, motor_angles=pos, motor_velocities=vel,
                          motor_efforts=eff, marker_times=kt, markers=markers,
                          marker_frame_id=next(iter(frame_ids)) if frame_ids else "mocap", command_times=ct,
                          command_names=cnames, commands=cpos, notes=tuple(notes))
