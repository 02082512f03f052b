#!/usr/bin/env bash
# The one-GPU figures of benchmarks/RESULTS.md, one part at a time (each part well under 10 minutes on an
# H200 whose FLA autotune cache is warm). Run from the repository root with kdacp and fla-core installed:
#
#   bash benchmarks/one_gpu.sh kernels  OUT   # summary kernels (KDA, GDN) and the short convolution against
#                                             # FLA's kernels, then the kernel GPU tests
#   bash benchmarks/one_gpu.sh layer    OUT   # KimiDeltaAttention against FLA's layer at 16K and 64K tokens
#   bash benchmarks/one_gpu.sh model    OUT   # the 346M Kimi Linear step with and without FSDP2, and prefill
#   bash benchmarks/one_gpu.sh compile  OUT   # the 346M Kimi Linear step compiled against eager at 16K and 64K
#   bash benchmarks/one_gpu.sh graph    OUT   # CUDA-graph replay of the layer's CP step and of prefill pieces at
#                                             # 2K tokens, host and wall time against eager; the step at 2K..16K
#                                             # tokens a rank beside FLA's layer's host time
#   bash benchmarks/one_gpu.sh compiled OUT   # the step under torch.compile(mode="reduce-overhead"): its GPU test,
#                                             # then its host and wall time at 4K tokens a rank
#   bash benchmarks/one_gpu.sh overhead OUT   # per-rank overhead (every batch, KDA and GDN) and the scaling
#                                             # model's predictions from the measured stages
#   bash benchmarks/one_gpu.sh zigzag   OUT   # a zigzag rank's step under CUDA's sync-debug mode (GPU test), then the
#                                             # summary kernels' tilings over a per-document rank's many short
#                                             # segments, then the per-rank overhead of the zigzag roles beside
#                                             # contiguous's
#   bash benchmarks/one_gpu.sh balanced OUT   # the busiest rank of a packed batch placed by balanced_document_layout
#                                             # beside per-document zigzag's roles (KDA and GDN, P = 8, log-normal)
#   bash benchmarks/one_gpu.sh zigzag_tuning OUT  # the KDA zigzag roles again with FLA autotuning afresh (its
#                                             # configurations' key holds no sequence count: RESULTS, Per-rank
#                                             # overhead, cause 1) beside the shipped configurations
#   bash benchmarks/one_gpu.sh gdn      OUT   # the Gated DeltaNet op against FLA's at 16K and 32K tokens
#   bash benchmarks/one_gpu.sh megatron OUT   # KdacpGatedDeltaNet against Megatron-Core's GatedDeltaNet at 16K
#                                             # and 32K tokens (needs megatron-core 0.19.2 installed)
#   bash benchmarks/one_gpu.sh megatron_triton_warm OUT  # under a Triton >= 3.7.1 first on PYTHONPATH
#                                             # (benchmarks/triton_prep.sh install): every kernel of the Megatron
#                                             # table compiled and autotuned (one round at 16K, one sequence and
#                                             # packed, each kernel FLA tunes printed; over 4 minutes cold on an
#                                             # H100), FLA's configurations exported to OUT/fla-configs (copy them
#                                             # into src/kdacp/configs/<GPU> to skip that next time)
#   bash benchmarks/one_gpu.sh megatron_triton OUT  # then, the Triton cache warm (the next call on the same
#                                             # machine), the megatron table forward + backward
#   bash benchmarks/one_gpu.sh profile  OUT   # the KDA and GDN layers' step split into the projections' matmuls and
#                                             # the rest, per backend (attn_gym where installed), beside the floor
#   bash benchmarks/one_gpu.sh attn_gym OUT   # backend="attn_gym" (benchmarks/attn_gym_prep.sh install first): its
#                                             # GPU tests, the KDA layer at 16K and 64K, the GDN layer and op
#   bash benchmarks/one_gpu.sh model_backend OUT BACKEND  # the 346M Kimi Linear step against transformers' own
#                                             # model (FLA's kernels), kdacp's layers on BACKEND (fla or attn_gym)
#   bash benchmarks/one_gpu.sh overhead_backend OUT BACKEND  # the per-rank overhead of the contiguous roles (KDA
#                                             # and GDN, one sequence and log-normal) with BACKEND as the local one
#   bash benchmarks/one_gpu.sh demo     OUT   # the whole demo on an empty Triton cache, then the GPU tests
#                                             # of determinism, 1M tokens, the models and prefill
#   bash benchmarks/one_gpu.sh split_tests OUT  # a first run at 4 heads autotuning nothing the shipped files lend
#                                             # to, then the split's GPU error and CUDA-graph tests (first use
#                                             # compiles for minutes: the whole call's time)
#   bash benchmarks/one_gpu.sh split_graph OUT  # where the split's CUDA-graph capture fails: each mode of
#                                             # benchmarks/split_graph_probe.py in a process of its own
#   bash benchmarks/one_gpu.sh split    OUT [FAMILY]  # the split inside one GPU: FAMILY (kda or gdn, default kda)
#                                             # against FLA's op at 2..32 heads and 64K tokens, one sequence and
#                                             # packed, each split setting (benchmarks/split_heads.py; one family
#                                             # fills a call), FlashQLA beside GDN where .whl/flashqla holds its
#                                             # wheels (benchmarks/flashqla_prep.sh download)
#   bash benchmarks/one_gpu.sh split_detail OUT  # the split's calls replayed from CUDA graphs at 2 and 4 heads, the
#                                             # chain kernel's tilings, each kernel's device time and the host's time
#                                             # per call at 4 heads
#   bash benchmarks/one_gpu.sh flashqla OUT [WHEELS]  # backend="flashqla" (FlashQLA's wheels in WHEELS, default
#                                             # .whl/flashqla): its GPU tests against float64 beside FLA's error
#                                             # (TileLang compiles FlashQLA's kernels at first use: over 5 minutes
#                                             # on an H100, the whole call)
#   bash benchmarks/one_gpu.sh flashqla_heads OUT [WHEELS]  # then, on the same machine (TileLang's cache warm), GDN
#                                             # at 2..32 heads and 64K tokens: FLA, kdacp's split settings,
#                                             # FlashQLA's op with and without its own split, kdacp on FlashQLA
#   bash benchmarks/one_gpu.sh versus OUT DIR # the kernels suite once, the layer (16K, one sequence) and the contiguous
#                                             # roles' overhead twice, another tree's library (DIR/src, made with
#                                             # git archive REV src | tar x -C DIR) and this one's in turns: a
#                                             # change's before and after on one card
#   bash benchmarks/one_gpu.sh first_run OUT  # as a new user on a GPU without configurations of its own: the demo
#                                             # on an empty Triton cache (the shipped ones, or a sibling's), kdacp
#                                             # tune at the demo's shapes, the demo again (the GPU's own), kdacp tune
#                                             # at the layer's; the GPU's files (the tuned entries, the sibling's for
#                                             # the shapes not tuned) packed in OUT/fla-configs.tgz (unpack them into
#                                             # src/kdacp/configs/<GPU> and name the GPU in SHIPPED_CAPABILITY to ship)
#
# Each step has its own time limit, prints one status line and leaves its log (and the suite's JSON,
# Markdown and PNG files) under OUT.
set -u
PARTS="kernels, layer, model, compile, graph, compiled, overhead, zigzag, balanced, zigzag_tuning, gdn, megatron, megatron_triton_warm, megatron_triton, profile, attn_gym, model_backend, overhead_backend, demo, split_tests, split_graph, split, split_detail, flashqla, flashqla_heads, first_run or versus"
part=${1:?part: $PARTS}
out=${2:?output folder}
mkdir -p "$out"
source "$(dirname "$0")/step.sh"  # step NAME LIMIT_S COMMAND...
bench=(python3 -m kdacp.cli bench -v --device cuda)
case "$part" in
kernels)
    step kernels_kda 180 "${bench[@]}" --suite kernels --out "$out/kernels_kda"
    step kernels_gdn 180 "${bench[@]}" --suite kernels --family gdn --out "$out/kernels_gdn"
    step kernels_conv 120 "${bench[@]}" --suite kernels --family conv --out "$out/kernels_conv"
    step kernel_tests 240 python3 -m pytest -q -m gpu tests/kernels
    ;;
layer)
    step layer 500 "${bench[@]}" --suite layer --world-size 1 --seq-lens 16384,65536 --batches one_sequence,lognormal \
        --out "$out/layer"
    ;;
model)
    step fsdp 200 python3 benchmarks/model_step.py
    step prefill 380 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/prefill.py \
        "$out/prefill" --world-size 1 --seq-lens 131072 524288 1048576 --repeats 2 --pieces-of 262144
    ;;
compile)  # one variant a process at 64K: both models and their activations do not fit together
    step compile_16k 200 python3 benchmarks/model_step.py --tokens 16384 --variants parallelize,+compile \
        --documents lognormal
    for variant in +compile parallelize; do
        step "compile_64k_${variant#+}" 200 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            python3 benchmarks/model_step.py --tokens 65536 --variants "$variant" --documents lognormal --steps 5
    done
    ;;
graph)
    step cuda_graph 200 python3 benchmarks/cuda_graph.py --tokens 2048 --iters 30
    grep '^|' "$out/cuda_graph.log"
    # the step at 2K..16K tokens a rank beside FLA's layer: kdacp's host time against FLA's and the device's
    step layer_host 240 python3 benchmarks/cuda_graph.py --captures step --batches one_sequence \
        --tokens 2048,4096,8192,16384 --iters 20
    grep '^|' "$out/layer_host.log"
    ;;
compiled)  # the step under torch.compile(mode="reduce-overhead"): its GPU test, then its host and wall time at 4K
    step reduce_overhead_test 200 python3 -m pytest -q -m gpu tests/layers/test_kda_layer_gpu.py -k reduce_overhead
    step layer_compiled 150 python3 benchmarks/cuda_graph.py --captures step --batches one_sequence --tokens 4096 \
        --iters 20 --compiled
    grep '^|' "$out/layer_compiled.log"
    ;;
overhead)
    step overhead 500 "${bench[@]}" --suite overhead --seq-lens 16384 --batches one_sequence,docs7,lognormal \
        --out "$out/overhead"
    step packed 60 python3 benchmarks/packed_prediction.py "$out/overhead/overhead.json"
    step scaling 240 "${bench[@]}" --suite scaling --world-size 1 --seq-lens 16384 --out "$out/scaling"
    ;;
zigzag)
    step sync_test 300 python3 -m pytest -q -m gpu tests/test_host_copies.py
    step summary_segments 240 python3 benchmarks/summary_segments.py
    grep '^|' "$out/summary_segments.log"
    for family in kda gdn; do  # 4 rounds of 3 calls: KDA's took 80 s on an H200
        step "zigzag_overhead_$family" 280 "${bench[@]}" --suite overhead --family "$family" --seq-lens 16384 \
            --layouts contiguous,zigzag,document_zigzag --ranks 2,8 --batches one_sequence,lognormal --rounds 4 \
            --iters 3 --out "$out/zigzag_overhead_$family"
    done
    ;;
balanced)
    for family in kda gdn; do
        step "balanced_overhead_$family" 280 "${bench[@]}" --suite overhead --family "$family" --seq-lens 16384 \
            --layouts document_zigzag,balanced_documents --ranks 8 --batches lognormal --rounds 4 --iters 3 \
            --out "$out/balanced_overhead_$family"
    done
    grep -h '^|' "$out"/balanced_overhead_*.log | grep -i "busiest\|middle\|role"
    ;;
zigzag_tuning)
    for mode in shipped fresh; do  # fresh: FLA tunes each kernel key on the first shape it sees, here the roles'
        how=(); [ "$mode" = fresh ] && how=(env FLA_CACHE_MODE=disabled TRITON_CACHE_DIR="$(mktemp -d)")
        step "zigzag_$mode" 280 ${how[@]+"${how[@]}"} "${bench[@]}" --suite overhead --family kda --seq-lens 16384 \
            --layouts contiguous,zigzag --ranks 8 --batches one_sequence --rounds 4 --iters 3 --out "$out/zigzag_$mode"
    done
    ;;
gdn)
    step gdn 250 "${bench[@]}" --suite gdn --world-size 1 --seq-lens 16384,32768 --out "$out/gdn"
    ;;
megatron_triton_warm|megatron_triton)  # every kernel compiles afresh under the new Triton, into its cache
    python3 -c "import sys, triton; from fla.utils import TRITON_ABOVE_3_7_1 as ok; print('triton', triton.__version__,
        'accepted by FLA' if ok else 'refused by FLA'); sys.exit(0 if ok else 1)" || exit 1
    if [ "$part" = megatron_triton_warm ]; then
        step megatron_triton_warm 530 env TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/megatron_gdn.py --seq-lens 16384 \
            --batches one_sequence,lognormal --rounds 1 --out "$out/megatron_triton_warm"
        step fla_configs 30 python3 -c "import sys, triton; from kdacp.backends.fla_configs import export_fla_configs; \
print(*export_fla_configs(triton.knobs.cache.dir, sys.argv[1]), sep='\\n')" "$out/fla-configs"
        grep -c "^Triton autotuning" "$out/megatron_triton_warm.log"
    else
        step megatron_triton 560 python3 benchmarks/megatron_gdn.py --seq-lens 16384,32768 \
            --batches one_sequence,lognormal --out "$out/megatron_triton"
        grep -h '^|' "$out/megatron_triton.log"
    fi
    ;;
megatron)
    step megatron_gdn 500 python3 benchmarks/megatron_gdn.py --seq-lens 16384,32768 --batches one_sequence,lognormal \
        --out "$out/megatron_gdn"
    grep '^|' "$out/megatron_gdn.log"
    ;;
profile)
    step layer_profile 300 python3 benchmarks/layer_profile.py --tokens 16384
    grep '^|' "$out/layer_profile.log"
    ;;
attn_gym)
    step attn_gym_tests 500 python3 -m pytest -q -m gpu -s tests/backends/test_attn_gym_backend_gpu.py
    step attn_gym_layer 500 "${bench[@]}" --suite layer --world-size 1 --seq-lens 16384,65536 \
        --batches one_sequence,lognormal --out "$out/attn_gym_layer"
    step attn_gym_gdn_layer 300 "${bench[@]}" --suite layer --family gdn --world-size 1 --seq-lens 16384,32768 \
        --batches one_sequence,lognormal --out "$out/attn_gym_gdn_layer"
    step attn_gym_gdn 300 "${bench[@]}" --suite gdn --world-size 1 --seq-lens 16384,32768 --out "$out/attn_gym_gdn"
    ;;
model_backend)
    backend=${3:?model_backend OUT BACKEND: fla or attn_gym}
    step "model_$backend" 300 python3 benchmarks/model_step.py --tokens 16384 --variants transformers,parallelize \
        --backend "$backend"
    tail -4 "$out/model_$backend.log"
    ;;
overhead_backend)
    backend=${3:?overhead_backend OUT BACKEND: fla or attn_gym}
    for family in kda gdn; do
        step "overhead_${family}_$backend" 280 "${bench[@]}" --suite overhead --family "$family" --backend "$backend" \
            --seq-lens 16384 --layouts contiguous --batches one_sequence,lognormal --rounds 3 --iters 3 \
            --out "$out/overhead_${family}_$backend"
    done
    grep -h '^|' "$out"/overhead_*_"$backend".log | head -40
    ;;
demo)
    step demo 120 env TRITON_CACHE_DIR="$(mktemp -d)" python3 -m kdacp.cli demo --world-size 1 --device cuda
    tail -2 "$out/demo.log"
    step gpu_tests 400 python3 -m pytest -q -m gpu tests/test_determinism_gpu.py tests/test_long_sequence_gpu.py \
        tests/models/test_prefill_gpu.py tests/models/test_parallelize_gpu.py
    ;;
split_tests)  # at most 560 s: one device call
    export ARCHIVE="$out/split_tests.tgz"
    step first_run_heads 120 python3 -m pytest -v -s -m gpu tests/test_tuning_gpu.py
    grep -h "PASSED\|FAILED\|autotuned at" "$out/first_run_heads.log"
    step split_tests 430 python3 -m pytest -v -m gpu tests/cp/test_split_gpu.py
    grep -h "PASSED\|FAILED\|ERROR\|passed\|failed" "$out/split_tests.log" | tail -12
    ;;
split_graph)  # the first mode compiles the kernels (about a minute on an H100); the others reuse them
    for mode in fb8 fb_none fb8_noeager fb8_loss fwd8; do
        step "split_graph_$mode" 120 python3 benchmarks/split_graph_probe.py "$mode"
        grep -h -A60 "^$mode " "$out/split_graph_$mode.log" | head -62
    done
    ;;
split)  # at most 560 s: one device call; a family's sweep took 290 s for its first 16 rows on an H100
    family=${3:-kda}
    if compgen -G ".whl/flashqla/*.whl*" > /dev/null; then  # FlashQLA beside the split where its wheels were carried
        eval "$(bash benchmarks/flashqla_prep.sh install .whl/flashqla /tmp/flashqla | tail -1)"
    fi
    # FLA leaves GDN's forward + backward out where it refuses its GDN backward, unless FlashQLA's wheels brought
    # tilelang (a forward alone is inference); the log, table and plots packed into one file (a call brings back a
    # few files only)
    export ARCHIVE="$out/split.tgz"
    step split_heads 550 python3 benchmarks/split_heads.py --families "$family" --heads 2,4,8,32 --tokens 65536 \
        --batches one_sequence,lognormal --splits none,auto,16 --rounds 3 --out "$out"
    grep -h " ms |" "$out/split_heads.log"
    ;;
split_detail)  # at most 560 s: one device call
    export ARCHIVE="$out/split_detail.tgz"
    step split_graphs 200 python3 benchmarks/split_heads.py --families kda,gdn --heads 2,4 --tokens 65536 \
        --splits none,auto,8 --rounds 3 --graphs  # the same calls replayed from CUDA graphs: no host time
    grep -h " ms |" "$out/split_graphs.log"
    step chain_kernel 120 python3 benchmarks/chain_kernel.py  # the chain's tilings: us a piece
    grep -h "^|" "$out/chain_kernel.log"
    for mode in "" --backward; do  # each kernel's device time and the host's time per call, at 4 heads
        step "split_profile${mode:+_backward}" 120 python3 benchmarks/split_profile.py --family kda --heads 4 \
            --splits none,8,auto $mode
        grep -h "^| kda" "$out/split_profile${mode:+_backward}.log"
    done
    ;;
flashqla|flashqla_heads)
    wheels=${3:-.whl/flashqla}  # FlashQLA's wheels (benchmarks/flashqla_prep.sh download), joined here
    eval "$(bash benchmarks/flashqla_prep.sh install "$wheels" /tmp/flashqla | tail -1)"
    if [ "$part" = flashqla ]; then
        step flashqla_tests 550 python3 -m pytest -q -s -m gpu tests/backends/test_flashqla_backend_gpu.py
        grep -h "error vs float64\|passed\|failed" "$out/flashqla_tests.log"
    else
        step flashqla_heads 550 python3 benchmarks/split_heads.py --families gdn --heads 2,4,8,32 --tokens 65536 \
            --splits none,auto,8 --out "$out/flashqla_heads"
        grep -h " ms |" "$out/flashqla_heads.log"
    fi
    ;;
first_run)
    nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
    demo=(python3 -m kdacp_command demo --world-size 1 --device cuda)
    step first_run_shipped 90 env TRITON_CACHE_DIR="$(mktemp -d)" "${demo[@]}"
    step tune_demo 180 python3 -m kdacp_command tune --gates softplus --batches docs7 --seq-lens 2048
    step first_run_own 90 env TRITON_CACHE_DIR="$(mktemp -d)" "${demo[@]}"
    step tune_layer 200 python3 -m kdacp_command tune --gates safe --batches one_sequence,docs7 --seq-lens 16384
    # one file: a device call brings back a few files only
    tar czf "$out/fla-configs.tgz" -C "${XDG_CACHE_HOME:-$HOME/.cache}/kdacp" fla-configs
    grep -h "^time: \|kdacp: no FLA\|^wrote" "$out"/first_run_*.log "$out"/tune_*.log
    ;;
versus)  # another tree's library beside this one's, in turns on one card
    other=${3:?versus OUT DIR: DIR holds the src folder of another commit (git archive REV src | tar x -C DIR)}
    [ -d "$other/src/kdacp" ] || { echo "versus: $other/src/kdacp is not there" >&2; exit 2; }
    for round in 1 2; do
        for tree in other this; do
            src=$PWD/src; [ "$tree" = other ] && src=$(cd "$other" && pwd)/src
            run=(env PYTHONPATH="$src:${PYTHONPATH:-}" "${bench[@]}")
            # the first of each compiles its kernels: over 60 s on a fresh H100
            [ "$round" = 1 ] && step "kernels_$tree" 150 "${run[@]}" --suite kernels --out "$out/kernels_$tree"
            step "layer_${tree}_$round" 50 "${run[@]}" --suite layer --world-size 1 --seq-lens 16384 \
                --batches one_sequence --out "$out/layer_${tree}_$round"
            step "overhead_${tree}_$round" 120 "${run[@]}" --suite overhead --seq-lens 16384 --layouts contiguous \
                --batches one_sequence --rounds 2 --iters 3 --out "$out/overhead_${tree}_$round"
        done
    done
    for f in "$out"/kernels_*.log "$out"/layer_*.log "$out"/overhead_*.log; do
        echo "== $f"; grep -h "^|" "$f" | grep -v "^|--" | head -8
    done
    ;;
*)
    echo "part must be $PARTS, got $part" >&2
    exit 2
    ;;
esac
