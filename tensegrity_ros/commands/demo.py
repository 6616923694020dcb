"""`tensegrity demo [--duration S] [--out build/demo]`: the whole hardware-in-the-loop graph against the
simulated robot, in one process (:mod:`tensegrity_ros.bringup`).

The driver drives the phase-shifted sinusoids through the emulated Dynamixel bus (real SDK, pty); the MuJoCo
twin of the TRUE robot (the nominal model's stiffnesses and dampings ~20 % off) moves with the emulated
motors; unlabelled markers stream at 120 Hz; the ingest labels them; the identifier re-identifies its 10-s
window whenever its worker is free, starting from the nominal model, and accepts only sets that predict the
newest 3 s (held out of the fit) significantly better; the predictor publishes a 1-s horizon at every
node-state message. A progress line shows the identified-vs-true parameter error, the 1-s prediction error
and the loop rates.

Every run ends with ``HEALTHY`` or ``DEGRADED: <reasons>`` (figures against config/health.yaml: delivery
against rate x duration, predictions per node state, real-time factor, identifier update period, prediction
latency, sets worse than the one they replaced) and exits 0 or 3 (2: bad input).

Writes to ``--out`` (a temporary sibling, renamed when complete): ``summary.json`` (health, delivery,
median_param_error_pct, prediction_rmse_mm, the predictor's realized error, latencies, rates, ...),
``report.md`` with ``parameter_convergence.png`` and ``plates_predicted_vs_measured.png``, ``true_model.yaml``
/ ``identified_model.yaml``, and ``bag/`` (MCAP, the monitored topics; predictions at 10 Hz).
"""
from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from . import UserError
from ..health import EXIT_DEGRADED, format_value
from ..machine_load import describe as describe_load
from ..metrics import rms_error
from ..param_names import kind_of
from ..paths import CONFIG_DIR

#: the niceness the demo asks for: the simulated robot (twin, emulated bus, driver: what a real robot does in
#: hardware) and the graph's callbacks at one level, above the predictor's relinearisation worker (-5,
#: config/nodes/state_predictor.yaml) and the identifier's (5) and anything else on the machine. With the graph
#: at -5, level with the predictor's worker, each 1-s relinearisation burst competed with the per-message
#: predictions: HEALTHY in 5 of 11 `make demo` runs, failing on latency p99 (20.9-24.1 ms); at -10, 3 of 3
ROBOT_NICE, GRAPH_NICE = -10, -10
#: with --realtime, SCHED_FIFO too: the simulated robot's simulation thread above the state predictor's own
#: executor thread (bringup.REALTIME_NODES), both above everything at a niceness. Not the default: on stop 44's
#: 2-core machine it took the latency p99 from 21-23 ms to 6-10 ms in one hour and made it worse in the next
#: (41-742 ms, against 12-28 ms without); docs/nodes.md, "Real-time scheduling"
SIMULATION_RT_PRIORITY, PREDICTOR_RT_PRIORITY = 20, 10
#: written into --out, so that the next `make demo` may replace the folder without --force
MARKER = ".tensegrity-demo-output"


def add_arguments(parser) -> None:
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds of robot motion (default 120; measured on 2 cores, 2026-12-02: the first "
                             "identified set accepted after 35-62 s, identifier updates 2.4-4.4 s apart, p50)")
    parser.add_argument("--out", default="build/demo",
                        help="output folder (default build/demo). A folder that holds an earlier demo's output is "
                             "replaced; any other non-empty folder is refused (exit 2) unless --force. Written to a "
                             "temporary sibling and renamed when complete")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty --out that is not an earlier demo's output (default: refuse)")
    parser.add_argument("--no-priority", dest="priority", action="store_false",
                        help="do not raise the simulated robot's and the graph's priority (default: niceness "
                             f"{ROBOT_NICE} and {GRAPH_NICE}; the predictor's worker runs at -5, the identifier's at 5; "
                             "needs root, CAP_SYS_NICE or `ulimit -e`, else the run goes on and says so)")
    parser.add_argument("--realtime", action="store_true",
                        help=f"also run the simulation thread under SCHED_FIFO {SIMULATION_RT_PRIORITY} and the state "
                             f"predictor's callbacks on an executor thread of their own under SCHED_FIFO "
                             f"{PREDICTOR_RT_PRIORITY} (default: off; it helped the latency in one hour of this "
                             "2-core machine and hurt it in the next, docs/nodes.md; needs root, CAP_SYS_NICE or "
                             "`ulimit -r`, else the run goes on and says so)")
    parser.add_argument("--model", default=str(CONFIG_DIR / "models" / "stacked_manipulator.yaml"),
                        help="nominal structure YAML")
    parser.add_argument("--reference",
                        default=str(CONFIG_DIR / "references" / "seed_sinusoids_continuous.yaml"),
                        help="reference the driver runs (default: the seed drive without an end)")
    parser.add_argument("--perturb", type=float, default=0.2,
                        help="spread of the true robot's stiffnesses and dampings around the nominal (default 0.2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the true robot's perturbation")
    parser.add_argument("--no-bag", action="store_true", help="do not record the MCAP bag")
    parser.add_argument("--controller", action="store_true",
                        help="close the loop (tensegrity_ros/commands/demo_control.py): --duration s of identification "
                             "on the sinusoids, then the plate_controller tracks a circle + tilt step with the "
                             "identified model and, paired, with the nominal one; summary.json gains a control block")
    parser.add_argument("--one-process", dest="robot_process", action="store_false",
                        help="run the simulated robot (twin, emulated bus, driver) in the graph's own process "
                             "too (default: a child process, like a real robot's separate driver)")
    parser.add_argument("--visualizer", action="store_true",
                        help="also run the visualizer node (/tensegrity/markers for RViz; default: off, there is "
                             "no RViz without ROS and on 2 cores its CPU comes out of the prediction latency)")
    parser.add_argument("--predictor-process", action="store_true",
                        help="run the state predictor in a process of its own, as `ros2 launch` does (default: "
                             "in the graph's process: on 2 cores the extra process costs CPU that the identifier "
                             "needs; HEALTHY in 5 of 12 runs, docs/nodes.md)")


# =====================================================================================================
# scoring (pure)
# =====================================================================================================
def parameter_errors(values: Mapping[str, float], truth: Mapping[str, float], names: Sequence[str]) -> Dict[str, float]:
    """|value / truth - 1| in % for ``names`` (those present in both)."""
    return {n: 100.0 * abs(float(values[n]) / float(truth[n]) - 1.0) for n in names
            if n in values and n in truth and truth[n]}


def prediction_errors(predictions, gt_times: np.ndarray, gt_positions: np.ndarray, gt_names: Sequence[str]):
    """Each prediction against what the twin then did.

    predictions: :class:`~tensegrity_ros.nodes._common.Prediction` records; gt_times (T,), gt_positions
    (T, N, 3) structure frame. Only predictions whose whole horizon lies within the ground truth are scored.
    Returns (stamps (P,), rms (P,) m over horizon and nodes, end (P,) m at the last step).
    """
    gt_times = np.asarray(gt_times, dtype=float)
    idx = {n: i for i, n in enumerate(gt_names)}
    stamps, rms, end = [], [], []
    for p in predictions:
        t = p.times
        if t.size == 0 or t[0] < gt_times[0] or t[-1] > gt_times[-1]:
            continue
        cols = [idx[n] for n in p.node_names if n in idx]
        keep = [k for k, n in enumerate(p.node_names) if n in idx]
        j = np.clip(np.searchsorted(gt_times, t) - 1, 0, gt_times.size - 2)
        w = ((t - gt_times[j]) / (gt_times[j + 1] - gt_times[j]))[:, None, None]
        truth = (1 - w) * gt_positions[j][:, cols] + w * gt_positions[j + 1][:, cols]
        err = np.linalg.norm(p.positions[:, keep] - truth, axis=-1)          # (K, n)
        stamps.append(p.stamp)
        rms.append(rms_error(err))
        end.append(rms_error(err[-1]))
    return np.array(stamps), np.array(rms), np.array(end)


def _pct(stats, q, scale=1e3):
    v = stats.values()
    return float(np.percentile(v, q) * scale) if v.size else math.nan


# =====================================================================================================
# the run
# =====================================================================================================
class Progress:
    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def line(self, text: str, final: bool = False) -> None:
        if self.tty:
            sys.stderr.write("\r" + text[:200].ljust(200) + ("\n" if final else ""))
        elif final or time.monotonic() - self.last >= 5.0:
            sys.stderr.write(text + "\n")
            self.last = time.monotonic()
        sys.stderr.flush()


def status_line(graph, truth, est_names, t0_ros, elapsed, nominal_err) -> Tuple[str, Dict[str, float]]:
    mon = graph.monitor
    nodes = graph.nodes
    ps = mon.parameter_sets[-1] if mon.parameter_sets else None
    errs = parameter_errors(ps.as_dict(), truth, est_names) if ps else {}
    perr = float(np.median(list(errs.values()))) if errs else math.nan
    kinds = ", ".join(f"{k} {v:.1f}%" for k, v in _by_kind(errs).items())
    # the latest dozen whose 1-s horizon the ground truth already covers (the newest ones reach into the future:
    # taking the last dozen of all printed "nan" all run long): this line runs in the graph's process every few
    # seconds; scoring 60 it took 29 ms p50 of wall time there (measured), and the predictor's latency tail felt it
    latest = mon.ground_truth[-1][0] if mon.ground_truth else -math.inf
    # (last_time, not times[-1]: 400 aranges took 1.9 ms of the graph's process per line, this 0.15 ms)
    preds = [p for p in itertools.islice(reversed(list(mon.predictions)), 400)
             if p.last_time <= latest][:12][::-1]
    # only the ground truth these predictions can be scored on (from the first one's stamp): stacking the whole
    # run's truth every second grew with the run (quadratic) and took a tenth of the graph process by 45 s
    since = preds[0].stamp - 0.1 if preds else math.inf
    # list() first: the executor thread appends while this runs, and a deque iterated from Python across
    # that ("deque mutated during iteration") ended a demo with a traceback; list() copies it at once
    gt = list(itertools.takewhile(lambda g: g[0] >= since, reversed(list(mon.ground_truth))))[::-1]
    pe = math.nan
    if preds and len(gt) > 10:
        t = np.array([g[0] for g in gt])
        P = np.stack([g[1] for g in gt])
        _, rms, _ = prediction_errors(preds, t, P, graph.true_structure.node_names)
        pe = float(np.median(rms) * 1e3) if rms.size else math.nan
    drv = graph.robot_stats()["driver"]
    ing = nodes["mocap_ingest"]
    idn = nodes["online_identifier"]
    motor_hz = drv.get("loop_rate_hz", math.nan)
    vals = {"t": elapsed, "param_err": perr, "pred_err": pe, "mocap_hz": ing.rate.rate(), "motor_hz": motor_hz,
            "lat_p50": graph.predictor_latency_recent_ms(), "accepted": idn.stats["accepted"], "rejected": idn.stats["rejected"]}
    text = (f"t={elapsed:5.1f}s | params: median error {perr:5.1f}% vs true ({kinds}; nominal {nominal_err:.1f}%), "
            f"{idn.stats['accepted']} sets accepted, {idn.stats['rejected']} rejected | 1-s prediction error "
            f"{pe:6.2f} mm | mocap {vals['mocap_hz']:5.1f} Hz, motors {motor_hz:5.1f} Hz, "
            f"predictor p50 {vals['lat_p50']:.2f} ms")
    return text, vals


def _by_kind(errs) -> dict:
    """Median error (%) per parameter kind (the suffix of ``element.kind``)."""
    kinds = sorted({kind_of(n) for n in errs})
    return {k: float(np.median([v for n, v in errs.items() if kind_of(n) == k])) for k in kinds}


def checked_inputs(args, what: str = "demo"):
    """Validate the demo's arguments before anything starts (exit 2 through UserError): returns the nominal
    structure, the output folder and whether it may be replaced. ``tensegrity demo --controller`` shares it."""
    from ..model import StructureError, load_structure
    from ._common import check_output_target

    if not (0 < args.duration <= 3600):
        raise UserError(f"--duration = {args.duration}: must be in (0, 3600] s")
    if not 0 <= args.perturb < 0.9:
        raise UserError(f"--perturb = {args.perturb}: must be in [0, 0.9)")
    for what, f in (("--model", args.model), ("--reference", args.reference)):
        if not Path(f).is_file():
            raise UserError(f"{what} {f}: no such file")
    try:
        nominal = load_structure(args.model)
    except StructureError as e:
        raise UserError(str(e)) from e
    if not nominal.actuators:
        raise UserError(f"{args.model}: the {what} needs an actuated structure (no actuators)")
    previous_demo = (Path(args.out) / MARKER).is_file()
    force = args.force or previous_demo
    out = check_output_target(args.out, "--out", force=force, kind="dir")
    return nominal, out, force


def demo_nodes(args, nodes):
    """``nodes`` less the visualizer unless ``--visualizer``."""
    return tuple(n for n in nodes if n != "visualizer" or args.visualizer)


def priority_fields(raise_priorities: bool = True, realtime: bool = False) -> dict:
    """The GraphConfig fields of the demo's priorities (``--no-priority``: none; ``--realtime``: SCHED_FIFO too);
    bench_graph.py shares them."""
    if not raise_priorities:
        return {}
    rt = dict(robot_rt_priority=SIMULATION_RT_PRIORITY, executor_rt_priority=PREDICTOR_RT_PRIORITY) if realtime else {}
    return dict(robot_nice=ROBOT_NICE, graph_nice=GRAPH_NICE, **rt)


def graph_config(args, **fields):
    """The demo's GraphConfig from its arguments (``fields`` on top: nodes, overrides, ...)."""
    from ..bringup import DEFAULT_NODES, GraphConfig
    from ..nodes.topics import TOPICS

    values = dict(nodes=demo_nodes(args, DEFAULT_NODES), model_file=args.model, reference_file=args.reference, perturb_fraction=args.perturb,
                  overrides={"sim_robot": {"perturb_seed": int(args.seed)}}, robot_process=args.robot_process,
                  predictor_process=args.predictor_process,
                  record_topics=None if args.no_bag else ["*"],
                  record_every={"/tensegrity/predicted_states": 12},
                  keep_predictions_every=6,
                  # the plate poses follow from the node states (same callback): 240 callbacks/s less
                  monitor_skip=(TOPICS["plate_c1"], TOPICS["plate_c2"]),
                  **priority_fields(args.priority, args.realtime))
    values.update(fields)
    return GraphConfig(**values)


def scoring_baseline(graph, nominal):
    """What a demo scores against: (the true structure, its parameter values by name, the nominal's values, the
    names of the kinds the identifier estimates, the nominal's median error over them in %)."""
    from ..engine import params_from_structure

    true_structure = graph.true_structure
    truth = {n: float(v) for n, v in params_from_structure(true_structure).named().items()}
    nom = {n: float(v) for n, v in params_from_structure(nominal).named().items()}
    estimate = graph.nodes["online_identifier"].p["estimate"]
    est_names = [n for n in nom if kind_of(n) in estimate]
    nominal_err = float(np.median(list(parameter_errors(nom, truth, est_names).values())))
    return true_structure, truth, nom, est_names, nominal_err


def run(args) -> int:
    if getattr(args, "controller", False):
        from .demo_control import run as run_controller

        return run_controller(args)
    from ..bringup import build_graph, drain, stop_sources
    from ._common import atomic_output

    nominal, out, force = checked_inputs(args)
    cfg = graph_config(args)
    import signal

    def _on_signal(signum, frame):    # SIGTERM ends the run like Ctrl-C: the graph is shut down, torque off
        raise KeyboardInterrupt
    # SIGINT too, explicitly: a demo started in the background of a script inherits SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    progress = Progress()
    sys.stderr.write(f"tensegrity demo: starting the graph ({nominal.name}, worker processes warm up ~10 s)...\n")
    graph = build_graph(cfg)
    try:
        true_structure, truth, nom, est_names, nominal_err = scoring_baseline(graph, nominal)
        graph.spin_in_background()
        t0 = time.monotonic()
        t0_ros = graph.nodes["online_identifier"].now_s()
        history = []
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= args.duration:
                break
            time.sleep(min(1.0, args.duration - elapsed))
            faults = graph.faults()
            if faults:
                raise UserError(f"stopped: {faults}")
            text, vals = status_line(graph, truth, est_names, t0_ros, time.monotonic() - t0, nominal_err)
            history.append(vals)
            progress.line(text)
        duration = time.monotonic() - t0
        stop_sources(graph)
        drained = drain(graph, 20.0)
        text, vals = status_line(graph, truth, est_names, t0_ros, duration, nominal_err)
        progress.line(text, final=True)
        sys.stderr.write("tensegrity demo: writing the summary, report and bag...\n")
        with atomic_output(args.out, "dir", force=force, flag="--out") as tmp:
            summary = summarise(graph, truth, nom, est_names, nominal_err, duration, drained, t0_ros, tmp,
                                 history)
            write_report(graph, summary, truth, nom, est_names, t0_ros, tmp, nominal, true_structure)
            if not args.no_bag:
                write_bag(graph, tmp / "bag")
                summary["bag"] = str(out / "bag")
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
            (tmp / MARKER).write_text("written by `tensegrity demo`: the next demo may replace this folder\n")
    finally:
        graph.shutdown()      # before the verdict: no node logs after the last line
    health = summary["health"]
    sys.stderr.write(f"tensegrity demo: median parameter error {summary['median_param_error_pct']:.1f} % "
                     f"(nominal {nominal_err:.1f} %), 1-s prediction RMSE {summary['prediction_rmse_mm']:.2f} mm over the "
                     f"whole run, {summary['prediction_rmse_mm_second_half']:.2f} mm in its second half (the first "
                     "predicts with the nominal model until a set is accepted), "
                     f"{summary['dropped_messages']} messages not delivered ({summary['lost_messages']} lost between "
                     f"nodes, {summary['not_produced_messages']} never produced by the sources); "
                     f"wrote {out / 'summary.json'}, "
                     f"{out / 'report.md'}" + ("" if args.no_bag else f", {out / 'bag'}") + "\n")
    if summary["machine"]:
        sys.stderr.write(f"machine during the run: {describe_load(summary['machine'])}\n")
    return report_health(health)


def report_health(health: dict) -> int:
    """Print a summary's ``health`` block, one figure per line, then the verdict as the LAST line (call it after
    the graph is shut down, so that no node logs after it); returns the exit code (0 healthy, 3 degraded)."""
    for name, f in health["figures"].items():
        rel = ">=" if f["op"] == "min" else "<="
        sys.stderr.write(f"  {'ok  ' if f['pass'] else 'FAIL'} {name} = {format_value(f['value'], f['unit'])} "
                         f"(threshold {rel} {format_value(f['threshold'], f['unit'])})\n")
    sys.stderr.flush()
    print(health["verdict"] + ("" if health["healthy"] else f" (exit {EXIT_DEGRADED})"), flush=True)
    return 0 if health["healthy"] else EXIT_DEGRADED


def summarise(graph, truth, nom, est_names, nominal_err, duration, drained, t0_ros, out, history) -> dict:
    mon, nodes = graph.monitor, graph.nodes
    ps = mon.parameter_sets[-1] if mon.parameter_sets else None
    final = ps.as_dict() if ps else dict(nom)
    errs = parameter_errors(final, truth, est_names)
    gt = list(mon.ground_truth)
    t_gt = np.array([g[0] for g in gt]) if gt else np.zeros(0)
    P_gt = np.stack([g[1] for g in gt]) if gt else np.zeros((0, 0, 3))
    names = graph.true_structure.node_names
    stamps, rms, end = prediction_errors(list(mon.predictions), t_gt, P_gt, names) if gt else (np.zeros(0),) * 3
    half = stamps >= (stamps[0] + stamps[-1]) / 2 if stamps.size else np.zeros(0, bool)
    robot = graph.robot_stats()
    drv, sim = robot["driver"], robot["sim"]
    pr, idn, ing = graph.predictor(), nodes["online_identifier"], nodes["mocap_ingest"]
    queue_drops = graph.drops()
    accepted = [p for p in mon.parameter_sets if p.set_id != "nominal"]
    first_ok = (accepted[0].stamp - t0_ros) if accepted else None
    # each published set against the truth, in order (the nominal first): did an accepted set make it worse?
    set_errors = [float(np.median(list(parameter_errors(p.as_dict(), truth, est_names).values())))
                  for p in mon.parameter_sets]
    worse = sum(1 for a, b in zip(set_errors, set_errors[1:]) if b > a)
    from ..bringup import delivery, delivery_summary, graph_health

    deliv = delivery(graph, duration)
    health = graph_health(graph, duration, {"accepted_worse_than_previous": worse}, sections=("graph", "demo"))
    realized, recent = pr.realized.whole_run(), pr.realized.per_step()
    k_1s = min(int(round(1.0 / pr.dt)), realized.size) - 1
    k_01, k_05 = int(round(0.1 / pr.dt)), int(round(0.5 / pr.dt))
    return {
        "health": health.as_dict(),
        "delivery": deliv,
        "priorities": {**graph.priorities, **({"simulation_thread": robot["sim"]["realtime"]}
                                              if robot["sim"].get("realtime") else {})},
        "gc_pauses_ms": graph.gc.summary() if graph.gc is not None else {},
        # context for the health figures: a saturated machine, not only the software, sets the latency tail
        "machine": graph.load.summary() if graph.load is not None else {},
        "accepted_worse_than_previous": worse,
        "parameter_set_errors_pct": [round(e, 3) for e in set_errors],
        "duration_s": round(duration, 3),
        "median_param_error_pct": float(np.median(list(errs.values()))) if errs else math.nan,
        "nominal_param_error_pct": nominal_err,
        # per kind: in 0.1-s windows the stiffnesses are well seen and the dampings weakly
        "median_param_error_pct_by_kind": _by_kind(errs),
        "nominal_param_error_pct_by_kind": _by_kind(parameter_errors(nom, truth, est_names)),
        "param_errors_pct": {k: round(v, 3) for k, v in errs.items()},
        "identified_parameter_set": ps.set_id if ps else "nominal",
        "parameter_sets_published": len(mon.parameter_sets),
        "identifier": {**idn.stats, "update_period_s_p50": idn.update_period_p50(duration),
                       "update_s_p50": _pct(idn.update_time, 50, 1.0), "last_update_timings_s": idn.last_timings,
                       "update_s_p99": _pct(idn.update_time, 99, 1.0), "first_accepted_after_s": first_ok,
                       "last_rejection": idn.last_decision.reason if idn.last_decision and not idn.last_decision.accept else ""},
        "prediction_rmse_mm": rms_error(rms) * 1e3,
        "prediction_rmse_mm_second_half": rms_error(rms[half]) * 1e3,
        "prediction_error_at_1s_mm": rms_error(end) * 1e3,
        "predictions_scored": int(rms.size),
        "predictions_published": pr.published,
        "predictions_skipped_uncovered": pr.skipped_uncovered,
        "predictions_extended": pr.extended,
        "predictions_capped": pr.capped,    # correction held at its bound (far-off linearisation)
        # the predictor's own score (no truth): each scored prediction against the node states that came later
        # whole run, and the last ~10 s (the predictor's memory): what a controller sees at the end
        "prediction_realized_error_mm": {"at_0.1s": _mm(realized, k_01), "at_0.5s": _mm(realized, k_05),
                                         "at_1s": _mm(realized, k_1s), "scored": int(pr.realized.scored),
                                         "recent_at_0.1s": _mm(recent, k_01), "recent_at_0.5s": _mm(recent, k_05),
                                         "recent_at_1s": _mm(recent, k_1s)},
        "prediction_latency_ms": {"p50": _pct(pr.latency, 50), "p99": _pct(pr.latency, 99),
                                  "compute_p50": _pct(pr.compute, 50)},
        "predictions_per_node_state": pr.predictions_per_node_state(),
        "relinearize_ms_p50": _pct(pr.lin_time, 50),
        # every message of a rate-driven stream not delivered (expected = rate x duration), lost between nodes or
        # never produced by its source, and whether every stream was complete
        **delivery_summary(deliv, drained),
        "queue_drops": queue_drops,      # of those, the ones a subscriber saw as sequence gaps
        "messages": graph.received(),
        "rates": {"mocap_hz": ing.frames / duration if duration else math.nan,
                  "driver_loop_hz": drv.get("loop_rate_hz"), "driver_cycles": drv.get("cycles"),
                  "driver_missed_cycles": drv.get("missed_cycles"), "sim_realtime_factor": sim.get("realtime_factor"),
                  "ingest_ms_p50": _pct(ing.proc_time, 50), "ingest_ms_p99": _pct(ing.proc_time, 99)},
        "robot_process": graph.robot is not None,
        "predictor_process": graph.predictor_proc is not None,
        "progress": history,
    }


def _mm(a: np.ndarray, k: int) -> float:
    return float(a[k] * 1e3) if 0 <= k < a.size and np.isfinite(a[k]) else math.nan


def write_report(graph, summary, truth, nom, est_names, t0_ros, out: Path, nominal, true_structure) -> List[Path]:
    from ..model import dump_structure
    from ..report.figures import parameter_table, plate_motion, plot_convergence, plot_plate_motion

    mon = graph.monitor
    files = []
    dump_structure(true_structure, out / "true_model.yaml", header="The simulated robot's true parameters.")
    idn = graph.nodes["online_identifier"]
    ps = mon.parameter_sets[-1] if mon.parameter_sets else None
    if ps is not None and ps.set_id != "nominal":
        files.append(Path(idn.save(str(out / "identified_model.yaml"))))
    hist = [{n: v for n, v in p.as_dict().items() if n in est_names} for p in mon.parameter_sets]
    conv = plot_convergence(hist, out / "parameter_convergence.png", truth={n: truth[n] for n in est_names},
                            x_label="published parameter set (0 = nominal)")
    if conv:
        files.append(conv)
    # predicted (1 s ahead) vs measured plate trajectories
    gt = list(mon.ground_truth)
    plates = None
    if gt and mon.predictions:
        names = true_structure.node_names
        t = np.array([g[0] for g in gt]) - t0_ros
        P = np.stack([g[1] for g in gt])
        pn = mon.predictions[0].node_names
        preds = [p for p in mon.predictions if p.node_names == pn]
        tp = np.array([p.times[-1] for p in preds]) - t0_ros
        Pp = np.stack([p.positions[-1] for p in preds])
        series = {"measured (twin)": (t, plate_motion(names, P)), "predicted 1 s ahead": (tp, plate_motion(pn, Pp))}
        plates = plot_plate_motion(t, series, out / "plates_predicted_vs_measured.png",
                                   title="plates C1, C2 relative to C0: twin vs the 1-s prediction made 1 s earlier")
        if plates:
            files.append(plates)
    s = summary
    table = parameter_table(ps.as_dict() if ps else nom, ps.std_dict() if ps else {},
                            dict(zip(ps.names, ps.identifiability)) if ps else {}, truth)
    lines = [
        "# tensegrity demo", "",
        f"Simulated {true_structure.name} (nominal stiffnesses and dampings ~20 % off the truth), "
        f"{s['duration_s']:.1f} s of motion.", "",
        "| metric | value |", "|---|---|",
        f"| median parameter error (identified vs true) | {s['median_param_error_pct']:.2f} % "
        f"(nominal: {s['nominal_param_error_pct']:.2f} %) |",
        f"| 1-s prediction RMSE (whole run / second half / at 1 s) | {s['prediction_rmse_mm']:.2f} / "
        f"{s['prediction_rmse_mm_second_half']:.2f} / {s['prediction_error_at_1s_mm']:.2f} mm |",
        f"| prediction latency p50 / p99 | {s['prediction_latency_ms']['p50']:.2f} / "
        f"{s['prediction_latency_ms']['p99']:.2f} ms |",
        f"| identifier updates accepted / rejected, update time p50 | {s['identifier']['accepted']} / "
        f"{s['identifier']['rejected']}, {s['identifier']['update_s_p50']:.2f} s |",
        f"| messages not delivered (mocap, motor states, node states; expected = rate x duration): lost between "
        f"nodes / never produced by the sources | {s['dropped_messages']}: {s['lost_messages']} / "
        f"{s['not_produced_messages']} |",
        f"| realized 1-s prediction error (scored against later node states, no truth) | "
        f"{s['prediction_realized_error_mm']['at_1s']:.2f} mm |",
        f"| mocap / driver loop rate, driver missed cycles | {s['rates']['mocap_hz']:.1f} / "
        f"{s['rates']['driver_loop_hz']:.1f} Hz, {s['rates']['driver_missed_cycles']} |",
        f"| the machine during the run | {describe_load(s['machine']) if s.get('machine') else 'not measured'} |",
        "",
        "## Parameters (last published set vs truth)", "", "```", table, "```", "",
        f"## Health: {s['health']['verdict']}", "", "| figure | value | threshold | |", "|---|---|---|---|",
        *[f"| {n} | {format_value(f['value'], f['unit'])} | {'>=' if f['op'] == 'min' else '<='} "
          f"{format_value(f['threshold'], f['unit'])} | {'ok' if f['pass'] else '**FAIL**'} |"
          for n, f in s["health"]["figures"].items()], "",
    ]
    if conv:
        lines += ["## Parameter convergence", "", f"![convergence]({conv.name})", ""]
    if plates:
        lines += ["## Predicted vs measured plate trajectories", "", f"![plates]({plates.name})", ""]
    (out / "report.md").write_text("\n".join(lines))
    files.append(out / "report.md")
    return files


def write_bag(graph, path: Path) -> Path:
    """Everything the monitor recorded (raw) as an MCAP bag, through :func:`tensegrity_ros.bags.write_topics`."""
    from ..bags import make_typestore, write_topics

    ts = make_typestore()
    mon = graph.monitor
    topics = {}
    for topic, msgs in mon.recorded.items():
        if not msgs:
            continue
        mtype = mon.TOPIC_TYPES[topic]
        topics[topic] = (mtype, [(t, ts.deserialize_cdr(data, mtype)) for t, data in msgs])
    return write_topics(path, topics, typestore=ts, overwrite=True)
