#!/usr/bin/env bash
# This round's one-H200 checks and figures (issues 28, 29, 31, 32, 33, 34), in two device calls of under
# 10 minutes each. On the device machine, after the install line that ../shared/tools/device-prep prints
# (FLA wheels, PYTHONPATH=/tmp/site:$PWD/src, TRITON_CACHE_DIR with the warm autotune cache):
#
#   bash benchmarks/one_gpu.sh 1 $OUT [BASE]   # the demo on an empty Triton cache, GPU tests of the short
#                                              # convolution, its kernels against FLA's, layer and op after
#   bash benchmarks/one_gpu.sh 2 $OUT [BASE]   # GPU tests of prefill and parallelize, the FSDP2 step, layer
#                                              # and op before (BASE: a checkout of the commit before this
#                                              # round), the per-rank overhead, prefill at 128K to 1M tokens
#
# Each step has its own time limit, prints one status line and leaves its log under the output folder
# (and, with ARCHIVE=FILE.tgz set, everything done so far in that one file after each step).
set -u
part=${1:?part 1 or 2}
out=${2:?output folder}
base=${3:-}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
if [ "$part" = 1 ]; then
    step demo 120 env TRITON_CACHE_DIR="$(mktemp -d)" /usr/bin/time -f "%e s wall (/usr/bin/time)" \
        python3 -m kdacp.cli demo --world-size 1 --device cuda
    tail -4 "$out/demo.log"
    step gpu_tests 170 python3 -m pytest -q -x -m gpu tests/kernels/test_short_conv_kernel.py
    tail -2 "$out/gpu_tests.log"
    step conv 60 python3 -m kdacp.cli bench --suite kernels --family conv --out "$out/conv"
    step layer_after 70 python3 -m kdacp.cli bench --suite layer --device cuda --world-size 1 --seq-lens 16384 \
        --batches one_sequence,lognormal --out "$out/layer_after"
    step op_after 40 python3 benchmarks/op_one_gpu.py 16384
elif [ "$part" = 2 ]; then
    step gpu_tests 130 python3 -m pytest -q -m gpu tests/models/test_prefill_gpu.py tests/models/test_parallelize_gpu.py
    tail -2 "$out/gpu_tests.log"
    step fsdp 90 python3 benchmarks/fsdp_step.py
    tail -3 "$out/fsdp.log"
    if [ -n "$base" ]; then
        step layer_before 60 env PYTHONPATH="/tmp/site:$base/src" python3 -m kdacp.cli bench --suite layer \
            --device cuda --world-size 1 --seq-lens 16384 --batches one_sequence,lognormal --out "$out/layer_before"
        step op_before 35 env PYTHONPATH="/tmp/site:$base/src" python3 benchmarks/op_one_gpu.py 16384
        tail -2 "$out/op_before.log"
    fi
    step overhead 100 python3 -m kdacp.cli bench --suite overhead --device cuda --seq-lens 16384 --out "$out/overhead"
    step prefill_128k 60 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_128k" --world-size 1 --seq-lens 131072 --repeats 1
    step prefill_long 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_long" --world-size 1 --seq-lens 524288 1048576 --repeats 1 --no-plain
    tail -8 "$out/prefill_long.log"
else
    echo "part must be 1 or 2, got $part" >&2
    exit 2
fi
