"""What the op suites (``cp``, ``gdn``) share: each contender's timed step (forward and backward, or
forward only), the relative difference of two contenders across ranks, and progress lines."""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

_log = logging.getLogger(__name__)


def _train_step(fn, x: dict, do: torch.Tensor):
    """One forward + backward of ``fn(**x) -> (o, final_state)``: ``(o, gradients of x)``, not accumulated."""
    o, _ = fn(**x)
    return o, torch.autograd.grad(o, list(x.values()), do)


def _forward_step(fn, x: dict):
    """One forward call without gradients: ``(o, [final_state])``, shaped like :func:`_train_step`'s result."""
    with torch.no_grad():
        o, final = fn(**x)
    return o, [] if final is None else [final]


def step_functions(runs: dict, names, x: dict, do: torch.Tensor, backward: bool) -> dict:
    """For each of ``names``, a no-argument callable running ``runs[name](**x)`` once: forward and backward
    against ``do`` (returning ``(o, gradients)``), or with ``backward=False`` forward only on detached
    inputs (returning ``(o, [final_state])``)."""
    if backward:
        return {name: (lambda fn=runs[name]: _train_step(fn, x, do)) for name in names}
    x_in = {n: t.detach() for n, t in x.items()}
    return {name: (lambda fn=runs[name]: _forward_step(fn, x_in)) for name in names}


def max_rel_diff(a_step, b_step, group) -> float:
    """The largest relative difference over the output and every gradient of two steps (replicated
    parameters' per-rank shares summed over the group first)."""
    pairs = [(a_step[0], b_step[0])] + list(zip(a_step[1], b_step[1]))
    diff = torch.stack([torch.stack([(a.float() - b.float()).norm() ** 2, b.float().norm() ** 2]) for a, b in pairs])
    dist.all_reduce(diff, group=group)
    return (diff[:, 0] / diff[:, 1]).sqrt().max().item()


def log(message: str, level: int = logging.INFO) -> None:
    """A message of rank 0 with its wall time through the ``kdacp`` logger: progress at INFO (``kdacp -v``
    shows it; FLA autotunes each kernel at first use, minutes cold), a failed case at WARNING."""
    if dist.get_rank() == 0:
        _log.log(level, f"[kdacp bench {time.strftime('%H:%M:%S')}] {message}")


def record_row(rows: list, row: dict, report) -> None:
    """Keep a measured ``row`` in ``rows``, hand it to ``report`` (if any) and give the CUDA allocator's cached
    blocks back before the next case (call it after dropping the case's inputs)."""
    rows.append(row)
    if report is not None:
        report(row)
    torch.cuda.empty_cache()
