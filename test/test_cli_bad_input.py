"""`tensegrity` on bad input: no user data destroyed, and no traceback (issue 16, item 5).

One table, one row per case. Each row runs ``tensegrity_ros.cli.main`` in-process inside an empty folder holding
only the row's user files, and checks the exit code, the one line on stderr, and the folder afterwards: a failed
run changes nothing and leaves nothing (no temporary sibling, no empty ``--out``); a successful one changes
only its outputs. ``forbid`` makes a step fail the test if it is reached (the bag read, the simulation): bad
input must be refused before any work. ``interrupt`` raises KeyboardInterrupt there instead (Ctrl-C mid-run).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import pytest

from tensegrity_ros.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "config" / "models" / "stacked_manipulator.yaml")
SMALL = str(ROOT / "config" / "models" / "spring_rod.yaml")          # fast to simulate
READ_BAG, SIMULATE = "tensegrity_ros.bags.read_robot_bag", "tensegrity_ros.twin.simulate"
EMULATOR_RUN = "tensegrity_ros.hardware.dynamixel.emulator.run"

USER_REPORT = {"rep/mine.txt": b"precious notes\n"}
USER_PARAMS = {"params.yaml": b"name: keep me\n"}
USER_OUT = {"o/mine.txt": b"my own results\n"}
USER_BAG = {"recording/mine.txt": b"my recording\n"}
RANDOM_BYTES = random.Random(16).randbytes(4096)
IDENTIFY = ["identify", "no_bag_needed", "--model", MODEL, "--out", "new.yaml"]
WEIGHED_BAD = Path(SMALL).read_text().replace("  mass: 10.0\n", "  mass: 10.0\n  mass_std: two percent\n",
                                              1).encode()
SIM = ["simulate", SMALL, "--duration", "0.2", "--settle", "0"]


@dataclass
class Case:
    id: str
    argv: Sequence[str]
    err: str                                     # expected in stderr
    files: Dict[str, bytes] = field(default_factory=dict)   # the user's files, there before the run
    code: int = 2
    forbid: Optional[str] = None                 # must not be reached (work before the input was checked)
    interrupt: Optional[str] = None              # Ctrl-C arrives here
    outputs: Sequence[str] = ()                  # top-level names a successful run may create or replace
    check: Optional[Callable[[Path], None]] = None
    as_user: bool = False                        # needs file permissions to apply (skipped as root)
    env: Dict[str, str] = field(default_factory=dict)       # environment variables set for the run


def _replaced_out(tmp: Path) -> None:
    assert (tmp / "o" / "summary.json").is_file() and not (tmp / "o" / "mine.txt").exists()


def _replaced_bag(tmp: Path) -> None:
    assert sorted(p.name for p in (tmp / "recording").iterdir()) == ["metadata.yaml", "recording.mcap"]


def _bag_inside_out(tmp: Path) -> None:
    assert (tmp / "o" / "summary.json").is_file() and (tmp / "o" / "bag" / "metadata.yaml").is_file()


CASES = [
    # ---- existing outputs are refused without --force, before any work -----------------------------------
    Case("identify-report-exists", IDENTIFY + ["--report", "rep"], "--report rep: the folder exists and is not "
         "empty", USER_REPORT, forbid=READ_BAG),
    Case("identify-out-exists", ["identify", "b", "--model", MODEL, "--out", "params.yaml"], "--force",
         USER_PARAMS, forbid=READ_BAG),
    Case("simulate-bag-exists", SIM + ["--out", "o2", "--bag", "recording"], "--bag recording: the folder exists",
         USER_BAG, forbid=SIMULATE),
    Case("simulate-out-exists", SIM + ["--out", "o"], "--out o: the folder exists and is not empty", USER_OUT,
         forbid=SIMULATE),
    Case("identify-report-is-cwd", IDENTIFY + ["--report", ".", "--force"], "somewhere else", USER_PARAMS,
         forbid=READ_BAG),
    Case("identify-out-inside-report", IDENTIFY[:-1] + ["rep2/p.yaml", "--report", "rep2"], "inside the --report",
         forbid=READ_BAG),
    # ---- structure files that are not YAML text ------------------------------------------------------------
    Case("validate-model-binary", ["validate", "/bin/ls"], "/bin/ls: <file> = b'\\x7fELF"),
    Case("simulate-model-random-bytes", ["simulate", "random.yaml", "--duration", "0.2", "--out", "o"],
         "random.yaml: <file>", {"random.yaml": RANDOM_BYTES}, forbid=SIMULATE),
    Case("identify-model-not-utf8", ["identify", "b", "--model", "latin1.yaml", "--out", "p.yaml"],
         "latin1.yaml: line 1 = b'\\xe9\\n': not UTF-8 text (byte offset 9)", {"latin1.yaml": b"name: caf\xe9\n"},
         forbid=READ_BAG),
    Case("validate-model-control-char", ["validate", "ctl.yaml"], "ctl.yaml: line 2 = None: not valid YAML",
         {"ctl.yaml": b"name: x\nnodes: \x01\n"}),
    # ---- flags ---------------------------------------------------------------------------------------------
    Case("simulate-duration-nan", SIM[:3] + ["nan", "--out", "o"], "--duration nan: expected a finite number > 0",
         forbid=SIMULATE),
    Case("simulate-duration-inf", SIM[:3] + ["inf", "--out", "o"], "--duration inf: expected a finite number > 0",
         forbid=SIMULATE),
    Case("simulate-reference-missing", ["simulate", MODEL, "--duration", "0.2", "--out", "o", "--reference",
                                        "nope.yaml"],
         "--reference nope.yaml: cannot read it", forbid=SIMULATE),
    Case("identify-estimate-typo", IDENTIFY + ["--estimate", "stifness"], "--estimate 'stifness': unknown name(s)",
         forbid=READ_BAG),
    Case("identify-refine-kinds-typo", IDENTIFY + ["--refine-kinds", "mass,rest_lenght"], "'rest_lenght'",
         forbid=READ_BAG),
    Case("identify-window-nan", IDENTIFY + ["--window", "nan"], "--window nan: expected a finite number > 0",
         forbid=READ_BAG),
    # ---- settings from the environment ------------------------------------------------------------------------
    Case("identify-blas-unknown", IDENTIFY, "TENSEGRITY_BLAS='mkl': valid values are auto, torch, numpy",
         forbid=READ_BAG, env={"TENSEGRITY_BLAS": "mkl"}),
    # ---- several bags (issue 17 item 7): each there and given once, before any is read -------------------------
    Case("identify-second-bag-missing", ["identify", "recording", "nope", "--model", MODEL, "--out", "p.yaml"],
         "nope: no such bag (bag 2 of 2", USER_BAG, forbid=READ_BAG),
    Case("identify-bag-given-twice", ["identify", "recording", "./recording", "--model", MODEL, "--out", "p.yaml"],
         "./recording: given twice (bags 1 and 2)", USER_BAG, forbid=READ_BAG),
    # ---- a bar's mass_std in the structure file (issue 17 item 4), the --truth file ----------------------------
    Case("identify-model-mass-std-bad", ["identify", "b", "--model", "weighed.yaml", "--out", "p.yaml"],
         "weighed.yaml: bars[0].mass_std = 'two percent': expected the mass's standard deviation in kg",
         {"weighed.yaml": WEIGHED_BAD}, forbid=READ_BAG),
    Case("identify-truth-missing", IDENTIFY + ["--report", "rep", "--truth", "nope.yaml"],
         "--truth nope.yaml: no such file", forbid=READ_BAG),
    # ---- outputs that cannot be written: refused before the (long) identification ---------------------------
    Case("identify-out-in-proc", IDENTIFY[:-1] + ["/proc/x.yaml"], "--out /proc/x.yaml: cannot write in /proc",
         forbid=READ_BAG),
    Case("identify-out-in-readonly-dir", IDENTIFY[:-1] + ["ro/p.yaml"], "--out ro/p.yaml: cannot write in",
         {"ro/": b""}, forbid=READ_BAG, as_user=True),
    # ---- emulate-bus id lists --------------------------------------------------------------------------------
    Case("emulate-bus-ids-reversed", ["emulate-bus", "--ids", "6-1"], "--ids '6-1': the range 6-1 is empty"),
    Case("emulate-bus-ids-empty", ["emulate-bus", "--ids", ","], "--ids ',': no motor ids"),
    Case("emulate-bus-ids-malformed", ["emulate-bus", "--ids", "1,x"], "'x' is not an id or a range"),
    Case("emulate-bus-ids-out-of-range", ["emulate-bus", "--ids", "250-260"], "id 260 is out of range"),
    Case("emulate-bus-link-live-symlink", ["emulate-bus", "--ids", "1", "--link", "ttyDXL"],
         "a symlink to /dev/null exists", {"ttyDXL@": b"/dev/null"}, forbid=EMULATOR_RUN),
    Case("emulate-bus-link-regular-file", ["emulate-bus", "--ids", "1", "--link", "notes.txt"],
         "exists and is not a symlink", {"notes.txt": b"my notes\n"}, forbid=EMULATOR_RUN),
    # ---- failures mid-run leave nothing, and --force never deletes before the new result exists -------------
    Case("simulate-interrupted", SIM + ["--out", "o2", "--bag", "b"], "", code=130, interrupt=SIMULATE),
    Case("simulate-force-interrupted", SIM + ["--out", "o", "--force"], "", USER_OUT, code=130, interrupt=SIMULATE),
    Case("identify-force-interrupted", ["identify", "b", "--model", MODEL, "--out", "params.yaml", "--report", "rep",
                                        "--force"], "", {**USER_REPORT, **USER_PARAMS}, code=130, interrupt=READ_BAG),
    # ---- successes: --force replaces, an empty folder is fine, no temporary sibling stays -------------------
    Case("simulate-out-force-replaces", SIM + ["--out", "o", "--force"], "", USER_OUT, code=0, outputs=["o"],
         check=_replaced_out),
    Case("simulate-bag-force-replaces", SIM + ["--out", "o2", "--bag", "recording", "--force"], "", USER_BAG,
         code=0, outputs=["o2", "recording"], check=_replaced_bag),
    Case("simulate-empty-out-bag-inside", SIM + ["--out", "o", "--bag", "o/bag"], "", {"o/": b""}, code=0,
         outputs=["o"], check=_bag_inside_out),
]


def _snapshot(folder: Path) -> Dict[str, Optional[bytes]]:
    """Every path under ``folder`` (hidden ones too): file contents, None for folders."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), folder)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, folder)] = Path(p).read_bytes()
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_input(case: Case, tmp_path, monkeypatch, capsys):
    if case.as_user and os.geteuid() == 0:
        pytest.skip("root writes through file permissions")
    monkeypatch.chdir(tmp_path)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    for name, data in case.files.items():
        p = tmp_path / name
        if name.endswith("/"):
            p.mkdir(parents=True)
        elif name.endswith("@"):                # a symlink to ``data``
            os.symlink(data.decode(), tmp_path / name[:-1])
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    if case.as_user:
        (tmp_path / "ro").chmod(0o555)
    if case.forbid:
        monkeypatch.setattr(case.forbid, lambda *a, **k: pytest.fail(f"{case.forbid} reached before the input "
                                                                     "was refused"))
    if case.interrupt:
        def ctrl_c(*a, **k):
            raise KeyboardInterrupt
        monkeypatch.setattr(case.interrupt, ctrl_c)
    before = _snapshot(tmp_path)

    rc = main(list(case.argv))
    err = capsys.readouterr().err

    assert rc == case.code, err
    assert case.err in err
    if case.code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tensegrity ") and ": error: " in lines[0], err
    after = _snapshot(tmp_path)
    assert not [p for p in after if ".tmp-" in p or ".old-" in p or ".probe-" in p], after.keys()
    if case.code != 0:
        assert after == before                  # the user's files untouched, nothing new (no empty --out)
    else:
        top = lambda p: Path(p).parts[0]        # noqa: E731
        assert {p: v for p, v in before.items() if top(p) not in case.outputs} == \
            {p: v for p, v in after.items() if top(p) not in case.outputs}
        assert all(top(p) in case.outputs for p in set(after) - set(before))
        case.check(tmp_path)
