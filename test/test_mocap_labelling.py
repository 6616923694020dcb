"""Marker labelling and the ingest entry point on synthetic mocap data.

The data: a structure whose bars each swing about a pivot (their fixed end, or their midpoint plus a
wandering midpoint) so every bar keeps its length exactly, seen by a mocap system with a Y-up, rotated and
offset frame, 0.3 mm noise, markers shuffled every frame, occlusions and a ghost marker.
"""
from dataclasses import replace
from pathlib import Path

import numpy as np

from tensegrity_ros.frames import FRAME_NODES, frame_from_nodes
import pytest

from tensegrity_ros.model import CoincidentConstraint, Node, String, load_structure
from tensegrity_ros.mocap import (AmbiguousMatchError, IngestConfig, LabellerConfig, MarkerLabeller, MocapIngest,
                                  NoMatchError, ingest_markers, physical_nodes)

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"
RATE = 120.0
NOISE = 0.3e-3


def _rot(axis, angle):
    axis = np.asarray(axis, float) / np.linalg.norm(axis)
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * K + (1 - np.cos(angle)) * K @ K


# structure -> mocap: Z-up to Y-up, 25 deg yaw, offset origin
R_SM = _rot([0, 1, 0], np.radians(25)) @ np.array([[1.0, 0, 0], [0, 0, 1], [0, -1, 0]])
T_SM = np.array([1.2, 0.05, -0.8])
TRUE_MS = (R_SM.T, -R_SM.T @ T_SM)  # mocap -> structure
# a rough guess of it (20 deg and 10 cm off), as an operator would write in a config file
GUESS = (_rot([0, 0, 1], np.radians(20)) @ R_SM.T, -R_SM.T @ T_SM + np.array([0.1, -0.05, 0.05]))


def fixed_icosahedron():
    """The icosahedron with three fixed nodes (an equilateral triangle: the labeller must disambiguate) and
    a virtual duplicate of n2 (coincident constraint) that carries a string and must not get a marker."""
    s = load_structure(MODELS / "icosahedron.yaml")
    fixed = {"n1", "n5", "n9"}
    nodes = tuple(replace(n, fixed=n.name in fixed) for n in s.nodes)
    n2 = s.nodes[s.node_index("n2")]
    nodes += (Node("n2v", n2.position),)
    strings = s.strings + (String("sv", ("n2v", "n12"), 100.0, 10.0, 0.9),)
    return replace(s, name="icosahedron_fixed", nodes=nodes, strings=strings,
                   constraints=(CoincidentConstraint(("n2", "n2v")),))


def free_icosahedron():
    return load_structure(MODELS / "icosahedron.yaml")


def motion(structure, n_frames, seed=0, rot_amp=0.15, trans_amp=0.04, drift=True):
    """Ground-truth node positions (T, N, 3) in the structure frame for the marker nodes, and their stamps."""
    rng = np.random.default_rng(seed)
    names = physical_nodes(structure)
    X0 = np.array([structure.nodes[structure.node_index(n)].position for n in names])
    fixed = np.array([structure.nodes[structure.node_index(n)].fixed for n in names])
    idx = {n: i for i, n in enumerate(names)}
    t = np.arange(n_frames) / RATE + rng.uniform(-2e-4, 2e-4, n_frames)
    t[0] = 0.0
    X = np.repeat(X0[None], n_frames, axis=0)
    for bar in structure.bars:
        a, b = idx[bar.nodes[0]], idx[bar.nodes[1]]
        pivot0 = X0[a] if fixed[a] else X0[b] if fixed[b] else 0.5 * (X0[a] + X0[b])
        moving_pivot = not (fixed[a] or fixed[b])
        axis = rng.normal(size=3)
        f1, f2, ph = rng.uniform(0.3, 0.9), rng.uniform(0.2, 0.6), rng.uniform(0, 2 * np.pi)
        d = rng.normal(size=3)
        d /= np.linalg.norm(d)
        for k, tk in enumerate(t):
            R = _rot(axis, rot_amp * np.sin(2 * np.pi * f1 * tk))
            p = pivot0 + (trans_amp * np.sin(2 * np.pi * f2 * tk) * d if moving_pivot else 0.0)
            for e in (a, b):
                if not fixed[e]:
                    X[k, e] = p + R @ (X0[e] - pivot0)
    if drift and not fixed.any():  # a free structure also wanders as a whole
        c = X0.mean(axis=0)
        for k, tk in enumerate(t):
            R = _rot([0.3, 1.0, 0.2], 0.4 * np.sin(0.5 * tk))
            X[k] = (X[k] - c) @ R.T + c + np.array([0.1, -0.05, 0.02]) * tk
    return names, t, X


def observe(X, seed=1, occlusions=(), ghost_frames=()):
    """Mocap frames: shuffled (M, 3) arrays in the mocap frame, and the true node of each row (-1 = ghost).

    occlusions: iterable of (frame slice, node index array or fraction) hiding those nodes in those frames.
    """
    rng = np.random.default_rng(seed)
    T, N, _ = X.shape
    visible = np.ones((T, N), dtype=bool)
    for sl, which in occlusions:
        if isinstance(which, float):  # a fresh random subset each frame
            for k in range(*sl.indices(T)):
                visible[k, rng.choice(N, int(round(which * N)), replace=False)] = False
        else:
            visible[sl, which] = False
    frames, truth = [], []
    for k in range(T):
        ids = np.flatnonzero(visible[k])
        pts = X[k, ids] @ R_SM.T + T_SM + rng.normal(0, NOISE, (ids.size, 3))
        if k in ghost_frames:
            pts = np.vstack([pts, X[k, 0] @ R_SM.T + T_SM + np.array([0.0, 0.2, 0.0])])
            ids = np.append(ids, -1)
        order = rng.permutation(len(ids))
        frames.append(pts[order])
        truth.append(ids[order])
    return frames, truth, visible


def truth_rows_without(truth_row, node):
    return np.flatnonzero(truth_row != node)


def run_labeller(labeller, t, frames):
    out = [labeller.add_frame(tk, m) for tk, m in zip(t, frames)]
    return out


def count_swaps(out, truth):
    """Labels pointing at another node's marker (or at a ghost)."""
    swaps = 0
    for f, tr in zip(out, truth):
        for i in np.flatnonzero(f.valid):
            swaps += int(tr[f.marker_index[i]] != i)
    return swaps


def transform_error(R, t):
    """Largest error (m) of the estimated mocap->structure transform over a 1.5 m cube around the structure."""
    pts = np.array(np.meshgrid(*[[-0.75, 0.75]] * 3)).reshape(3, -1).T
    Y = pts @ R_SM.T + T_SM
    return float(np.max(np.linalg.norm(Y @ R.T + t - pts, axis=1)))


@pytest.fixture(scope="module")
def fixed_run():
    s = fixed_icosahedron()
    names, t, X = motion(s, 480)
    N = len(names)
    hidden = np.random.default_rng(5).choice(np.flatnonzero([n not in s.fixed_nodes for n in names]),
                                             int(np.ceil(0.2 * N)), replace=False)
    frames, truth, visible = observe(X, occlusions=[(slice(120, 240), hidden), (slice(300, 420), 0.2)],
                                     ghost_frames=range(60, 90))
    lab = MarkerLabeller(s, LabellerConfig(initial_transform=GUESS))
    out = run_labeller(lab, t, frames)
    return s, names, t, X, frames, truth, visible, lab, out, hidden


def test_physical_nodes_skip_virtual_duplicates():
    s = fixed_icosahedron()
    names = physical_nodes(s)
    assert "n2v" not in names and len(names) == 12 and names[0] == "n1"


def test_fixed_structure_tracks_through_occlusion_without_swaps(fixed_run):
    s, names, t, X, frames, truth, visible, lab, out, hidden = fixed_run
    assert lab.names == names
    assert count_swaps(out, truth) == 0
    valid = np.array([f.valid for f in out])
    # invalid exactly where occluded: nothing invented, and every visible node labelled after re-acquisition
    assert not np.any(valid & ~visible)
    assert np.array_equal(valid, visible), np.argwhere(valid != visible)[:10]
    # occluded nodes come back right after the occlusion
    assert valid[240:300, hidden].all()
    pos = np.array([f.positions for f in out])
    assert np.all(np.isnan(pos[~valid]))
    err = np.linalg.norm(pos[valid] - X[valid], axis=1)
    assert err.max() < 3e-3  # noise + transform


def test_transform_from_y_up_offset_frame_below_1mm(fixed_run):
    lab = fixed_run[7]
    R, t = lab.transform  # refreshed automatically after 120 frames on the fixed nodes' mean
    err = transform_error(R, t)
    assert err < 1e-3, err
    lab.refresh_transform()  # on request: same result from the same window
    assert transform_error(*lab.transform) < 1e-3
    # a single frame's fixed-node markers already give ~1 mm; averaging them is what brings it well below
    assert transform_error(lab.registration.R, lab.registration.t) < 2e-3


def test_symmetric_structure_needs_a_hint():
    s = fixed_icosahedron()
    names, t, X = motion(s, 2)
    frames, _, _ = observe(X)
    with pytest.raises(AmbiguousMatchError, match="initial_transform"):
        MarkerLabeller(s).add_frame(0.0, frames[0])


def test_free_structure_registration_and_tracking():
    s = free_icosahedron()
    names, t, X = motion(s, 360, seed=3)
    N = len(names)
    frames, truth, visible = observe(X, seed=4, occlusions=[(slice(100, 220), 0.2)])
    lab = MarkerLabeller(s, LabellerConfig(initial_transform=GUESS))
    out = run_labeller(lab, t, frames)
    assert count_swaps(out, truth) == 0
    valid = np.array([f.valid for f in out])
    assert np.array_equal(valid, visible)
    assert transform_error(lab.registration.R, lab.registration.t) < 2e-3


def test_no_match_on_random_points():
    s = fixed_icosahedron()
    rng = np.random.default_rng(0)
    lab = MarkerLabeller(s, LabellerConfig(initial_transform=GUESS, registration_timeout_s=0.05))
    with pytest.raises(NoMatchError) as err:
        for k in range(20):
            f = lab.add_frame(k / RATE, rng.uniform(-1, 1, (12, 3)))
            assert not f.registered and not f.valid.any()
    msg = str(err.value)
    assert "icosahedron_fixed" in msg and "12 marker nodes" in msg and "saw 12 markers" in msg, msg
    with pytest.raises(NoMatchError, match=r"expected >= 12 markers .* saw 5"):
        MarkerLabeller(s, LabellerConfig(registration_timeout_s=0.0)).add_frame(0.0, rng.uniform(-1, 1, (5, 3)))


def test_ingest_entry_point(fixed_run):
    s, names, t, X, frames, truth, visible, *_ = fixed_run
    cfg = IngestConfig(labeller=LabellerConfig(initial_transform=GUESS))
    series = ingest_markers(s, t, frames, cfg)
    assert series.names == names
    assert np.array_equal(series.valid, visible)
    Vt = np.gradient(X, t, axis=0)
    ok = series.velocity_valid
    assert ok[200:].mean() > 0.7
    err = np.linalg.norm(series.velocities[ok] - Vt[ok], axis=1)
    speed = np.linalg.norm(Vt[ok], axis=1)
    rel = np.sqrt(np.mean(err ** 2)) / np.sqrt(np.mean(speed ** 2))
    # these swings reach ~5 m/s^2, far above the seed drive the default filter is tuned for, so it lags;
    # test_mocap_filtering bounds it on seed-like motion. The offline smoother has no lag:
    assert rel < 0.25, rel
    smooth = ingest_markers(s, t, frames, IngestConfig(labeller=LabellerConfig(initial_transform=GUESS)),
                            smooth_window_s=0.1)
    ok = smooth.velocity_valid
    err = np.linalg.norm(smooth.velocities[ok] - Vt[ok], axis=1)
    assert np.sqrt(np.mean(err ** 2)) / np.sqrt(np.mean(np.linalg.norm(Vt[ok], axis=1) ** 2)) < 0.05
    ing = MocapIngest(s, IngestConfig(labeller=LabellerConfig(initial_transform=GUESS)))
    sample = ing.add_frame(t[0], frames[0])
    assert sample.registered and sample.valid.all() and sample.frame_id == "structure"
    # the icosahedron happens to have nodes named like the seed's C0 (n1..n3) and C1 (n10..n12) plates, not C2
    assert set(sample.plate_poses) == {"C0", "C1"}
    truth = frame_from_nodes(X[0], names, FRAME_NODES["C0"])
    np.testing.assert_allclose(sample.plate_poses["C0"], truth, atol=3e-3)
    R = sample.plate_poses["C0"][:3, :3]
    np.testing.assert_allclose(R @ R.T, np.eye(3), atol=1e-12)
    occluded = ing.add_frame(t[1], frames[1][truth_rows_without(fixed_run[5][1], 0)])
    assert occluded.plate_poses["C0"] is None and not occluded.valid[0]


def test_a_recording_comes_out_in_one_transform():
    """The registration is made on a single frame; at 1 mm of marker noise it is millimetres off at the nodes far
    from the fixed ones. Live, the labeller re-fits it on the fixed nodes' mean position at every frame until
    ``auto_refresh_frames`` (until stop 36: once, at that frame, so the whole first second sat in the single
    frame's transform, 4.9 mm off here). Offline, ingest_markers (identify's path) re-expresses every frame in the
    final transform, the first ones too."""
    s = fixed_icosahedron()
    names, t, X = motion(s, 240)
    frames, _, _ = observe(X, seed=3)
    rng = np.random.default_rng(13)
    frames = [f + rng.normal(0, 1e-3, f.shape) for f in frames]          # ~1 mm of noise in all
    cfg = IngestConfig(labeller=LabellerConfig(initial_transform=GUESS))
    n0 = cfg.labeller.auto_refresh_frames

    def bias_mm(P, sl):
        """The largest systematic error of a node over the frames ``sl``: its mean error's norm, mm."""
        return 1e3 * float(np.max(np.linalg.norm(np.nanmean(P[sl] - X[sl], axis=0), axis=1)))

    live = MocapIngest(s, cfg)
    P_live = np.stack([live.add_frame(tk, m).positions for tk, m in zip(t, frames)])
    series = ingest_markers(s, t, frames, cfg)
    P_off = series.positions
    first12, first, rest = slice(0, 12), slice(0, n0), slice(n0, None)
    assert bias_mm(P_live, first) < 1.0, bias_mm(P_live, first)                   # 4.9 mm with one refresh
    # the first frames, live, are in transforms averaged over only a few frames; offline, in the final one
    assert bias_mm(P_live, first12) > 2 * bias_mm(P_off, first12), (bias_mm(P_live, first12), bias_mm(P_off, first12))
    assert bias_mm(P_off, first) < min(0.8, 1.5 * bias_mm(P_off, rest)), (bias_mm(P_off, first), bias_mm(P_off, rest))
    np.testing.assert_allclose(P_off[rest], P_live[rest], rtol=0, atol=1e-12)      # after the last re-fit: as live
    assert np.array_equal(series.valid, ~np.isnan(P_off).any(axis=2))


def test_stacked_manipulator_static_if_present():
    """The stacked manipulator: 24 marker nodes (virtual plate duplicates skipped),
    3-fold symmetric, so it needs the guess; three occluded nodes come back; the seed's plate frames."""
    path = MODELS / "stacked_manipulator.yaml"
    if not path.exists():
        pytest.skip("config/models/stacked_manipulator.yaml not there yet")
    s = load_structure(path)
    names = physical_nodes(s)
    assert len(names) == 24
    X0 = np.array([s.nodes[s.node_index(n)].position for n in names])
    X = np.repeat(X0[None], 150, axis=0)
    hidden = np.array([names.index(n) for n in ("n11", "n14", "n20")])
    frames, truth, visible = observe(X, occlusions=[(slice(30, 100), hidden)])
    ing = MocapIngest(s, IngestConfig(labeller=LabellerConfig(initial_transform=GUESS)))
    out, labelled = [], []
    for k, f in enumerate(frames):
        out.append(ing.add_frame(k / RATE, f))
        labelled.append(ing.last_frame)
    assert np.array_equal(np.array([o.valid for o in out]), visible)
    assert count_swaps(labelled, truth) == 0
    assert set(out[-1].plate_poses) == {"C0", "C1", "C2"} and out[50].plate_poses["C1"] is None
    assert transform_error(*ing.transform) < 1e-3


def test_the_guess_decides_between_labellings_that_pass(tmp_path):
    """A robot is never in its file's shape. The suite's icosahedron (fixed at an equilateral face, a draw of its
    true parameters sagging under gravity, seed 1, 20 % occlusion) was registered with a labelling turned 120 deg:
    9.2 mm RMS against the file, where the right one (the lab's guess is 3 deg off) left 14.6 mm, beyond the
    ambiguity margin, so the guess was never asked; every node of the recording came out 12-35 mm off. With the
    guess deciding between the labellings that pass the RMS limits, the registration is the guess's."""
    import dataclasses
    import json

    from tensegrity_ros.bags import TopicNames, read_robot_bag
    from tensegrity_ros.commands._common import load_mocap_frame
    from tensegrity_ros.frames import invert_transform
    from tensegrity_ros.mocap.geometry import rotation_angle
    from tensegrity_ros.validation import independent as I
    habits = dataclasses.replace(I.LabHabits(), occlusion=0.2)
    I.record(I.load_suite_structure("icosa6_fixed3"), tmp_path, seed=1, duration_s=1.0, habits=habits)
    true = invert_transform(np.array(json.loads((tmp_path / "recording.json").read_text())["true_mocap_transform"]))
    guess = invert_transform(load_mocap_frame(tmp_path / "mocap_guess.yaml").matrix)
    rec = read_robot_bag(tmp_path / "bag", TopicNames())
    nominal = load_structure(tmp_path / "nominal.yaml")

    def registered_off_deg(tolerance_deg):
        lab = MarkerLabeller(nominal, LabellerConfig(initial_transform=guess,
                                                     initial_transform_tolerance_deg=tolerance_deg))
        for tk, m in zip(rec.marker_times, rec.markers):
            if lab.add_frame(tk, m).registered:
                return np.degrees(rotation_angle(lab.transform[0] @ true[:3, :3].T))
        raise AssertionError("never registered")

    assert np.degrees(rotation_angle(guess[:3, :3] @ true[:3, :3].T)) == pytest.approx(3.0, abs=0.1)
    assert registered_off_deg(45.0) < 1.0
    assert registered_off_deg(180.0) > 100.0        # the guess allowed anywhere: the best RMS alone, as before
