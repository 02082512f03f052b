#!/usr/bin/env bash
# The two-GPU figures of benchmarks/RESULTS.md (2 GPUs of one host, NCCL), in two parts of under 10
# minutes each. Run from the repository root with kdacp and fla-core installed:
#
#   bash benchmarks/two_gpu.sh 1 OUT   # the 2-GPU tests; the op (KDA, GDN) against one GPU and FLA's CP, with
#                                      # per-rank traces; the layer's state and ulysses modes; the scaling
#                                      # model's P = 2 prediction beside the measured step
#   bash benchmarks/two_gpu.sh 2 OUT   # the demo's first step on an empty Triton cache, the 50-step training
#                                      # curves on 1 and 2 GPUs, the layer's CP step captured in a CUDA graph
#                                      # (NCCL's exchanges inside it) against eager
#
# Each step has its own time limit, prints one status line and leaves its log and results under OUT.
set -u
part=${1:?part 1 or 2}
out=${2:?output folder}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
if [ "$part" = 1 ]; then
    step gpu_tests 120 python3 -m pytest -q -m gpu tests/cp/test_cp_gpu.py tests/layers/test_kda_layer_cp_gpu.py
    tail -1 "$out/gpu_tests.log"
    step cp_kda 150 python3 -m kdacp.cli bench -v --suite cp --world-size 2 --seq-lens 16384 \
        --batches one_sequence,docs7 --trace "$out/trace" --out "$out/cp_kda"
    step cp_gdn 180 python3 -m kdacp.cli bench -v --suite cp --family gdn --world-size 2 --seq-lens 16384,32768 \
        --batches one_sequence,docs7 --out "$out/cp_gdn"
    step layer 120 python3 -m kdacp.cli bench -v --suite layer --world-size 2 --modes state,ulysses --out "$out/layer"
    step scaling 120 python3 -m kdacp.cli bench -v --suite scaling --world-size 2 --seq-lens 16384 --out "$out/scaling"
elif [ "$part" = 2 ]; then
    step demo 200 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kdacp.cli demo --world-size 2 --device cuda
    tail -5 "$out/demo.log"
    step train 380 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/train_curve.py "$out/train" --world-sizes 1 2 --steps 50
    tail -5 "$out/train.log"
    step cuda_graph 120 torchrun --nproc-per-node 2 benchmarks/cuda_graph.py --captures step --tokens 2048
    grep '^|' "$out/cuda_graph.log"
else
    echo "part must be 1 or 2, got $part" >&2
    exit 2
fi
