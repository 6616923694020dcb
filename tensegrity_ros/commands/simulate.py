"""`tensegrity simulate MODEL.yaml --duration S --out DIR [--bag FILE]`

Runs the MuJoCo twin of a structure file driven by the reference sinusoids, writes node and plate
trajectories (NPZ and CSV) and plots like the seed's Figure 6 (positions and ZYX Euler angles of C1 and C2
relative to C0). With ``--bag`` it also writes a rosbag2 recording as it would come off the robot: motor
states at 80 Hz and unlabeled, noisy, partly occluded markers at 120 Hz in a Y-up mocap frame.

Every flag, the model, the reference and the output locations are checked before the simulation starts; an
existing non-empty ``--out`` or ``--bag`` is replaced only with ``--force``, and the outputs appear all at once
when the run succeeds (nothing is left behind when it fails).
"""
from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from . import UserError
from ..paths import CONFIG_DIR
from ._common import (add_force_argument, atomic_output, check_output_target, finite, load_mocap_frame,
                      load_model, read_text_file)

DEFAULT_REFERENCE = CONFIG_DIR / "references" / "seed_sinusoids.yaml"
#: The twin is recorded at a rate both sensor rates divide (120 Hz mocap, 80 Hz motors).
RECORD_HZ = 240.0


def add_arguments(parser) -> None:
    parser.add_argument("model", help="structure file (YAML)")
    parser.add_argument("--duration", type=float, required=True, help="simulated time [s], finite and > 0")
    parser.add_argument("--out", required=True,
                        help="output folder (trajectories, plots); an existing non-empty folder is refused unless "
                             "--force")
    add_force_argument(parser)
    parser.add_argument("--reference", default=str(DEFAULT_REFERENCE), help="reference sinusoids (YAML)")
    parser.add_argument("--dt", type=float, default=1e-3, help="twin time step [s]")
    parser.add_argument("--integrator", choices=("RK4", "implicitfast"), default="RK4",
                        help="MuJoCo integrator (default RK4: converged at 1 ms; implicitfast is stable with "
                             "heavier damping but mm-level off the physics, see docs/twin.md)")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds to settle before recording")
    parser.add_argument("--perturb", type=float, default=0.0,
                        help="simulate a 'true' robot whose K, c, m differ by this relative spread (e.g. 0.2); "
                             "its model is written to OUT/true_model.yaml")
    parser.add_argument("--seed", type=int, default=0, help="random seed (perturbation, noise, occlusion)")
    bag = parser.add_argument_group("robot bag")
    bag.add_argument("--bag", help="write a rosbag2 recording here, a folder (default: none; may lie inside --out); "
                                   "an existing non-empty folder is refused unless --force")
    bag.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    bag.add_argument("--noise-mm", type=float, default=1.0, help="marker noise, std [mm]")
    bag.add_argument("--occlusion", type=float, default=0.02, help="probability a marker is missing in a frame")
    bag.add_argument("--drop-frames", type=float, default=0.0, help="probability a whole mocap frame is missing")
    bag.add_argument("--mocap-frame", help="mocap frame YAML (default config/mocap/optitrack_yup.yaml)")
    bag.add_argument("--mocap-hz", type=float, default=120.0)
    bag.add_argument("--motor-hz", type=float, default=80.0)


def run(args) -> int:
    from ..model import dump_structure
    from ..model.perturb import perturb_structure
    from ..references import ReferenceConfigError, load_reference, motor_angles, motor_velocities
    from ..twin import simulate

    # Flags, inputs and output locations first: a bad one fails before the simulation, and writes nothing.
    duration = finite("--duration", args.duration, lo=0, lo_open=True, hint="simulated seconds, e.g. 10")
    dt = finite("--dt", args.dt, lo=0, lo_open=True, hint="twin time step in seconds, e.g. 0.001")
    finite("--settle", args.settle, lo=0, hint="seconds to settle before recording, e.g. 1")
    finite("--perturb", args.perturb, lo=0, hint="relative spread of K, c, m, e.g. 0.2")
    if args.bag:
        finite("--noise-mm", args.noise_mm, lo=0, hint="marker noise std in mm, e.g. 1")
        finite("--occlusion", args.occlusion, lo=0, hi=1, hint="a probability")
        finite("--drop-frames", args.drop_frames, lo=0, hi=1, hint="a probability")
        finite("--mocap-hz", args.mocap_hz, lo=0, lo_open=True, hi=RECORD_HZ, hint="e.g. 120")
        finite("--motor-hz", args.motor_hz, lo=0, lo_open=True, hi=RECORD_HZ, hint="e.g. 80")
    nominal = load_model(args.model)
    frame = load_mocap_frame(args.mocap_frame) if args.bag else None
    ref = None
    if nominal.actuators:
        read_text_file(args.reference, "--reference", "reference file (YAML), e.g. config/references/*.yaml")
        try:
            ref = load_reference(args.reference, nominal.actuators)
        except ReferenceConfigError as err:
            raise UserError(str(err)) from err
    inputs = (args.model, args.reference, args.mocap_frame)
    out = check_output_target(args.out, "--out", args.force, kind="dir", inputs=inputs)
    bag = check_output_target(args.bag, "--bag", args.force, kind="dir", inputs=inputs) if args.bag else None
    if bag is not None and (bag == out or out in bag.parents):
        bag_in_out = bag.relative_to(out)               # written inside --out's temporary folder, moved with it
        if bag_in_out == Path("."):
            raise UserError(f"--bag {args.bag}: the same folder as --out; put the bag inside it, e.g. "
                            f"--bag {Path(args.out) / 'bag'}")
    else:
        bag_in_out = None
        if bag is not None and bag in out.parents:
            raise UserError(f"--out {args.out}: inside the --bag folder {args.bag}; write them side by side")

    structure = perturb_structure(nominal, args.perturb, args.seed) if args.perturb > 0 else nominal
    angle_fn = (lambda t: motor_angles(ref, structure.actuators, np.atleast_1d(t))[0]) if ref else None
    with ExitStack() as outputs:                        # all outputs appear at the end, or none does
        out_tmp = outputs.enter_context(atomic_output(out, "dir", args.force, "--out"))
        if bag is None:
            bag_tmp = None
        elif bag_in_out is not None:
            bag_tmp = out_tmp / bag_in_out
        else:
            # written as BAG_TMP/NAME, then its files moved up: rosbag2 names the storage file after the folder
            bag_tmp = outputs.enter_context(atomic_output(bag, "dir", args.force, "--bag")) / bag.name
        if args.perturb > 0:
            dump_structure(structure, out_tmp / "true_model.yaml", header="The simulated robot's true parameters.")
        traj = simulate(structure, angle_fn, duration, record_hz=RECORD_HZ, timestep=dt,
                        integrator=args.integrator,
                        settle=args.settle, progress=True)
        _write_trajectories(out_tmp, structure, traj)
        written = sorted(f.name for f in out_tmp.iterdir() if f.is_file()) + ["summary.json"]
        summary = _summarise(structure, traj)
        if bag_tmp is not None:
            summary["bag"] = _write_bag(args, bag_tmp, frame, structure, traj, ref, motor_velocities)
            if bag_in_out is None:
                for f in bag_tmp.iterdir():
                    f.rename(bag_tmp.parent / f.name)
                bag_tmp.rmdir()
        (out_tmp / "summary.json").write_text(json.dumps(summary, indent=2))
    for k, v in summary.items():
        print(f"  {k:<32} {v}")
    print(f"wrote {args.out}/ ({', '.join(written)})")
    floor_mm = args.noise_mm if args.bag else 1.0
    if summary["max_internal_motion_mm"] < floor_mm:
        # the simulation is right, but a recording of it cannot identify anything: say so before `identify` does
        sys.stderr.write(
            f"tensegrity simulate: warning: the structure barely deforms (node-to-node distances change by at most "
            f"{summary['max_internal_motion_mm']:.3g} mm, under {floor_mm:g} mm"
            f"{', the marker noise' if args.bag else ''}), so a recording of it carries no information on its "
            "strings" + ("" if structure.actuators else
                         ": it has no actuators, so nothing here drives it"
                         + ("" if structure.fixed_nodes else ", and with no fixed node it only falls")) + ".\n")
    return 0


def _write_trajectories(out: Path, structure, traj) -> None:
    from ..report import moving_nodes, plate_motion, plot_node_motion, plot_plate_motion

    np.savez_compressed(out / "trajectory.npz", times=traj.times, node_names=np.array(traj.node_names),
                        positions=traj.positions, velocities=traj.velocities, motor_angles=traj.motor_angles,
                        tensions=traj.tensions, string_names=np.array(traj.string_names))
    motion = plate_motion(structure.node_names, traj.positions)
    if not motion:          # no manipulator plates: the nodes that move most
        plot_node_motion(traj.times, {"twin": traj.positions}, structure.node_names,
                         moving_nodes(structure.node_names, traj.positions, structure.fixed_nodes),
                         out / "nodes.png", title=f"{structure.name}: node motion (MuJoCo twin)")
        return
    cols, header = [traj.times], ["t_s"]
    for plate, (pos, eul) in motion.items():
        cols += [pos, np.degrees(eul)]
        header += [f"{plate}_{a}_m" for a in "xyz"] + [f"{plate}_{a}_deg" for a in ("yaw", "pitch", "roll")]
    np.savetxt(out / "plates.csv", np.column_stack(cols), delimiter=",", header=",".join(header), comments="",
               fmt="%.6f")
    plot_plate_motion(traj.times, {"twin": (traj.times, motion)}, out / "plates.png",
                      title=f"{structure.name}: C1, C2 relative to C0 (MuJoCo twin)")


def _summarise(structure, traj) -> dict:
    from ..report import plate_motion

    out = {"structure": structure.name, "duration_s": round(float(traj.times[-1]), 3),
           "min_string_tension_N": round(float(traj.tensions.min()), 3),
           "max_string_tension_N": round(float(traj.tensions.max()), 3)}
    for plate, (pos, eul) in plate_motion(structure.node_names, traj.positions).items():
        span = pos.max(axis=0) - pos.min(axis=0)
        out[f"{plate}_excursion_mm"] = [round(float(v) * 1e3, 2) for v in span]
        out[f"{plate}_angle_span_deg"] = [round(float(v), 2) for v in np.degrees(eul.max(0) - eul.min(0))]
    slack = [s.name for s, low in zip(structure.strings, traj.tensions.min(axis=0)) if low <= 0]
    out["strings_going_slack"] = slack
    out["max_internal_motion_mm"] = round(internal_motion(traj.positions) * 1e3, 4)
    return out


def internal_motion(positions: np.ndarray) -> float:
    """How far the structure deforms over a run, m: the largest change of any node-to-node distance from the
    first frame. A rigid motion (falling, turning) leaves it at zero, and so tells nothing of the strings."""
    X = np.asarray(positions, dtype=float)
    worst = 0.0
    for i in range(X.shape[1] - 1):                     # one node against the later ones: memory O(frames x nodes)
        d = np.linalg.norm(X[:, i + 1:] - X[:, i:i + 1], axis=-1)
        worst = max(worst, float(np.abs(d - d[:1]).max(initial=0.0)))
    return worst


def _write_bag(args, path: Path, frame, structure, traj, ref, motor_velocities) -> str:
    """The robot's recording at ``path`` (a temporary folder, see atomic_output): motor states at motor_hz,
    unlabeled markers at mocap_hz (header stamps) seen in the mocap ``frame``."""
    from ..bags import BagError, JointSeries, MarkerSeries, write_robot_bag
    from ..mocap import physical_nodes
    from ..twin.markers import markers

    rng = np.random.default_rng(args.seed + 1)
    t = traj.times
    mi = _decimate(t, args.mocap_hz)
    phys = [structure.node_index(n) for n in physical_nodes(structure)]
    frames = []
    for k in mi:
        if rng.random() < args.drop_frames:
            continue
        frames.append((t[k], markers(traj.positions[k], frame, args.noise_mm * 1e-3, args.occlusion, rng, phys)))
    # Motor states: angle (rad), velocity (rad/s) and effort as the string's torque on its spool (N m).
    ki = _decimate(t, args.motor_hz)
    names = tuple(a.name for a in structure.actuators)
    by_string = {s.actuator: j for j, s in enumerate(structure.strings) if s.actuator}
    effort = np.stack([traj.tensions[ki, by_string[a.name]] * a.spool_radius for a in structure.actuators], 1) \
        if names else np.zeros((len(ki), 0))
    vel = motor_velocities(ref, structure.actuators, t[ki]) if ref else np.zeros((len(ki), len(names)))
    motor = JointSeries(t[ki], names, traj.motor_angles[ki], vel, effort)
    try:
        write_robot_bag(path, motor_states=motor, storage=args.storage, overwrite=True,
                        markers=MarkerSeries(np.array([f[0] for f in frames]), [f[1] for f in frames]))
    except BagError as err:
        raise UserError(str(err)) from err
    return f"{args.bag} ({args.storage}, {len(frames)} mocap frames, {len(ki)} motor samples)"


def _decimate(t: np.ndarray, hz: float) -> np.ndarray:
    """Indices of the samples closest to a ``hz`` grid over ``t``."""
    grid = np.arange(t[0], t[-1] + 1e-9, 1.0 / hz)
    return np.unique(np.clip(np.searchsorted(t, grid - 0.5 / RECORD_HZ), 0, len(t) - 1))
