"""`tensegrity export-mjcf PARAMS.yaml --out model.xml [--force]`: a structure file (e.g. identified parameters)
as an MJCF model that MuJoCo loads, the same model the twin simulates (:func:`tensegrity_ros.twin.build_mjcf`).

The file starts with an XML comment that says how to drive it: each string's actuator takes its rest length
(metres), not a motor angle, and which motor angle gives which rest length (and, for ``cord`` strings, which
stiffness).
"""
from __future__ import annotations

import os

from . import UserError
from ._common import add_force_argument, atomic_output, check_output_target, finite, load_model

INTEGRATORS = ("implicitfast", "implicit", "Euler", "RK4")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="structure file (YAML), e.g. identified parameters from `tensegrity identify`")
    parser.add_argument("--out", required=True, help="MJCF file to write (e.g. model.xml)")
    parser.add_argument("--timestep", default="0.001", help="MuJoCo timestep, s (default 0.001, as the twin)")
    parser.add_argument("--integrator", default="implicitfast", choices=INTEGRATORS,
                        help="MuJoCo integrator (default implicitfast, as the twin)")
    parser.add_argument("--ground", action="store_true", help="add a ground plane with contacts (default: none)")
    add_force_argument(parser)


def _g(x: float) -> str:
    return f"{float(x):.10g}"


def actuator_comment(s, source: str) -> str:
    """The text of the XML comment: the actuator convention and the motor-angle -> rest-length map."""
    lines = [
        f"tensegrity export-mjcf of {os.path.basename(source)} (structure {s.name!r}), the MuJoCo twin's model.",
        "Strings: one spatial tendon and one general actuator per string, both named after it.",
        "Each actuator is a position servo on its tendon length L (gain kappa, bias 0, -kappa, -zeta):",
        "  force = kappa * (ctrl - L) - zeta * dL/dt, clamped to [-1e7, 0] N (pull only),",
        "  so ctrl is the string's REST LENGTH xi0 in metres, not a motor angle.",
        "Keyframe 'nominal': the file's pose with ctrl = nominal rest lengths xi00 (every motor at its zero offset).",
        "Motor angle u (rad, velocity du) -> rest length of the string it drives (docs/CONTRACTS.md string law):",
        "  xi0 = xi00 + direction * spool_radius * (u - zero_offset); set ctrl = xi0 + (zeta / kappa) * dxi0/dt,",
        "  dxi0/dt = direction * spool_radius * du (the damping acts on the stretch rate dL/dt - dxi0/dt).",
        "  cord-law strings: kappa = stiffness * xi00 / xi0 also changes with u: set actuator_gainprm[0] = kappa and",
        "  actuator_biasprm[1] = -kappa (this file holds kappa at xi0 = xi00); spring-law strings: kappa = stiffness.",
    ]
    by_act = {st.actuator: st for st in s.strings if st.actuator}
    if s.actuators:
        lines.append("Actuated strings (ctrl = xi0):")
    for a in s.actuators:
        st = by_act.get(a.name)
        if st is None:
            lines.append(f"  motor {a.name} (id {a.motor_id}): drives no string")
            continue
        k = a.direction * a.spool_radius
        law = (f"kappa = {_g(st.stiffness * st.rest_length)} / xi0 N/m" if st.stiffness_law == "cord"
               else f"kappa = {_g(st.stiffness)} N/m")
        lines.append(f"  {st.name} <- motor {a.name} (id {a.motor_id}): xi0 = {_g(st.rest_length)} + {_g(k)} * "
                     f"(u - {_g(a.zero_offset)}) m, {st.stiffness_law} law: {law}, zeta = {_g(st.damping)} N s/m")
    lines += [
        "Slack strings: the string law pulls only while L > xi0; the twin (tensegrity_ros.twin.TwinSim) zeroes the",
        "gains of slack strings every step (Euler-type integrators); a plain mj_step does not.",
    ]
    if s.std_devs:
        lines.append(f"The file's {len(s.std_devs)} identified standard deviations have no MJCF counterpart "
                     "(values only).")
    return "\n" + "\n".join("  " + ln.replace("--", "- -") for ln in lines) + "\n"


def export_xml(s, source: str, timestep: float = 0.001, integrator: str = "implicitfast",
               ground: bool = False) -> str:
    """MJCF text of structure ``s`` (:func:`tensegrity_ros.twin.build_mjcf`) with the actuator comment first."""
    import xml.etree.ElementTree as ET

    from ..twin import TwinBuildError, build_mjcf

    try:
        xml = build_mjcf(s, timestep=timestep, integrator=integrator, ground=ground)
    except TwinBuildError as err:
        raise UserError(f"{source}: cannot build an MJCF model: {err}") from err
    root = ET.fromstring(xml)
    root.insert(0, ET.Comment(actuator_comment(s, source)))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode") + "\n"


def run(args) -> int:
    dt = finite("--timestep", args.timestep, lo=0, lo_open=True, hi=0.1, hint="seconds, e.g. 0.001")
    out = check_output_target(args.out, "--out", args.force, kind="file", inputs=[args.model])
    if os.path.abspath(args.model) == str(out):
        raise UserError(f"--out {args.out}: is the input file; choose another path")
    s = load_model(args.model)
    xml = export_xml(s, args.model, dt, args.integrator, args.ground)
    import mujoco

    try:
        mujoco.MjModel.from_xml_string(xml)          # what we write must load
    except ValueError as err:
        raise UserError(f"{args.model}: MuJoCo rejects the exported model: {' '.join(str(err).split())}") from err
    with atomic_output(out, "file", args.force, "--out") as tmp:
        tmp.write_text(xml, encoding="utf-8")
    print(f"{args.out}: MJCF of '{s.name}' ({len(s.bars)} bars, {len(s.strings)} strings, "
          f"{len(s.actuators)} motors; ctrl = rest lengths, see the comment at the top)")
    return 0
