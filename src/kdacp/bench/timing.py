"""Timing shared by the suites: contenders round-robin in one run, the slowest rank's figure (or one
process's, without a group)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["time_round_robin", "peak_gb"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(fns: dict, warmup: int, rounds: int, iters: int, group, device: torch.device) -> dict:
    """Milliseconds per call of each of ``fns`` (name -> callable), the slowest rank's of ``group``
    (``None``: this process alone, no collective).

    After ``warmup`` calls of each, ``rounds`` times: each contender in turn runs ``iters`` calls
    back to back (a warm queue), timed by CUDA events (wall clock on CPU) after a barrier, so a
    context-parallel contender never waits for a peer still busy with the previous contender."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    total = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            if group is not None:
                dist.barrier(group)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                _sync(device)
                total[name] += start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                total[name] += (time.perf_counter() - t0) * 1e3
    ms = {n: total[n] / (rounds * iters) for n in fns}
    if group is None:
        return ms
    slowest = torch.tensor(list(ms.values()), dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(fns, slowest.tolist()))


def peak_gb(fn, group, device: torch.device) -> float:
    """Peak allocated GiB during one call, the largest over ranks (0 on CPU)."""
    if device.type != "cuda":
        return 0.0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak.item()
