"""``visualizer``: what RViz shows of the robot (docs/viz.md), a thin shell over
:class:`tensegrity_ros.viz.markers.MarkerScene`.

Subscribes ``/tensegrity/node_states``, ``/tensegrity/motor_states`` (both sensor-data QoS: only the latest
counts), ``/tensegrity/identified_parameters`` (latched) and ``/tensegrity/predicted_states`` (best effort,
the latest). Publishes ``/tensegrity/markers`` (visualization_msgs/MarkerArray) at ``rate_hz`` when something
new arrived: bars as cylinders, nodes as spheres, strings as lines coloured by their tension (the engine's
string law at the latest node states and motor angles, with the active identified parameters; 0 N blue to
``tension_scale_n`` red, slack grey) and the latest predicted horizon as a faded ghost (bars at
``ghost_steps`` steps and the nodes' predicted paths). A marker whose element can no longer be drawn (an
occluded node, no recent prediction) is deleted. Diagnostics: markers published, update time p50/p99.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from geometry_msgs.msg import Point
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import JointState
from visualization_msgs.msg import Marker, MarkerArray

from ..engine.params import params_from_structure
from ..model import load_structure
from ..viz.markers import MarkerScene, MarkerSpec, MarkerStyle
from . import _common as C
from .tables.visualizer import PARAMS
from tensegrity_ros.msg import IdentifiedParameters, NodeStates, PredictedStates

MARKERS_TOPIC = "/tensegrity/markers"
MARKER_QOS = QoSProfile(depth=2)
LATEST_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
MARKER_TYPES = {"cylinder": Marker.CYLINDER, "line_strip": Marker.LINE_STRIP, "line_list": Marker.LINE_LIST,
                "sphere_list": Marker.SPHERE_LIST}


def marker_array(specs: Sequence[MarkerSpec], stamp: float, frame_id: str,
                 deleted: Sequence[Tuple[str, int]] = ()) -> MarkerArray:
    """The MarkerArray of ``specs`` (ADD) and of the keys ``deleted`` (DELETE), stamped ``stamp`` s in ``frame_id``."""
    header_stamp = C.sec_to_stamp(stamp)
    out = []
    for ns, i in deleted:
        m = Marker(ns=ns, id=i, action=Marker.DELETE)
        m.header.stamp, m.header.frame_id = header_stamp, frame_id
        out.append(m)
    for s in specs:
        m = Marker(ns=s.ns, id=s.id, type=MARKER_TYPES[s.type], action=Marker.ADD)
        m.header.stamp, m.header.frame_id = header_stamp, frame_id
        p, q = m.pose.position, m.pose.orientation
        p.x, p.y, p.z = s.position
        q.x, q.y, q.z, q.w = s.orientation
        m.scale.x, m.scale.y, m.scale.z = s.scale
        m.color.r, m.color.g, m.color.b, m.color.a = s.color
        if len(s.points):
            m.points = [Point(x=x, y=y, z=z) for x, y, z in np.asarray(s.points, dtype=float).tolist()]
        out.append(m)
    return MarkerArray(markers=out)


class VisualizerNode(C.GraphNode):
    DEFAULT_NAME = "visualizer"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, **kwargs):
        super().__init__(node_name, **kwargs)
        p = self.p
        self.structure = load_structure(p["model_file"])
        self.scene = MarkerScene(self.structure, self._style())
        self.nominal = params_from_structure(self.structure)
        self.params, self.set_id = self.nominal, "nominal"
        self.auto_scale = self.scene.rest_tension_scale(self.params)
        self._lock = threading.Lock()
        self._states: Optional[bytes] = None        # latest raw messages; decoded at the next tick only
        self._motors: Optional[bytes] = None
        self._prediction: Optional[bytes] = None
        self._version = 0                           # bumped by every input; a tick with nothing new sends nothing
        self._drawn = -1
        self.sent_keys: set = set()
        self.published = 0
        self.last_ghost = False
        self.update_time = C.RollingStats(500)

        self.pub = self.counting_publisher(MarkerArray, MARKERS_TOPIC, MARKER_QOS)
        self.subscribe(NodeStates, C.TOPICS["node_states"], self._keep("_states"), qos_profile_sensor_data,
                       raw=True, info=False)
        self.subscribe(JointState, C.TOPICS["motor_states"], self._keep("_motors"), qos_profile_sensor_data,
                       raw=True, info=False)
        self.subscribe(PredictedStates, C.TOPICS["predicted_states"], self._keep("_prediction"), LATEST_QOS,
                       raw=True, info=False)
        self.subscribe(IdentifiedParameters, C.TOPICS["identified_parameters"], self._on_parameters, C.LATCHED_QOS,
                       info=False)
        self.timer = self.every(1.0 / p["rate_hz"], self._tick)
        self.diag_timer = self.every(p["diagnostics_period_s"], self._diagnostics)

    def _style(self) -> MarkerStyle:
        p = self.p
        return MarkerStyle(string_width_m=p["string_width_m"], tension_scale_n=p["tension_scale_n"],
                           ghost_steps=p["ghost_steps"], ghost_alpha=p["ghost_alpha"])

    def on_parameter_change(self, name, value) -> Optional[str]:
        self._version += 1          # redraw with the new style at the next tick (self.p is updated after this)
        return None

    # ---- inputs -------------------------------------------------------------------------------------------
    def _keep(self, attr: str):
        def keep(data: bytes) -> None:
            setattr(self, attr, data)
            self._version += 1
        keep.__name__ = f"keep{attr}"
        return keep

    def _on_parameters(self, msg) -> None:
        try:
            ps = C.parameter_set_from_msg(msg)
            params = C.params_with_set(self.nominal, ps)
            scale = self.scene.rest_tension_scale(params)
        except (ValueError, RuntimeError) as e:
            self.get_logger().error(f"identified parameters not usable: {e}")
            return
        with self._lock:
            self.params, self.set_id, self.auto_scale = params, ps.set_id, scale
            self._version += 1

    def motor_angles(self) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
        """(angles, rates) (A,) rad, rad/s in the model's actuator order from the latest motor states (None
        where an actuator is missing)."""
        data, names = self._motors, self.scene.actuator_names
        if data is None or not names:
            return None, None
        r = C.joint_state_from_cdr(data)
        idx = {n: i for i, n in enumerate(r.names)}
        if not all(n in idx for n in names):
            return None, None
        order = [idx[n] for n in names]
        u, ud = r.position[order], r.velocity[order]
        return (u if np.all(np.isfinite(u)) else None), (ud if np.all(np.isfinite(ud)) else None)

    # ---- output -------------------------------------------------------------------------------------------
    def markers(self) -> Optional[Tuple[List[MarkerSpec], float, str]]:
        """(specs, stamp s, frame) for the latest inputs; None before any node states."""
        if self._states is None:
            return None
        rec = C.node_states_from_cdr(self._states)
        scene = self.scene
        scene.style = self._style()
        X = scene.full_positions(rec.names, rec.positions, rec.valid)
        V = scene.full_velocities(rec.names, rec.velocities, rec.velocity_valid)
        u, ud = self.motor_angles()
        with self._lock:
            params, auto = self.params, self.auto_scale
        tensions = scene.tensions(params, X, V, u, ud)
        ghost = None
        if self._prediction is not None and scene.style.ghost_steps > 0:
            pred = C.prediction_from_cdr(self._prediction)
            end = pred.stamp + pred.dt * max(pred.horizon_steps - 1, 0)
            if pred.horizon_steps and rec.stamp - end <= self.p["prediction_timeout_s"]:
                ghost = (pred.node_names, pred.positions)
        specs = scene.markers(X, tensions, self.p["tension_scale_n"] or auto, ghost)
        return specs, rec.stamp, self.p["frame_id"] or rec.frame_id or "structure"

    def _tick(self) -> None:
        version = self._version
        if version == self._drawn:
            return
        t0 = time.perf_counter()
        out = self.markers()
        if out is None:
            return
        specs, stamp, frame = out
        keys = {s.key for s in specs}
        self.pub.publish(marker_array(specs, stamp, frame, sorted(self.sent_keys - keys)))
        self.sent_keys = keys
        self._drawn = version
        self.published += 1
        self.last_ghost = any(s.ns == "ghost" for s in specs)
        self.update_time.add(time.perf_counter() - t0)

    def _diagnostics(self) -> None:
        vals: Dict[str, object] = {"marker_arrays": self.published, "markers": len(self.sent_keys),
                                   "ghost": self.last_ghost, "parameter_set": self.set_id,
                                   "tension_scale_n": self.p["tension_scale_n"] or self.auto_scale}
        vals.update(self.update_time.summary(1e3, "update_ms_"))
        if self._states is None:
            level, message = "stale", f"no node states yet on {C.TOPICS['node_states']}"
        else:
            level, message = "ok", f"{len(self.sent_keys)} markers on {MARKERS_TOPIC}"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: markers", level, message, vals,
                                                self.structure.name)])


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(VisualizerNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
