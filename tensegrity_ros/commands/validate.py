"""`tensegrity validate MODEL.yaml`: exit 0 with a summary, or exit 2 naming file, key and value."""
from __future__ import annotations

from ._common import load_model


def add_arguments(parser) -> None:
    parser.add_argument("model", help="structure file (YAML)")


def run(args) -> int:
    s = load_model(args.model)          # any bad file (binary, not YAML, invalid) is a one-line UserError
    n_segments = sum(len(st.segments) for st in s.strings)
    n_virtual = sum(1 for c in s.constraints if c.type == "coincident")
    print(f"{args.model}: OK  '{s.name}'")
    print(f"  nodes {len(s.nodes)} ({len(s.fixed_nodes)} fixed, {n_virtual} virtual), bars {len(s.bars)}, "
          f"strings {len(s.strings)} composite / {n_segments} simple, constraints {len(s.constraints)}, "
          f"actuators {len(s.actuators)}, gravity {list(s.gravity)}")
    if s.std_devs:
        print(f"  carries {len(s.std_devs)} identified standard deviations")
    return 0
