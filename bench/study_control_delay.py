"""Study (not in `make bench`): the plate controller's closed loop on the twin with a measurement delay, the
loop of test/test_control_closed_loop.py plus a 10-mm circle target, a state ``delay`` steps old and optionally
the state predicted over the delay with the applied inputs (``compensate``). docs/control.md, "Measured".

usage: python bench/study_control_delay.py DELAY_STEPS(10 ms) COMPENSATE(0|1) MODEL_ERROR(0..) CYCLES [MPCOptions dict]
"""
import ast
import sys

import numpy as np
import torch
from tensegrity_ros import frames as F
from tensegrity_ros.control import MPCOptions, PlateMPC, PlateOutputMap
from tensegrity_ros.model import load_structure
from tensegrity_ros.model.perturb import perturb_structure
from tensegrity_ros.paths import CONFIG_DIR
from tensegrity_ros.predict.horizon import HorizonPredictor
from tensegrity_ros.twin.sim import TwinSim
from tensegrity_ros.workers import limit_blas_threads
torch.set_num_threads(1); limit_blas_threads(1)
s = load_structure(CONFIG_DIR / 'models' / 'stacked_manipulator.yaml')
core = HorizonPredictor(s, dt=0.01, nominal="twin", jac_stride=10)
omap = PlateOutputMap.from_structure(s); names = s.node_names
d = int(sys.argv[1]); comp = int(sys.argv[2]); off = float(sys.argv[3]); cycles = int(sys.argv[4])
extra = ast.literal_eval(sys.argv[5]) if len(sys.argv) > 5 else {}
truth = perturb_structure(s, off, seed=1, kinds=("stiffness",)) if off else s
sim = TwinSim(truth); sim.step(np.zeros(6), 1); sim.settle(3.0)
center = F.manipulator_relative_poses(sim.node_positions(), names)["0C2"].copy()
opts = MPCOptions(**extra); mpc = PlateMPC.from_structure(s, omap, opts)
N, dt, CS = opts.horizon_steps, core.dt, 5
params = core.engine.default_params()
def target_at(t):
    y = center.copy(); y[0] += 0.01 * np.cos(2*np.pi*t/10); y[1] += 0.01 * np.sin(2*np.pi*t/10); return y
hist = [(sim.node_positions().copy(), sim.node_velocities().copy())]   # per 10-ms step
uhist = [np.zeros(6)]                                                    # angle at each step boundary
plan = np.zeros((N, 6)); u_now = np.zeros(6); errs = []; msgs = []; T = 0.0
for c in range(cycles):
    j = max(0, len(hist) - 1 - d)
    P, V = hist[j]
    dd = len(hist) - 1 - j                  # actual delay in steps
    x = core.measured_state(names, P, V, np.ones(len(names), bool))
    fut = np.vstack([plan[CS:], np.repeat(plan[-1:], CS + dd, 0)])
    if comp and dd:
        applied = np.array(uhist[j:])       # dd+1 angles from the state's time to now
        u_nom = np.vstack([applied, fut])[:N + dd + 1]
        lin = core.linearize(params, 0.0, P, V, u_nom, N + dd)
        Jk = lin.expand(0).Jk32.astype(float)
        n = lin.x.shape[1]
        res = mpc.solve(lin.x[dd], lin.x[dd:], lin.u[dd:], Jk[dd:, :, :n], Jk[dd:, :, n:],
                        np.stack([target_at(T + k * dt) for k in range(N + 1)]), u_now, dt, elapsed_s=CS * dt if c else 0.0)
    else:
        u_nom = np.vstack([u_now[None], fut])[:N + 1]
        lin = core.linearize(params, 0.0, P, V, u_nom, N)
        Jk = lin.expand(0).Jk32.astype(float); n = lin.x.shape[1]
        res = mpc.solve(x, lin.x, lin.u, Jk[:, :, :n], Jk[:, :, n:],
                        np.stack([target_at(T + k * dt) for k in range(N + 1)]), u_now, dt, elapsed_s=CS * dt if c else 0.0)
    plan = res.step_plan; msgs.append(res.message)
    u0 = u_now
    for k in range(CS):
        u1 = plan[k]
        for i in range(10):
            w = (i + 1) / 10
            sim.step((1 - w) * u0 + w * u1, 1, (u1 - u0) / dt)
        u0 = u1
        hist.append((sim.node_positions().copy(), sim.node_velocities().copy())); uhist.append(u1.copy())
    u_now = plan[CS - 1]; T += CS * dt
    y = F.manipulator_relative_poses(sim.node_positions(), names)["0C2"]
    errs.append(np.linalg.norm(y[:3] - target_at(T)[:3]))
e = np.array(errs) * 1e3
print(f"delay {d*10} ms comp {comp} off {off} {extra}: RMSE {np.sqrt(np.mean(e**2)):.1f} mm, last half {np.sqrt(np.mean(e[len(e)//2:]**2)):.1f} mm, max {e.max():.1f}; {msgs[-1][:60]}")
