"""The demo's first training step on one GPU, in process, under cProfile: where the seconds of a fresh
machine go (Triton compiling, FLA autotuning, the rest).

    TRITON_CACHE_DIR=$(mktemp -d) TRITON_PRINT_AUTOTUNING=1 python benchmarks/first_step_profile.py OUT_DIR

Prints the build, first-step and later-step times and the 40 costliest calls by cumulative time, and
writes ``OUT_DIR/demo_first_step.prof``; with ``TRITON_PRINT_AUTOTUNING=1`` Triton also prints each
autotuned kernel and its tuning time. cProfile slows Python-heavy compilation: the first step runs a
few seconds longer than under ``kdacp demo``.
"""
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist

from kdacp.demo import demo_batch, demo_config, demo_model, demo_step
from kdacp.distributed import new_cp_group
from kdacp.layers import KDAContextParallel
from kdacp.models import parallelize


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29517")
    cfg = demo_config(1, device="cuda", dtype="bfloat16")
    start = time.perf_counter()
    model = demo_model(cfg, "cuda").to(torch.bfloat16)
    cp = KDAContextParallel(cfg.mode, new_cp_group(), strategy=cfg.strategy, backend=cfg.backend)
    parallelize(model, cp)
    torch.cuda.synchronize()
    build = time.perf_counter() - start
    ids, cu = demo_batch(cfg, 0, "cuda")
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    demo_step(model, ids, cu, cp.group)
    torch.cuda.synchronize()
    profile.disable()
    first = time.perf_counter() - start
    later = []
    for step in range(1, 6):
        ids, cu = demo_batch(cfg, step, "cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        demo_step(model, ids, cu, cp.group)
        torch.cuda.synchronize()
        later.append(time.perf_counter() - start)
    print(f"build {build:.2f} s; first step {first:.2f} s; later steps {1e3 * sum(later) / len(later):.1f} ms")
    profile.dump_stats(os.path.join(out_dir, "demo_first_step.prof"))
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
