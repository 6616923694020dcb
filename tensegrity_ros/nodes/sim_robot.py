"""``sim_robot``: the simulated robot behind the same interfaces as the real one.

* An :class:`~tensegrity_ros.hardware.dynamixel.emulator.EmulatedBus` (Protocol 2.0 motors on a pty, linked at
  ``link_path``): the ``dynamixel_driver`` node opens it like a real U2D2 port (``bus: real``,
  ``port: <link_path>``) and talks to it through the unmodified SDK.
* A MuJoCo :class:`~tensegrity_ros.twin.sim.TwinSim` of the TRUE robot: ``true_model_file``, or the nominal
  ``model_file`` with its string stiffnesses and dampings (``perturb_kinds``) scaled by 1 + 0.2 N(0, 1)
  (``perturb_fraction``, seeded; :func:`tensegrity_ros.model.perturb.perturb_structure`), so the identifier
  starts ~20 % (RMS) off. It is stepped in real time
  (``realtime_factor``) with the emulated motors' present angles setting the actuated rest lengths.
* ``/mocap/markers`` (PoseArray) at ``mocap_rate_hz`` (120): one unlabelled marker per physical node, shuffled,
  in an OptiTrack-like frame (Y up, offset; ``mocap_frame``), with ``marker_noise_m`` and ``occlusion_prob``.
* ``/sim/ground_truth`` (NodeStates, all nodes, structure frame, exact): for tests and the demo's scoring only.

Diagnostics: achieved real-time factor, lag behind the wall clock, frames published, motor angles.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Dict, Optional, Sequence

import numpy as np

from ..model import CoincidentConstraint, Structure, load_structure
from ..model.perturb import perturb_structure
from . import _common as C
from .tables.sim_robot import DEFAULT_PERTURBED, PARAMS, PERTURBABLE  # noqa: F401 (re-exported)


# ---- pure helpers --------------------------------------------------------------------------------------
def marker_node_indices(structure: Structure) -> np.ndarray:
    """Nodes that carry a physical marker: all but the virtual duplicates of coincident constraints."""
    virtual = {c.nodes[1] for c in structure.constraints if isinstance(c, CoincidentConstraint)}
    return np.array([i for i, n in enumerate(structure.node_names) if n not in virtual], dtype=int)


def _default_frame() -> list:
    from ..twin.markers import MocapFrame
    f = MocapFrame()
    return [float(x) for x in np.asarray(f.rotation).reshape(-1)] + [float(x) for x in f.offset]


class SimRobotNode(C.GraphNode):
    DEFAULT_NAME = "sim_robot"
    PARAMS = PARAMS

    def __init__(self, node_name: str = DEFAULT_NAME, *, start: bool = True, **kwargs):
        super().__init__(node_name, **kwargs)
        from geometry_msgs.msg import PoseArray
        from tensegrity_ros.msg import NodeStates
        from ..hardware.dynamixel.emulator import EmulatedBus
        from ..twin.markers import MocapFrame
        from ..twin.sim import TwinSim

        p = self.p
        self.nominal = load_structure(p["model_file"])
        if p["true_model_file"]:
            self.true_structure = load_structure(p["true_model_file"])
        else:
            self.true_structure = perturb_structure(self.nominal, p["perturb_fraction"], p["perturb_seed"],
                                                    tuple(p["perturb_kinds"]))
        s = self.true_structure
        tr = C.transform_from_list(p["mocap_frame"] or _default_frame())
        self.frame = MocapFrame(tr[0], tr[1])
        self.marker_idx = marker_node_indices(s)
        self.rng = np.random.default_rng(p["seed"])
        self.sim = TwinSim(s, timestep=p["timestep"], integrator=p["integrator"])
        self.actuators = tuple(s.actuators)
        self.motor_ids = [int(a.motor_id) for a in self.actuators]
        self.emulator = None
        if self.actuators:
            self.emulator = EmulatedBus(self.motor_ids, {int(a.motor_id): a.model for a in self.actuators},
                                        baud=p["baud"], link_path=p["link_path"] or None,
                                        time_constant_s=p["motor_time_constant_s"],
                                        max_speed_rad_s=p["motor_max_speed_rad_s"], clock="wall")
            for a in self.actuators:   # motors start where the strings have their nominal rest lengths
                self.emulator.set_position(int(a.motor_id), float(a.zero_offset))
        if p["settle_s"] > 0:
            self.sim.step(self.motor_angles(), n_steps=int(round(p["settle_s"] / self.sim.dt)))
        self.pub_markers = self.counting_publisher(PoseArray, C.TOPICS["markers"], C.STREAM_QOS)
        self.pub_truth = None
        if p["publish_ground_truth"]:
            self.pub_truth = self.counting_publisher(NodeStates, C.TOPICS["ground_truth"], C.STREAM_QOS)
        self.frames = 0
        self.skipped_frames = 0
        self.lag = C.RollingStats(2000)
        self.rtf = math.nan
        self.rt_status: Optional[dict] = None    # rt_priority: {"done", "message"} once the thread started
        self.last_truth = None        # (stamp, positions (N, 3), velocities (N, 3))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.timer = self.every(p["diagnostics_period_s"], self._diagnostics)
        self.get_logger().info(
            f"true {s.name}: {len(self.marker_idx)} markers at {p['mocap_rate_hz']:g} Hz"
            + (f", {len(self.actuators)} emulated motors on {self.emulator.port}" if self.emulator else ""))
        if start:
            self.start()

    @property
    def port(self) -> Optional[str]:
        return None if self.emulator is None else self.emulator.port

    def motor_angles(self) -> Optional[np.ndarray]:
        """Present angles of the emulated motors in actuator order (rad), or None without actuators."""
        if self.emulator is None:
            return None
        pos = self.emulator.present_positions_rad()
        return np.array([pos[i] for i in self.motor_ids])

    # ---- the real-time loop ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sim-robot", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """Frames on a wall-clock schedule; each tick steps the twin up to the current time (scaled by
        ``realtime_factor``) with the motors' present angles, then publishes. A tick that comes too late
        (a busy CPU) is not made up: like a mocap system, the frame is skipped (``skipped_frames``), so the
        stamps, the twin's time and the motor angles it was driven with always agree."""
        p = self.p
        if p["rt_priority"]:
            self.rt_status = C.realtime_thread(self, p["rt_priority"], "simulation thread")
        period = 1.0 / p["mocap_rate_hz"]
        dt = self.sim.dt
        rtf = p["realtime_factor"]
        t0_wall = time.monotonic()
        t0_ros = self.now_s()
        t0_sim = self.sim.time
        next_tick = t0_wall + period
        try:
            while not self._stop.is_set():
                ahead = next_tick - time.monotonic()
                if ahead > 0:
                    self._stop.wait(ahead)
                    if self._stop.is_set():
                        break
                now = time.monotonic()
                late = now - next_tick
                if late > period:                     # skip the frames we are late for
                    missed = int(late // period)
                    self.skipped_frames += missed
                    next_tick += missed * period
                    self.lag.add(late)
                target = t0_sim + (next_tick - t0_wall) * rtf
                n = int(round((target - self.sim.time) / dt))
                if n > 0:
                    self.sim.step(self.motor_angles(), n_steps=n)
                self._publish(t0_ros + (self.sim.time - t0_sim) / rtf)
                next_tick += period
                if self.frames % 120 == 0:
                    wall = time.monotonic() - t0_wall
                    self.rtf = (self.sim.time - t0_sim) / wall if wall > 0 else math.nan
        except Exception as e:  # pragma: no cover - reported, node keeps its services
            self.fault = e
            self.get_logger().error(f"simulation stopped: {type(e).__name__}: {e}")

    def _publish(self, stamp: float) -> None:
        P = self.sim.node_positions()
        self.frames += 1
        m = markers_from_nodes(P, self.frame, self.marker_idx, self.p["marker_noise_m"], self.p["occlusion_prob"],
                               self.rng)
        self.pub_markers.publish(C.pose_array_to_cdr(stamp, m, self.p["mocap_frame_id"]))
        if self.pub_truth is not None and (self.frames - 1) % self.p["ground_truth_every"] == 0:
            V = self.sim.node_velocities()
            self.last_truth = (stamp, P, V)
            self.pub_truth.publish(C.node_states_to_cdr(stamp, self.true_structure.node_names, P, V,
                                                        np.ones(len(P), dtype=bool), "structure", "ground truth"))

    def _diagnostics(self) -> None:
        vals: Dict[str, object] = {"frames": self.frames, "skipped_frames": self.skipped_frames,
                                   "realtime_factor": self.rtf, "sim_time_s": self.sim.time}
        vals.update(self.lag.summary(1e3, "lag_ms_"))
        u = self.motor_angles()
        if u is not None:
            vals["motor_angles_rad"] = np.round(u, 4).tolist()
            vals["port"] = self.port
        level = "ok"
        message = f"simulating {self.true_structure.name} at {self.rtf:.2f}x real time"
        if self.fault is not None:
            level, message = "error", f"stopped: {self.fault}"
        elif math.isfinite(self.rtf) and self.rtf < 0.9 * self.p["realtime_factor"]:
            level = "warn"
        self.publish_diagnostics([C.diag_status(f"{self.get_name()}: simulated robot", level, message, vals,
                                                self.true_structure.name)])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self.emulator is not None:
            self.emulator.stop()

    def destroy_node(self):
        self.stop()
        return super().destroy_node()


def markers_from_nodes(P: np.ndarray, frame, indices: np.ndarray, noise_m: float, occlusion: float,
                       rng: np.random.Generator) -> np.ndarray:
    """(M, 3) unlabelled, shuffled markers in the mocap frame (see :func:`tensegrity_ros.twin.markers.markers`)."""
    from ..twin.markers import markers
    return markers(P, frame, noise_std=noise_m, occlusion_prob=occlusion, rng=rng, indices=indices)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return C.run_node(SimRobotNode, argv)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())
