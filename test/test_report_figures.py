"""The identification report a person reads (issue 17 item 10): every parameter in the convergence plot and the
tables, plate plots relative to their start, errors against the truth. The figures are captured before saving."""
from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest

from tensegrity_ros.param_names import element_of, kind_of
from tensegrity_ros.report import figures
from tensegrity_ros.report import parameter_rows, plot_convergence, plot_plate_motion, rows_csv, rows_markdown


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions would save (closed afterwards)."""
    import matplotlib.pyplot as plt
    figs = []

    def keep(fig, path):
        figs.append(fig)
        return path
    monkeypatch.setattr(figures, "_save", keep)
    yield figs
    for f in figs:
        plt.close(f)


def _history(n_strings=14, n_bars=18, steps=5):
    rng = np.random.default_rng(0)
    names = ([f"s{i}.{k}" for k in ("stiffness", "damping", "rest_length") for i in range(n_strings)]
             + [f"b{i}.mass" for i in range(n_bars)] + ["m1.spool_radius", "m1.zero_offset"])
    start = {n: (1.0 if kind_of(n) == "rest_length" else 100.0) for n in names}
    hist = []
    for k in range(steps):
        h = {n: v * (1 + 0.1 * rng.normal() / (k + 1)) if not n.startswith("m1.") else v for n, v in start.items()}
        hist.append({**h, "loss": 10.0 / (k + 1)})
    return names, hist


def test_convergence_plot_shows_every_parameter(drawn, tmp_path):
    names, hist = _history()                              # 62 parameters, 2 of them never moved
    assert plot_convergence(hist, tmp_path / "c.png") is not None
    fig = drawn[0]
    shown = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    moved = [n for n in names if not n.startswith("m1.")]
    assert len(moved) == 60 and sorted(shown) == sorted(element_of(n) for n in moved)   # not the first 24
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert any(t.startswith("stiffness (14 parameters)") for t in titles)
    assert any(t.startswith("mass (18 parameters)") for t in titles)
    assert any(t.startswith("loss") for t in titles)
    assert "held fixed (not estimated): 1 spool_radius, 1 zero_offset" in fig._suptitle.get_text()
    rest = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("rest_length"))
    assert rest.get_ylabel() == "[mm]"                     # differences in mm, not % of a metre


def test_plate_plot_is_relative_to_the_start(drawn, tmp_path):
    t = np.linspace(0, 1, 50)
    pos = np.stack([1.2 + 0.01 * np.sin(6 * t), -0.4 + 0.0 * t, 0.8 + 0.002 * t], axis=1)
    pos[0] = np.nan                                        # the first finite sample is the reference
    eul = np.stack([0.5 + 0.01 * t, 0 * t, 0 * t], axis=1)
    plot_plate_motion(t, {"measured": (t, {"C1": (pos, eul)}), "predicted": (t, {"C1": (pos + 0.001, eul)})},
                      tmp_path / "p.png", title="x", relative_to_start=True)
    ax = drawn[0].axes[0]
    first = [line.get_ydata()[1] for line in ax.get_lines()]
    assert first[:3] == pytest.approx([0.0, 0.0, 0.0], abs=1e-9)      # measured starts at 0 mm
    assert first[3:] == pytest.approx([1.0, 1.0, 1.0], abs=1e-9)      # the prediction's 1 mm offset stays
    assert "change from the start" in ax.get_title() and "[mm]" in ax.get_ylabel()


def test_parameter_rows_every_parameter_with_prior_sigma_and_error():
    values = {"s1.stiffness": 110.0, "s1.rest_length": 1.001, "b1.mass": 0.5, "m1.zero_offset": 0.0}
    rows = parameter_rows(values, {"s1.stiffness": 4.0, "s1.rest_length": 0.0002, "b1.mass": 0.01},
                          prior={"s1.stiffness": 100.0, "s1.rest_length": 1.0, "b1.mass": 0.5},
                          prior_std={"s1.stiffness": 20.0}, truth={"s1.stiffness": 100.0, "s1.rest_length": 1.0008,
                                                                   "b1.mass": 0.5},
                          status={"b1.mass": "kept at the prior"})
    by = {r["parameter"]: r for r in rows}
    assert list(by) == list(values)
    assert by["s1.stiffness"]["error"] == pytest.approx(10.0) and by["s1.stiffness"]["error_unit"] == "%"
    assert by["s1.stiffness"]["truth_inside_2sigma"] is False          # 10 off, 2 sigma = 8
    assert by["s1.rest_length"]["error"] == pytest.approx(0.2) and by["s1.rest_length"]["error_unit"] == "mm"
    assert by["s1.rest_length"]["truth_inside_2sigma"] is True
    assert by["b1.mass"]["status"] == "kept at the prior" and by["m1.zero_offset"]["status"] == "fixed"
    assert math.isnan(by["m1.zero_offset"]["error"]) and by["m1.zero_offset"]["truth_inside_2sigma"] is None
    table = list(csv.DictReader(io.StringIO(rows_csv(rows))))
    assert [r["parameter"] for r in table] == list(values) and table[3]["error"] == ""
    md = rows_markdown(rows)
    assert "| s1.stiffness |  | 100 ± 40 | 110 ± 8 |" in md and "**no**" in md


def test_residuals_are_plotted_from_the_recordings_start(drawn, tmp_path):
    """A bag's stamps are epoch seconds: the axis starts at 0, not at 1.76e9 under an offset label."""
    from tensegrity_ros.report import plot_residuals
    t = 1.764e9 + np.linspace(0.0, 24.0, 100)
    plot_residuals(t, np.ones(100), tmp_path / "r.png", label="1-s prediction node RMS error")
    ax = drawn[0].axes[0]
    x = ax.get_lines()[0].get_xdata()
    assert x[0] == 0.0 and x[-1] == pytest.approx(24.0)
    assert ax.get_xlabel() == "time from the recording's start [s]"


def test_convergence_plot_holds_round_off_as_fixed(drawn, tmp_path):
    """A fixed spool radius comes back through the log parametrisation 1e-16 relative off: no panel of 1e-14 %."""
    hist = [{"s1.stiffness": 100.0 * (1 + 0.1 / (k + 1)), "m1.spool_radius": 0.012 * (1 + (k % 2) * 2e-16)}
            for k in range(4)]
    plot_convergence(hist, tmp_path / "c.png")
    titles = [ax.get_title(loc="left") for ax in drawn[0].axes]
    assert any(t.startswith("stiffness") for t in titles) and not any(t.startswith("spool_radius") for t in titles)
    assert "held fixed (not estimated): 1 spool_radius" in drawn[0]._suptitle.get_text()


def test_node_plot_shows_the_most_moving_free_nodes_from_their_start(drawn, tmp_path):
    from tensegrity_ros.report import moving_nodes, plot_node_motion
    names = ("b1", "b2", "t1", "t2", "t3")
    T = 60
    t = 1.764e9 + np.linspace(0, 2, T)
    pos = np.zeros((T, 5, 3)) + np.array([0.3, -0.2, 1.0])
    pos[:, 0, 0] += 0.05 * np.sin(t - t[0])              # b1 moves most, but it is fixed
    pos[:, 2, 2] += 0.004 * np.sin(3 * (t - t[0]))       # t1: 8 mm
    pos[:, 4, 1] += 0.001 * np.sin(3 * (t - t[0]))       # t3: 2 mm; t2 does not move
    pos[0, 2] = np.nan                                    # t1's first sample occluded
    shown = moving_nodes(names, pos, fixed=("b1", "b2"), most=2)
    assert shown == [2, 4]
    plot_node_motion(t, {"measured": pos, "predicted": pos + 0.001}, names, shown, tmp_path / "n.png", title="x")
    axes = drawn[0].axes
    assert [ax.get_title(loc="left").split(":")[0] for ax in axes] == ["node t1", "node t3"]
    lines = axes[0].get_lines()
    assert lines[0].get_xdata()[0] == 0.0 and lines[0].get_xdata()[-1] == pytest.approx(2.0)
    z = 1e3 * 0.004 * np.sin(3 * (t - t[0]))
    assert lines[2].get_ydata()[1] == 0.0                  # z from its first measured sample
    assert lines[2].get_ydata()[5] == pytest.approx(z[5] - z[1])
    assert lines[3].get_ydata()[1] == pytest.approx(1.0)   # the prediction's 1-mm offset stays visible
    assert axes[-1].get_xlabel() == "time from the recording's start [s]" and axes[0].get_ylabel() == "[mm]"
    assert moving_nodes(names, pos, fixed=names) == []
    assert plot_node_motion(t, {"measured": pos}, names, [], tmp_path / "none.png") is None


def test_residual_plot_draws_the_noise_floor(drawn, tmp_path):
    """The 1-s prediction error is measured against noisy markers: the floor the noise alone sets is drawn and
    named, so a person does not read 1.7 mm of marker noise as model error."""
    from tensegrity_ros.report import plot_residuals
    t = np.linspace(0.0, 4.0, 50)
    plot_residuals([t, t], [np.full(50, 2.0), np.full(50, 2.5)], tmp_path / "r.png", names=["a", "b"],
                   noise_floor_mm=1.73)
    for ax in drawn[0].axes:
        floor = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(floor) == 1 and floor[0].get_ydata()[0] == pytest.approx(1.73)
        assert "noise alone: 1.73 mm" in ax.get_legend().get_texts()[-1].get_text()
    plot_residuals(t, np.ones(50), tmp_path / "s.png", noise_floor_mm=float("nan"))   # no estimate: no line
    assert not [ln for ln in drawn[1].axes[0].get_lines() if ln.get_linestyle() == "--"]
