"""The rclpy-free core of the Dynamixel driver node.

:class:`DriverCore` runs one control cycle at a time (``cycle(now)``): read the motor states,
compute the goals from the active command source through the :class:`~.safety.SafetyFilter`,
sync-write them, and return a typed :class:`MotorStates` record plus :class:`DriverStats`. The
bus is a :class:`~.dynamixel.bus.DynamixelBus` on a real port or on the emulator's pty: the same
SDK code path either way; :func:`make_bus` picks one from ``bus: real|emulated``.

Lifecycle (the managed node's transitions map one to one): :meth:`DriverCore.connect` (configure: open the port,
ping every motor, check its model number, position mode, first states; torque stays off), :meth:`~DriverCore.enable`
(activate: refused while a motor reports a hardware error; holds the present angles, torque on),
:meth:`~DriverCore.disable` (deactivate: torque off, the port stays open and ``cycle`` goes on reading: the motors
are limp, their states still measured), :meth:`~DriverCore.shutdown` (cleanup / shutdown: torque off, port closed).
:meth:`~DriverCore.start` is connect + enable (the plain node, ``run``). :meth:`~DriverCore.reboot` reboots every
motor with torque off and re-checks them; :func:`reboot_refusal` says when a reboot is refused.

Torque goes off on every exit path: :meth:`DriverCore.shutdown` (idempotent) is called by
``run()``'s ``finally``, by ``__exit__``, by the node's ``destroy_node``/signal handlers, and the
bus itself has an ``atexit`` hook. A fatal condition inside ``cycle`` (hardware error with a
shutdown bit, a motor missing) turns torque off *before* the typed error propagates.

Effort: ``MotorStates.efforts`` is in N·m where every motor's torque constant is known
(:mod:`.torque`: the e-Manual's stall torque / current), else the Present Current in A; ``DriverCore.effort_unit``
and ``DriverStats.effort_unit`` name it ("N.m" or "A"), ``MotorStates.currents`` is always A.

Angles: commands, limits and published states are motor angles in rad (0 = the control table's
zero tick: 2048 on X, 0 on PRO), exactly the ``u`` of the string law in docs/CONTRACTS.md; the
actuator's ``direction``/``zero_offset``/``spool_radius`` belong to the string model, not here.

:class:`RateScheduler` is a fixed-rate loop helper with absolute deadlines (no drift), measuring
the period jitter and the missed cycles.

:func:`check_command_publishers` is the rule the node applies to ``/tensegrity/motor_commands``: topic
commands are refused while more than one node publishes them.

Motor plans (``/tensegrity/motor_plan``, :mod:`.plan`): :meth:`DriverCore.set_plan` hands one over. A fresh
plan is followed, through the same safety filter, while the command source is ``plan`` or ``reference`` (a plan
preempts the reference sinusoids; the switch blends over ``ramp_s``); ``topic`` and ``hold`` are an operator's
explicit choices and a plan does not override them. A plan older than ``plan_timeout_s`` (or past its last
point) is stale: the driver HOLDS the last safe goal and says so (``DriverStats.plan_state`` = ``stale``, the
node's /diagnostics WARN) until a fresh plan arrives or the command source is set again. It does not go back to
the reference: the reference's clock ran on while the plan was followed, so going back means a motion to a
distant point of the sinusoids that nobody asked for at the moment a controller failed; holding leaves the robot
where its last safe command put it, as the topic watchdog does.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .dynamixel.bus import DynamixelBus, MotorReading
from .dynamixel.errors import DynamixelError, HardwareError, ModelMismatch, MotorMissing
from .dynamixel.tables import decode_hardware_error, get_table
from .plan import Plan, PlanError, plan_state
from .safety import Action, SafetyConfig, SafetyFilter, State
from .torque import effort_scale

log = logging.getLogger(__name__)

COMMAND_SOURCES = ("reference", "topic", "hold", "plan")


# ---- records ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MotorStates:
    """One cycle's measurement, in actuator order."""

    stamp: float
    names: Tuple[str, ...]
    motor_ids: Tuple[int, ...]
    positions: Tuple[float, ...]    # rad (last known value when not ``valid``)
    velocities: Tuple[float, ...]   # rad/s
    efforts: Tuple[float, ...]      # N·m, or A where a torque constant is unknown (DriverCore.effort_unit)
    errors: Tuple[int, ...]         # Hardware Error Status bits
    valid: Tuple[bool, ...]         # False when the motor did not answer this cycle
    goals: Tuple[float, ...]        # goals written this cycle (rad)
    currents: Tuple[float, ...] = ()   # A (Present Current)


@dataclass
class DriverStats:
    cycles: int = 0
    missed_cycles: int = 0
    loop_rate_hz: float = 0.0
    period_median_s: float = 0.0
    period_p99_s: float = 0.0
    jitter_p99_s: float = 0.0
    read_failures: int = 0
    state: str = "init"
    command_source: str = "hold"
    motor_counters: Dict[int, Dict[str, int]] = field(default_factory=dict)
    safety_counters: Dict[str, int] = field(default_factory=dict)
    hardware_errors: Dict[int, int] = field(default_factory=dict)
    last_error: str = ""
    plan_state: str = "none"          # none | following | stale (holding) | ignored (source topic / hold)
    plan_reason: str = ""             # why the plan is stale or ignored
    plans_received: int = 0
    plans_stale: int = 0              # times a followed plan went stale (each time the motors were held)
    torque_on: bool = False
    effort_unit: str = "A"            # of JointState.effort: "N.m" (torque constants known) or "A" (current)


# ---- fixed-rate scheduler -------------------------------------------------------------------------
class RateScheduler:
    """Absolute-deadline fixed-rate loop.

    ``wait()`` sleeps until the next deadline ``t0 + k * period`` (never ``sleep(period)``, so
    the loop does not drift). If the caller overran by a whole period or more, the skipped
    deadlines are counted in ``missed`` and the schedule jumps forward instead of bursting.
    """

    def __init__(self, rate_hz: float = 80.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, window: int = 4096):
        if not rate_hz > 0:
            raise ValueError("rate_hz must be > 0")
        self.rate_hz = float(rate_hz)
        self.period = 1.0 / self.rate_hz
        self.clock, self.sleep = clock, sleep
        self.window = int(window)
        self.t0: Optional[float] = None
        self.k = 0
        self.missed = 0
        self.cycles = 0
        self._last_wake: Optional[float] = None
        self._periods: List[float] = []

    def start(self, now: Optional[float] = None) -> float:
        self.t0 = self.clock() if now is None else now
        self.k = 0
        self._last_wake = self.t0
        return self.t0

    def wait(self) -> float:
        """Sleep until the next deadline; returns the wake-up time."""
        if self.t0 is None:
            return self.start()
        self.k += 1
        deadline = self.t0 + self.k * self.period
        now = self.clock()
        late = now - deadline
        if late >= self.period * (1 - 1e-9):
            skipped = int(math.floor(late / self.period + 1e-9))
            self.missed += skipped
            self.k += skipped
            deadline = self.t0 + self.k * self.period
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:
                break
            self.sleep(remaining)
        wake = self.clock()
        if self._last_wake is not None:
            self._periods.append(wake - self._last_wake)
            if len(self._periods) > self.window:
                del self._periods[: len(self._periods) - self.window]
        self._last_wake = wake
        self.cycles += 1
        return wake

    def periods(self) -> np.ndarray:
        return np.asarray(self._periods, dtype=float)

    def summary(self) -> Dict[str, float]:
        p = self.periods()
        if p.size == 0:
            return {"rate_hz": 0.0, "period_median_s": 0.0, "period_p99_s": 0.0, "jitter_median_s": 0.0,
                    "jitter_p99_s": 0.0, "missed_cycles": self.missed, "cycles": self.cycles}
        jitter = np.abs(p - self.period)
        return {"rate_hz": float(1.0 / np.mean(p)), "period_median_s": float(np.median(p)),
                "period_p99_s": float(np.percentile(p, 99)), "jitter_median_s": float(np.median(jitter)),
                "jitter_p99_s": float(np.percentile(jitter, 99)), "missed_cycles": self.missed,
                "cycles": self.cycles}


# ---- configuration ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MotorSpec:
    """Minimal actuator record (duck-type compatible with ``tensegrity_ros.model.Actuator``)."""

    name: str
    motor_id: int
    model: str = "xm430"
    limits: Tuple[float, float] = (-math.pi, math.pi)
    spool_radius: float = 0.0
    direction: int = 1
    zero_offset: float = 0.0


@dataclass(frozen=True)
class BusConfig:
    """A bus YAML (``config/hardware/*.yaml``)."""

    bus: str = "real"                 # real | emulated
    port: str = "/dev/ttyUSB0"        # for emulated: optional symlink path ("" = none)
    baud: int = 1_000_000
    rate_hz: float = 80.0
    watchdog_s: float = 0.25
    max_rate_rad_s: float = 1.0
    ramp_s: float = 1.0
    retries: int = 2
    missing_after: int = 3
    fast_sync_read: Optional[bool] = None
    latency_ms: Optional[float] = None
    motors: Tuple[MotorSpec, ...] = ()
    emulator: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BusConfig":
        known = {"bus", "port", "baud", "rate_hz", "watchdog_s", "max_rate_rad_s", "ramp_s", "retries",
                 "missing_after", "fast_sync_read", "latency_ms", "motors", "emulator"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown bus config keys {sorted(unknown)}; known: {sorted(known)}")
        motors = []
        for m in d.get("motors") or []:
            lim = m.get("limits", (-math.pi, math.pi))
            motors.append(MotorSpec(name=str(m.get("name", f"motor_{m['id']}")), motor_id=int(m["id"]),
                                    model=str(m.get("model", "xm430")),
                                    limits=(float(lim[0]), float(lim[1]))))
        for m in motors:
            get_table(m.model)  # validate model names early
        kind = str(d.get("bus", "real"))
        if kind not in ("real", "emulated"):
            raise ValueError(f"bus must be 'real' or 'emulated', got {kind!r}")
        fsr = d.get("fast_sync_read")
        lat = d.get("latency_ms")
        return cls(bus=kind, port=str(d.get("port", "/dev/ttyUSB0") or ""), baud=int(d.get("baud", 1_000_000)),
                   rate_hz=float(d.get("rate_hz", 80.0)), watchdog_s=float(d.get("watchdog_s", 0.25)),
                   max_rate_rad_s=float(d.get("max_rate_rad_s", 1.0)), ramp_s=float(d.get("ramp_s", 1.0)),
                   retries=int(d.get("retries", 2)), missing_after=int(d.get("missing_after", 3)),
                   fast_sync_read=None if fsr is None else bool(fsr),
                   latency_ms=None if lat is None else float(lat), motors=tuple(motors),
                   emulator=dict(d.get("emulator") or {}))


def load_bus_config(path: str) -> BusConfig:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return BusConfig.from_dict(data)


def resolve_actuators(config: BusConfig, actuators: Optional[Sequence] = None) -> Tuple:
    """The actuators to drive: the structure file's if given (cross-checked against the bus
    config's motor list when that has one), else the bus config's motor list."""
    if actuators is None:
        if not config.motors:
            raise ValueError("no actuators: give a structure file or a 'motors' list in the bus config")
        return tuple(config.motors)
    actuators = tuple(actuators)
    if config.motors:
        want = {m.motor_id: get_table(m.model).model for m in config.motors}
        have = {a.motor_id: get_table(a.model).model for a in actuators}
        if want != have:
            raise ValueError(f"bus config motors {want} do not match the structure's actuators {have} "
                             f"(id: model); fix one of them")
    return actuators


def make_bus(config: BusConfig, actuators: Sequence, emulator_options: Optional[Mapping[str, Any]] = None):
    """(DynamixelBus, EmulatedBus or None) for ``config.bus`` = real | emulated.

    Either way the returned DynamixelBus talks to a serial device through dynamixel_sdk; for
    ``emulated`` the device is an :class:`~.dynamixel.emulator.EmulatedBus` pty started here
    (the caller owns it and must ``stop()`` it after closing the bus).
    """
    motors = {int(a.motor_id): str(a.model) for a in actuators}
    common = dict(retries=config.retries, fast_sync_read=config.fast_sync_read,
                  missing_after=config.missing_after, latency_ms=config.latency_ms)
    if config.bus == "real":
        return DynamixelBus(config.port, config.baud, motors, **common), None
    from .dynamixel.emulator import EmulatedBus, FaultConfig

    opts = dict(config.emulator)
    opts.update(emulator_options or {})
    faults = opts.pop("faults", None)
    if isinstance(faults, Mapping):
        faults = FaultConfig(drop_probability=float(faults.get("drop_probability", 0.0)),
                             corrupt_crc_probability=float(faults.get("corrupt_crc_probability", 0.0)),
                             hardware_errors={int(k): int(v) for k, v in (faults.get("hardware_errors") or {}).items()},
                             silent_ids=set(int(i) for i in faults.get("silent_ids") or ()))
    emu = EmulatedBus(list(motors), motors, baud=config.baud, link_path=config.port or None, faults=faults, **opts)
    return DynamixelBus(emu.port, config.baud, motors, **common), emu


# ---- who may command the motors --------------------------------------------------------------------------
COMMANDS_TOPIC = "/tensegrity/motor_commands"
#: the node name rmw reports for an endpoint whose participant has not (yet) said which node it is
UNKNOWN_NODE_MARK = "_NODE_NAME_UNKNOWN_"


@dataclass(frozen=True)
class PublisherCheck:
    """Whether the driver takes topic commands, given the nodes that publish them."""

    accept: bool
    publishers: Tuple[str, ...]   # the publishing nodes, sorted (an unknown node once per publisher)
    reason: str = ""              # why they are refused ("" when accepted)


def check_command_publishers(publishers: Sequence[str], topic: str = COMMANDS_TOPIC) -> PublisherCheck:
    """Accept topic commands only while at most one node publishes them.

    ``publishers``: the node name (e.g. ``/ns/name``) of each publisher on ``topic``, one entry per
    publisher, as the ROS graph reports them. A node with several publishers counts once; publishers
    whose node is unknown (empty, or rmw's ``_NODE_NAME_UNKNOWN_``: a non-ROS DDS writer, or one still
    being discovered) each count as a node of their own, since they cannot be told apart. Two or more
    nodes: refused, the reason naming them (two commanders, or a simulation that joined a real robot's
    graph, must not take turns on the motors). None or one: accepted.
    """
    known, unknown = set(), []
    for p in publishers:
        p = (p or "").strip()
        if not p or UNKNOWN_NODE_MARK in p:
            unknown.append(p or "?")
        else:
            known.add(p)
    names = tuple(sorted(known)) + tuple(unknown)
    if len(names) <= 1:
        return PublisherCheck(True, names)
    return PublisherCheck(False, names, f"{len(names)} nodes publish {topic} ({', '.join(names)}): topic commands "
                                        "refused until only one does")


def command_goals(names: Sequence[str], msg_names: Sequence[str], positions: Sequence[float]
                  ) -> Tuple[Optional[Union[Dict[str, float], List[float]]], str]:
    """A /tensegrity/motor_commands JointState as :meth:`DriverCore.set_topic_command` goals: {name: rad} for the
    names the driver knows, or the positions in actuator order when unnamed; (None, why) when it is ignored."""
    if msg_names:
        goals = {n: float(v) for n, v in zip(msg_names, positions) if n in names}
        return (goals, "") if goals else (None, f"motor command names {list(msg_names)} match none of {list(names)}")
    if len(positions) != len(names):
        return None, f"unnamed motor command with {len(positions)} positions ignored: {len(names)} motors"
    return [float(v) for v in positions], ""


# ---- command sources ------------------------------------------------------------------------------------
ReferenceFn = Callable[[float], Sequence[float]]


class DriverCore:
    """One control loop over a bus; see the module docstring.

    Args:
        bus: a :class:`DynamixelBus` (opened by :meth:`start` if needed).
        actuators: objects with ``.name, .motor_id, .model, .limits`` (and the string-model fields).
        rate_hz: loop rate for :meth:`run`.
        reference: t -> goal angles (rad, actuator order), t in s since the reference source
            became active.
        command_source: "reference" | "topic" | "hold".
    """

    def __init__(self, bus: DynamixelBus, actuators: Sequence, *, rate_hz: float = 80.0,
                 max_rate_rad_s: float = 1.0, watchdog_s: float = 0.25, ramp_s: float = 1.0,
                 command_source: str = "hold", reference: Optional[ReferenceFn] = None,
                 clock: Callable[[], float] = time.monotonic, operating_mode: str = "position",
                 emulator: Any = None, plan_timeout_s: float = 0.25):
        self.bus = bus
        self.actuators = tuple(actuators)
        if not self.actuators:
            raise ValueError("no actuators")
        ids = [int(a.motor_id) for a in self.actuators]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate motor ids {ids}")
        missing = [i for i in ids if i not in bus.tables]
        if missing:
            raise ValueError(f"motor ids {missing} are not on the bus {list(bus.tables)}")
        self.names = tuple(a.name for a in self.actuators)
        self.ids = tuple(ids)
        self.tables = [bus.tables[i] for i in ids]
        bounds = [t.angle_range for t in self.tables]
        self.safety = SafetyFilter(SafetyConfig.from_actuators(
            self.actuators, max_rate_rad_s=max_rate_rad_s, watchdog_s=watchdog_s, ramp_s=ramp_s, bounds=bounds))
        self.rate_hz = float(rate_hz)
        self.clock = clock
        self.operating_mode = operating_mode
        self.emulator = emulator
        self._reference = reference
        self._ref_t0 = 0.0
        if command_source not in COMMAND_SOURCES:
            raise ValueError(f"command_source must be one of {COMMAND_SOURCES}")
        if command_source == "reference" and reference is None:
            raise ValueError("command_source 'reference' needs a reference function")
        self.command_source = command_source
        self._topic_goal: Optional[np.ndarray] = None
        self._topic_stamp: Optional[float] = None
        if not (math.isfinite(plan_timeout_s) and plan_timeout_s > 0):
            raise ValueError(f"plan_timeout_s must be > 0, got {plan_timeout_s!r}")
        self.plan_timeout_s = float(plan_timeout_s)
        self._plan: Optional[Plan] = None
        self._lock = threading.RLock()
        self._n = len(ids)
        self._pos = np.full(self._n, np.nan)
        self._vel = np.zeros(self._n)
        self._eff = np.zeros(self._n)
        self._goals = np.full(self._n, np.nan)
        self._cur = np.zeros(self._n)
        self.effort_unit, self._effort_scale = effort_scale([t.model for t in self.tables])
        self.stats = DriverStats(command_source=command_source, effort_unit=self.effort_unit)
        self._cycle_times: List[float] = []
        self._connected = False          # port open, motors checked (configure)
        self._torque = False             # torque enabled by enable() (activate / ~/set_torque true)
        self._shut = False
        self._io = threading.RLock()     # one bus sequence at a time: a cycle, enable, disable, reboot

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Configured: the port is open and the motors were checked."""
        return self._connected and not self._shut and self.bus.is_open

    @property
    def torque_on(self) -> bool:
        return self._torque

    def connect(self, now: Optional[float] = None, settle_reads: int = 5) -> MotorStates:
        """Configure: open the port, ping every motor and check its model number (typed errors: PortNotFound,
        NoResponse, BaudMismatch, MotorMissing, ModelMismatch), torque off, position mode, read the first states.
        Hardware error bits are recorded, not raised (:meth:`enable` refuses them; :meth:`reboot` clears them).
        The port is closed again on any failure."""
        now = self.clock() if now is None else now
        with self._io:
            try:
                self._shut = False
                if not self.bus.is_open:
                    self.bus.open(check_hardware_errors=False)
                if not self._torque:   # a motor may still hold torque from an earlier run
                    self.bus.disable_torque(self.ids)
                self.bus.set_operating_mode(self.operating_mode, self.ids)
                readings = self._settle(settle_reads, "no state read at configure")
                self._connected = True
                self._update_from(readings)
                self.stats.hardware_errors = dict(self.bus.hardware_errors)
                self.stats.state = "torque_on" if self._torque else "torque_off"
                return self._states(now, readings)
            except BaseException:
                self.shutdown()
                raise

    def enable(self, now: Optional[float] = None, settle_reads: int = 5) -> MotorStates:
        """Activate / torque on: refused with HardwareError while a motor reports one (reboot it first); the goals
        start at the present angles (no jump), then follow the command source (the reference restarts at t=0).
        Torque is off again (port open) if anything fails."""
        now = self.clock() if now is None else now
        with self._io:
            if not self.connected:
                raise RuntimeError("DriverCore.connect() first (or it was shut down)")
            try:
                readings = self._settle(settle_reads, "no state read before torque on")
                self.bus.read_hardware_errors(self.ids)
                self.bus.raise_on_hardware_error()
                present = np.array([readings[i].position_rad for i in self.ids])
                self.safety.reset(present, now)
                self._ref_t0 = now
                self.bus.enable_torque(self.ids, hold_present=True)
                self._torque = True
                self._update_from(readings)
                self._goals = self.safety.last_goal.copy()
                self.stats.state, self.stats.torque_on = self.safety.state.value, True
                return self._states(now, readings)
            except BaseException:
                try:
                    self.disable()
                except Exception:
                    log.exception("torque off after a failed enable")
                raise

    def disable(self) -> List[int]:
        """Deactivate / torque off; the port stays open and :meth:`cycle` goes on reading the (limp) motors.
        Returns the ids where torque off was not confirmed."""
        with self._io:
            self._torque = False
            self.stats.torque_on = False
            if self.stats.state not in ("stopped", "shutdown"):
                self.stats.state = "torque_off"
            if not self.bus.is_open:
                return []
            failed = self.bus.disable_torque(self.ids)
            if failed:
                log.error("torque off not confirmed on motor(s) %s: cut the motor power if they still hold", failed)
            return failed

    def start(self, now: Optional[float] = None, settle_reads: int = 5) -> MotorStates:
        """connect + enable: open the bus, check the motors, hold the present positions and enable torque.
        Torque off and the port closed on any failure."""
        try:
            self.connect(now, settle_reads)
            return self.enable(now, settle_reads)
        except BaseException:
            self.shutdown()
            raise

    def reboot(self) -> str:
        """Torque off, REBOOT every motor, re-check them (ping, model number, position mode, hardware error status).
        Torque stays off. Returns what was done; raises MotorMissing / ModelMismatch / HardwareError when a motor
        does not come back clean. The caller decides whether a reboot is allowed now (:func:`reboot_refusal`)."""
        with self._io:
            if not self.connected:
                raise RuntimeError("the port is closed: configure the driver first")
            failed = self.disable()
            if failed:
                raise HardwareError(failed[0], 0, ("torque off not confirmed before the reboot",))
            for i in self.ids:
                self.bus.reboot(i)
            found = self.bus.ping(self.ids)
            for i in self.ids:
                if i not in found:
                    raise MotorMissing(i, "no answer to PING after REBOOT")
                if found[i] != self.bus.tables[i].model_number:
                    raise ModelMismatch(i, self.bus.tables[i].model_number, found[i])
            self.bus.set_operating_mode(self.operating_mode, self.ids)
            hw = self.bus.read_hardware_errors(self.ids)
            self.stats.hardware_errors = dict(hw)
            bad = next((i for i in self.ids if hw.get(i)), None)
            if bad is not None:
                raise HardwareError(bad, hw[bad], decode_hardware_error(hw[bad]))
            if self.safety.state is State.STOPPED:   # a latched fault is cleared by a clean reboot
                self.stats.state = "torque_off"
            self.stats.last_error = ""
            return (f"rebooted motors {list(self.ids)}: all answer with their model, no hardware error; "
                    "torque is off")

    def set_torque(self, on: bool, now: Optional[float] = None) -> Tuple[bool, str]:
        """``~/set_torque`` once the lifecycle allows it (:func:`torque_refusal`): (success, what happened)."""
        if on == self._torque:
            return True, f"torque already {'on' if on else 'off'}"
        try:
            if on:
                self.enable(now)
                return True, f"torque on: holding the present angles, then command source {self.command_source}"
            failed = self.disable()
        except DynamixelError as e:
            return False, error_text(e)
        if failed:
            return False, f"torque off not confirmed on motors {failed}: cut the motor power if they still hold"
        return True, "torque off: the motors are limp; their states are still published"

    def request_reboot(self, lifecycle_state: str) -> Tuple[bool, str]:
        """``~/reboot``: refused as :func:`reboot_refusal` says, else :meth:`reboot`; (success, what happened)."""
        why = reboot_refusal(lifecycle_state, self._torque, self.stats.plan_state)
        if why is not None:
            return False, "refused: " + why
        try:
            done = self.reboot()
        except DynamixelError as e:
            return False, "reboot failed, torque off: " + error_text(e)
        then = "~/set_torque true" if lifecycle_state == "active" else "activate the driver"
        return True, f"{done}; {then} to hold again"

    def _settle(self, reads: int, why: str) -> Dict[int, MotorReading]:
        readings: Dict[int, MotorReading] = {}
        for _ in range(max(1, reads)):
            readings.update(self.bus.read_states())
            if all(i in readings for i in self.ids):
                return readings
        missing = [i for i in self.ids if i not in readings]
        raise MotorMissing(missing[0], why)

    def shutdown(self) -> None:
        """Torque off and close the bus (idempotent; safe from any thread)."""
        if self._shut:
            return
        self._shut = True
        self._torque = self.stats.torque_on = False
        try:
            self.bus.close()
        finally:
            self._connected = False
            self.stats.state = "shutdown"

    def __enter__(self) -> "DriverCore":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- commands -------------------------------------------------------------------------------
    def set_command_source(self, source: str, now: Optional[float] = None) -> None:
        """Switch the command source; the goals blend from the current ones over ``ramp_s``."""
        if source not in COMMAND_SOURCES:
            raise ValueError(f"unknown command source {source!r}; use one of {COMMAND_SOURCES}")
        if source == "reference" and self._reference is None:
            raise ValueError("no reference loaded")
        now = self.clock() if now is None else now
        with self._lock:
            if source == self.command_source:
                return
            self.command_source = source
            if source == "reference":
                self._ref_t0 = now
            if source == "topic":
                self._topic_goal, self._topic_stamp = None, None
            self._plan = None                   # a new source starts clean: the next fresh plan is followed
            self.stats.plan_state, self.stats.plan_reason = "none", ""
            self.safety.begin_switch(now)
            self.stats.command_source = source

    def set_plan(self, times: Sequence[float], angles, received: Optional[float] = None) -> None:
        """A controller's plan: ``times`` (K,) s on this core's clock, strictly increasing; ``angles`` (K, A) rad
        in actuator order, NaN = keep that motor's goal; ``received`` (default now) starts its timeout."""
        times = np.asarray(times, dtype=float).reshape(-1)
        angles = np.asarray(angles, dtype=float).reshape(times.size, self._n)
        if times.size == 0 or not np.all(np.isfinite(times)) or np.any(np.diff(times) <= 0):
            raise ValueError("plan times must be finite and strictly increasing")
        received = self.clock() if received is None else float(received)
        with self._lock:
            self._plan = Plan(times, angles, received)
            self.stats.plans_received += 1

    def set_plan_from(self, t0: float, offsets, angles, now_ros: float) -> None:
        """A plan message's times onto this core's clock: ``t0`` its stamp and ``now_ros`` the ROS time now (s),
        ``offsets`` (K,) s from ``t0``; PlanError when it ended before it arrived."""
        now = self.clock()
        times = now + (float(t0) - float(now_ros)) + np.asarray(offsets, dtype=float)
        if times[-1] < now:
            raise PlanError(f"the plan ended {now - times[-1]:.2f} s before it arrived")
        self.set_plan(times, angles, received=now)

    def set_reference(self, reference: ReferenceFn, now: Optional[float] = None) -> None:
        with self._lock:
            self._reference = reference
            self._ref_t0 = self.clock() if now is None else now

    def set_topic_command(self, goals: Union[Sequence[float], Mapping[str, float]],
                          stamp: Optional[float] = None) -> None:
        """A goal command (rad) from the topic: actuator-order sequence or {name: angle} (missing
        names keep their current goal). ``stamp`` (driver clock) defaults to now."""
        stamp = self.clock() if stamp is None else stamp
        with self._lock:
            base = self._topic_goal if self._topic_goal is not None else \
                (self.safety.last_goal if self.safety.last_goal is not None else np.full(self._n, np.nan))
            if isinstance(goals, Mapping):
                g = np.array(base, dtype=float, copy=True)
                for name, v in goals.items():
                    if name not in self.names:
                        raise KeyError(f"unknown actuator {name!r}; known: {self.names}")
                    g[self.names.index(name)] = float(v) if v is not None else np.nan
            else:
                g = np.array(goals, dtype=float).reshape(-1)
                if g.size != self._n:
                    raise ValueError(f"command has {g.size} entries, expected {self._n}")
            self._topic_goal, self._topic_stamp = g, stamp

    def _target(self, now: float) -> Tuple[Optional[np.ndarray], Optional[float], bool]:
        """(goals or None = hold, command stamp, check the watchdog). Called with ``_lock`` held."""
        src = self.command_source
        if src in ("plan", "reference"):
            if self._plan is not None:
                return self._plan_target(now)
            if src == "plan":
                self.stats.plan_state, self.stats.plan_reason = "none", "no plan yet: holding"
                return None, None, False
        elif self._plan is not None:
            self.stats.plan_state, self.stats.plan_reason = "ignored", f"command source {src}"
        if src == "hold":
            return None, None, False
        if src == "topic":
            if self._topic_goal is None:
                return None, None, False
            return self._topic_goal.copy(), self._topic_stamp, True
        try:
            g = np.asarray(self._reference(now - self._ref_t0), dtype=float).reshape(-1)
        except Exception as e:  # a broken reference holds the goal, it does not kill the loop
            log.error("reference generator failed: %s", e)
            return None, None, False
        return g, None, False

    def _plan_target(self, now: float) -> Tuple[Optional[np.ndarray], Optional[float], bool]:
        """Follow the plan while it is fresh, else hold (see the module docstring). Called with ``_lock`` held."""
        fresh, why = plan_state(self._plan, now, self.plan_timeout_s)
        st = self.stats
        if fresh:
            if st.plan_state != "following":            # from the reference, a hold or a stale plan: blend in
                self.safety.begin_switch(now)
                log.info("following the motor plan")
            st.plan_state, st.plan_reason = "following", ""
            return self._plan.at(now), None, False
        if st.plan_state == "following":
            st.plans_stale += 1
            log.warning("motor plan stale (%s): holding the last safe goal", why)
        st.plan_state, st.plan_reason = "stale", why + ": holding the last safe goal"
        return None, None, False

    # ---- the cycle -------------------------------------------------------------------------------
    def cycle(self, now: Optional[float] = None) -> Tuple[MotorStates, DriverStats]:
        """Read, compute safe goals, write (torque off: read only). Raises typed DynamixelErrors after turning
        torque off."""
        with self._io:
            return self._cycle(now)

    def _cycle(self, now: Optional[float]) -> Tuple[MotorStates, DriverStats]:
        if not self.connected:
            raise RuntimeError("DriverCore.start() first (or it was shut down)")
        now = self.clock() if now is None else now
        try:
            readings = self.bus.read_states()
            self.stats.read_failures = sum(1 for i in self.ids if i not in readings)
            self._update_from(readings)
            if not self._torque:                # limp: the states are measured, no goal is written
                self._note_cycle(now)
                return self._states(now, readings), self._snapshot_stats()
            hw = {i: self.bus.hardware_errors.get(i, 0) for i in self.ids}
            with self._lock:  # the command source may be switched from another thread
                target, stamp, check = self._target(now)
                out = self.safety.step(now, target, command_stamp=stamp, hardware_errors=hw, check_watchdog=check)
            if out.action is Action.TORQUE_OFF_ALL:
                failed = self.bus.disable_torque()
                bad = next((i for i in self.ids if hw.get(i)), None)
                if failed:
                    log.error("torque off not confirmed on %s", failed)
                if bad is not None:
                    raise HardwareError(bad, hw[bad], decode_hardware_error(hw[bad]))
                raise HardwareError(self.ids[0], 0, ("safety filter stopped: " + self.safety.stop_reason,))
            self.bus.write_goals({i: float(g) for i, g in zip(self.ids, out.goals)})
            self._goals = out.goals
        except BaseException as e:
            self.stats.last_error = f"{type(e).__name__}: {e}"
            self._emergency_off()
            raise
        self._note_cycle(now)
        return self._states(now, readings), self._snapshot_stats()

    def _emergency_off(self) -> None:
        self._torque = self.stats.torque_on = False
        if self.safety.state is not State.STOPPED:
            self.safety.stop(self.stats.last_error or "exception")
        try:
            if self.bus.is_open:
                self.bus.disable_torque()
        except Exception:
            log.exception("torque off after an error failed; closing the bus")
            try:
                self.bus.close()
            except Exception:
                pass

    def _update_from(self, readings: Mapping[int, MotorReading]) -> None:
        for k, i in enumerate(self.ids):
            r = readings.get(i)
            if r is not None:
                self._pos[k], self._vel[k], self._cur[k] = r.position_rad, r.velocity_rad_s, r.current_a
                self._eff[k] = r.current_a * self._effort_scale[k]

    def _states(self, now: float, readings: Mapping[int, MotorReading]) -> MotorStates:
        return MotorStates(
            stamp=now, names=self.names, motor_ids=self.ids, positions=tuple(float(x) for x in self._pos),
            velocities=tuple(float(x) for x in self._vel), efforts=tuple(float(x) for x in self._eff),
            errors=tuple(int(self.bus.hardware_errors.get(i, 0)) for i in self.ids),
            valid=tuple(i in readings for i in self.ids), goals=tuple(float(x) for x in self._goals),
            currents=tuple(float(x) for x in self._cur))

    def _note_cycle(self, now: float) -> None:
        self.stats.cycles += 1
        self._cycle_times.append(now)
        if len(self._cycle_times) > 4 * max(int(self.rate_hz), 1):
            del self._cycle_times[: len(self._cycle_times) - 4 * max(int(self.rate_hz), 1)]
        if len(self._cycle_times) >= 2:
            span = self._cycle_times[-1] - self._cycle_times[0]
            if span > 0:
                self.stats.loop_rate_hz = (len(self._cycle_times) - 1) / span

    def _snapshot_stats(self) -> DriverStats:
        s = self.stats
        s.state = self.safety.state.value if self._torque else "torque_off"
        s.motor_counters = {i: dict(vars(c)) for i, c in self.bus.counters.items()}
        s.safety_counters = dict(vars(self.safety.counters))
        s.hardware_errors = dict(self.bus.hardware_errors)
        return s

    # ---- loop ------------------------------------------------------------------------------------------
    def loop(self, stop: threading.Event, on_cycle: Callable[[MotorStates, DriverStats], None],
             on_stats: Optional[Callable[[DriverStats], None]] = None, stats_every_s: float = 1.0,
             duration_s: Optional[float] = None, scheduler: Optional[RateScheduler] = None) -> DriverStats:
        """Cycle at ``rate_hz`` (absolute deadlines) until ``stop`` is set or ``duration_s`` has passed:
        ``on_cycle(states, stats)`` every cycle; the period statistics (median, p99, jitter over the window) and
        ``on_stats(stats)`` every ``stats_every_s`` (the node: once a second, not every cycle: they were ~5 % of the
        simulated robot's process at 80 Hz). Exceptions propagate, torque already off; the port stays open."""
        sched = scheduler or RateScheduler(self.rate_hz, clock=self.clock)
        t_end = None if duration_s is None else self.clock() + duration_s
        last = -math.inf
        sched.start()
        while not stop.is_set():
            now = sched.wait()
            if stop.is_set() or (t_end is not None and now >= t_end):
                break
            states, stats = self.cycle(now)
            stats.missed_cycles = sched.missed
            due = now - last >= stats_every_s
            if due:
                last = now
                summ = sched.summary()
                stats.period_median_s, stats.period_p99_s = summ["period_median_s"], summ["period_p99_s"]
                stats.jitter_p99_s = summ["jitter_p99_s"]
            on_cycle(states, stats)
            if due and on_stats is not None:
                on_stats(stats)
        self.stats.missed_cycles = sched.missed
        return self.stats

    def run(self, duration_s: Optional[float] = None, stop_event: Optional[threading.Event] = None,
            on_cycle: Optional[Callable[[MotorStates, DriverStats], None]] = None,
            scheduler: Optional[RateScheduler] = None) -> DriverStats:
        """Start (if needed) and :meth:`loop` until ``duration_s`` or ``stop_event``, the statistics every cycle;
        torque off and bus closed on every way out."""
        try:
            if not (self.connected and self._torque):
                self.start()
            return self.loop(stop_event or threading.Event(), on_cycle or (lambda states, stats: None),
                             stats_every_s=0.0, duration_s=duration_s, scheduler=scheduler)
        finally:
            self.shutdown()


# ---- what the node reports ----------------------------------------------------------------------------------
_LEVEL_RANK = {"ok": 0, "warn": 1, "error": 2}


def driver_diagnostics(stats: DriverStats, check: PublisherCheck, refused_commands: int = 0,
                       error: Optional[BaseException] = None) -> Tuple[str, str, List[Tuple[str, str]]]:
    """(level ok|warn|error, message, [(key, value)]) of the driver's /diagnostics status.

    ERROR: stopped (a fault, torque off), or topic commands refused while the source is ``topic``. WARN: hardware
    error bits, read failures, the safety filter holding, topic commands refused under another source, or a
    motor plan that went stale (the motors are held; ``plan_reason`` says why).
    """
    hw_bad = {i: b for i, b in stats.hardware_errors.items() if b}
    if error is not None or stats.state == "stopped":
        level, message = "error", f"stopped: {error or stats.last_error}"
    elif hw_bad or stats.read_failures or stats.state == "hold":
        level, message = "warn", f"state {stats.state}, read failures {stats.read_failures}"
    elif stats.state == "torque_off":
        level, message = "warn", "torque off: the motors are limp, states only (~/set_torque true to hold)"
    elif stats.plan_state == "stale":
        level, message = "warn", f"motor plan stale: {stats.plan_reason}"
    else:
        following = " following the motor plan" if stats.plan_state == "following" else ""
        level, message = "ok", f"running at {stats.loop_rate_hz:.1f} Hz{following}"
    if not check.accept:
        lv = "error" if stats.command_source == "topic" else "warn"
        message = check.reason if level == "ok" else f"{check.reason}; {message}"
        level = max(level, lv, key=_LEVEL_RANK.__getitem__)
    kv = [("state", stats.state), ("command_source", stats.command_source),
          ("loop_rate_hz", f"{stats.loop_rate_hz:.2f}"), ("cycles", str(stats.cycles)),
          ("missed_cycles", str(stats.missed_cycles)), ("period_median_ms", f"{stats.period_median_s * 1e3:.3f}"),
          ("period_p99_ms", f"{stats.period_p99_s * 1e3:.3f}"), ("jitter_p99_ms", f"{stats.jitter_p99_s * 1e3:.3f}"),
          ("topic_commands", "accepted" if check.accept else "refused"),
          ("command_publishers", ", ".join(check.publishers) or "none"),
          ("refused_commands", str(refused_commands)),
          ("plan_state", stats.plan_state), ("plan_reason", stats.plan_reason),
          ("plans_received", str(stats.plans_received)), ("plans_stale", str(stats.plans_stale)),
          ("torque", "on" if stats.torque_on else "off"), ("effort_unit", stats.effort_unit)]
    for i, c in sorted(stats.motor_counters.items()):
        kv.append((f"motor_{i}", " ".join(f"{k}={v}" for k, v in c.items())))
    for i, b in sorted(stats.hardware_errors.items()):
        kv.append((f"motor_{i}_hardware_error", f"0x{b:02X}"))
    for k, v in stats.safety_counters.items():
        kv.append((f"safety_{k}", str(v)))
    if error is not None and getattr(error, "hint", None):
        kv.append(("hint", error.hint))
    return level, message, kv


def publisher_change(prev: PublisherCheck, check: PublisherCheck, topic: str = COMMANDS_TOPIC
                     ) -> Optional[Tuple[str, str]]:
    """(log level "error" | "info", text) when the verdict on the command publishers changed, else None."""
    if not check.accept and (prev.accept or prev.publishers != check.publishers):
        return "error", check.reason
    if check.accept and not prev.accept:
        who = check.publishers[0] if check.publishers else "none"
        return "info", f"topic commands on {topic} accepted again (publisher: {who})"
    return None


def error_text(e: BaseException) -> str:
    """``Type: message. Hint: hint`` of a typed error (the hint when it has one)."""
    hint = getattr(e, "hint", "")
    return f"{type(e).__name__}: {getattr(e, 'message', e)}" + (f". Hint: {hint}" if hint else "")


# ---- the torque and reboot services ---------------------------------------------------------------------------
def reboot_refusal(lifecycle_state: str, torque_on: bool, plan_state: str) -> Optional[str]:
    """Why ``~/reboot`` is refused now, or None to go ahead (torque off, reboot, re-check).

    Refused while the port is closed (unconfigured: nothing to talk to) and while a motor plan is being followed
    with torque on: a controller is moving the robot, and a reboot drops every motor's torque mid-motion. Turn torque
    off first (``~/set_torque false``) or deactivate the node; a reboot with torque on otherwise (holding, reference,
    topic) turns it off first, as ROBOTIS' hardware interface does.
    """
    if lifecycle_state in ("unconfigured", "finalized"):
        return f"the driver is {lifecycle_state}: the port is closed; configure it first"
    if torque_on and plan_state == "following":
        return ("a motor plan is being followed with torque on: rebooting would drop the motors mid-motion; "
                "turn torque off first (~/set_torque false) or deactivate the driver")
    return None


def torque_refusal(lifecycle_state: str, enable: bool) -> Optional[str]:
    """Why ``~/set_torque`` is refused in this lifecycle state, or None. Torque follows the lifecycle: only an
    active driver (its loop running, goals checked by the safety filter) may turn it on; off is always accepted
    where the port is open."""
    if lifecycle_state in ("unconfigured", "finalized"):
        return f"the driver is {lifecycle_state}: the port is closed (torque is off); configure and activate it first"
    if enable and lifecycle_state != "active":
        return (f"the driver is {lifecycle_state}: torque goes on with the control loop; activate it "
                "(ros2 lifecycle set <node> activate)")
    return None


def reference_function(path: str, actuators: Sequence) -> ReferenceFn:
    """t -> goal angles (A,) rad in ``actuators`` order from a reference YAML (NaN = hold for an actuator the
    reference does not name); the limits are checked over its duration (or 60 s) up front."""
    from .. import references as R

    ref = R.load_reference(path)
    names = list(ref.actuator_names) if ref.actuator_names else [a.name for a in actuators]
    order = [names.index(a.name) if a.name in names else -1 for a in actuators]
    horizon = ref.duration_s if getattr(ref, "duration_s", None) else 60.0
    R.motor_angles(ref, actuators, np.linspace(0.0, horizon, 2001))  # limit check up front

    def reference(t: float) -> np.ndarray:
        u = R.motor_angles(ref, actuators, np.array([t]), check_limits=False)[0]
        return np.array([u[k] if k >= 0 else np.nan for k in order])

    return reference
