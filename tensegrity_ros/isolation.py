"""Keep simulated graphs off a real robot's network (rclpy-free: launch files and the CLI import it).

Why: with the ROS 2 defaults (domain 0, discovery across the whole subnet) a demo or a simulation
started on a lab laptop joins the graph of a real robot on the same network: its simulated motor
states, markers and identified parameters (and a bag replay's /clock) reach the robot's nodes as if
they were real, and two ``/tensegrity/motor_commands`` publishers could fight over the motors. So a
simulated graph (``tensegrity demo``, ``sim.launch.py``, ``replay.launch.py``) runs on a domain of its
own, :data:`DEMO_DOMAIN_ID`, and discovers this host only (:data:`LOCALHOST_ONLY_ENV`), unless the user
chose otherwise: an explicit ``ROS_DOMAIN_ID`` / ``ROS_AUTOMATIC_DISCOVERY_RANGE`` in the environment
wins over these defaults, an explicit argument wins over both. rcl reads both variables when a context
starts, so apply :func:`isolated_env`'s result before ``rclpy.init`` (or with ``SetEnvironmentVariable``
before the first node of a launch file). The real robot's ``manipulator.launch.py`` does not use it.
See docs/hardware.md, "Isolating and securing the graph".
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Union

DOMAIN_ID_VAR = "ROS_DOMAIN_ID"
DISCOVERY_RANGE_VAR = "ROS_AUTOMATIC_DISCOVERY_RANGE"

#: the domain simulated graphs use when ROS_DOMAIN_ID is not set (the real robots use others)
DEMO_DOMAIN_ID = 42
#: what makes a graph discover this host only (ROS 2 Jazzy's improved dynamic discovery)
LOCALHOST_ONLY_ENV: Dict[str, str] = {DISCOVERY_RANGE_VAR: "LOCALHOST"}
#: the values rcl accepts for ROS_AUTOMATIC_DISCOVERY_RANGE
DISCOVERY_RANGES = ("LOCALHOST", "SUBNET", "OFF", "SYSTEM_DEFAULT")
#: the largest domain id the DDS port formula allows on Linux (0-101 are always safe)
MAX_DOMAIN_ID = 232


def _given(value) -> bool:
    return value is not None and str(value).strip() != ""


def _domain(value: Union[int, str], where: str) -> str:
    try:
        d = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where}: ROS domain id must be an integer 0..{MAX_DOMAIN_ID}, got {value!r}") from None
    if not 0 <= d <= MAX_DOMAIN_ID:
        raise ValueError(f"{where}: ROS domain id must be in 0..{MAX_DOMAIN_ID} (0..101 are safe), got {d}")
    return str(d)


def _range(value: str, where: str) -> str:
    r = str(value).strip().upper()
    if r not in DISCOVERY_RANGES:
        raise ValueError(f"{where}: {DISCOVERY_RANGE_VAR} must be one of {DISCOVERY_RANGES}, got {value!r}")
    return r


def isolated_env(environ: Mapping[str, str], domain_id: Optional[Union[int, str]] = None,
                 discovery_range: Optional[str] = None) -> Dict[str, str]:
    """The ``ROS_DOMAIN_ID`` and ``ROS_AUTOMATIC_DISCOVERY_RANGE`` a simulated graph should run with.

    Each value is, in order of precedence: the explicit argument; the user's non-empty setting in
    ``environ``; the default (:data:`DEMO_DOMAIN_ID`, ``LOCALHOST``). Returns both keys, as strings,
    for ``os.environ.update(...)``; ``environ`` is not modified. Raises ValueError on a domain id
    outside 0..232 or a discovery range rcl does not know (case is normalised: ``localhost`` ->
    ``LOCALHOST``).
    """
    if _given(domain_id):
        domain = _domain(domain_id, "domain_id")
    elif _given(environ.get(DOMAIN_ID_VAR)):
        domain = _domain(environ[DOMAIN_ID_VAR], DOMAIN_ID_VAR)
    else:
        domain = str(DEMO_DOMAIN_ID)
    if _given(discovery_range):
        rng = _range(discovery_range, "discovery_range")
    elif _given(environ.get(DISCOVERY_RANGE_VAR)):
        rng = _range(environ[DISCOVERY_RANGE_VAR], DISCOVERY_RANGE_VAR)
    else:
        rng = LOCALHOST_ONLY_ENV[DISCOVERY_RANGE_VAR]
    return {DOMAIN_ID_VAR: domain, DISCOVERY_RANGE_VAR: rng}


def launch_actions(environ: Mapping[str, str]):
    """The ``domain_id`` / ``discovery_range`` launch arguments and the ``SetEnvironmentVariable`` actions that
    apply them to every process started after them (put them before the first Node of a simulated graph's
    launch file). Defaults: :func:`isolated_env` of ``environ``. Imports ``launch`` only when called, so this
    module stays importable without it."""
    from launch.actions import DeclareLaunchArgument, SetEnvironmentVariable
    from launch.substitutions import LaunchConfiguration

    env = isolated_env(environ)
    return [
        DeclareLaunchArgument("domain_id", default_value=env[DOMAIN_ID_VAR],
                              description=f"{DOMAIN_ID_VAR} of the simulated graph (default {DEMO_DOMAIN_ID} "
                                          f"unless {DOMAIN_ID_VAR} is set): keep it off the real robots' domains"),
        DeclareLaunchArgument("discovery_range", default_value=env[DISCOVERY_RANGE_VAR],
                              description=f"{DISCOVERY_RANGE_VAR}: LOCALHOST (default unless set) | SUBNET | OFF "
                                          "| SYSTEM_DEFAULT"),
        SetEnvironmentVariable(DOMAIN_ID_VAR, LaunchConfiguration("domain_id")),
        SetEnvironmentVariable(DISCOVERY_RANGE_VAR, LaunchConfiguration("discovery_range")),
    ]
