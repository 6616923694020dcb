"""Differentiable tensegrity engines (PyTorch): pure functions over frozen, typed params and states.

    from tensegrity_ros.engine import make_engine
    eng = make_engine(structure, backend="nodal", integrator="semi_implicit")
    params = eng.default_params()            # or default_params(batch=B): many hypotheses at once
    s0 = eng.initial_state(batch=B)
    states = eng.rollout(params, s0, Inputs(motor_angles=u), dt=1e-3)   # u: (T, B, A) rad

Backends: ``nodal`` (reduced-coordinate nodal dynamics, the main engine; composite strings, constraints,
actuators) and ``spring_rod`` (the spring-rod seed's rod engine: rods with {p, v, q, w}). Integrators:
``semi_implicit`` and ``rk4``. See docs/engine.md.
"""
from __future__ import annotations

import os
from typing import Optional

# Tensors of 2 MB and more in transparent huge pages (PyTorch's CPU allocator reads this at its first allocation;
# a user's own setting, 0 included, wins). A rollout's outputs are fresh tensors of tens of MB, and faulting them
# in 4-kB pages cost more than the steps as rollouts grew: on this project's 2-core AMD EPYC (2026-12-03,
# batch 1024, float32, compiled, alternating processes, 3 each) the manipulator's 500-step rollouts ran at
# 0.45-0.59 M item-steps/s without, 0.64-0.87 M with; the icosahedron's 1.38-1.70 M against 2.19-2.89 M; a fresh
# 88-MB tensor filled in 41 ms against 9 ms. Only large allocations change (the nodes' messages do not).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from ..model import Structure
from ._common import setup_compile
from .integrators import INTEGRATORS
from .nodal import NodalEngine, StringUnitForces, string_unit_forces
from .params import (KIND_NAMES, REST_LENGTH_BOUNDS, TRANSFORMS, Params, ParamsMeta, apply_to_structure,
                     from_unconstrained, load_params_yaml, params_from_structure, save_params_yaml, stack_params,
                     to_unconstrained)
from .spring_rod import SpringRodEngine
from .state import Inputs, RodState, State, inputs_from_angles
from .topology import Topology, build_topology

#: backend name -> engine class
BACKENDS = {"nodal": NodalEngine, "spring_rod": SpringRodEngine}


def make_engine(structure: Structure, backend: str = "nodal", integrator: str = "semi_implicit",
                dtype: torch.dtype = torch.float64, device: Optional[torch.device] = None, **options):
    """Build an engine for ``structure``.

    backend: ``nodal`` | ``spring_rod``; integrator: ``semi_implicit`` | ``rk4``. ``dtype``/``device`` are
    those of the engine's constants and default params/states; computations follow the inputs' dtype and
    device. ``options``: nodal: ``baumgarte=(alpha, beta)``, ``projection_iters``, ``solver``;
    spring_rod: ``tension_only``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (valid: {', '.join(BACKENDS)})")
    if integrator not in INTEGRATORS:
        raise ValueError(f"unknown integrator {integrator!r} (valid: {', '.join(INTEGRATORS)})")
    return BACKENDS[backend].create(structure, integrator=integrator, dtype=dtype, device=device, **options)


__all__ = ["setup_compile", "BACKENDS", "INTEGRATORS", "Inputs", "KIND_NAMES", "NodalEngine", "Params", "ParamsMeta",
           "REST_LENGTH_BOUNDS", "RodState", "SpringRodEngine", "State", "StringUnitForces", "TRANSFORMS",
           "Topology", "apply_to_structure", "build_topology", "from_unconstrained", "inputs_from_angles",
           "load_params_yaml", "make_engine", "params_from_structure", "save_params_yaml", "stack_params",
           "string_unit_forces", "to_unconstrained"]
