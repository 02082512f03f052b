"""Soak: many training steps of the demo model under context parallelism, watching for growth.

Every step trains :func:`kdacp.demo.demo_model` (transformers' Kimi Linear under :func:`kdacp.parallelize`,
``state`` mode for its KDA layers, the given strategy) on a new packed batch (a new ``cu_seqlens`` tensor
each step, so every per-batch cache is exercised) with :func:`kdacp.demo.demo_step` and plain SGD.
At the first step, every ``every`` steps and the last, each rank records, and rows keep the largest over
ranks: its resident memory (``rss_MB``) and, on CUDA, allocated memory (``cuda_MB``); its threads and open file descriptors; and
the sizes of kdacp's caches (the layer contexts' per-batch and per-shape memos, the cross-rank
verification memo). A leak shows as a column that keeps growing after warm-up.

    kdacp bench --suite soak --device cpu --world-size 4 [--steps 2000]

Each row reaches ``report`` as it is measured, so a run stopped early (``kdacp bench --timeout``) keeps it.
"""
from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

from kdacp.demo import demo_batch, demo_config, demo_model, demo_step
from kdacp.cp import checks, new_cp_group
from kdacp.cp import ContextParallel
from kdacp.integrations.transformers import load_kimi_linear, parallelize

from .harness import PlotSpec

MULTI_RANK = True
prepare = load_kimi_linear  # transformers' model module, before the process group (kdacp.workers.launch)
PLOTS = {"soak_memory": PlotSpec(x="step", y=("rss_MB", "cuda_MB"), title="memory over a long run", ylabel="MB",
                                 logx=False)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(steps: int = 2000, every: int | None = None, strategy: str = "p2p", group=None, device: str = "cpu",
        report=None, seq_lens: tuple[int, ...] | None = None) -> list[dict]:
    """Rows ``step, rss_MB, cuda_MB, threads, fds, context_memo, verified_plans, loss`` (the global
    token-mean loss); call on every rank of an initialised process group. ``seq_lens``: the documents of
    each step's packed batch (default: the demo's); ``every``: steps between rows (default a twentieth of
    ``steps``, at least 1)."""
    if steps < 1 or (every is not None and every < 1):
        raise ValueError(f"steps and every must be >= 1, got steps={steps}, every={every}")
    every = every or max(1, steps // 20)
    device = torch.device(device)
    group = group or new_cp_group()
    P = dist.get_world_size(group)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = demo_config(P, strategy=strategy, device=device.type, dtype=dtype, steps=steps,
                      **({} if seq_lens is None else dict(seq_lens=tuple(seq_lens))))
    model = demo_model(cfg, device).to(getattr(torch, dtype))
    cp = ContextParallel("state", group, strategy=strategy)
    parallelize(model, cp)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr / 10)
    rows = []
    for step in range(1, steps + 1):
        ids, cu = demo_batch(cfg, step, device)
        _, loss = demo_step(model, ids, cu, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % every == 0 or step in (1, steps):
            memo = cp.memo_sizes()
            values = torch.tensor([_rss_mb(), torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda"
                                   else 0.0, threading.active_count(), len(os.listdir("/proc/self/fd")),
                                   memo["contexts"], checks.verified_plans()], dtype=torch.float64, device=device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
            names = ("rss_MB", "cuda_MB", "threads", "fds", "context_memo", "verified_plans")
            row = dict(step=step, **dict(zip(names, values.tolist())), loss=loss.item())
            rows.append(row)
            if report is not None:
                report(row)
    return rows
