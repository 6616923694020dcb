"""Figures in the seed's style: plate positions and ZYX Euler angles of C1, C2 relative to C0 (Fig. 6),
residuals over time, parameter convergence, and a parameter table."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..frames import FRAME_NODES, euler_zyx, frame_from_nodes, relative_pose  # noqa: E402

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
                      path: Path, title: str = "") -> Optional[Path]:
    """One column per plate (C1, C2): positions [mm] on top, ZYX angles [deg] below; one line per series.

    series: {label: (times (T,), plate_motion(...) result)}. Returns None if no plate is present.
    """
    plates = sorted({p for _, motion in series.values() for p in motion})
    if not plates:
        return None
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
        axes[0, j].set_title(f"{plate} relative to C0")
        axes[0, j].set_ylabel("position [mm]")
        axes[1, j].set_ylabel("ZYX Euler angle [deg]")
        axes[1, j].set_xlabel("time [s]")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_residuals(t: np.ndarray, residual_mm: np.ndarray, path: Path, label: str = "node position residual",
                   title: str = "") -> Path:
    """Residual over time: t (T,) s, residual_mm (T,) or (T, K) mm (one line per column); ``title`` (e.g. the
    model check's verdict) above the plot, wrapped."""
    import textwrap
    fig, ax = plt.subplots(figsize=(9, 3.5 + 0.25 * len(textwrap.wrap(title, 110))))
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=8, loc="left")
    ax.plot(t, residual_mm, lw=1)
    ax.set_xlabel("time [s]")
    ax.set_ylabel(f"{label} [mm]")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_convergence(history: Sequence[Mapping[str, float]], path: Path, truth: Optional[Mapping[str, float]] = None,
                     max_lines: int = 24, x_label: str = "iteration") -> Optional[Path]:
    """Parameter values over iterations (or time), relative to their final value (or to ``truth``).

    history: [{"name": value, ...}, ...] in order; keys may include "loss" (plotted on its own axis).
    """
    if not history:
        return None
    names = [k for k in history[-1] if k != "loss"][:max_lines]
    ref = {n: (truth or {}).get(n, history[-1][n]) for n in names}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    x = np.arange(len(history))
    for n in names:
        vals = np.array([h.get(n, np.nan) for h in history], dtype=float)
        scale = ref[n] if ref[n] else 1.0
        ax1.plot(x, 100.0 * (vals / scale - 1.0), lw=1, label=n)
    ax1.set_ylabel(f"error vs {'truth' if truth else 'final'} [%]")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=6, ncol=3)
    if any("loss" in h for h in history):
        ax2.semilogy(x, [h.get("loss", np.nan) for h in history])
        ax2.set_ylabel("loss")
    ax2.set_xlabel(x_label)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


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
