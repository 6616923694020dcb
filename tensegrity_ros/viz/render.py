"""The markers of :mod:`.markers` drawn with matplotlib: what RViz shows, as a picture (docs/img/markers.png).

    python -m tensegrity_ros.viz.render                 # writes docs/img/markers.png
    python -m tensegrity_ros.viz.render -o out.png --time 5.0

:func:`draw` puts a list of :class:`~.markers.MarkerSpec` on a 3-D axis (cylinders as thick lines, strings in
their tension colours with a colour bar in N, the ghost with its fading opacity); :func:`demo_scene` makes the
picture of the docs: the stacked manipulator under the seed drive in its MuJoCo twin, its string tensions from
the engine at that state, and the next second of the twin's motion as the ghost (where the graph shows the
state predictor's horizon).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..model import CoincidentConstraint, Structure, load_structure
from ..paths import CONFIG_DIR, REPO_ROOT
from .markers import TENSION_COLORS, MarkerScene, MarkerSpec, MarkerStyle

DEFAULT_MODEL = CONFIG_DIR / "models" / "stacked_manipulator.yaml"
DEFAULT_REFERENCE = CONFIG_DIR / "references" / "seed_sinusoids.yaml"
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "img" / "markers.png"
#: matplotlib line width (points) per metre of marker width, for the picture
POINTS_PER_M = 250.0
#: the picture's background: RViz's default (48, 48, 48)
BACKGROUND = (0.19, 0.19, 0.19)


def tension_colormap():
    """:data:`~.markers.TENSION_COLORS` as a matplotlib colormap (the colour bar's)."""
    from matplotlib.colors import LinearSegmentedColormap

    return LinearSegmentedColormap.from_list("tension", [(x, c) for x, c in TENSION_COLORS])


def draw(ax, specs: Sequence[MarkerSpec], scale: float, colorbar: bool = True) -> None:
    """Draw ``specs`` on a 3-D axis; a colour bar for 0..``scale`` N when ``colorbar``."""
    for s in specs:
        P = np.asarray(s.points, dtype=float)
        if s.type == "cylinder":
            q = np.asarray(s.orientation)
            axis = _rotate(q, np.array([0.0, 0.0, 1.0])) * s.scale[2] / 2
            c = np.asarray(s.position)
            P = np.stack([c - axis, c + axis])
            ax.plot(*P.T, color=s.color[:3], alpha=s.color[3], lw=max(s.scale[0] * POINTS_PER_M, 1.5),
                    solid_capstyle="round", zorder=3)
        elif s.type == "line_strip":
            ax.plot(*P.T, color=s.color[:3], alpha=s.color[3], lw=max(s.scale[0] * POINTS_PER_M * 1.5, 1.0), zorder=2)
        elif s.type == "line_list":
            for a, b in P.reshape(-1, 2, 3):
                ax.plot(*np.stack([a, b]).T, color=s.color[:3], alpha=s.color[3],
                        lw=max(s.scale[0] * POINTS_PER_M * 0.5, 0.6), zorder=1)
        elif s.type == "sphere_list":
            ax.scatter(*P.T, color=s.color[:3], alpha=s.color[3], s=8, depthshade=False, zorder=4)
    if colorbar:
        import matplotlib.pyplot as plt
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        sm = ScalarMappable(norm=Normalize(0.0, scale), cmap=tension_colormap())
        cb = plt.colorbar(sm, ax=ax, shrink=0.6, pad=0.08)
        cb.set_label("string tension [N] (grey: slack)")


def _rotate(q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """v rotated by the unit quaternion q = (x, y, z, w)."""
    u, w = q[:3], q[3]
    return v + 2.0 * np.cross(u, np.cross(u, v) + w * v)


def render(specs: Sequence[MarkerSpec], scale: float, path, title: str = "", elev: float = 18.0,
           azim: float = 35.0) -> Path:
    """Write the picture of ``specs`` to ``path`` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.style.context("dark_background"), plt.rc_context({"grid.color": "0.35"}):
        fig = plt.figure(figsize=(8.0, 7.5), dpi=110, facecolor=BACKGROUND)
        ax = fig.add_subplot(projection="3d", facecolor=BACKGROUND)
        for pane in (ax.xaxis, ax.yaxis, ax.zaxis):
            pane.set_pane_color(BACKGROUND + (1.0,))
        draw(ax, specs, scale)
        _finish(fig, ax, specs, title, elev, azim)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, bbox_inches="tight", facecolor=BACKGROUND)
        plt.close(fig)
    return path


def _finish(fig, ax, specs: Sequence[MarkerSpec], title: str, elev: float, azim: float) -> None:
    """Equal axes around everything drawn, labels in m, the view and the title."""
    pts = np.concatenate([np.asarray(s.points, dtype=float).reshape(-1, 3) for s in specs if len(s.points)]
                         + [np.asarray([s.position]) for s in specs if s.type == "cylinder"])
    lo, hi = pts.min(0), pts.max(0)
    c, r = (lo + hi) / 2, (hi - lo).max() / 2 * 1.05
    ax.set_xlim(c[0] - r, c[0] + r)
    ax.set_ylim(c[1] - r, c[1] + r)
    ax.set_zlim(max(c[2] - r, lo[2] - 0.05), max(c[2] - r, lo[2] - 0.05) + 2 * r)
    ax.set_box_aspect((1, 1, 1))
    ax.set_xlabel("x [m]")
    ax.set_ylabel("y [m]")
    ax.set_zlabel("z [m]")
    ax.view_init(elev=elev, azim=azim)
    if title:
        ax.set_title(title, fontsize=10)


def marker_nodes(structure: Structure) -> Tuple[str, ...]:
    """Nodes that carry a mocap marker: all but the virtual duplicates of coincident constraints."""
    virtual = {c.nodes[1] for c in structure.constraints if isinstance(c, CoincidentConstraint)}
    return tuple(n for n in structure.node_names if n not in virtual)


def demo_scene(model=DEFAULT_MODEL, reference=DEFAULT_REFERENCE, time_s: float = 4.5, horizon_s: float = 1.0,
               dt: float = 0.01, style: MarkerStyle = MarkerStyle()) -> Tuple[List[MarkerSpec], float, str]:
    """(specs, colour scale N, title) of the manipulator at ``time_s`` of the drive in its MuJoCo twin: node
    states as mocap would give them (marker nodes only), tensions from the engine at that state (nominal
    parameters, the motor angles of the drive), and the next ``horizon_s`` of the twin as the ghost."""
    from ..engine import params_from_structure
    from ..references import load_reference, motor_angles, motor_velocities
    from ..twin.sim import TwinSim

    s = load_structure(model)
    ref = load_reference(reference, s.actuators)
    sim = TwinSim(s)
    per = max(1, int(round(dt / sim.dt)))

    def run(t_end: float, keep: bool) -> list:
        out = []
        while sim.time < t_end - 1e-9:
            sim.step(motor_angles(ref, s.actuators, sim.time)[0], n_steps=per,
                     motor_velocities=motor_velocities(ref, s.actuators, sim.time)[0])
            if keep:
                out.append(sim.node_positions())
        return out

    run(time_s, False)
    names = marker_nodes(s)
    idx = [s.node_names.index(n) for n in names]
    X_now, V_now = sim.node_positions()[idx], sim.node_velocities()[idx]
    u, ud = motor_angles(ref, s.actuators, sim.time)[0], motor_velocities(ref, s.actuators, sim.time)[0]
    ghost = np.stack(run(time_s + horizon_s, True))[:, idx]
    scene = MarkerScene(s, style)
    params = params_from_structure(s)
    X = scene.full_positions(names, X_now)
    V = scene.full_velocities(names, V_now)
    tensions = scene.tensions(params, X, V, u, ud)
    scale = style.tension_scale_n or scene.rest_tension_scale(params)
    specs = scene.markers(X, tensions, scale, (names, ghost))
    title = (f"/tensegrity/markers: {s.name} at t = {time_s:.1f} s of the seed drive (MuJoCo twin)\n"
             f"bars, strings by tension (engine, nominal parameters), faded ghost: the next {horizon_s:.1f} s")
    return specs, scale, title


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=str(DEFAULT_OUTPUT), help="PNG to write (docs/img/markers.png)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--reference", default=str(DEFAULT_REFERENCE))
    ap.add_argument("--time", type=float, default=4.5, help="instant of the drive shown [s]")
    ap.add_argument("--horizon", type=float, default=1.0, help="ghost horizon [s]")
    a = ap.parse_args(argv)
    specs, scale, title = demo_scene(a.model, a.reference, a.time, a.horizon)
    print(render(specs, scale, a.output, title))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
