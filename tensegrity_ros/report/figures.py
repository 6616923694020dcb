"""Figures in the seed's style: plate positions and ZYX Euler angles of C1, C2 relative to C0 (Fig. 6),
residuals over time, parameter convergence (every parameter, one panel per kind), and parameter tables (every
parameter with its prior, value, +-2 sigma and, when the truth is known, its error) as text, CSV and Markdown."""
from __future__ import annotations

import csv
import io
import math
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..frames import FRAME_NODES, euler_zyx, frame_from_nodes, relative_pose  # noqa: E402
from ..metrics import rms_error  # noqa: E402
from ..param_names import element_of, kind_of  # noqa: E402

AXES_POS = ("x", "y", "z")
AXES_EUL = ("yaw (Z)", "pitch (Y)", "roll (X)")


def plate_motion(names: Sequence[str], positions: np.ndarray) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """Plate motion relative to the ground frame C0, the seed's Figure 6 quantities.

    names: (N,) node names; positions: (T, N, 3) m (NaN where not measured).
    Returns {"C1"|"C2": (position (T, 3) m, ZYX Euler angles (T, 3) rad)} for the plates the names cover.
    """
    have = set(names)
    frames = {k: frame_from_nodes(positions, names, triple) for k, triple in FRAME_NODES.items()
              if set(triple) <= have}
    if "C0" not in frames:
        return {}
    out = {}
    for plate in ("C1", "C2"):
        if plate in frames:
            rel = relative_pose(frames["C0"], frames[plate])
            out[plate] = (rel[..., :3, 3], euler_zyx(rel[..., :3, :3]))
    return out


def plot_plate_motion(t: np.ndarray, series: Mapping[str, Tuple[np.ndarray, Mapping[str, Tuple[np.ndarray, np.ndarray]]]],
                      path: Path, title: str = "", relative_to_start: bool = False) -> Optional[Path]:
    """One column per plate (C1, C2): positions [mm] on top, ZYX angles [deg] below; one line per series.

    series: {label: (times (T,), plate_motion(...) result)}. Returns None if no plate is present.
    relative_to_start: plot each quantity's change from the first series' first finite value (the same
    reference for every series), so a 1-m offset does not squash millimetre motion.
    """
    plates = sorted({p for _, motion in series.values() for p in motion})
    if not plates:
        return None
    if relative_to_start:
        ref = {}
        for plate in plates:
            first = next(m[plate] for _, m in series.values() if plate in m)
            ref[plate] = tuple(_first_finite(a) for a in first)
        series = {label: (times, {p: (pos - ref[p][0], eul - ref[p][1]) for p, (pos, eul) in motion.items()})
                  for label, (times, motion) in series.items()}
    fig, axes = plt.subplots(2, len(plates), figsize=(6.5 * len(plates), 7), squeeze=False, sharex=True)
    styles = ["-", "--", ":", "-."]
    for j, plate in enumerate(plates):
        for k, (label, (times, motion)) in enumerate(series.items()):
            if plate not in motion:
                continue
            pos, eul = motion[plate]
            for i in range(3):
                color = f"C{i}"
                axes[0, j].plot(times, pos[:, i] * 1e3, styles[k % 4], color=color, lw=1.2,
                                label=f"{AXES_POS[i]} {label}")
                axes[1, j].plot(times, np.degrees(eul[:, i]), styles[k % 4], color=color, lw=1.2,
                                label=f"{AXES_EUL[i]} {label}")
        since = ", change from the start" if relative_to_start else ""
        axes[0, j].set_title(f"{plate} relative to C0: position{since}")
        axes[1, j].set_title(f"{plate} relative to C0: ZYX Euler angles{since}")
        axes[0, j].set_ylabel("position change [mm]" if relative_to_start else "position [mm]")
        axes[1, j].set_ylabel("ZYX Euler angle change [deg]" if relative_to_start else "ZYX Euler angle [deg]")
        axes[1, j].set_xlabel("time [s]")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def moving_nodes(names: Sequence[str], positions: np.ndarray, fixed: Sequence[str] = (), most: int = 6) -> List[int]:
    """Indices of the (at most ``most``) nodes that move most in ``positions`` (T, N, 3) m (NaN where not
    measured), ``fixed`` nodes left out, in structure order."""
    span = np.full(len(names), -1.0)
    for i, n in enumerate(names):
        p = positions[:, i]
        p = p[np.isfinite(p).all(axis=1)]
        if n not in fixed and len(p) > 1:
            span[i] = float(np.linalg.norm(p.max(axis=0) - p.min(axis=0)))
    ranked = [i for i in np.argsort(-span, kind="stable") if span[i] >= 0][:most]
    return sorted(int(i) for i in ranked)


def plot_node_motion(t: np.ndarray, series: Mapping[str, np.ndarray], names: Sequence[str], nodes: Sequence[int],
                     path: Path, title: str = "") -> Optional[Path]:
    """Measured against predicted motion of single nodes, for structures without the manipulator's plates: one
    panel per node in ``nodes`` (indices into ``names``), its x, y, z change from the first series' first finite
    sample [mm] (the same reference for every series, so a prediction's offset stays visible), against time from
    the recording's start. series: {label: positions (T, N, 3) m}, NaN where not measured or not predicted.
    Returns None when ``nodes`` is empty."""
    if not len(nodes):
        return None
    t = np.asarray(t, dtype=float)
    t = t - t[0] if t.size else t
    first = next(iter(series.values()))
    fig, axes = plt.subplots(len(nodes), 1, figsize=(10, 0.8 + 2.3 * len(nodes)), sharex=True, squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, i in zip(axes[:, 0], nodes):
        ref = _first_finite(first[:, i])
        for k, (label, pos) in enumerate(series.items()):
            for a in range(3):
                ax.plot(t, 1e3 * (pos[:, i, a] - ref[a]), styles[k % 4], color=f"C{a}", lw=1.0,
                        label=f"{AXES_POS[a]} {label}")
        ax.set_title(f"node {names[i]}: position change from the start (structure frame)", fontsize=9, loc="left")
        ax.set_ylabel("[mm]")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[-1, 0].set_xlabel("time from the recording's start [s]")
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, 100)), fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_residuals(t, residual_mm, path: Path, label: str = "node position residual", title: str = "",
                   names: Optional[Sequence[str]] = None, noise_floor_mm: Optional[float] = None) -> Path:
    """Residual over time from the recording's start: t (T,) s (any origin: a bag's stamps), residual_mm (T,) or
    (T, K) mm (one line per column); ``title`` (e.g. the model check's verdict) above the plot, wrapped. Several
    recordings: ``t`` and ``residual_mm`` lists (one entry each, own time base) and ``names``: one panel per
    recording. ``noise_floor_mm``: what the markers' noise alone gives on this measure, drawn as a dashed line (a
    node's 3-D error against noisy markers cannot fall below it, however good the model)."""
    several = isinstance(t, (list, tuple))
    ts, rs = (list(t), list(residual_mm)) if several else ([t], [residual_mm])
    names = list(names) if names is not None else [""] * len(ts)
    head = textwrap.wrap(title, 110)
    fig, axes = plt.subplots(len(ts), 1, figsize=(9, 0.5 + 3.0 * len(ts) + 0.25 * len(head)), squeeze=False)
    for k, (tk, rk) in enumerate(zip(ts, rs)):
        ax = axes[k, 0]
        tk = np.asarray(tk, dtype=float)
        ax.plot(tk - tk[0] if tk.size else tk, rk, lw=1)      # a bag's stamps are epoch seconds (~1.7e9)
        if noise_floor_mm is not None and math.isfinite(noise_floor_mm):
            ax.axhline(noise_floor_mm, color="k", ls="--", lw=1,
                       label=f"the markers' noise alone: {noise_floor_mm:.2f} mm")
            ax.legend(fontsize=7, loc="upper right")
        rms = rms_error(rk, skip_missing=True)
        sub = f"{names[k]}: " if names[k] else ""
        ax.set_title(f"{sub}{label}, RMS {rms:.2f} mm", fontsize=9, loc="left")
        ax.set_xlabel("time from the recording's start [s]")
        ax.set_ylabel(f"{label} [mm]" if not several else "[mm]")
        ax.grid(alpha=0.3)
    if head:
        fig.suptitle("\n".join(head), fontsize=8, x=0.01, ha="left")
    fig.tight_layout()
    return _save(fig, path)


def plot_convergence(history: Sequence[Mapping[str, float]], path: Path, truth: Optional[Mapping[str, float]] = None,
                     max_lines: Optional[int] = None, x_label: str = "iteration", title: str = "") -> Optional[Path]:
    """Every parameter's value over iterations (or time), one panel per kind, relative to its final value (or to
    ``truth``): log-parametrised kinds in %, rest lengths and zero offsets as differences in mm / mrad.

    history: [{"name": value, ...}, ...] in order; keys may include "loss" (plotted on its own panel below).
    max_lines: plot at most this many parameters (None: all, the default).
    """
    if not history:
        return None
    names = [k for k in history[-1] if k != "loss"]
    if max_lines is not None:
        names = names[:max_lines]
    ref = {n: (truth or {}).get(n, history[-1][n]) for n in names}
    groups: Dict[str, List[str]] = {}
    constant: Dict[str, int] = {}                   # kinds none of whose parameters ever moved: one line, no panel
    for n in names:
        groups.setdefault(kind_of(n), []).append(n)
    for kind in list(groups):
        if not any(_moved([h.get(n, np.nan) for h in history]) for n in groups[kind]):
            constant[kind] = len(groups.pop(kind))
    if constant:
        held = "held fixed (not estimated): " + ", ".join(f"{n} {k}" for k, n in constant.items())
        title = f"{title}\n{held}" if title else held
    has_loss = any("loss" in h for h in history)
    if not groups and not has_loss:
        groups = {"(no parameter moved)": []}
    rows = len(groups) + (1 if has_loss else 0)
    fig, axes = plt.subplots(rows, 1, figsize=(11, 0.6 + 3.0 * rows), sharex=True, squeeze=False)
    x = np.arange(len(history))
    against = "truth" if truth else "final value"
    for ax, (kind, members) in zip(axes[:, 0], groups.items()):
        unit, factor, relative = _display(kind)
        for n in members:
            vals = np.array([h.get(n, np.nan) for h in history], dtype=float)
            if relative:
                scale = ref[n] if ref[n] else 1.0
                y = 100.0 * (vals / scale - 1.0)
            else:
                y = factor * (vals - ref[n])
            ax.plot(x, y, lw=0.9, label=element_of(n) or n)
        ax.set_title(f"{kind} ({len(members)} parameter{'s' if len(members) != 1 else ''}): "
                     f"{'error' if truth else 'difference'} vs the {against}", fontsize=9, loc="left")
        ax.set_ylabel("[%]" if relative else f"[{unit}]")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=max(1, math.ceil(len(members) / 8)), loc="center left", bbox_to_anchor=(1.0, 0.5))
    if has_loss:
        ax = axes[-1, 0]
        ax.semilogy(x, [h.get("loss", np.nan) for h in history])
        ax.set_title("loss (normalised sum of squared residuals, prior included)", fontsize=9, loc="left")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel(x_label)
    top = 1.0
    if title:
        fig.suptitle(title, fontsize=10)
        top = 1.0 - (0.25 + 0.18 * title.count("\n")) / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    return _save(fig, path)


def _moved(values: Sequence[float], rtol: float = 1e-9) -> bool:
    """Whether a parameter's history moved by more than round-off: a fixed parameter comes back through the
    log parametrisation 1e-16 relative off its file value, which drew a panel of 1e-14 % "errors"."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return v.size > 1 and float(np.ptp(v)) > rtol * max(float(np.abs(v).max()), 1e-300)


def _display(kind: str) -> Tuple[str, float, bool]:
    """(unit shown, factor from SI, shown relative in %) for differences of a parameter kind."""
    if kind == "rest_length":
        return "mm", 1e3, False
    if kind == "zero_offset":
        return "mrad", 1e3, False
    return "%", 100.0, True


def _first_finite(a: np.ndarray) -> np.ndarray:
    """The first row of ``a`` (T, k) whose entries are all finite (zeros if none)."""
    ok = np.isfinite(a).all(axis=1)
    return a[int(np.argmax(ok))] if ok.any() else np.zeros(a.shape[1:])


def parameter_table(values: Mapping[str, float], std_devs: Mapping[str, float] = None,
                    identifiability: Mapping[str, float] = None, truth: Mapping[str, float] = None) -> str:
    """A fixed-width text table: name, value, std dev, identifiability and (if given) error vs truth."""
    std_devs, identifiability, truth = std_devs or {}, identifiability or {}, truth or {}
    head = f"{'parameter':<22}{'value':>12}{'std dev':>12}{'ident.':>8}" + (f"{'error %':>10}" if truth else "")
    lines = [head, "-" * len(head)]
    for n, v in values.items():
        row = f"{n:<22}{v:>12.5g}{std_devs.get(n, float('nan')):>12.3g}{identifiability.get(n, float('nan')):>8.2f}"
        if truth:
            tv = truth.get(n)
            row += f"{100 * (v / tv - 1):>10.2f}" if tv else f"{'':>10}"
        lines.append(row)
    return "\n".join(lines)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: columns of :func:`parameter_rows`, in order (CSV header)
ROW_COLUMNS = ("parameter", "kind", "unit", "status", "prior", "prior_std", "value", "std", "minus_2sigma",
               "plus_2sigma", "identifiability", "truth", "error", "error_unit", "truth_inside_2sigma")


def parameter_rows(values: Mapping[str, float], std_devs: Mapping[str, float] = None, *,
                   prior: Mapping[str, float] = None, prior_std: Mapping[str, float] = None,
                   truth: Mapping[str, float] = None, identifiability: Mapping[str, float] = None,
                   status: Mapping[str, str] = None, units: Mapping[str, str] = None) -> List[Dict[str, Any]]:
    """One row per parameter in ``values`` (all of them, in order), columns :data:`ROW_COLUMNS`.

    values / std_devs / prior / prior_std / truth / identifiability: by parameter name, in the parameter's own
    unit (``units``: by kind, e.g. ``engine.params.UNITS``); status: by name (``estimated``, ``fixed``, ``kept at
    the prior``, ...; default ``estimated`` where a std is given, else ``fixed``). The error against the truth is
    relative (%) for scale kinds and a difference (mm, mrad) for rest lengths and zero offsets; NaN where absent.
    """
    std_devs, prior, prior_std = std_devs or {}, prior or {}, prior_std or {}
    truth, identifiability, status, units = truth or {}, identifiability or {}, status or {}, units or {}
    nan = float("nan")
    rows = []
    for n, v in values.items():
        kind = kind_of(n)
        sd = float(std_devs.get(n, nan))
        tv = float(truth.get(n, nan))
        unit_shown, factor, relative = _display(kind)
        if math.isfinite(tv):
            err = 100.0 * (v / tv - 1.0) if (relative and tv) else factor * (v - tv) if not relative else nan
        else:
            err = nan
        inside = (abs(v - tv) <= 2 * sd) if (math.isfinite(tv) and math.isfinite(sd)) else None
        rows.append({"parameter": n, "kind": kind, "unit": units.get(kind, ""),
                     "status": status.get(n, "estimated" if math.isfinite(sd) else "fixed"),
                     "prior": float(prior.get(n, nan)), "prior_std": float(prior_std.get(n, nan)), "value": float(v),
                     "std": sd, "minus_2sigma": v - 2 * sd, "plus_2sigma": v + 2 * sd,
                     "identifiability": float(identifiability.get(n, nan)), "truth": tv, "error": err,
                     "error_unit": unit_shown if math.isfinite(err) else "", "truth_inside_2sigma": inside})
    return rows


def rows_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`parameter_rows` as CSV (header :data:`ROW_COLUMNS`; floats round-trip exactly; empty cells for NaN /
    unknown)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(ROW_COLUMNS)
    for r in rows:
        w.writerow(["" if (isinstance(r[c], float) and not math.isfinite(r[c])) or r[c] is None else
                    (repr(r[c]) if isinstance(r[c], float) else r[c]) for c in ROW_COLUMNS])
    return buf.getvalue()


def rows_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`parameter_rows` as a Markdown table a person reads: value +- 2 sigma, the prior, the error."""
    has_truth = any(math.isfinite(r["truth"]) for r in rows)
    head = ["parameter", "unit", "prior", "value ± 2σ", "status", "ident."]
    if has_truth:
        head += ["truth", "error", "truth in ±2σ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda x, fmt=".5g": "" if not math.isfinite(x) else format(x, fmt)  # noqa: E731
    for r in rows:
        prior = f(r["prior"]) + (f" ± {2 * r['prior_std']:.3g}" if math.isfinite(r["prior_std"]) else "")
        val = f(r["value"]) + (f" ± {2 * r['std']:.3g}" if math.isfinite(r["std"]) else "")
        cells = [r["parameter"], r["unit"], prior, val, r["status"], f(r["identifiability"], ".2f")]
        if has_truth:
            err = f"{r['error']:+.2f} {r['error_unit']}" if math.isfinite(r["error"]) else ""
            cells += [f(r["truth"]), err, {True: "yes", False: "**no**", None: ""}[r["truth_inside_2sigma"]]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rows_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`parameter_rows` as a fixed-width text table (every parameter)."""
    has_truth = any(math.isfinite(r["truth"]) for r in rows)
    width = max([22] + [len(r["parameter"]) + 2 for r in rows])
    head = (f"{'parameter':<{width}}{'unit':>6}{'prior':>12}{'value':>12}{'2 sigma':>11}{'ident.':>8}  {'status':<18}"
            + (f"{'truth':>12}{'error':>12}{'in 2s':>6}" if has_truth else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        row = (f"{r['parameter']:<{width}}{r['unit']:>6}{r['prior']:>12.5g}{r['value']:>12.5g}{2 * r['std']:>11.3g}"
               f"{r['identifiability']:>8.2f}  {r['status']:<18}")
        if has_truth:
            err = f"{r['error']:+.2f} {r['error_unit']}" if math.isfinite(r["error"]) else ""
            row += f"{r['truth']:>12.5g}{err:>12}{ {True: 'yes', False: 'NO', None: ''}[r['truth_inside_2sigma']]:>6}"
        lines.append(row)
    return "\n".join(lines)
