"""Differentiable exchanges used by the layer's context-parallel modes.

The only module in ``layers/`` that moves data between ranks. Every exchange is an
``autograd.Function`` whose backward is the adjoint exchange, so gradients cross ranks exactly
as activations did. Nothing here keeps state between calls: several forwards may be in flight
before their backwards, and non-reentrant checkpointing may re-run a forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "all_to_all_gather", "shift_right"]


def _p2p(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None, group) -> None:
    """Send ``send`` to group rank ``dst`` and receive ``recv`` from group rank ``src`` (either may be None)."""
    ops = []
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src), group))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, dst), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _shift(x: torch.Tensor, step: int, group) -> torch.Tensor:
    """Rank ``r`` receives rank ``r - step``'s ``x`` (zeros where there is no such rank)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    out = torch.zeros_like(x)
    dst, src = rank + step, rank - step
    _p2p(x if 0 <= dst < size else None, dst, out if 0 <= src < size else None, src, group)
    return out


class _ShiftRight(torch.autograd.Function):
    """Rank ``r`` receives rank ``r-1``'s tensor (rank 0 receives zeros); backward shifts left (the
    last rank's tensor reached nobody, so its gradient is zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _shift(x, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, -1, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` along dim 0; with equal splits it is its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


class _AllToAllGather(torch.autograd.Function):
    """``all_to_all(x)`` and ``state`` of every rank concatenated along ``dim``, in one autograd node.

    Every rank holds the gathered state and may use it, so backward sums all ranks' gradients and
    keeps this rank's slice. Sharing the node with ``x`` (which every rank uses) makes every rank
    run that backward collective even where its loss ignores the state.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: torch.Tensor, dim: int, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(state, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, state.contiguous(), group=group)
        return _all_to_all(x, group), torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor, grad_state: torch.Tensor):
        group = ctx.group
        # A whole-state all-reduce (states are small; gloo has no reduce-scatter).
        total = grad_state.contiguous().clone()
        dist.all_reduce(total, group=group)
        own = total.chunk(dist.get_world_size(group), ctx.dim)[dist.get_rank(group)]
        return _all_to_all(grad_x, group), own, None, None


def shift_right(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of the previous rank of ``group`` (zeros on rank 0); one send and one receive per rank."""
    return _ShiftRight.apply(x, group)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block ``j`` of dim 0 goes to rank ``j``; block ``i`` of the result came from rank ``i``."""
    return _AllToAll.apply(x, group)


def all_to_all_gather(x: torch.Tensor, state: torch.Tensor, dim: int, group):
    """``(all_to_all(x), states of all ranks concatenated along dim)``; the gathered state's
    gradients from all ranks add up (the convention of ``chunk_kda``'s final state)."""
    return _AllToAllGather.apply(x, state, dim, group)
