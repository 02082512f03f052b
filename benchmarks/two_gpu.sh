#!/usr/bin/env bash
# What issues 15, 16 and 17 still need from 2 H200s (device kind nvidia-h200-x2), in two device calls
# of under 10 minutes each. On the device machine, after the install line that ../shared/tools/device-prep
# prints (FLA wheels, PYTHONPATH, TRITON_CACHE_DIR with the warm autotune cache):
#
#   bash benchmarks/two_gpu.sh 1 $OUT    # GPU tests, KDA cp rows with traces, scaling at P=2, GDN cp rows
#   bash benchmarks/two_gpu.sh 2 $OUT    # the demo's first step on a fresh Triton cache, the 50-step curves
#
# Each step has its own time limit, prints one status line and leaves its log and results under $OUT.
# Record the figures in benchmarks/RESULTS.md (date, GPU, commit, command).
set -u
part=${1:?part 1 or 2}
out=${2:?output folder}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
if [ "$part" = 1 ]; then
    step gpu_tests 120 python3 -m pytest -q -m gpu tests/distributed/test_cp_gpu.py tests/layers/test_kda_layer_cp_gpu.py
    tail -1 "$out/gpu_tests.log"
    # issue 4/14: one sequence and packed at 16K per rank, every strategy beside FLA's CP, per-rank traces
    step cp_kda 150 python3 -m kdacp.cli bench --suite cp --world-size 2 --seq-lens 16384 \
        --batches one_sequence,docs7 --trace "$out/trace" --out "$out/cp_kda"
    # issue 15: the model's P=2 prediction against the measured step, each strategy, one sequence and packed
    step scaling 120 python3 -m kdacp.cli bench --suite scaling --world-size 2 --seq-lens 16384 --out "$out/scaling"
    # issue 16: GDN at Qwen3-Next shapes against FLA's GDN CP and one GPU, 16K and 32K per rank
    step cp_gdn 180 python3 -m kdacp.cli bench --suite cp --family gdn --world-size 2 --seq-lens 16384,32768 \
        --batches one_sequence,docs7 --out "$out/cp_gdn"
elif [ "$part" = 2 ]; then
    # issue 17: the first demo step on a fresh Triton cache (target under 20 s), then the training curves
    step demo 200 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kdacp.cli demo --world-size 2 --device cuda
    tail -5 "$out/demo.log"
    step train 380 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/train_curve.py "$out/train" --world-sizes 1 2 --steps 50
    tail -5 "$out/train.log"
else
    echo "part must be 1 or 2, got $part" >&2
    exit 2
fi
