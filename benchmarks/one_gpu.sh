#!/usr/bin/env bash
# This round's one-H200 checks and figures (issues 32, 34), each part one device call of under 10 minutes. On
# the device machine, after the install line that ../shared/tools/device-prep prints (FLA wheels,
# PYTHONPATH=/tmp/site:$PWD/src, TRITON_CACHE_DIR with the warm autotune cache):
#
#   bash benchmarks/one_gpu.sh 1 $OUT   # the short convolution's tilings swept, then its kernels against FLA's
#                                       # and the layer against FLA's layer at 16K and 64K tokens with the
#                                       # fastest (benchmarks/conv_round.py); the convolution's GPU tests
#   bash benchmarks/one_gpu.sh 2 $OUT   # with the shipped tilings: the kernels and the layer against FLA's again,
#                                       # the 346M Kimi Linear step (parallelize, and with FSDP2), the GPU tests
#                                       # of the convolution and the layer
#   bash benchmarks/one_gpu.sh 3 $OUT   # issue 32: the stage probe's GPU tests (device-time stages), then the
#                                       # per-rank overhead and the scaling model's stages and predictions
#   bash benchmarks/one_gpu.sh 4 $OUT   # issue 32 item 5: the GDN forward's kernels against FLA's (GPU test), its
#                                       # host and device time beside FLA's op, and the gdn suite at 16K and 32K
#   bash benchmarks/one_gpu.sh 5 $OUT   # the layer GPU tests against FLA's layer in float32 and GDN's (thirteenth
#                                       # session: one passed in 270 s, the rest not reached; what takes the time
#                                       # was not looked at)
#   bash benchmarks/one_gpu.sh 6 $OUT   # the backward's sweep (with 3-stage pipelining), then the kernels and the
#                                       # layer with its fastest (fourteenth session: run; RESULTS.md)
#   bash benchmarks/one_gpu.sh 7 $OUT   # the conv GPU tests with the shipped tilings; the gdn suite with its
#                                       # training rows and device-time columns (fourteenth session: run)
#   bash benchmarks/one_gpu.sh 8 $OUT   # the determinism and 1M-token GPU tests with the short convolution's
#                                       # pipelined backward and its reduction kernel (fifteenth session: run)
#   bash benchmarks/one_gpu.sh 9 $OUT   # issue 32: the scaling suite's stages with the step model's rows (36
#                                       # mixer layers, none or an attention layer after every 3); the gdn suite
#
# Each step has its own time limit, prints one status line and leaves its log under the output folder
# (and, with ARCHIVE=FILE.tgz set, everything done so far in that one file after each step).
set -u
part=${1:?part 1 to 9}
out=${2:?output folder}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
if [ "$part" = 1 ]; then
    step conv_round 380 python3 benchmarks/conv_round.py "$out/round" --seq-lens 16384 65536
    grep -E "^tilings" "$out/conv_round.log"
    step conv_tests 140 python3 -m pytest -q -m gpu tests/kernels/test_short_conv_kernel.py
    tail -2 "$out/conv_tests.log"
elif [ "$part" = 2 ]; then
    step conv_round 170 python3 benchmarks/conv_round.py "$out/round" --seq-lens 16384 65536 --no-sweep
    step fsdp 150 python3 benchmarks/fsdp_step.py
    tail -4 "$out/fsdp.log"
    step gpu_tests 180 python3 -m pytest -q -m gpu tests/layers/test_kda_layer_gpu.py tests/kernels/test_short_conv_kernel.py
    tail -2 "$out/gpu_tests.log"
elif [ "$part" = 3 ]; then
    step probe_tests 120 python3 -m pytest -q -m gpu tests/bench/test_stage_probe.py
    tail -2 "$out/probe_tests.log"
    step overhead 320 python3 -m kdacp.cli bench --suite overhead --device cuda --seq-lens 16384 \
        --batches one_sequence,docs7 --out "$out/overhead"
    step scaling 240 python3 -m kdacp.cli bench --suite scaling --device cuda --world-size 1 --seq-lens 16384 \
        --out "$out/scaling"
elif [ "$part" = 4 ]; then
    step gdn_kernels_test 120 python3 -m pytest -q -m gpu tests/backends/test_fla_gdn_backend.py \
        -k launches_flas_kernels
    tail -1 "$out/gdn_kernels_test.log"
    step gdn_profile 150 python3 benchmarks/gdn_forward_profile.py --out "$out/gdnprof" --gate-in-kernel \
        --cases one_sequence,docs7 --modes no_grad --iters 30
    tail -8 "$out/gdn_profile.log"
    rm -f "$out"/gdnprof/trace_*  # large; the report keeps their summary
    step gdn 150 python3 -m kdacp.cli bench --suite gdn --device cuda --world-size 1 --seq-lens 16384,32768 \
        --out "$out/gdn"
    grep "^|" "$out/gdn.log" | tail -5
elif [ "$part" = 5 ]; then
    step layer_tests 590 python3 -m pytest -q -m gpu tests/layers/test_kda_layer_gpu.py \
        -k "float32_equals_fla_layer or gdn_layer"
    tail -2 "$out/layer_tests.log"
elif [ "$part" = 6 ]; then
    step conv_round 500 python3 benchmarks/conv_round.py "$out/round" --passes bwd --seq-lens 16384 65536
    grep -E "^tilings" "$out/conv_round.log"
elif [ "$part" = 7 ]; then
    step conv_tests 300 python3 -m pytest -q -m gpu tests/kernels/test_short_conv_kernel.py
    tail -2 "$out/conv_tests.log"
    step gdn_train 250 python3 -m kdacp.cli bench --suite gdn --device cuda --world-size 1 --seq-lens 16384,32768 \
        --out "$out/gdn"
    grep "^|" "$out/gdn_train.log" | tail -9
elif [ "$part" = 8 ]; then
    step determinism 200 python3 -m pytest -q -m gpu tests/test_determinism_gpu.py
    tail -1 "$out/determinism.log"
    step long_sequence 380 python3 -m pytest -q -m gpu tests/test_long_sequence_gpu.py
    tail -1 "$out/long_sequence.log"
elif [ "$part" = 9 ]; then
    step scaling 200 python3 -m kdacp.cli bench --suite scaling --device cuda --world-size 1 --seq-lens 16384 \
        --out "$out/scaling"
    grep -A14 "### step model" "$out/scaling/scaling.md"
    step gdn 250 python3 -m kdacp.cli bench --suite gdn --device cuda --world-size 1 --seq-lens 16384,32768 \
        --out "$out/gdn"
    grep "^|" "$out/gdn.log" | tail -9
else
    echo "part must be 1 to 9, got $part" >&2
    exit 2
fi
