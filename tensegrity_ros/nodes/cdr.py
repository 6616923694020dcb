"""The hand-written CDR codec of the streamed messages: serialised PoseArray, NodeStates, JointState and
PredictedStates read and written with numpy, published and subscribed raw.

At 120 Hz with ~1000 callbacks/s in one Python process, building and (de)serialising nested Python message
objects is a large share of the CPU (a PoseArray of 24 markers: ~0.8 ms; a 1-s PredictedStates horizon is
thousands of Points). Every function here is tested against rclpy's ``serialize_message`` /
``deserialize_message`` (test/test_nodes_common.py); a subscriber still receives ordinary messages.

rclpy-free (and free of any ROS package): struct and numpy only; the records are in :mod:`.records`.
"""
from __future__ import annotations

import struct
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .records import JointRecord, NodeStatesRecord, Prediction


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
