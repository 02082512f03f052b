"""What the op suites (``cp``, ``gdn``) share: one timed step forward and backward or forward only, the
relative difference of two contenders across ranks, and progress lines."""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

__all__ = ["forward_step", "log", "max_rel_diff", "train_step"]


def train_step(fn, x: dict, do: torch.Tensor):
    """One forward + backward of ``fn(**x) -> (o, final_state)``: ``(o, gradients of x)``, not accumulated."""
    o, _ = fn(**x)
    return o, torch.autograd.grad(o, list(x.values()), do)


def forward_step(fn, x: dict):
    """One forward call without gradients: ``(o, [final_state])``, shaped like :func:`train_step`'s result."""
    with torch.no_grad():
        o, final = fn(**x)
    return o, [] if final is None else [final]


def max_rel_diff(a_step, b_step, group) -> float:
    """The largest relative difference over the output and every gradient of two steps (replicated
    parameters' per-rank shares summed over the group first)."""
    pairs = [(a_step[0], b_step[0])] + list(zip(a_step[1], b_step[1]))
    diff = torch.stack([torch.stack([(a.float() - b.float()).norm() ** 2, b.float().norm() ** 2]) for a, b in pairs])
    dist.all_reduce(diff, group=group)
    return (diff[:, 0] / diff[:, 1]).sqrt().max().item()


def log(message: str) -> None:
    """Progress on rank 0's stderr, with wall time: FLA autotunes each kernel at first use (minutes, cold)."""
    if dist.get_rank() == 0:
        print(f"[kdacp bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
