"""`tensegrity identify BAG --model MODEL.yaml --out PARAMS.yaml [--report DIR]`

Reads a rosbag2 recording with `rosbags` (no ROS runtime), labels the mocap markers to structure nodes
through the same ingest entry point as the live `mocap_ingest` node, aligns motor and mocap time, runs the
two-stage identification and writes PARAMS.yaml: the input structure file with the identified values in
place and their standard deviations beside them, so every tool loads it. Bad input exits with code 2 and
writes nothing: every flag, the model and the output locations are checked before the bag is read, existing
outputs are replaced only with ``--force``, and the outputs appear all at once when the run succeeds.

Exit codes: 0 identified and the checks passed; 3 identified and written, but the result is not to be trusted
as it stands (the model check found a mismatch, the fit predicts the held-out windows worse than the nominal, or
the actuated strings' other stiffness law predicts the recording better): the last lines say which; 2 bad input
(nothing written).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from ..health import EXIT_DEGRADED        # identified and written, but a check failed (the demo's code too)
from . import UserError
from ._common import (add_force_argument, atomic_output, check_output_target, finite, load_mocap_frame, load_model,
                      progress_bar)


def add_arguments(parser) -> None:
    parser.epilog = ("exit codes: 0 identified, the model, held-out and string-law checks passed; 3 identified and written, but "
                     "a check failed (model mismatch, worse than the nominal on held-out windows, or the other "
                     "string law predicts better: the last lines say which); 2 bad input, nothing written")
    parser.add_argument("bag", nargs="+",
                        help="rosbag2 directory (MCAP or sqlite3); several: recordings of the same robot, fitted "
                             "jointly with one parameter set (each bag keeps its own time base, mocap registration "
                             "and labelling; each one's residual is reported)")
    parser.add_argument("--model", required=True, help="structure file (YAML) of the recorded robot")
    parser.add_argument("--out", required=True,
                        help="where to write the identified structure file (YAML); missing folders are created; an "
                             "existing non-empty file is refused unless --force")
    parser.add_argument("--report", help="folder for plots, a parameter table and summary.json (default: no report); "
                                         "an existing non-empty folder is refused unless --force")
    parser.add_argument("--truth", default="auto",
                        help="structure file holding the TRUE parameters of the recorded robot (a simulation's "
                             "true_model.yaml or truth.yaml): the report then gives each parameter's error and "
                             "whether the truth lies inside +-2 sigma. auto (default): a true_model.yaml or truth.yaml "
                             "beside the bag folder(s), when every bag has one and they agree; none: no truth")
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
                             "--longer-windows 1.0:auto:10 (the last rung stops when converged). Long windows see "
                             "damping and masses far better but need a start near the answer; the ladder gets "
                             "there (manipulator bench, three seeds: 0.8-2.9 %% median error instead of 1.9-4.5 %% "
                             "with one longer stage). ITERS is a cap: a rung stops earlier when converged. COUNT "
                             "'auto': 2 windows per 3 recorded seconds, at least 8 (a longer recording is used, "
                             "at a cost linear in its length)")
    parser.add_argument("--noise-mm", type=float, default=1.0, help="marker noise of the recording, std [mm]")
    parser.add_argument("--prior-std", default="stiffness=0.2,damping=0.2,mass=0.2,rest_length=0.003",
                        help="the model file's uncertainty: Gaussian prior of stage 2 around it, per kind "
                             "(relative, as a fraction or in %%, e.g. mass=2%% for weighed bars; rest_length in m); "
                             "a mass prior sets the overall scale (absolute values with their std), no mass prior "
                             "holds the nominal total mass fixed (ratios reported); 'none' = no prior. A bar's "
                             "mass_std in the structure file (kg, or %% of its mass) replaces mass= for that bar")
    parser.add_argument("--holdout", type=float, default=0.1,
                        help="fraction of the recording set aside, in 0.2-s windows spread over it, to check at the "
                             "end that the fit predicts better than the nominal model (0: no check)")
    parser.add_argument("--bridge-occlusions", action="store_true",
                        help="let a fitting window start where a marker is missing: its state from the node's "
                             "neighbours, or the start moved past a longer dropout (for heavily occluded "
                             "recordings; off by default, docs/identification.md 'Window starts under occlusion')")
    parser.add_argument("--law-check", action=argparse.BooleanOptionalAction, default=True,
                        help="after the fit, refit with the actuated strings' other stiffness_law (cord <-> spring) "
                             "and say which law predicts the recording better; exit 3 when the other one does "
                             "(default: on; a refit and two scorings, a third to a half more time: 14-17 s on a 12-s "
                             "recording of the generality suite, 29 s of 114 s on the README's 16-s manipulator bag, 2 "
                             "cores; no effect without actuated strings)")
    parser.add_argument("--step-check", action=argparse.BooleanOptionalAction, default=True,
                        help="after the fit, roll it out at half the engine step; when following that would move "
                             "some estimate by more than 0.25 of its sigma, refit the last stage at half the step, "
                             "up to twice (default: on; strings that go slack need it: docs/identification.md "
                             "'The engine's step'; each refit costs about twice the last stage before it)")
    parser.add_argument("--jackknife", action="store_true",
                        help="last, refit the last stage once per window without that window (3 iterations each) "
                             "and add the spread of those fits to the standard deviations: sigma that hold where "
                             "the objective is far from quadratic (unweighed masses), at one refit per window "
                             "(off by default; docs/identification.md 'The window jackknife')")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (default: auto, cuda when present)")
    parser.add_argument("--workers", default="auto",
                        help="processes that share stage 2's windows on a Linux CPU (same result, ~1.5-1.8x faster "
                             "with 2); auto = the usable cores, at most 8")


def run(args) -> int:
    t_start = time.perf_counter()
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
    truth_file = _truth_file(args.truth, args.bag) if args.report else None        # only the report uses it
    truth = _truth(truth_file, structure, strict=args.truth.strip().lower() != "auto") if truth_file else None
    guess = invert_transform(load_mocap_frame(args.mocap_frame).matrix)  # labeller wants mocap -> structure
    out = check_output_target(args.out, "--out", args.force, kind="file")
    report = None
    if args.report:
        report = check_output_target(args.report, "--report", args.force, kind="dir",
                                     inputs=(*args.bag, args.model, args.mocap_frame))
        if report == out or report in out.parents:
            raise UserError(f"--out {args.out}: inside the --report folder {args.report}, which is written as a "
                            "whole; write the structure file beside it")
    topics = TopicNames(motor_states=args.motor_topic, markers=args.markers_topic,
                        motor_commands=args.commands_topic)
    bags = list(args.bag)
    _check_bags(bags)
    several = len(bags) > 1
    # ---- each bag: read, then markers -> labelled node states (the live node's code path) ---------------
    # every bag keeps its own time base, its own registration of the mocap frame and its own labelling; the
    # parameters are one set for all of them
    recs, datasets = [], []
    for k, bag in enumerate(bags):
        where = f" (bag {k + 1} of {len(bags)}; every bag must record the robot of --model: identify other robots " \
                "separately, or leave this bag out)" if several else ""
        try:
            rec = read_robot_bag(bag, topics, required_actuators=[a.name for a in structure.actuators] or None)
        except BagError as err:
            raise UserError(f"{err}{where}") from err
        print(f"bag {bag}: {len(rec.marker_times)} mocap frames, {len(rec.motor_times)} motor samples, "
              f"{rec.duration_s:.1f} s")
        config = IngestConfig(labeller=LabellerConfig(initial_transform=guess))
        t0 = time.perf_counter()
        try:
            with progress_bar(len(rec.markers), "labelling markers") as bar:
                series = ingest_markers(structure, rec.marker_times, _tick(rec.markers, bar), config)
        except MocapError as err:
            raise UserError(f"{bag}: topic {topics.markers}: the markers never match the structure "
                            f"'{structure.name}': {err}{where}") from err
        n_valid = int(series.valid.sum())
        if n_valid == 0:
            raise UserError(f"{bag}: topic {topics.markers}: no marker frame matched the structure "
                            f"'{structure.name}' (check --model and --mocap-frame){where}")
        print(f"labelled {series.valid.mean():.1%} of node samples in {time.perf_counter() - t0:.1f} s")
        recs.append(rec)
        datasets.append(_dataset(structure, series, rec, name=str(bag) if several else None))
    if several:
        print(f"fitting one parameter set to {len(bags)} recordings ({sum(r.duration_s for r in recs):.1f} s in "
              f"all; --windows {args.windows} and --longer-windows count windows over all of them)")

    weighed = [b for b in structure.bars if b.mass_std is not None]
    if weighed:
        rest = (f"the other {len(structure.bars) - len(weighed)}: --prior-std mass="
                f"{prior_std['mass']:g}" if "mass" in prior_std else "the others: no mass prior") \
            if len(weighed) < len(structure.bars) else "all bars"
        print(f"mass prior from {args.model}: mass_std of {len(weighed)} bar(s) ("
              + ", ".join(f"{b.name} {b.mass_std * 1e3:.3g} g" for b in weighed[:6])
              + (", ..." if len(weighed) > 6 else "") + f"); {rest}")
    options = IdentifyOptions.from_flat(estimate=estimate, refine_kinds=refine_kinds,
                                        estimate_delay=args.estimate_delay, max_iter=args.max_iter,
                                        max_time_s=max_time, window_s=window, max_windows=args.windows,
                                        noise_std_m=noise_mm * 1e-3, prior_std=prior_std, longer_windows=longer,
                                        device=args.device, workers=workers, heldout_check=holdout > 0,
                                        heldout_fraction=holdout or 0.1,
                                        law_check=args.law_check and "refine" in stages,
                                        set_aside_outlying=True, bridge_start_gaps=args.bridge_occlusions,
                                        step_check=args.step_check, jackknife=args.jackknife)
    iters = args.max_iter + sum(it for _, _, it in longer)
    with progress_bar(iters if "refine" in stages else 1, "identifying") as bar:
        last = {"iteration": None}

        def tick(info) -> None:
            # returns None on purpose: a callback returning True stops stage 2, and tqdm's update() returns
            # True whenever it redraws (which stopped runs after ~2 iterations). One tick per LM iteration: the
            # callback also reports each run's starting point (iteration 0) and every chord step.
            if info.get("event") == "start":          # a step after the fit: say what runs now
                (bar.write if hasattr(bar, "write") else print)(f"{info.get('what', info['stage'])} ...")
                if info.get("iterations"):             # a step with iterations of its own (the jackknife's refits)
                    bar.total = bar.n + int(info["iterations"])
                    bar.refresh()
                return
            if info.get("stage") == "regression":
                return
            it = info.get("iteration")
            if it and it != last["iteration"]:
                bar.update(1)
            last["iteration"] = it

        result = identify(structure, datasets if several else datasets[0], stages=stages, options=options,
                          callback=tick)
    source = ", ".join(bags)
    if not result.ok:
        raise UserError(f"{source}: identification failed: {result.error}")
    print(result.summary())

    identified = _checked(apply_to_structure(structure, result.params, result.std_devs), source)
    duration = " + ".join(f"{r.duration_s:.1f}" for r in recs)
    header = (f"Identified by `tensegrity identify` from {source} ({duration} s); "
              f"residual RMS {result.residual_rms_m * 1e3:.2f} mm; converged={result.converged}; "
              f"{result.model_mismatch.status if result.model_mismatch is not None else 'model_not_checked'}.\n"
              f"Values are in place; std_devs holds their standard deviations.")
    with ExitStack() as outputs:                    # both appear at the end, or neither does
        out_tmp = outputs.enter_context(atomic_output(out, "file", args.force, "--out"))
        rep_tmp = outputs.enter_context(atomic_output(report, "dir", args.force, "--report")) if report else None
        rms_mm = _write_report(rep_tmp, structure, identified, recs, datasets, result, prior_std=prior_std,
                               truth=truth) if report else None
        dump_structure(identified, out_tmp, header=header)
    if report:
        print(f"report: {args.report} (1-s prediction RMS {rms_mm:.1f} mm)")
    print(f"wrote {args.out}")
    print(time_line(result.timings, time.perf_counter() - t_start, sum(r.duration_s for r in recs)))
    for line in verdict_lines(result):
        print(line)
    failed = degraded_reasons(result)
    if failed:
        print(f"identify: DEGRADED (exit {EXIT_DEGRADED}): {'; '.join(failed)}; {args.out} is written, but check "
              f"the model and the recording before using it")
        return EXIT_DEGRADED
    return 0


#: identify's stages as the time line names them (``IdentifyResult.timings`` keys), with how to skip the optional ones
_TIMED = (("refine", "stage 2"), ("string_law", "string-law check (--no-law-check skips it)"),
          ("jackknife", "jackknife"), ("covariance", "standard deviations"),
          ("engine_step_refits", "engine-step refits"), ("held_out", "held-out check"), ("model_check", "model check"),
          ("regression", "stage 1"))


def time_line(timings, wall_s: float, recorded_s: float) -> str:
    """Where identify's wall time went, against the recording's length (issue 20 asks for identification in real
    time, <= 1x): the stages over 0.5 s, largest first, and the rest (reading the bags, labelling the markers,
    the report)."""
    parts = sorted(((float(timings[k]), name) for k, name in _TIMED if float(timings.get(k, 0.0)) >= 0.5),
                   reverse=True)
    rest = wall_s - sum(t for t, _ in parts)
    ratio = f" ({wall_s / recorded_s:.1f}x real time)" if recorded_s > 0 else ""
    return (f"time: {wall_s:.0f} s for {recorded_s:.1f} s of recording{ratio}: "
            + ", ".join(f"{name} {t:.0f} s" for t, name in parts)
            + f", the rest (reading, labelling, report) {max(rest, 0.0):.0f} s")


def degraded_reasons(result):
    """Why the identified set is not to be trusted as it stands (empty: the checks passed or did not run)."""
    mm, ho = result.model_mismatch, result.held_out
    out = []
    if mm is not None and mm.mismatch:
        out.append(f"model mismatch ({mm.status})")
    if ho is not None and ho.verdict == "worse":
        out.append("the fit predicts the held-out windows worse than the nominal")
    if result.string_law is not None and result.string_law.mismatch:
        out.append("the other string law predicts the recording better")
    return out


def verdict_lines(result):
    """The last lines a person sees: the model check, the held-out check and the string-law check, loud when they
    fail; the engine step when the last rung had to be refitted at a shorter one (or still moves the fit)."""
    lines = []
    mm, ho = result.model_mismatch, result.held_out
    if mm is not None:
        lines.append(("WARNING: " if mm.mismatch else "") + mm.line())
    if ho is not None:
        lines.append(("WARNING: " if ho.verdict == "worse" else "") + ho.line())
    if result.string_law is not None:
        lines.append(("WARNING: " if result.string_law.mismatch else "") + result.string_law.line())
    st = result.engine_step
    if st is not None and (not st.ok or len(st.steps_s) > 1):        # refitted at a shorter step, or still too long
        lines.append(("WARNING: " if not st.ok else "") + st.line())
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
    """'0.3:24:3' -> (0.3, 24, 3): window length [s], window count (or 'auto': from the recorded time),
    Levenberg-Marquardt iterations."""
    try:
        ws, nw, it = text.split(":")
        stage = (float(ws), "auto" if nw.strip().lower() == "auto" else int(nw), int(it))
    except ValueError:
        raise UserError(f"--longer-windows {text!r}: expected SECONDS:COUNT:ITERS, e.g. 0.3:24:3 or 1.0:auto:10") \
            from None
    if not (stage[0] > 0 and (stage[1] == "auto" or stage[1] >= 1) and stage[2] >= 0):
        raise UserError(f"--longer-windows {text!r}: need SECONDS > 0, COUNT >= 1 or auto, ITERS >= 0")
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


def _truth_file(flag: str, bags):
    """The --truth file: a path, ``none``, or ``auto`` (a true_model.yaml / truth.yaml beside every bag, the same
    file content for all of them; otherwise no truth)."""
    if flag.strip().lower() == "none":
        return None
    if flag.strip().lower() != "auto":
        if not Path(flag).is_file():
            raise UserError(f"--truth {flag}: no such file; pass the true robot's structure file (a simulation's "
                            "true_model.yaml), or none")
        return Path(flag)
    found = []
    for bag in bags:
        parent = Path(bag).absolute().parent
        cand = [parent / n for n in ("true_model.yaml", "truth.yaml") if (parent / n).is_file()]
        if not cand:
            return None
        found.append(cand[0])
    texts = {f.read_bytes() for f in found}
    return found[0] if len(texts) == 1 else None


def _truth(path: Path, structure, strict: bool = True):
    """{name: true value} from the structure file ``path``; it must describe the same elements as --model (else
    exit 2 when given with --truth; found by ``auto``: a note, and no truth)."""
    from ..engine import params_from_structure
    from ..model import StructureError, load_structure

    try:
        true = load_structure(path)
        values = {n: float(v) for n, v in params_from_structure(true).named().items()}
        names = list(params_from_structure(structure).named())
        if list(values) != names:
            odd = sorted(set(values) ^ set(names))[:4]
            raise UserError(f"--truth {path}: not the structure of --model (parameters differ, e.g. "
                            f"{', '.join(odd)}); pass the true model of this robot, or --truth none")
    except (StructureError, UserError) as err:
        if strict:
            raise UserError(f"--truth: {err}" if isinstance(err, StructureError) else str(err)) from err
        print(f"truth: {path} beside the bag is not used ({err})")
        return None
    print(f"truth: {path} (the report gives each parameter's error; --truth none to leave it out)")
    return values


def _check_bags(bags) -> None:
    """Several bags: each given once and each there, before any is read (a typo fails before minutes of work)."""
    if len(bags) < 2:
        return                      # one bag: read_robot_bag's own errors, as always
    seen = {}
    for k, bag in enumerate(bags):
        key = Path(bag).resolve()
        if key in seen:
            raise UserError(f"{bag}: given twice (bags {seen[key] + 1} and {k + 1}); give each recording once")
        seen[key] = k
    for k, bag in enumerate(bags):
        if not Path(bag).exists():
            raise UserError(f"{bag}: no such bag (bag {k + 1} of {len(bags)}: expected a rosbag2 directory with "
                            "metadata.yaml); check the path, or leave it out")


def _dataset(structure, series, rec, name=None):
    """Node states on structure node order (virtual nodes left invalid) with motor angles at mocap stamps."""
    from ..ident import make_dataset
    from ..ident.data import resample_motor_angles

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
        angles = resample_motor_angles(series.t[keep], rec.motor_times, rec.motor_angles[:, order])
    return make_dataset(series.t[keep], positions[keep], valid[keep], angles, node_names=structure.node_names,
                        actuator_names=tuple(a.name for a in structure.actuators),
                        name=name or Path(rec.path).name)


def _write_report(*args, **kwargs) -> float:
    """:func:`_report` with torch on one thread, as identification runs: its small batched rollouts ran 6.7x slower
    on two threads (5.4 s against 0.8 s for a 6-s bag) and took 205 s when another process held the second core
    (measured on this project's 2-core machine)."""
    from ..engine._common import torch_threads

    with torch_threads(1):
        return _report(*args, **kwargs)


def _report(tmp: Path, structure, identified, recs, datasets, result, *, prior_std=None, truth=None,
            say=print) -> float:
    """Plots, parameter tables and summary.json into the (temporary, see atomic_output) folder ``tmp``; returns
    the 1-s prediction RMS error [mm] over all recordings. ``truth``: {name: true value} or None; ``say`` gets one
    line per step (the report takes a while on long recordings: a person sees where it is)."""
    from ..engine import params_from_structure
    from ..engine.params import UNITS
    from ..ident.heldout import prior_std_of
    from ..ident.pipeline import structure_prior_std
    from ..metrics import rms_error
    from ..report import (moving_nodes, parameter_rows, plate_motion, plot_convergence, plot_node_motion,
                          plot_plate_motion, plot_residuals, rows_csv, rows_markdown, rows_text)
    from ..report.prediction import horizon_prediction

    several = len(datasets) > 1
    steps = len(datasets) + 3
    step = iter(range(1, steps + 1))
    names, times, per_frames, errs, per_rec = [], [], [], [], []
    for k, (rec, dataset) in enumerate(zip(recs, datasets)):
        t0 = time.perf_counter()
        label = f"{rec.path}" + (f" (recording {k + 1})" if several else "")
        say(f"report [{next(step)}/{steps}]: 1-s predictions of {label} ({dataset.duration:.1f} s) ...")
        pred = horizon_prediction(identified, dataset, horizon_s=1.0)
        measured = plate_motion(structure.node_names, dataset.positions)
        predicted = plate_motion(structure.node_names, pred)
        t_rel = dataset.times - dataset.times[0]              # a bag's stamps are epoch seconds
        suffix = f"-{k + 1}" if several else ""
        head = (f"{structure.name}, {rec.path if several else Path(rec.path).name}: measured vs the identified "
                "model (restarted from the measurement every 1 s)")
        if not plot_plate_motion(t_rel, {"measured": (t_rel, measured), "predicted 1 s ahead": (t_rel, predicted)},
                                 tmp / f"plates{suffix}.png", relative_to_start=True, title=head):
            # a structure without the manipulator's plates (every lab's own robot): its most-moving nodes
            shown = moving_nodes(structure.node_names, dataset.positions, structure.fixed_nodes)
            plot_node_motion(t_rel, {"measured": dataset.positions, "predicted 1 s ahead": pred},
                             structure.node_names, shown, tmp / f"nodes{suffix}.png", title=head)
        err = np.linalg.norm(pred - dataset.positions, axis=2)
        err = np.where(dataset.valid & np.isfinite(err), err, np.nan)
        per_frame = rms_error(err, axis=1, skip_missing=True)
        names.append(Path(rec.path).name if not several else f"{k + 1}: {rec.path}")
        times.append(dataset.times)
        per_frames.append(1e3 * per_frame)
        errs.append(err[np.isfinite(err)])
        per_rec.append({"bag": str(rec.path), "duration_s": rec.duration_s,
                        "prediction_1s_rms_mm": 1e3 * rms_error(err, skip_missing=True)})
        say(f"        {per_rec[-1]['prediction_1s_rms_mm']:.2f} mm RMS ({time.perf_counter() - t0:.1f} s)")
    say(f"report [{next(step)}/{steps}]: residual and convergence plots ...")
    verdicts = verdict_lines(result)
    # a node's 3-D error against markers with noise sigma per coordinate is at least sqrt(3) sigma
    mm = result.model_mismatch
    floor = math.sqrt(3.0) * 1e3 * mm.noise_std_m if mm is not None else None
    plot_residuals(times if several else times[0], per_frames if several else per_frames[0], tmp / "residuals.png",
                   label="1-s prediction node RMS error", title=" | ".join(verdicts), names=names if several else None,
                   noise_floor_mm=floor)
    plot_convergence([{**h["params"], "loss": h["loss"]} for h in result.history if "params" in h],
                     tmp / "convergence.png", x_label="loss evaluation (all stage-2 runs in order)",
                     truth=truth, title=f"{structure.name}: parameter convergence "
                                        f"({'against the truth' if truth else 'relative to the final values'})")
    say(f"report [{next(step)}/{steps}]: parameter tables ...")
    prior = {n: float(v) for n, v in params_from_structure(structure).named().items()}
    values = result.values()
    widths = structure_prior_std(structure, prior_std or {})          # the file's per-bar mass_std included
    psd = {n: prior_std_of(n, prior.get(n, float("nan")), widths) for n in values}
    status = {}
    for n in values:
        status[n] = ("kept at the prior" if n in result.prior_dominated else "not determined" if n in
                     result.undetermined else "estimated" if n in result.std_devs else "fixed")
    rows = parameter_rows(values, result.std_devs, prior=prior,
                          prior_std={n: v for n, v in psd.items() if v is not None}, truth=truth,
                          identifiability=result.identifiability, status=status, units=UNITS)
    (tmp / "parameters.csv").write_text(rows_csv(rows))
    md = [f"# {structure.name}: identified parameters", "",
          f"From {', '.join(str(r.path) for r in recs)}. Every parameter of the model: its prior (the structure "
          "file's value ± 2 prior σ), the identified value ± 2σ (σ: the calibrated standard deviation), how it was "
          "treated" + (", and its error against the truth." if truth else "."), "",
          *[f"- {line}" for line in verdicts], ""]
    if several:
        md += [f"- {line}" for line in result.recording_lines()] + [""]
    md.append("")
    (tmp / "parameters.md").write_text("\n".join(md) + rows_markdown(rows))
    (tmp / "parameters.txt").write_text("\n".join(verdicts) + "\n\n" + result.summary() + "\n\n" + rows_text(rows)
                                        + "\n")
    say(f"report [{next(step)}/{steps}]: summary.json")
    allerr = np.concatenate(errs) if errs else np.array([])
    summary = {**result.to_dict(), "bag": str(recs[0].path) if not several else [str(r.path) for r in recs],
               "duration_s": recs[0].duration_s if not several else sum(r.duration_s for r in recs),
               "prediction_1s_rms_mm": 1e3 * rms_error(allerr),
               "parameters": rows}
    if several:
        for r, entry in zip(result.recordings or [{}] * len(per_rec), per_rec):
            entry.update({k: v for k, v in r.items() if k != "name"})
        summary["recordings"] = per_rec
    if truth:
        summary["truth_inside_2sigma"] = _inside_fraction(rows)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary["prediction_1s_rms_mm"]


def _inside_fraction(rows):
    """Of the estimated parameters with a truth: how many lie inside their +-2 sigma."""
    judged = [r["truth_inside_2sigma"] for r in rows if r["status"] == "estimated" and r["truth_inside_2sigma"]
              is not None]
    return {"inside": int(sum(judged)), "of": len(judged)}
