#!/usr/bin/env bash
# This round's one-H200 checks and figures (issues 29, 31, 32, 33, 34), each part one device call of under
# 10 minutes. On the device machine, after the install line that ../shared/tools/device-prep prints
# (FLA wheels, PYTHONPATH=/tmp/site:$PWD/src, TRITON_CACHE_DIR with the warm autotune cache):
#
#   bash benchmarks/one_gpu.sh 1 $OUT   # the demo on an empty Triton cache (its imports timed), the FSDP2
#                                       # step (and a profile of each run), prefill at 128K to 1M tokens,
#                                       # the GPU test of parallelize
#   bash benchmarks/one_gpu.sh 2 $OUT   # the FSDP2 step with AdamW fused and foreach; prefill at 128K
#                                       # (warm, profiled) and 512K / 1M in one pass and in pieces of 256K;
#                                       # which of torchtitan's dependencies the machine has
#   bash benchmarks/one_gpu.sh 3 $OUT   # GPU tests of the layers, the GDN backend and parallelize; prefill
#                                       # at 512K and 1M against transformers' own forward, twice each
#   bash benchmarks/one_gpu.sh 5 $OUT   # after the pieces' attention change: the GPU prefill and parallelize
#                                       # tests, prefill at 512K and 1M in pieces
#   bash benchmarks/one_gpu.sh 4 $OUT   # the short convolution's kernels and the layer against FLA's, the
#                                       # per-rank overhead, the GDN suite
#
# Each step has its own time limit, prints one status line and leaves its log under the output folder
# (and, with ARCHIVE=FILE.tgz set, everything done so far in that one file after each step).
set -u
part=${1:?part 1 to 5}
out=${2:?output folder}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
if [ "$part" = 1 ]; then
    # The first Python process of the machine: its imports read everything from disk (-X importtime: where).
    step demo 120 env TRITON_CACHE_DIR="$(mktemp -d)" /usr/bin/time -f "%e s wall (/usr/bin/time)" \
        python3 -X importtime -m kdacp.cli demo --world-size 1 --device cuda
    grep -v "^import time" "$out/demo.log" | tail -4
    step fsdp 150 python3 benchmarks/fsdp_step.py --profile
    tail -4 "$out/fsdp.log"
    step prefill_128k 70 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_128k" --world-size 1 --seq-lens 131072 --repeats 1
    step prefill_long 100 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_long" --world-size 1 --seq-lens 524288 1048576 --repeats 1 --no-plain
    tail -8 "$out/prefill_long.log"
    step gpu_tests 150 python3 -m pytest -q -m gpu tests/models/test_parallelize_gpu.py
    tail -2 "$out/gpu_tests.log"
elif [ "$part" = 2 ]; then
    python3 -c "
import importlib.util as u
print('torchtitan deps here:', {m: u.find_spec(m) is not None for m in
      ('pyarrow', 'pandas', 'datasets', 'tensorboard', 'grpc', 'tyro', 'torchdata', 'tokenizers', 'wandb', 'fsspec')})"
    step fsdp_fused 150 python3 benchmarks/fsdp_step.py --optimizer fused
    tail -3 "$out/fsdp_fused.log"
    step fsdp_foreach 150 python3 benchmarks/fsdp_step.py --optimizer foreach
    tail -3 "$out/fsdp_foreach.log"
    step prefill_128k 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_128k" --world-size 1 --seq-lens 131072 --repeats 2 --profile
    tail -4 "$out/prefill_128k.log"
    step prefill_long 200 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_long" --world-size 1 --seq-lens 524288 1048576 --repeats 1 \
        --no-plain --pieces-of 262144
    tail -9 "$out/prefill_long.log"
elif [ "$part" = 3 ]; then
    step gpu_tests 200 python3 -m pytest -q -m gpu tests/layers/test_kda_layer_gpu.py tests/backends/test_fla_gdn_backend.py \
        tests/models/test_parallelize_gpu.py
    tail -2 "$out/gpu_tests.log"
    step prefill_512k 150 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_512k" --world-size 1 --seq-lens 524288 --repeats 2 --pieces-of 262144
    tail -5 "$out/prefill_512k.log"
    step prefill_1m 200 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_1m" --world-size 1 --seq-lens 1048576 --repeats 1 --pieces-of 262144
    tail -5 "$out/prefill_1m.log"
elif [ "$part" = 5 ]; then
    step gpu_tests 170 python3 -m pytest -q -m gpu tests/models/test_prefill_gpu.py tests/models/test_parallelize_gpu.py
    tail -2 "$out/gpu_tests.log"
    step prefill_512k 100 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_512k" --world-size 1 --seq-lens 524288 --repeats 2 --pieces-of 262144 \
        --no-plain
    tail -4 "$out/prefill_512k.log"
    step prefill_1m 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        python3 benchmarks/prefill.py "$out/prefill_1m" --world-size 1 --seq-lens 1048576 --repeats 1 --pieces-of 262144 \
        --no-plain
    tail -4 "$out/prefill_1m.log"
elif [ "$part" = 4 ]; then
    step conv 60 python3 -m kdacp.cli bench --suite kernels --family conv --out "$out/conv"
    step layer 90 python3 -m kdacp.cli bench --suite layer --device cuda --world-size 1 --seq-lens 16384 \
        --batches one_sequence,lognormal --out "$out/layer"
    step overhead 150 python3 -m kdacp.cli bench --suite overhead --device cuda --seq-lens 16384 --out "$out/overhead"
    step gdn 120 python3 -m kdacp.cli bench --suite gdn --device cuda --seq-lens 16384,32768 --out "$out/gdn"
else
    echo "part must be 1 to 5, got $part" >&2
    exit 2
fi
