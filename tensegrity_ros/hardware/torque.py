"""Torque constants: what ``JointState.effort`` on ``/tensegrity/motor_states`` is measured in.

A Dynamixel reports Present Current (A, :meth:`~.dynamixel.tables.ControlTable.current_to_amp`), not torque.
Where ROBOTIS' e-Manual gives a stall torque with its current, their ratio is used as the torque constant and the
driver publishes the effort in N·m (``current x k``); models without such a figure are left out of
:data:`TORQUE_CONSTANTS`, and a bus with any of them publishes current in A for every motor (one unit per message,
named by :func:`effort_unit` and the driver's ``/diagnostics`` key ``effort_unit``).

Sources (ROBOTIS e-Manual, specification tables, stall torque at the recommended 12.0 V):

* XM430-W350 (https://emanual.robotis.com/docs/en/dxl/x/xm430-w350/): 4.1 N·m at 12.0 V, 2.3 A -> 1.783 N·m/A.
* XM540-W270 (https://emanual.robotis.com/docs/en/dxl/x/xm540-w270/): 10.6 N·m at 12.0 V, 4.4 A -> 2.409 N·m/A
  (the e-Manual prints 2.409 Nm/A itself).
* PRO L54-50-S290-R and M42-10-S260-R (https://emanual.robotis.com/docs/en/dxl/pro/l54-50-s290-r/, .../m42-10-s260-r/):
  no stall figure; continuous torque and current only, with a large no-load current (L54-50-S290-R: 4.8 N·m at
  1.9 A, 1.05 A with no load), so no torque constant follows from them: these publish current (A).

The ratio is the stall point's: below stall the gearbox friction and the no-load current make ``k x I`` an upper
estimate of the output torque (a few tenths of a N·m on an XM430). It is a unit, not a calibrated torque sensor.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Tuple

import numpy as np

from .dynamixel.tables import get_table

#: {canonical model name (tables.TABLES key): N·m per A}: e-Manual stall torque / stall current at 12.0 V
TORQUE_CONSTANTS: Mapping[str, float] = {
    "xm430": 4.1 / 2.3,
    "xm540": 10.6 / 4.4,
}

NEWTON_METRE = "N.m"
AMPERE = "A"


def torque_constant(model: str) -> Optional[float]:
    """N·m per A of ``model`` (any alias :func:`~.dynamixel.tables.get_table` accepts), None when unknown."""
    return TORQUE_CONSTANTS.get(get_table(model).model)


def effort_scale(models: Iterable[str]) -> Tuple[str, np.ndarray]:
    """(unit, scale (A,)): effort = current (A) x scale, per motor in ``models`` order.

    Every constant known: ("N.m", the constants); any unknown: ("A", ones), so a message never mixes units.
    """
    ks = [torque_constant(m) for m in models]
    if ks and all(k is not None for k in ks):
        return NEWTON_METRE, np.asarray(ks, dtype=float)
    return AMPERE, np.ones(len(ks))


def effort_unit(models: Iterable[str]) -> str:
    """"N.m" when every model's torque constant is known, else "A" (see :func:`effort_scale`)."""
    return effort_scale(models)[0]
