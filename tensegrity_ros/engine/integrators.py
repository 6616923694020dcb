"""Time integrators (registry by name), generic over the configuration type.

A system is given by ``accel(x, v) -> (a, aux)`` plus, for configurations that are not plain vectors
(quaternions), ``xdot(x, v)`` (configuration rate) and ``add(x, dx, h)`` (x + h dx). Inputs are held
constant over the step (zero-order hold, like MuJoCo's ctrl).

* ``semi_implicit`` (symplectic Euler, the spring-rod seed's Sec. 3.4): v1 = v + h a(x, v); x1 = x + h v1.
* ``rk4``: classical 4th-order Runge-Kutta on (x, v).
* ``implicit`` (nodal engine only): semi-implicit Euler with the string damping linearly implicit (like
  MuJoCo's ``implicitfast``), for heavily damped strings on light bars; see
  :func:`tensegrity_ros.engine.laws.implicit_step`. It needs the engine's structure, so :func:`get` has no
  generic version of it.

Both return (x1, v1, aux) where ``aux`` is what ``accel`` returned at the start of the step.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

INTEGRATORS = ("semi_implicit", "rk4", "implicit")


def _plain_xdot(x, v):
    return v


def _plain_add(x, dx, h):
    return x + h * dx


def semi_implicit(x, v, accel: Callable, dt: float, xdot: Callable = _plain_xdot,
                  add: Callable = _plain_add) -> Tuple[Any, Any, Any]:
    """Symplectic Euler: v1 = v + dt a(x, v), x1 = x (+) dt xdot(x, v1)."""
    a, aux = accel(x, v)
    v1 = v + dt * a
    return add(x, xdot(x, v1), dt), v1, aux


def rk4(x, v, accel: Callable, dt: float, xdot: Callable = _plain_xdot,
        add: Callable = _plain_add) -> Tuple[Any, Any, Any]:
    """Classical RK4 on (x, v)."""
    h = 0.5 * dt
    a1, aux = accel(x, v)
    k1 = xdot(x, v)
    x2, v2 = add(x, k1, h), v + h * a1
    a2, _ = accel(x2, v2)
    k2 = xdot(x2, v2)
    x3, v3 = add(x, k2, h), v + h * a2
    a3, _ = accel(x3, v3)
    k3 = xdot(x3, v3)
    x4, v4 = add(x, k3, dt), v + dt * a3
    a4, _ = accel(x4, v4)
    k4 = xdot(x4, v4)
    dx = _comb(k1, k2, k3, k4)
    v1 = v + (dt / 6.0) * (a1 + 2.0 * a2 + 2.0 * a3 + a4)
    return add(x, dx, dt / 6.0), v1, aux


def _comb(k1, k2, k3, k4):
    if isinstance(k1, tuple):
        return tuple(_comb(*ks) for ks in zip(k1, k2, k3, k4))
    return k1 + 2.0 * k2 + 2.0 * k3 + k4


def get(name: str) -> Callable:
    """The integrator called ``name``; ValueError listing the valid names otherwise."""
    if name == "semi_implicit":
        return semi_implicit
    if name == "rk4":
        return rk4
    if name == "implicit":
        raise ValueError("the 'implicit' integrator is specific to the nodal engine (laws.implicit_step)")
    raise ValueError(f"unknown integrator {name!r} (valid: {', '.join(INTEGRATORS)})")
