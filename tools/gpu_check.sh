#!/bin/bash
# The GPU checks of issue 20 item 4 as one run on a lent GPU machine (the workplace's `device` tool), sized for its
# 15 minutes: test/test_cuda.py, the online identifier's update and `tensegrity identify` on CUDA and on that
# machine's CPU, the engine's throughput. Every log and result lands in $OUT (at most 8 files come back).
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
part() { echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
part machine
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
python3 -c "import torch, mujoco, rosbags; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.is_available(), 'mujoco', mujoco.__version__)" || exit 9
M=config/models/stacked_manipulator.yaml

part test/test_cuda.py
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rA test/test_cuda.py > $OUT/test_cuda.log 2>&1
echo "pytest exit $?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/test_cuda.log

part online identifier update, cuda then cpu
timeout 90 python3 bench/bench_gpu.py --only online --out $OUT/online.json > $OUT/online.log 2>&1
echo "exit $?"; grep "online update" $OUT/online.log

for dev in cuda cpu; do
    part "identify --device $dev"
    s=$(date +%s%N)
    timeout $([ $dev = cuda ] && echo 150 || echo 60) python3 -m tensegrity_ros.cli identify .gpu/sim/bag --model $M \
        --out $OUT/identified_$dev.yaml --force --device $dev > $OUT/identify_$dev.log 2>&1
    echo "exit $?, wall $(( ($(date +%s%N) - s) / 1000000 )) ms"; grep "^time:" $OUT/identify_$dev.log
done

part engine
timeout 150 python3 bench/bench_gpu.py --only engine --out $OUT/engine.json 2>&1 | grep -v "^device"
part done
