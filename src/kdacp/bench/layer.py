"""KimiDeltaAttention layer step (forward + backward) with context parallelism: state vs Ulysses vs one GPU.

Each rank holds ``T_local`` tokens of one sequence (B=1, bf16, fla backend). Rows: the one-GPU layer at
``T_local`` and at the global ``world_size * T_local`` tokens, then each CP mode; times are the
slowest rank's (warm, synchronised), ``speedup`` is over the one-GPU layer on the same global batch.

    kdacp bench --suite layer
    (or under torchrun: torchrun --nproc-per-node 2 -m kdacp.cli bench --suite layer)

``run(...)`` returns the rows (for a CLI); call it on every rank of an initialised NCCL group.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from kdacp.distributed import new_cp_group
from kdacp.layers import KDAContextParallel, KimiDeltaAttention

from .harness import PlotSpec

MULTI_RANK = True
PLOTS = {"layer_vs_tokens": PlotSpec(x="global_tokens", y="ms", series="run",
                                     title="layer step (fwd+bwd) vs global tokens")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, warmup: int, iters: int, group, device: torch.device) -> float:
    """Milliseconds per call (wall clock around synchronised loops), the maximum over the group."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier(group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    ms = torch.tensor((time.perf_counter() - start) * 1e3 / iters, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return ms.item()


def layer_step(layer: KimiDeltaAttention, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Forward and backward of one layer call; gradients of the input and every parameter."""
    y, _ = layer(x)
    torch.autograd.grad(y, [x, *layer.parameters()], dy)


def run(t_local: int = 16384, hidden: int = 2048, heads: int = 32, head_dim: int = 128,
        modes=("state", "ulysses"), warmup: int = 3, iters: int = 10, group=None, device="cuda",
        dtype=torch.bfloat16, backend: str = "fla", report=None) -> list[dict]:
    """Rows ``run, gpus, tokens_per_gpu, global_tokens, ms, peak_GB, speedup``.

    ``speedup``: the one-GPU time on ``global_tokens`` over the row's time; ``peak_GB``: the largest
    peak memory over ranks (CUDA only). ``report``: called with each row as it completes (before
    ``speedup`` is known). Call on every rank of ``group`` (default: a new :func:`new_cp_group`).
    """
    device = torch.device(device)
    group = group or new_cp_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)  # replicated parameters
    layer = KimiDeltaAttention(hidden, heads, head_k_dim=head_dim, head_v_dim=head_dim, backend=backend,
                               device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    cases = [("one_gpu", None, 1), ("one_gpu", None, world_size)]
    cases += [(mode, KDAContextParallel(mode, group), 1) for mode in modes]
    rows = []
    for name, cp, scale in cases:
        layer.cp = cp
        T = t_local * scale
        x = torch.randn(1, T, hidden, device=device, generator=gen, dtype=dtype).requires_grad_()
        dy = torch.randn(1, T, hidden, device=device, generator=gen, dtype=dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = time_ms(lambda: layer_step(layer, x, dy), warmup, iters, group, device)
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
                            device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        gpus = 1 if cp is None else world_size
        rows.append(dict(run=name, gpus=gpus, tokens_per_gpu=T, global_tokens=T * gpus, ms=ms, peak_GB=peak.item()))
        if report is not None:
            report(rows[-1])
        del x, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    one_gpu = {r["global_tokens"]: r["ms"] for r in rows if r["run"] == "one_gpu"}
    for r in rows:
        r["speedup"] = one_gpu[r["global_tokens"]] / r["ms"]
    return rows
