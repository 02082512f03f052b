"""The demo's first training step on one GPU, in process, under cProfile: where the seconds of a fresh
machine go (Triton compiling, FLA autotuning, the rest).

    TRITON_CACHE_DIR=$(mktemp -d) TRITON_PRINT_AUTOTUNING=1 python benchmarks/first_step_profile.py OUT_DIR [--precompile] [--no-profile]

``--precompile``: the first step starts with :func:`kdacp.precompile` (as ``kdacp demo`` does), its time
included and also printed; ``--no-profile``: no cProfile (the times as ``kdacp demo`` sees them).

Prints the build, first-step and later-step times and the 40 costliest calls by cumulative time, and
writes ``OUT_DIR/demo_first_step.prof``; with ``TRITON_PRINT_AUTOTUNING=1`` Triton also prints each
autotuned kernel and its tuning time. cProfile slows Python-heavy compilation: the first step runs a
few seconds longer than under ``kdacp demo``.
"""
import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

from kdacp import precompile
from kdacp.demo import demo_batch, demo_config, demo_model, demo_step
from kdacp.cp import new_cp_group
from kdacp.cp import ContextParallel
from kdacp.integrations.transformers import parallelize


def main(out_dir: str, ahead: bool, profiled: bool) -> None:
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group("nccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29517")
    cfg = demo_config(1, device="cuda", dtype="bfloat16")
    start = time.perf_counter()
    model = demo_model(cfg, "cuda").to(torch.bfloat16)
    cp = ContextParallel(cfg.mode, new_cp_group(), strategy=cfg.strategy, backend=cfg.backend)
    parallelize(model, cp)
    torch.cuda.synchronize()
    build = time.perf_counter() - start
    ids, cu = demo_batch(cfg, 0, "cuda")
    profile = cProfile.Profile()
    start = time.perf_counter()
    if profiled:
        profile.enable()
    compiled, ahead_s = 0, 0.0
    if ahead:
        compiled = precompile(lambda: demo_step(model, ids, cu, cp.group))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        ahead_s = time.perf_counter() - start
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
    print(f"build {build:.2f} s; first step {first:.2f} s (of which precompile {ahead_s:.2f} s, {compiled} "
          f"kernels); later steps {1e3 * sum(later) / len(later):.1f} ms")
    if profiled:
        profile.dump_stats(os.path.join(out_dir, "demo_first_step.prof"))
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=".")
    parser.add_argument("--precompile", action="store_true")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    a = parser.parse_args()
    main(a.out, a.precompile, a.profile)
