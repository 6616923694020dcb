"""Frozen pytrees of tensors for engine states and inputs.

All are registered with ``torch.utils._pytree`` (so ``tree_map``, ``torch.func`` and ``torch.compile`` see
their tensors) and have ``.map(fn)``. A rollout returns the same classes with a leading time axis T.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.utils._pytree as pytree

from ._common import register_tensor_dataclass


class _Tree:
    """Mixin: ``map`` and ``replace`` for frozen dataclasses of (optional) tensors."""

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """Apply ``fn`` to every tensor field (None fields stay None)."""
        return pytree.tree_map(lambda t: None if t is None else fn(t), self)

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def __getitem__(self, index):
        """Index every tensor's leading axes, e.g. ``states[t]`` (time) or ``state[:, None]``."""
        return self.map(lambda t: t[index])


@register_tensor_dataclass
@dataclass(frozen=True)
class State(_Tree):
    """Nodal state (rollouts: a leading time axis T is added to every field).

    positions: (B, N, 3) positions of ALL structure nodes (virtual and fixed included), structure order, m.
    velocities: (B, N, 3) node velocities, m/s.
    """

    positions: torch.Tensor
    velocities: torch.Tensor


@register_tensor_dataclass
@dataclass(frozen=True)
class RodState(_Tree):
    """Spring-rod state: rod rigid-body state plus the derived node positions/velocities.

    positions: (B, N, 3) positions of all structure nodes (rod ends; fixed nodes at their file position), m.
    velocities: (B, N, 3) node velocities, m/s.
    rod_positions: (B, R, 3) rod centres p, m.
    rod_velocities: (B, R, 3) rod centre velocities v, m/s.
    rod_orientations: (B, R, 4) unit quaternions q (w, x, y, z), local z axis = from the bar's first to
        its second node.
    rod_angular_velocities: (B, R, 3) angular velocity w in the world frame, rad/s.
    """

    positions: torch.Tensor
    velocities: torch.Tensor
    rod_positions: torch.Tensor
    rod_velocities: torch.Tensor
    rod_orientations: torch.Tensor
    rod_angular_velocities: torch.Tensor


@register_tensor_dataclass
@dataclass(frozen=True)
class Inputs(_Tree):
    """Inputs for one step (``step``) or a sequence (``rollout``: add a leading time axis T to every field).

    Each field may be None (zero) and may omit the batch dim B (broadcast).
    motor_angles: (B, A) motor angles u, rad (held over the step).
    motor_velocities: (B, A) motor angular velocities u', rad/s, giving xi0' = Y u' in the damping term
        (None: xi0' = 0; see :func:`inputs_from_angles` to get them by finite differences).
    external_forces: (B, N, 3) forces on nodes, N (forces on constrained/fixed nodes are mapped through T^T).
    control_forces: (B, R, 3) spring-rod only: world-frame forces on rods, N (scaled by control_force_scalar).
    control_arms: (B, R, 3) spring-rod only: application points in the rod's local frame, m (None: centre).
    """

    motor_angles: Optional[torch.Tensor] = None
    motor_velocities: Optional[torch.Tensor] = None
    external_forces: Optional[torch.Tensor] = None
    control_forces: Optional[torch.Tensor] = None
    control_arms: Optional[torch.Tensor] = None


def inputs_from_angles(motor_angles: torch.Tensor, dt: float, **other) -> Inputs:
    """Sequence inputs with motor velocities from finite differences of ``motor_angles`` (T, B, A) rad.

    Central differences inside, one-sided at the ends (second order everywhere for smooth signals).
    """
    u = motor_angles
    if u.shape[0] < 2:
        v = torch.zeros_like(u)
    else:
        v = torch.gradient(u, spacing=dt, dim=0, edge_order=1)[0]
    return Inputs(motor_angles=u, motor_velocities=v, **other)


def rollout_horizon(inputs: Optional[Inputs], steps: Optional[int]) -> int:
    """The number of steps a rollout runs: the inputs' leading time axis T, or ``steps``; they must agree."""
    lengths = set()
    if inputs is not None:
        for t in (inputs.motor_angles, inputs.motor_velocities, inputs.external_forces, inputs.control_forces,
                  inputs.control_arms):
            if t is not None:
                lengths.add(int(t.shape[0]))
    if steps is not None:
        lengths.add(int(steps))
    if len(lengths) != 1:
        raise ValueError(f"rollout needs one horizon: inputs with a leading time axis T (or steps=T); got {lengths}")
    return lengths.pop()
