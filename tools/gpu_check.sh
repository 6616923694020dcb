#!/bin/bash
# The GPU checks of issue 20 item 4 as one run on a lent GPU machine (the workplace's `device` tool), sized for its
# 15 minutes: test/test_cuda.py, `tensegrity identify` on CUDA and on that machine's CPU, the tangent step with
# and without CUDA graphs, where the engine's time goes (profile), the engine's throughput, the online
# identifier's update. Every log and result lands in $OUT (at most 8 files come back). The parts run in order of
# what they prove, each under its own timeout and all within DEADLINE seconds, so that a slow one leaves the
# others' results and the whole run ends before the device tool's limit.
#
# Prepared here, once (that machine has Python 3.12 and torch, but neither MuJoCo nor rosbags, and no network):
#   echo /.whl/ >> .git/info/exclude; echo /.gpu/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl mujoco==4.0.0 mujoco-core==4.0.0 rosbags==0.11.9 lz4==4.4.5 \
#       ruamel.yaml==0.19.1 glfw==2.11.0 PyOpenGL==3.1.10 apsw==3.54.1.0 backports.zstd==1.8.0
#   mkdir -p .gpu/sim && cp -r build/sim/bag build/sim/true_model.yaml .gpu/sim/    # the README's 16-s bag
# Then: run(command="bash tools/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=560).
#
# Learnt on the H200 of 2026-12-04: leave MUJOCO_GL unset there (with MUJOCO_GL=egl, `import mujoco` fails:
# PyOpenGL finds no EGL library and raises an AttributeError that mujoco does not catch), and keep whole logs in
# $OUT (a `| tail` there cut the one failure's message). The parts run in order of what they prove, each under its
# own timeout, so that a slow one leaves the others' results.
cd "$(dirname "$0")/.." || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 9
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
T0=$(date +%s)
DEADLINE=${DEADLINE:-500}
part() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
# seconds a part may take: its cap, or what is left before the deadline (0: skip it)
budget() { local left=$(( DEADLINE - ($(date +%s) - T0) )); [ $left -lt 20 ] && echo 0 && return
           [ "$1" -lt $left ] && echo "$1" || echo $left; }
part machine
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
python3 -c "import torch, mujoco, rosbags; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.is_available(), 'mujoco', mujoco.__version__)" || exit 9
M=config/models/stacked_manipulator.yaml

part test/test_cuda.py test/test_engine_graphs.py
t=$(budget 170); timeout $t python3 -m pytest -q -p no:cacheprovider --timeout 120 -rA test/test_cuda.py \
    test/test_engine_graphs.py > $OUT/tests.log 2>&1
echo "pytest exit $?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/tests.log

for dev in cuda cpu; do
    part "identify --device $dev"
    t=$(budget $([ $dev = cuda ] && echo 120 || echo 45)); [ $t = 0 ] && continue
    s=$(date +%s%N)
    timeout $t python3 -m tensegrity_ros.cli identify .gpu/sim/bag --model $M \
        --out $OUT/identified_$dev.yaml --force --device $dev > /tmp/identify_$dev.log 2>&1
    echo "exit $?, wall $(( ($(date +%s%N) - s) / 1000000 )) ms"; grep "^time:" /tmp/identify_$dev.log
    grep -iE "error|traceback|health|verdict" /tmp/identify_$dev.log | head -8
done

part "tangent step, CUDA graphs on and off"
t=$(budget 60); [ $t != 0 ] && timeout $t python3 bench/bench_gpu.py --only tangent --tangent-rows 4096 \
    --out $OUT/tangent.json 2>&1 | grep "tangent step"

part "profile: where the engine's time goes"
t=$(budget 70); [ $t != 0 ] && timeout $t python3 bench/bench_gpu.py --only profile --out $OUT/profile.json 2>&1 \
    | grep "^profile"

part engine
t=$(budget 150); [ $t != 0 ] && timeout $t python3 bench/bench_gpu.py --only engine --batches 1024 65536 \
    --out $OUT/engine.json 2>&1 | grep -v "^device"

part "online identifier update, cuda then cpu"
t=$(budget 80); [ $t != 0 ] && timeout $t python3 bench/bench_gpu.py --only online --out $OUT/online.json \
    > /tmp/online.log 2>&1
grep -A12 "online update" /tmp/online.log | head -40
part done
