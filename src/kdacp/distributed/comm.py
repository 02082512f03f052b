"""The raw ``torch.distributed`` calls of the context-parallel op (``cp_chunk_kda``), in one place.

The layers' differentiable exchanges (halo, all-to-all) are in :mod:`kdacp.layers.comm`; group and
rank queries (``get_rank``, ``get_world_size``) are made where they are needed.

Ranks are ranks of the plan's group; point-to-point calls translate them to global ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["new_group", "post_recv", "send", "wait", "all_gather", "post_all_gather", "all_reduce_sum",
           "all_gather_signatures"]


def new_group(ranks=None):
    """A new process group over global ``ranks`` (default: all), on the default group's backend.

    On NCCL its communication streams get high priority: a state message posted right after the
    kernel that computes it then starts at once instead of queueing behind the next large compute
    kernel's blocks (on 2 H200s this took a context-parallel step from 1.15-1.29x to 1.05x the
    one-GPU time; ``benchmarks/RESULTS.md``). Collective: every rank of the default group calls
    it, in the same order.
    """
    backend = dist.get_backend()
    options = None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    return dist.new_group(ranks, backend=backend, pg_options=options)


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def post_recv(buffer: torch.Tensor, src: int, group) -> dist.Work:
    """Post a non-blocking receive into ``buffer`` from group rank ``src``."""
    return dist.irecv(buffer, src=_global_rank(group, src), group=group)


def send(tensor: torch.Tensor, dst: int, group) -> dist.Work:
    """Start a non-blocking send of ``tensor`` to group rank ``dst``; keep ``tensor`` alive until waited."""
    return dist.isend(tensor.contiguous(), dst=_global_rank(group, dst), group=group)


def wait(works) -> None:
    for work in works:
        work.wait()


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[world_size, *tensor.shape]``: every rank's ``tensor``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def post_all_gather(tensor: torch.Tensor, group):
    """Start a non-blocking all-gather of ``tensor``; returns ``(work, parts)``: after ``work.wait()``,
    ``torch.stack(parts)`` is ``[world_size, *tensor.shape]``. Keep ``tensor`` alive until then."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    return dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True), parts


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``tensor`` over the group (in place, returned)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_signatures(signature: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's small int64 ``signature``, gathered in one collective (on ``device``, which
    must suit the group's backend: CUDA for NCCL)."""
    local = torch.tensor(signature, dtype=torch.int64, device=device)
    return all_gather(local, group).tolist()
