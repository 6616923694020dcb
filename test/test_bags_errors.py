"""Bad recordings: each raises its BagError subclass with a message that names the problem."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from tensegrity_ros.bags import (BagActuatorError, BagCorruptError, BagError, BagNotFoundError, BagStampError,
                                 BagTooShortError, BagTopicMissingError, BagTopicTypeError, read_robot_bag,
                                 write_robot_bag, write_topics)
from tensegrity_ros.model import Actuator

NAMES = ("m1", "m2", "m3")


def _series(T=100, K=150, t0=100.0):
    rng = np.random.default_rng(0)
    t = t0 + np.arange(T) / 80.0
    kt = t0 + np.arange(K) / 120.0
    return (t, NAMES, rng.normal(size=(T, 3)), rng.normal(size=(T, 3)), None), \
        (kt, [rng.uniform(-1, 1, (20, 3)) for _ in range(K)])


@pytest.fixture(scope="module", params=["mcap", "sqlite3"])
def good_bag(tmp_path_factory, request):
    ms, mk = _series()
    return write_robot_bag(tmp_path_factory.mktemp("bags") / f"good_{request.param}", motor_states=ms, markers=mk,
                           storage=request.param)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _storage_file(bag: Path) -> Path:
    return next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))


def test_good_bag_reads(good_bag):
    rec = read_robot_bag(good_bag, required_actuators=NAMES)
    assert rec.motor_angles.shape == (100, 3) and len(rec.markers) == 150
    assert np.isnan(rec.motor_efforts).all()  # no effort recorded -> NaN, not zeros


def test_missing_path(tmp_path):
    with pytest.raises(BagNotFoundError, match="no such bag") as err:
        read_robot_bag(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(err.value)


def test_missing_topic(tmp_path):
    ms, _ = _series()
    msgs = [(t, {"header": {"stamp": t}, "name": list(NAMES), "position": p}) for t, p in zip(ms[0], ms[2])]
    path = write_topics(tmp_path / "nomocap", {"/tensegrity/motor_states": ("sensor_msgs/msg/JointState", msgs)})
    with pytest.raises(BagTopicMissingError) as err:
        read_robot_bag(path)
    msg = str(err.value)
    assert "/mocap/markers" in msg and "is missing" in msg and "/tensegrity/motor_states (sensor_msgs/msg/JointState)" \
        in msg and str(path) in msg
    assert err.value.topic == "/mocap/markers" and isinstance(err.value, BagError)


def test_wrong_type(tmp_path):
    ms, mk = _series()
    msgs = [(t, {"header": {"stamp": t}, "pose": {"position": {"x": 1.0}}}) for t in mk[0]]
    path = write_robot_bag(tmp_path / "wrongtype", motor_states=ms, markers=mk, extra_topics={
        "/tensegrity/motor_commands": ("geometry_msgs/msg/PoseStamped", msgs)})
    with pytest.raises(BagTopicTypeError,
                       match=r"topic /tensegrity/motor_commands has type geometry_msgs/msg/PoseStamped, "
                             r"expected sensor_msgs/msg/JointState"):
        read_robot_bag(path)
    path2 = write_topics(tmp_path / "wrong2", {
        "/tensegrity/motor_states": ("sensor_msgs/msg/JointState", [(0.0, {})]),
        "/mocap/markers": ("geometry_msgs/msg/PoseStamped", msgs)})
    with pytest.raises(BagTopicTypeError, match="/mocap/markers has type geometry_msgs/msg/PoseStamped"):
        read_robot_bag(path2)


def test_too_short(tmp_path):
    ms, mk = _series(T=40, K=60)  # 0.49 s of data
    path = write_robot_bag(tmp_path / "short", motor_states=ms, markers=mk)
    with pytest.raises(BagTooShortError) as err:
        read_robot_bag(path)
    msg = str(err.value)
    assert "/tensegrity/motor_states has 40 samples over 0.487 s" in msg and "at least 10 samples over 1 s" in msg
    rec = read_robot_bag(path, min_duration_s=0.4, min_samples=30)  # configurable
    assert rec.motor_angles.shape == (40, 3)
    ms, _ = _series(T=100)
    path = write_robot_bag(tmp_path / "short_mocap", motor_states=ms, markers=mk)
    with pytest.raises(BagTooShortError, match="topic /mocap/markers has 60 samples over 0.492 s"):
        read_robot_bag(path)


@pytest.mark.parametrize("damage", ["half", "garbage", "no_metadata", "bad_metadata", "missing_file"])
def test_truncated_or_corrupt(good_bag, tmp_path, damage):
    bag = _copy(good_bag, tmp_path / "damaged")
    f = _storage_file(bag)
    data = f.read_bytes()
    if damage == "half":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif damage == "no_metadata":
        (bag / "metadata.yaml").unlink()
    elif damage == "bad_metadata":
        (bag / "metadata.yaml").write_text("rosbag2_bagfile_information: [unclosed\n")
    elif damage == "missing_file":
        f.unlink()
    with pytest.raises(BagCorruptError) as err:
        read_robot_bag(bag)
    msg = str(err.value)
    assert str(bag) in msg, msg
    assert any(w in msg for w in ("truncated or corrupt", "metadata.yaml is missing")), msg


def test_truncated_sqlite_detected_by_message_count(tmp_path):
    """A sqlite3 bag cut short (rows lost) still opens; the count promised by metadata.yaml catches it."""
    import sqlite3
    ms, mk = _series()
    bag = write_robot_bag(tmp_path / "cut", motor_states=ms, markers=mk, storage="sqlite3")
    with sqlite3.connect(_storage_file(bag)) as db:
        db.execute("DELETE FROM messages WHERE id > 120")
    with pytest.raises(BagCorruptError, match=r"has \d+ readable messages but metadata.yaml lists \d+: the file is "
                                              r"truncated"):
        read_robot_bag(bag)


def test_actuator_names_not_in_bag(good_bag):
    acts = [Actuator("m1", 1, 0.01), Actuator("m7", 7, 0.01), Actuator("m9", 9, 0.01)]
    with pytest.raises(BagActuatorError) as err:
        read_robot_bag(good_bag, required_actuators=acts)
    msg = str(err.value)
    assert "['m7', 'm9'] are not in the bag" in msg and "its joints: m1, m2, m3" in msg and str(good_bag) in msg


def test_unstamped_messages(tmp_path):
    ms, mk = _series()
    msgs = [(t, {"header": {"stamp": 0.0}, "name": list(NAMES), "position": p}) for t, p in zip(ms[0], ms[2])]
    path = write_robot_bag(tmp_path / "nostamp", motor_states=ms, markers=mk)
    path2 = write_topics(tmp_path / "nostamp2", {"/tensegrity/motor_states": ("sensor_msgs/msg/JointState", msgs),
                                                  "/mocap/markers": ("geometry_msgs/msg/PoseArray", [])})
    assert read_robot_bag(path).motor_times[0] == 100.0
    with pytest.raises(BagStampError, match="every header.stamp is zero"):
        read_robot_bag(path2)
