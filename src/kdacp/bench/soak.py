"""Soak: many training steps of the demo model under context parallelism, watching for growth.

Every step trains :class:`kdacp.demo.DemoModel` (``state`` mode, the given strategy) on a new packed
batch (a new ``cu_seqlens`` tensor each step, so every per-batch cache is exercised), with plain SGD.
Every ``every`` steps each rank records, and rows keep the largest over ranks: its resident memory
(``rss_MB``) and, on CUDA, allocated memory (``cuda_MB``); its threads and open file descriptors; and
the sizes of kdacp's caches (the layer contexts' per-batch and per-shape memos, the cross-rank
verification memo). A leak shows as a column that keeps growing after warm-up.

    kdacp bench --suite soak --device cpu --world-size 4
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

from kdacp.demo import DemoModel, demo_batch, demo_config, sgd_step, token_loss
from kdacp.distributed import checks, new_cp_group
from kdacp.layers import KDAContextParallel

from .harness import PlotSpec

MULTI_RANK = True
PLOTS = {"soak_memory": PlotSpec(x="step", y=("rss_MB", "cuda_MB"), title="memory over a long run", ylabel="MB",
                                 logx=False)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(steps: int = 2000, every: int = 100, strategy: str = "p2p", group=None, device: str = "cpu",
        report=None) -> list[dict]:
    """Rows ``step, rss_MB, cuda_MB, threads, fds, batch_memo, shape_memo, verified_plans, loss``;
    call on every rank of an initialised process group."""
    device = torch.device(device)
    group = group or new_cp_group()
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = demo_config(P, strategy=strategy, device=device.type, dtype=dtype, steps=steps)
    torch.manual_seed(cfg.seed)
    model = DemoModel(cfg).to(device, getattr(torch, dtype))
    cp = KDAContextParallel("state", group, strategy=strategy)
    model.set_context_parallel(cp)
    T = sum(cfg.seq_lens)
    shard = slice(rank * T // P, (rank + 1) * T // P)
    rows = []
    for step in range(1, steps + 1):
        ids, targets, cu = demo_batch(cfg, step, device)
        loss = token_loss(model(ids[:, shard], cu), targets[:, shard], T)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        sgd_step(model.parameters(), cfg.lr / 10)
        if step % every == 0 or step == 1:
            values = torch.tensor([_rss_mb(), torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda"
                                   else 0.0, threading.active_count(), len(os.listdir("/proc/self/fd")),
                                   len(cp._batches), len(cp._row_plans), len(checks._VERIFIED)], dtype=torch.float64,
                                  device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            names = ("rss_MB", "cuda_MB", "threads", "fds", "batch_memo", "shape_memo", "verified_plans")
            row = dict(step=step, **dict(zip(names, values.tolist())), loss=total.item())
            rows.append(row)
            if report is not None:
                report(row)
    return rows
