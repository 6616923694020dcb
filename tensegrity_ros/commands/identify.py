"""`tensegrity identify BAG --model MODEL.yaml --out PARAMS.yaml [--report DIR]`

Reads a rosbag2 recording with `rosbags` (no ROS runtime), labels the mocap markers to structure nodes
through the same ingest entry point as the live `mocap_ingest` node, aligns motor and mocap time, runs the
two-stage identification and writes PARAMS.yaml: the input structure file with the identified values in
place and their standard deviations beside them, so every tool loads it. Bad input exits with code 2 and
writes nothing: every flag, the model and the output locations are checked before the bag is read, existing
outputs are replaced only with ``--force``, and the outputs appear all at once when the run succeeds.
"""
from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from . import UserError
from ._common import (add_force_argument, atomic_output, check_output_target, finite, load_mocap_frame, load_model,
                      progress_bar)


def add_arguments(parser) -> None:
    parser.add_argument("bag", help="rosbag2 directory (MCAP or sqlite3)")
    parser.add_argument("--model", required=True, help="structure file (YAML) of the recorded robot")
    parser.add_argument("--out", required=True,
                        help="where to write the identified structure file (YAML); missing folders are created; an "
                             "existing non-empty file is refused unless --force")
    parser.add_argument("--report", help="folder for plots, a parameter table and summary.json (default: no report); "
                                         "an existing non-empty folder is refused unless --force")
    add_force_argument(parser)
    parser.add_argument("--motor-topic", default="/tensegrity/motor_states")
    parser.add_argument("--markers-topic", default="/mocap/markers")
    parser.add_argument("--commands-topic", default="/tensegrity/motor_commands")
    parser.add_argument("--mocap-frame", default=None,
                        help="YAML with a rough mocap->structure guess (config/mocap/*.yaml); needed to pick one "
                             "labelling of a symmetric structure (default: config/mocap/optitrack_yup.yaml)")
    parser.add_argument("--stages", default="regression,refine",
                        help="comma-separated: regression, refine (default: both)")
    parser.add_argument("--estimate", default="mass,stiffness,damping",
                        help="parameter kinds estimated by stage 1 (default: mass,stiffness,damping; an unknown "
                             "kind is refused before the bag is read, naming the valid ones)")
    parser.add_argument("--refine-kinds", default="mass,stiffness,damping,rest_length",
                        help="parameter kinds freed in stage 2 (default: mass,stiffness,damping,rest_length)")
    parser.add_argument("--estimate-delay", action="store_true", help="estimate the motor-to-mocap delay")
    parser.add_argument("--max-iter", type=int, default=12, help="stage-2 (Levenberg-Marquardt) iterations")
    parser.add_argument("--max-time", type=float, default=None, help="stage-2 wall-time budget [s]")
    parser.add_argument("--window", type=float, default=0.1, help="multiple-shooting window [s] (short windows "
                        "keep stage 2 nearly linear from a 20 %%-off model)")
    parser.add_argument("--windows", type=int, default=16,
                        help="multiple-shooting windows, spread over the recording (cost grows linearly)")
    parser.add_argument("--longer-windows", action="append", default=None, metavar="SECONDS:COUNT:ITERS",
                        help="then refine again on longer windows, each run from the result before (repeatable, "
                             "in order; 'none': stop after the first fit). Default: the bench's ladder "
                             "(ident.LONGER_WINDOWS_LADDER), --longer-windows 0.2:12:3 --longer-windows 0.5:8:3 "
                             "--longer-windows 1.0:8:3. Long windows see "
                             "damping and masses far better but need a start near the answer; the ladder gets "
                             "there (manipulator bench, three seeds: 0.8-2.9 %% median error instead of 1.9-4.5 %% "
                             "with one longer stage; ~70 s more on 2 cores)")
    parser.add_argument("--noise-mm", type=float, default=1.0, help="marker noise of the recording, std [mm]")
    parser.add_argument("--prior-std", default="stiffness=0.2,damping=0.2,mass=0.2,rest_length=0.003",
                        help="the model file's uncertainty: Gaussian prior of stage 2 around it, per kind "
                             "(relative, as a fraction or in %%, e.g. mass=2%% for weighed bars; rest_length in m); "
                             "a mass prior sets the overall scale (absolute values with their std), no mass prior "
                             "holds the nominal total mass fixed (ratios reported); 'none' = no prior")
    parser.add_argument("--holdout", type=float, default=0.1,
                        help="fraction of the recording set aside, in 0.2-s windows spread over it, to check at the "
                             "end that the fit predicts better than the nominal model (0: no check)")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (default: auto, cuda when present)")
    parser.add_argument("--workers", default="auto",
                        help="processes that share stage 2's windows on a Linux CPU (same result, ~1.5-1.8x faster "
                             "with 2); auto = the usable cores, at most 8")


def run(args) -> int:
    from ..bags import BagError, TopicNames, read_robot_bag
    from ..engine import apply_to_structure
    from ..engine.params import KIND_NAMES                  # the valid parameter kinds, owned there
    from ..frames import invert_transform
    from ..ident import STAGES, IdentifyOptions, identify
    from ..ident.regression import REGRESSION_KINDS         # the kinds stage 1 can estimate
    from ..mocap import IngestConfig, LabellerConfig, MocapError, ingest_markers
    from ..model import dump_structure

    # Flags first, then the model and the output locations: a typo fails before minutes of work.
    stages = _kinds("--stages", args.stages, STAGES)
    estimate = _kinds("--estimate", args.estimate, REGRESSION_KINDS)
    refine_kinds = _kinds("--refine-kinds", args.refine_kinds, KIND_NAMES)
    prior_std = _prior_std(args.prior_std, KIND_NAMES)
    longer = _ladder(args.longer_windows)
    workers = _workers(args.workers)
    if args.max_iter < 0:
        raise UserError(f"--max-iter {args.max_iter}: expected an integer >= 0 (stage-2 iterations)")
    if args.windows < 1:
        raise UserError(f"--windows {args.windows}: expected an integer >= 1")
    max_time = None if args.max_time is None else finite("--max-time", args.max_time, lo=0, lo_open=True,
                                                          hint="seconds; leave it out for no budget")
    window = finite("--window", args.window, lo=0, lo_open=True, hint="seconds, e.g. 0.1")
    noise_mm = finite("--noise-mm", args.noise_mm, lo=0, lo_open=True, hint="marker noise std in mm, e.g. 1.0")
    holdout = finite("--holdout", args.holdout, lo=0, hi=0.5, hint="a fraction of the recording, e.g. 0.1; 0: no check")
    _device(args.device)
    structure = load_model(args.model)
    guess = invert_transform(load_mocap_frame(args.mocap_frame).matrix)  # labeller wants mocap -> structure
    out = check_output_target(args.out, "--out", args.force, kind="file")
    report = None
    if args.report:
        report = check_output_target(args.report, "--report", args.force, kind="dir",
                                     inputs=(args.bag, args.model, args.mocap_frame))
        if report == out or report in out.parents:
            raise UserError(f"--out {args.out}: inside the --report folder {args.report}, which is written as a "
                            "whole; write the structure file beside it")
    topics = TopicNames(motor_states=args.motor_topic, markers=args.markers_topic,
                        motor_commands=args.commands_topic)
    try:
        rec = read_robot_bag(args.bag, topics, required_actuators=[a.name for a in structure.actuators] or None)
    except BagError as err:
        raise UserError(str(err)) from err
    print(f"bag {args.bag}: {len(rec.marker_times)} mocap frames, {len(rec.motor_times)} motor samples, "
          f"{rec.duration_s:.1f} s")

    # ---- markers -> labelled node states (the live node's code path) --------------------------------
    config = IngestConfig(labeller=LabellerConfig(initial_transform=guess))
    t0 = time.perf_counter()
    try:
        with progress_bar(len(rec.markers), "labelling markers") as bar:
            series = ingest_markers(structure, rec.marker_times, _tick(rec.markers, bar), config)
    except MocapError as err:
        raise UserError(f"{args.bag}: topic {topics.markers}: the markers never match the structure "
                        f"'{structure.name}': {err}") from err
    n_valid = int(series.valid.sum())
    if n_valid == 0:
        raise UserError(f"{args.bag}: topic {topics.markers}: no marker frame matched the structure "
                        f"'{structure.name}' (check --model and --mocap-frame)")
    print(f"labelled {series.valid.mean():.1%} of node samples in {time.perf_counter() - t0:.1f} s")

    dataset = _dataset(structure, series, rec)
    options = IdentifyOptions(estimate=estimate, refine_kinds=refine_kinds,
                              estimate_delay=args.estimate_delay, max_iter=args.max_iter, max_time_s=max_time,
                              window_s=window, max_windows=args.windows, noise_std_m=noise_mm * 1e-3,
                              prior_std=prior_std, longer_windows=longer, device=args.device, workers=workers,
                              heldout_check=holdout > 0, heldout_fraction=holdout or 0.1)
    iters = args.max_iter + sum(it for _, _, it in longer)
    with progress_bar(iters if "refine" in stages else 1, "identifying") as bar:
        last = {"iteration": None}

        def tick(info) -> None:
            # returns None on purpose: a callback returning True stops stage 2, and tqdm's update() returns
            # True whenever it redraws (which stopped runs after ~2 iterations). One tick per LM iteration: the
            # callback also reports each run's starting point (iteration 0) and every chord step.
            if info.get("stage") == "regression":
                return
            it = info.get("iteration")
            if it and it != last["iteration"]:
                bar.update(1)
            last["iteration"] = it

        result = identify(structure, dataset, stages=stages, options=options, callback=tick)
    if not result.ok:
        raise UserError(f"{args.bag}: identification failed: {result.error}")
    print(result.summary())

    identified = _checked(apply_to_structure(structure, result.params, result.std_devs), args.bag)
    header = (f"Identified by `tensegrity identify` from {args.bag} ({rec.duration_s:.1f} s); "
              f"residual RMS {result.residual_rms_m * 1e3:.2f} mm; converged={result.converged}; "
              f"{result.model_mismatch.status if result.model_mismatch is not None else 'model_not_checked'}.\n"
              f"Values are in place; std_devs holds their standard deviations.")
    with ExitStack() as outputs:                    # both appear at the end, or neither does
        out_tmp = outputs.enter_context(atomic_output(out, "file", args.force, "--out"))
        rep_tmp = outputs.enter_context(atomic_output(report, "dir", args.force, "--report")) if report else None
        rms_mm = _write_report(rep_tmp, structure, identified, series, rec, dataset, result) if report else None
        dump_structure(identified, out_tmp, header=header)
    if report:
        print(f"report: {args.report} (1-s prediction RMS {rms_mm:.1f} mm)")
    print(f"wrote {args.out}")
    for line in verdict_lines(result):
        print(line)
    return 0


def verdict_lines(result):
    """The last lines a person sees: the model check and the held-out check, loud when they fail."""
    lines = []
    mm, ho = result.model_mismatch, result.held_out
    if mm is not None:
        lines.append(("WARNING: " if mm.mismatch else "") + mm.line())
    if ho is not None:
        lines.append(("WARNING: " if ho.verdict == "worse" else "") + ho.line())
    if result.prior_dominated:
        lines.append(f"kept at the prior (the data do not move them): {', '.join(result.prior_dominated)}")
    return lines


def _ladder(flags):
    """The --longer-windows flags as stages: None gives the default ladder (the bench's schedule, with which its
    seeds end at 0.84 / 2.94 / 1.37 % against 2.29 / 1.93 / 4.45 % with a single 0.3-s stage); ['none'] none."""
    if flags is None:
        from ..ident import LONGER_WINDOWS_LADDER      # here, not at import: `--help` needs no torch
        return LONGER_WINDOWS_LADDER
    if [f.strip().lower() for f in flags] == ["none"]:
        return ()
    return tuple(_longer(x) for x in flags)


def _longer(text: str):
    """'0.3:24:3' -> (0.3, 24, 3): window length [s], window count, Levenberg-Marquardt iterations."""
    try:
        ws, nw, it = text.split(":")
        stage = (float(ws), int(nw), int(it))
    except ValueError:
        raise UserError(f"--longer-windows {text!r}: expected SECONDS:COUNT:ITERS, e.g. 0.3:24:3") from None
    if not (stage[0] > 0 and stage[1] >= 1 and stage[2] >= 0):
        raise UserError(f"--longer-windows {text!r}: need SECONDS > 0, COUNT >= 1, ITERS >= 0")
    return stage


def _checked(identified, bag):
    """The identified structure, re-validated like any structure file: unphysical values are refused."""
    from ..model import StructureError, structure_from_dict, structure_to_dict

    try:
        return structure_from_dict(structure_to_dict(identified), source=f"identified from {bag}")
    except StructureError as err:
        raise UserError(f"{err} -- the data do not determine this value physically; record longer or richer "
                        "motion, or add the refine stage") from err


class _tick:
    """A sequence view of ``items`` that advances ``bar`` as the ingest loop reads it."""

    def __init__(self, items, bar):
        self.items, self.bar = items, bar

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        self.bar.update(1)
        return self.items[k]


def _prior_std(text: str, valid):
    """``kind=value,...`` -> {kind: value} (kinds among ``valid``, values finite and > 0); ``none`` -> {}."""
    if text.strip().lower() in ("", "none"):
        return {}
    out = {}
    for part in text.split(","):
        kind, _, val = part.partition("=")
        val = val.strip()
        try:
            pct = val.endswith("%")
            out[kind.strip()] = float(val[:-1]) / 100.0 if pct else float(val)
            if pct and kind.strip() in ("rest_length", "zero_offset"):
                raise UserError(f"--prior-std: {part!r}: {kind.strip()} takes an absolute value (m or rad), not %")
        except ValueError:
            raise UserError(f"--prior-std: {part!r} is not kind=value (e.g. stiffness=0.2)") from None
        if kind.strip() not in valid or not 0 < out[kind.strip()] < float("inf"):
            raise UserError(f"--prior-std: {part!r}: kind must be one of {', '.join(valid)} and the value a "
                            "finite number > 0 (e.g. stiffness=0.2)")
    return out


def _workers(text: str) -> int:
    """``auto`` -> :func:`~tensegrity_ros.ident.workers.usable_cores`; else an integer >= 1."""
    if text.strip().lower() == "auto":
        from ..ident.workers import usable_cores
        return usable_cores()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"--workers {text!r}: expected auto or an integer >= 1")
    return n


def _kinds(flag: str, text: str, valid):
    """Comma-separated names, each among ``valid`` (the module that owns them), at least one."""
    names = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in names if k not in valid]
    if bad or not names:
        what = f"unknown name(s) {', '.join(map(repr, bad))}" if bad else "no names given"
        raise UserError(f"{flag} {text!r}: {what}; expected a comma-separated list of {', '.join(valid)}")
    return names


def _device(text: str) -> None:
    """``auto``, ``cpu`` or ``cuda[:N]`` (only when torch sees a CUDA device)."""
    import torch

    if text in ("auto", "cpu"):
        return
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f"--device {text}: torch sees no CUDA device here; use --device cpu or auto")
        return
    raise UserError(f"--device {text!r}: expected cpu, cuda, cuda:N or auto")


def _dataset(structure, series, rec):
    """Node states on structure node order (virtual nodes left invalid) with motor angles at mocap stamps."""
    from ..ident import make_dataset

    index = {n: i for i, n in enumerate(structure.node_names)}
    T, N = len(series.t), len(structure.nodes)
    positions = np.full((T, N, 3), np.nan)
    valid = np.zeros((T, N), dtype=bool)
    cols = [index[n] for n in series.names]
    positions[:, cols] = series.positions
    valid[:, cols] = series.valid
    keep = (series.t >= rec.motor_times[0]) & (series.t <= rec.motor_times[-1]) if len(rec.motor_times) else \
        np.ones(T, dtype=bool)
    angles = None
    if structure.actuators:
        order = [rec.motor_names.index(a.name) for a in structure.actuators]
        angles = np.stack([np.interp(series.t[keep], rec.motor_times, rec.motor_angles[:, j]) for j in order], axis=1)
    return make_dataset(series.t[keep], positions[keep], valid[keep], angles, node_names=structure.node_names,
                        actuator_names=tuple(a.name for a in structure.actuators), name=Path(rec.path).name)


def _write_report(tmp: Path, structure, identified, series, rec, dataset, result) -> float:
    """Plots, parameter table and summary.json into the (temporary, see atomic_output) folder ``tmp``; returns
    the 1-s prediction RMS error [mm]."""
    from ..report import parameter_table, plate_motion, plot_convergence, plot_plate_motion, plot_residuals
    from ..report.prediction import horizon_prediction

    pred = horizon_prediction(identified, dataset, horizon_s=1.0)
    measured = plate_motion(structure.node_names, dataset.positions)
    predicted = plate_motion(structure.node_names, pred)
    plot_plate_motion(dataset.times, {"measured": (dataset.times, measured), "predicted": (dataset.times, predicted)},
                      tmp / "plates.png", title=f"{structure.name}: measured vs identified model (1-s predictions)")
    err = np.linalg.norm(pred - dataset.positions, axis=2)
    err = np.where(dataset.valid & np.isfinite(err), err, np.nan)
    seen = np.isfinite(err).any(axis=1)
    per_frame = np.full(len(err), np.nan)
    per_frame[seen] = np.sqrt(np.nanmean(err[seen] ** 2, axis=1))
    plot_residuals(dataset.times, 1e3 * per_frame, tmp / "residuals.png", label="1-s prediction node RMS error",
                   title=" | ".join(verdict_lines(result)))
    plot_convergence([{**h["params"], "loss": h["loss"]} for h in result.history if "params" in h],
                     tmp / "convergence.png", x_label="loss evaluation")
    table = parameter_table({n: v for n, v in result.values().items() if n in result.std_devs},
                            result.std_devs, result.identifiability)
    (tmp / "parameters.txt").write_text("\n".join(verdict_lines(result)) + "\n\n" + result.summary() + "\n\n" + table
                                        + "\n")
    summary = {**result.to_dict(), "bag": str(rec.path), "duration_s": rec.duration_s,
               "prediction_1s_rms_mm": float(1e3 * np.sqrt(np.nanmean(err ** 2)))}
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary["prediction_1s_rms_mm"]
