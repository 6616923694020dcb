"""The MPC core on small linear systems, where the answer is known.

* Unconstrained, it is finite-horizon LQR: the first input equals -K_0 x_0 from the Riccati recursion (1e-5),
  for a time-varying system linearised about a non-zero nominal (the deviation form's affine terms included).
* A target out of reach: the plan honours the actuator and rate limits exactly, the status says best effort,
  and the solver's own plan was already within its tolerance of them.
* A model error the controller does not know: without integral action a steady offset stays, with it the
  offset goes.
* Stale, non-finite and mis-shaped inputs: hold with a reason, or a clear error.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tensegrity_ros.control import LinearOutputMap, MPCOptions, PlateMPC, Status, project_plan

# zero-order hold (what LQR assumes), no rate cost, no integral, limits that never bind, tight OSQP tolerances
UNCONSTRAINED = dict(input_model="hold", rate_scale_rad_s=math.inf, integral_time_s=0.0, max_rate_rad_s=1e6,
                     eps_abs=1e-9, eps_rel=1e-9, max_iter=20000)


def tv_system(n=4, m=2, N=12, seed=0):
    """A lightly unstable, time-varying discrete system A_k, B_k (k = 0..N-1)."""
    rng = np.random.default_rng(seed)
    A0 = np.eye(n) + 0.1 * rng.standard_normal((n, n))
    A = np.stack([A0 + 0.02 * np.sin(0.5 * k) * np.eye(n, k=1) for k in range(N)])
    B = np.stack([0.1 * rng.standard_normal((n, m)) + 0.01 * k * np.eye(n, m) for k in range(N)])
    return A, B


def riccati_first_gain(A, B, Q, R, Qf):
    """K_0 of finite-horizon LQR: min sum_{k<N} x'Qx + u'Ru + x_N' Qf x_N, x_{k+1} = A_k x_k + B_k u_k."""
    P = Qf
    K = None
    for k in reversed(range(A.shape[0])):
        K = np.linalg.solve(R + B[k].T @ P @ B[k], B[k].T @ P @ A[k])
        P = Q + A[k].T @ P @ (A[k] - B[k] @ K)
    return K


@pytest.mark.parametrize("nominal", ["zero", "affine"])
def test_unconstrained_qp_is_finite_horizon_lqr(nominal):
    n, m, N = 4, 2, 12
    A, B = tv_system(n, m, N)
    q, r, qf = 3.0, 0.5, 20.0
    opts = MPCOptions(horizon_steps=N, block_steps=1, position_tol_m=1 / math.sqrt(q),
                      node_tol_m=1 / math.sqrt(q), terminal_factor=qf / q, effort_scale_rad=1 / math.sqrt(r),
                      **UNCONSTRAINED)
    mpc = PlateMPC(LinearOutputMap(np.eye(n)), -1e3 * np.ones(m), 1e3 * np.ones(m), opts)
    x0 = np.array([0.5, -0.3, 0.2, 0.1])
    if nominal == "zero":
        xbar, ubar = np.zeros((N + 1, n)), np.zeros((N, m))
    else:   # a nominal trajectory of the same (linear) system: the deviation form must give the same answer
        rng = np.random.default_rng(1)
        ubar = 0.3 * rng.standard_normal((N, m))
        xbar = np.zeros((N + 1, n))
        xbar[0] = rng.standard_normal(n)
        for k in range(N):
            xbar[k + 1] = A[k] @ xbar[k] + B[k] @ ubar[k]
    res = mpc.solve(x0, xbar, ubar, A, B, np.zeros(n), np.zeros(m), dt=0.01)
    assert res.status == Status.SOLVED, res.message
    K0 = riccati_first_gain(A, B, q * np.eye(n), r * np.eye(m), qf * np.eye(n))
    u0 = -K0 @ x0
    assert np.abs(u0).max() > 0.05                   # a non-trivial input, so matching it means something
    np.testing.assert_allclose(res.plan[0], u0, atol=1e-5)
    # the whole plan is the LQR open-loop sequence too: roll the Riccati policy forward
    x = x0.copy()
    P, Ks = qf * np.eye(n), []
    for k in reversed(range(N)):
        Kk = np.linalg.solve(r * np.eye(m) + B[k].T @ P @ B[k], B[k].T @ P @ A[k])
        P = q * np.eye(n) + A[k].T @ P @ (A[k] - B[k] @ Kk)
        Ks.insert(0, Kk)
    for k in range(N):
        uk = -Ks[k] @ x
        np.testing.assert_allclose(res.plan[k], uk, atol=1e-5)
        x = A[k] @ x + B[k] @ uk
    np.testing.assert_allclose(res.predicted[-1], x, atol=1e-5)


def first_order_plant(m=2, dt=0.05, tau=0.3, gain=1.0):
    """y relaxes to gain * u with time constant tau (the shape of a damped string stage, per motor)."""
    a = math.exp(-dt / tau)
    return np.eye(m) * a, np.eye(m) * gain * (1 - a)


def test_saturated_target_honours_limits_and_says_best_effort():
    m, N, dt = 2, 20, 0.05
    A1, B1 = first_order_plant(m, dt)
    A, B = np.repeat(A1[None], N, 0), np.repeat(B1[None], N, 0)
    lower, upper = np.array([-0.4, -0.2]), np.array([0.4, 0.3])
    opts = MPCOptions(horizon_steps=N, block_steps=2, position_tol_m=0.01, node_tol_m=0.01, max_rate_rad_s=1.5,
                      integral_time_s=0.0, eps_abs=1e-7, eps_rel=1e-7)
    mpc = PlateMPC(LinearOutputMap(np.eye(m)), lower, upper, opts)
    step = opts.max_rate_rad_s * opts.block_steps * dt
    u_prev = np.array([0.0, 0.1])
    x0 = np.array([0.3, -0.1])
    res = mpc.solve(x0, np.zeros((N + 1, m)), np.zeros((N, m)), A, B, np.array([2.0, -3.0]), u_prev, dt)
    assert res.status == Status.BEST_EFFORT, res.message
    assert res.active_limits > 0
    v = res.plan
    assert np.all(v >= lower - 1e-12) and np.all(v <= upper + 1e-12)
    d = np.diff(np.vstack([u_prev, v]), axis=0)
    assert np.abs(d).max() <= step + 1e-12
    assert res.projection_rad < 1e-4          # the QP itself had the constraints right (within tolerance)
    # both limits bind: motor 1 runs to its upper limit at the rate limit, motor 2 to its lower one
    np.testing.assert_allclose(v[-1], [upper[0], lower[1]], atol=1e-6)
    np.testing.assert_allclose(d[0], [step, -step], atol=1e-6)
    # a reachable target next: solved, no limit active, and a warm-started (reused) solver
    solver = mpc._solver
    x1 = np.array([0.1, 0.05])                # at rest at u = x (gain 1), asked to move 20 mrad / -10 mrad
    res2 = mpc.solve(x1, np.zeros((N + 1, m)), np.zeros((N, m)), A, B, x1 + [0.02, -0.01], x1, dt)
    assert res2.status == Status.SOLVED and res2.active_limits == 0 and mpc._solver is solver


def test_projection_is_exact():
    rng = np.random.default_rng(3)
    v = rng.uniform(-3, 3, (10, 3))
    lo, hi = np.array([-1.0, -0.5, 0.0]), np.array([1.0, 0.5, 2.0])
    p = project_plan(v, np.array([5.0, 0.0, -1.0]), lo, hi, 0.3)
    d = np.diff(np.vstack([np.clip([5.0, 0.0, -1.0], lo, hi), p]), axis=0)
    assert np.all(p >= lo) and np.all(p <= hi) and np.abs(d).max() <= 0.3 + 1e-15


@pytest.mark.parametrize("integral_time_s, disturbance", [(0.0, "none"), (0.3, "none"), (0.0, "state")])
def test_steady_model_error_is_removed(integral_time_s, disturbance):
    """The true plant's gain is 30 % below the model's: plain MPC leaves a steady offset; integral action, or
    the disturbance estimate, drives it to zero."""
    m, N, dt = 2, 20, 0.05
    A1, B1 = first_order_plant(m, dt)
    At, Bt = first_order_plant(m, dt, gain=0.7)
    opts = MPCOptions(horizon_steps=N, block_steps=2, position_tol_m=0.01, node_tol_m=0.01, max_rate_rad_s=5.0,
                      input_model="hold",                        # the plant below holds each input over a step
                      integral_time_s=integral_time_s, effort_scale_rad=0.5, disturbance=disturbance,
                      measured_velocity_weight=1.0)      # a first-order plant: no velocities in its state
    mpc = PlateMPC(LinearOutputMap(np.eye(m)), -np.ones(m) * 3, np.ones(m) * 3, opts)
    A, B = np.repeat(A1[None], N, 0), np.repeat(B1[None], N, 0)
    target = np.array([0.4, -0.3])
    x, u = np.zeros(m), np.zeros(m)
    for cycle in range(120):
        res = mpc.solve(x, np.zeros((N + 1, m)), np.zeros((N, m)), A, B, target, u, dt,
                        elapsed_s=dt if cycle else 0.0)
        assert res.ok, res.message
        u = res.plan[0]
        x = At @ x + Bt @ u
    err = np.abs(x - target).max()
    if integral_time_s or disturbance != "none":
        assert err < 1e-3, err
    else:
        assert err > 0.02, err                 # the offset the integral removes is really there


def test_stale_nonfinite_and_bad_shapes():
    m, N = 2, 10
    A1, B1 = first_order_plant(m)
    A, B = np.repeat(A1[None], N, 0), np.repeat(B1[None], N, 0)
    opts = MPCOptions(horizon_steps=N, block_steps=2, max_input_age_s=0.2)
    mpc = PlateMPC(LinearOutputMap(np.eye(m)), -np.ones(m), np.ones(m), opts)
    u = np.array([0.2, -0.1])
    z = (u.copy(), np.zeros((N + 1, m)), np.zeros((N, m)), A, B, u + [0.01, 0.01], u, 0.05)
    res = mpc.solve(*z, age_s=0.5)
    assert res.status == Status.STALE and "0.500 s old" in res.message and not res.ok
    np.testing.assert_allclose(res.plan, np.repeat(u[None], opts.blocks, 0))
    Abad = A.copy()
    Abad[3, 0, 0] = np.nan
    res = mpc.solve(z[0], z[1], z[2], Abad, *z[4:])
    assert res.status == Status.FAILED and "not finite" in res.message
    np.testing.assert_allclose(res.step_plan[0], u)
    with pytest.raises(ValueError, match="covers 5 steps"):
        mpc.solve(z[0], z[1][:6], z[2], A, B, *z[5:])
    with pytest.raises(ValueError, match="target"):
        mpc.solve(*z[:5], np.zeros(3), u, 0.05)
    assert mpc.solve(*z).status == Status.SOLVED
    with pytest.raises(ValueError, match="no room"):
        PlateMPC(LinearOutputMap(np.eye(m)), -np.ones(m), np.ones(m), MPCOptions(limit_margin_rad=2.0))


def test_initial_velocities_blend_the_measurement_with_the_prediction():
    """measured_velocity_weight: positions as measured, velocities w x measured + (1 - w) x the previous cycle's
    prediction of now under its plan; as measured on the first cycle and after a hold (no prediction followed)."""
    dt, N, w = 0.01, 10, 0.3
    A1 = np.array([[1.0, dt], [-50.0 * dt, 1.0 - 2.0 * dt]])     # a mass on a spring: state [position, velocity]
    B1 = np.array([[0.0], [50.0 * dt]])
    A, B = np.repeat(A1[None], N, 0), np.repeat(B1[None], N, 0)
    opts = MPCOptions(horizon_steps=N, block_steps=5, input_model="hold", disturbance="none",
                      measured_velocity_weight=w)
    mpc = PlateMPC(LinearOutputMap(np.eye(2)), [-1.0], [1.0], opts)
    xbar, ubar, target = np.zeros((N + 1, 2)), np.zeros((N, 1)), np.array([0.1, np.nan])   # velocity not tracked
    x0 = np.array([0.01, -0.2])
    r1 = mpc.solve(x0, xbar, ubar, A, B, target, [0.0], dt)
    np.testing.assert_array_equal(r1.state, x0)
    assert abs(r1.predicted[4, 1] - x0[1]) > 0.05           # the plan moves it: the prediction differs
    x5 = np.array([0.02, 0.4])                               # measured 5 steps later
    r2 = mpc.solve(x5, xbar, ubar, A, B, target, r1.step_plan[4], dt, elapsed_s=5 * dt)
    np.testing.assert_allclose(r2.state, [x5[0], w * x5[1] + (1 - w) * r1.predicted[4, 1]], rtol=0, atol=1e-12)
    mpc.hold(r2.step_plan[4], dt, Status.STALE, "test")
    r3 = mpc.solve(x5, xbar, ubar, A, B, target, r2.step_plan[4], dt, elapsed_s=5 * dt)
    np.testing.assert_array_equal(r3.state, x5)
    with pytest.raises(ValueError, match="measured_velocity_weight"):
        MPCOptions(measured_velocity_weight=1.5)



def _lagged(command_times, commands, m0, lag, t_end, h=2e-6):
    """Fine Euler simulation of a first-order servo (time constant ``lag``) behind a command linear between
    (command_times, commands): the motor angle at every h up to t_end, (T, A)."""
    ts = np.arange(0.0, t_end + h / 2, h)
    c = np.stack([np.interp(ts, command_times, commands[:, j]) for j in range(commands.shape[1])], axis=1)
    m = np.empty_like(c)
    m[0] = m0
    for i in range(1, ts.size):
        m[i] = m[i - 1] + h * (c[i - 1] - m[i - 1]) / lag
    return ts, m


def test_actuator_lag_predicts_the_servo_angles():
    """actuator_lag_s: the effective input of each step is the mean of the servo angles at its ends, the servo a
    first-order lag behind the commanded ramp, starting from the angle the previous cycle's plan led it to. A
    plant whose state is the last step's effective input (A = 0, B = I) shows it directly."""
    m, N, dt, lag = 2, 20, 0.01, 0.05
    opts = MPCOptions(horizon_steps=N, block_steps=5, position_tol_m=0.01, node_tol_m=0.01, max_rate_rad_s=2.0,
                      disturbance="none", measured_velocity_weight=1.0, actuator_lag_s=lag)
    mpc = PlateMPC(LinearOutputMap(np.eye(m)), -np.ones(m), np.ones(m), opts)
    A, B = np.zeros((N, m, m)), np.repeat(np.eye(m)[None], N, 0)
    zx, zu = np.zeros((N + 1, m)), np.zeros((N + 1, m))
    target = np.array([0.3, -0.2])
    r1 = mpc.solve(np.zeros(m), zx, zu, A, B, target, np.zeros(m), dt)
    np.testing.assert_array_equal(r1.motor, np.zeros(m))          # first cycle: at the present command
    times = dt * np.arange(N + 1)
    ts, ang = _lagged(times, np.vstack([np.zeros(m), r1.step_plan]), np.zeros(m), lag, N * dt)
    per = int(round(dt / (ts[1] - ts[0])))
    points = ang[::per][:N + 1]                                     # the servo angles at the steps
    assert np.abs(r1.predicted - r1.step_plan).max() > 0.02          # the lag matters here ...
    # ... and is predicted: exactly at the steps (the step's input is the mean of its two ends) ...
    np.testing.assert_allclose(r1.predicted, 0.5 * (points[:-1] + points[1:]), atol=2e-5)
    # ... which is the mean over the step to 1 mrad
    means = np.stack([ang[k * per:(k + 1) * per + 1].mean(axis=0) for k in range(N)])
    np.testing.assert_allclose(r1.predicted, means, atol=1e-3)
    # 5 steps on: the servo state is where the first plan led it
    r2 = mpc.solve(r1.predicted[4], zx, zu, A, B, target, r1.step_plan[4], dt, elapsed_s=5 * dt)
    np.testing.assert_allclose(r2.motor, points[5], atol=2e-5)
    with pytest.raises(ValueError, match="actuator_lag_s"):
        MPCOptions(actuator_lag_s=-0.1)


def test_applied_commands_come_first_and_the_plan_ramps_on_from_them():
    """u_applied: the angles already commanded for steps 0..K0 (the previous plan, until the new one reaches the
    driver). The plan keeps them, its ramp starts from u_applied[K0] at step K0 under the rate limit from there,
    and the prediction uses them. A plant whose state is the last step's effective input (A = 0, B = I) shows it."""
    m, N, dt, K0 = 2, 20, 0.01, 3
    opts = MPCOptions(horizon_steps=N, block_steps=5, position_tol_m=0.01, node_tol_m=0.01, max_rate_rad_s=1.0,
                      disturbance="none", measured_velocity_weight=1.0)
    mpc = PlateMPC(LinearOutputMap(np.eye(m)), -np.ones(m), np.ones(m), opts)
    A, B = np.zeros((N, m, m)), np.repeat(np.eye(m)[None], N, 0)
    zx, zu = np.zeros((N + 1, m)), np.zeros((N + 1, m))
    applied = np.array([[0.0, 0.0], [0.01, -0.01], [0.02, -0.02], [0.03, -0.03]])     # (K0+1, A)
    res = mpc.solve(np.zeros(m), zx, zu, A, B, np.array([0.5, -0.5]), np.zeros(m), dt, u_applied=applied)
    assert res.ok and res.plan_offset_steps == K0
    np.testing.assert_allclose(res.step_plan[:K0], applied[1:], atol=1e-12)
    np.testing.assert_allclose(res.predicted[:K0], 0.5 * (applied[:-1] + applied[1:]), atol=1e-9)
    # from step K0 a ramp to the first knot at K0 + 5, at most 1 rad/s from the applied angle
    ramp = applied[K0] + (res.plan[0] - applied[K0]) * np.arange(1, 6)[:, None] / 5
    np.testing.assert_allclose(res.step_plan[K0:K0 + 5], ramp, atol=1e-12)
    assert np.abs(res.plan[0] - applied[K0]).max() <= 1.0 * 5 * dt + 1e-12
    assert np.abs(res.plan[0] - applied[K0]).max() > 0.04          # the far target: it ramps at the limit
    with pytest.raises(ValueError, match="u_applied"):
        mpc.solve(np.zeros(m), zx, zu, A, B, np.zeros(m), np.zeros(m), dt, u_applied=np.zeros((N + 1, m)))
