"""Motion capture: marker labelling, velocity filtering and the one ingest entry point (no ROS imports).

``MocapIngest.add_frame(stamp, markers)`` is what the ``mocap_ingest`` node, bag replay and the tests call.
"""
from .filtering import (ConstantVelocityKF, Derivatives, KalmanConfig, KFOutput, kalman_velocities,
                        smooth_derivatives)
from .geometry import MarkerTopology, marker_topology, physical_nodes, virtual_nodes
from .ingest import IngestConfig, MocapIngest, NodeStateSample, NodeStateSeries, PlatePoses, ingest_markers
from .labelling import (AmbiguousMatchError, LabelledFrame, LabellerConfig, MarkerLabeller, MocapError,
                        NoMatchError, Registration, register_markers)

__all__ = ["AmbiguousMatchError", "ConstantVelocityKF", "Derivatives", "IngestConfig", "KFOutput", "KalmanConfig",
           "LabelledFrame", "LabellerConfig", "MarkerLabeller", "MarkerTopology", "MocapError", "MocapIngest",
           "NoMatchError", "NodeStateSample", "NodeStateSeries", "PlatePoses", "Registration",
           "ingest_markers", "kalman_velocities", "marker_topology", "physical_nodes",
           "register_markers", "smooth_derivatives", "virtual_nodes"]
