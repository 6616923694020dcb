"""What every node of the graph shares, written once: a facade over the modules that do each job.

``from . import _common as C`` (the nodes of this package, bench/ and test/) keeps working; new
code may import from the module that owns a name.

* **Topics and QoS** (:mod:`.topics`): the stream / sensor / latched profiles, :func:`sensor_qos`; the names
  (:data:`TOPICS`) and the QoS parameters (:func:`sensor_qos_params`) are in :mod:`.topic_names` (ROS-free).
* **Parameters** (:mod:`.params`, ROS-free): :class:`ParamSpec`, reusable checks, :func:`declare_parameters`;
  each node's table is in :mod:`.tables` (ROS-free).
* **The node base and main** (:mod:`.graph_node`): :class:`LeanNode`, :class:`GraphNode`,
  :class:`CountingPublisher`, :func:`run_node`, :func:`realtime_thread`.
* **Statistics** (:mod:`.stats`, rclpy-free): :class:`RollingStats`, :class:`RateMeter`, :class:`SequenceMonitor`.
* **Records** (:mod:`.records`, rclpy-free): :class:`NodeStatesRecord`, :class:`JointRecord`, :class:`Prediction`.
* **Conversions** (:mod:`.convert`, message classes but no rclpy): messages <-> arrays / records, stamps,
  :func:`diag_status`, IdentifiedParameters <-> :class:`~tensegrity_ros.parameter_set.ParameterSet`.
* **The CDR codec** (:mod:`.cdr`, rclpy-free): serialised PoseArray, NodeStates, JointState and PredictedStates
  read and written with numpy, tested against rclpy's serialisation.
* **Quaternions** are in :mod:`tensegrity_ros.frames`; **compute workers and BLAS threads** in
  :mod:`tensegrity_ros.workers` (both rclpy-free; re-exported here).
"""
from __future__ import annotations

from ..frames import matrix_from_quaternion, quaternion_from_matrix
from ..parameter_set import ParameterSet, split_name
from ..workers import (WORKER_KINDS, WorkerStopped, limit_blas_threads, make_worker, stop_worker, worker_init,
                       worker_pid)
from .cdr import (joint_state_from_cdr, markers_from_cdr, node_states_from_cdr, node_states_to_cdr,
                  pose_array_to_cdr, prediction_from_cdr, prediction_to_cdr, sample_to_cdr)
from .convert import (LEVELS, diag_status, diag_values, joint_state_from_msg, joint_state_to_msg,
                      markers_from_pose_array, markers_to_pose_array, matrix_from_pose, node_states_from_msg,
                      node_states_to_msg, parameter_set_from_msg, parameter_set_to_msg, params_with_set,
                      pose_from_matrix, pose_stamped_from_matrix, prediction_from_msg, prediction_to_msg,
                      sample_to_node_states, sec_to_stamp, stamp_to_sec, transform_stamped_from_matrix)
from .graph_node import CountingPublisher, GraphNode, LeanNode, realtime_thread, run_node
from .params import (Check, ParameterError, ParamSpec, check_changes, declare_parameters, file_exists, nonnegative,
                     positive, required_file, spec_table, transform_from_list, transform_list)
from .records import JointRecord, NodeStatesRecord, Prediction
from .stats import RateMeter, RollingStats, SequenceMonitor
from .topic_names import QOS_RELIABILITIES, SENSOR_DEPTH, TOPICS, sensor_qos_params
from .topics import (DIAG_QOS, LATCHED_QOS, LATEST_QOS, PREDICTION_QOS, SENSOR_QOS, SENSOR_READER_QOS, STREAM_DEPTH,
                     STREAM_QOS, STREAM_QOS_BEST_EFFORT, sensor_qos, stream_qos)

__all__ = [
    # topics
    "TOPICS", "STREAM_DEPTH", "STREAM_QOS", "STREAM_QOS_BEST_EFFORT", "PREDICTION_QOS", "LATCHED_QOS", "LATEST_QOS",
    "DIAG_QOS",
    "SENSOR_DEPTH", "SENSOR_QOS", "SENSOR_READER_QOS", "QOS_RELIABILITIES", "stream_qos", "sensor_qos",
    "sensor_qos_params",
    # params
    "ParameterError", "Check", "ParamSpec", "positive", "nonnegative", "file_exists", "required_file",
    "transform_list", "transform_from_list", "declare_parameters", "spec_table", "check_changes",
    # graph_node
    "LeanNode", "GraphNode", "CountingPublisher", "realtime_thread", "run_node",
    # stats
    "RollingStats", "RateMeter", "SequenceMonitor",
    # records
    "NodeStatesRecord", "JointRecord", "Prediction",
    # convert
    "LEVELS", "diag_status", "diag_values", "stamp_to_sec", "sec_to_stamp", "node_states_to_msg",
    "node_states_from_msg", "sample_to_node_states", "joint_state_from_msg", "joint_state_to_msg",
    "markers_from_pose_array", "markers_to_pose_array", "pose_from_matrix", "matrix_from_pose",
    "pose_stamped_from_matrix", "transform_stamped_from_matrix", "prediction_to_msg", "prediction_from_msg",
    "parameter_set_to_msg", "parameter_set_from_msg", "params_with_set",
    # cdr
    "prediction_to_cdr", "prediction_from_cdr", "pose_array_to_cdr", "markers_from_cdr", "node_states_to_cdr",
    "sample_to_cdr", "node_states_from_cdr", "joint_state_from_cdr",
    # frames, parameter_set, workers (rclpy-free, outside nodes/)
    "matrix_from_quaternion", "quaternion_from_matrix", "ParameterSet", "split_name", "WORKER_KINDS",
    "WorkerStopped", "limit_blas_threads", "make_worker", "stop_worker", "worker_init", "worker_pid",
]
