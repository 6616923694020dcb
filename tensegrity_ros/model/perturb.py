"""A "true robot" that differs from its nominal model: for simulated identification experiments."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .schema import Structure


def perturb_structure(structure: Structure, spread: float, seed: int = 0,
                      kinds=("stiffness", "damping", "mass")) -> Structure:
    """A copy with every string stiffness/damping and bar mass scaled by (1 + spread * N(0, 1)).

    Factors are clipped to [0.5, 1.5] so the structure stays prestressed and every value stays positive;
    node positions and rest lengths are unchanged (the twin settles into the new equilibrium).
    """
    rng = np.random.default_rng(seed)

    def factor() -> float:
        return float(np.clip(1.0 + spread * rng.standard_normal(), 0.5, 1.5))

    strings = tuple(replace(s, **{k: getattr(s, k) * factor() for k in ("stiffness", "damping") if k in kinds})
                    for s in structure.strings)
    bars = tuple(b.with_mass(b.mass * factor()) if "mass" in kinds else b for b in structure.bars)
    note = f"Perturbed from '{structure.name}': {', '.join(kinds)} x (1 + {spread:g} N(0,1)), numpy seed {seed}."
    return replace(structure, strings=strings, bars=bars, notes=(structure.notes + "\n" + note).strip())
