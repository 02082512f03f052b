"""Differentiable exchanges used by the layer's context-parallel modes.

The only module in ``layers/`` that calls ``torch.distributed``. Every exchange is an
``autograd.Function`` whose backward is the adjoint exchange, so gradients cross ranks exactly
as activations did. Nothing here keeps state between calls: several forwards may be in flight
before their backwards, and non-reentrant checkpointing may re-run a forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_dim", "all_to_all", "shift_right"]


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


class _ShiftRight(torch.autograd.Function):
    """Rank ``r`` receives rank ``r-1``'s tensor (rank 0 receives zeros); backward shifts left."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        out = torch.zeros_like(x)
        _p2p(x if rank + 1 < size else None, rank + 1, out if rank > 0 else None, rank - 1, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        grad = grad.contiguous()
        # The last rank's tensor reached nobody, so its gradient is zero.
        out = torch.zeros_like(grad)
        _p2p(grad if rank > 0 else None, rank - 1, out if rank + 1 < size else None, rank + 1, group)
        return out, None


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` along dim 0; with equal splits it is its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class _AllGatherDim(torch.autograd.Function):
    """Concatenate every rank's ``x`` along ``dim``. The result is treated as replicated: each
    rank's gradient for it is assumed equal, so backward keeps this rank's own slice (no sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank], None, None


def shift_right(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of the previous rank of ``group`` (zeros on rank 0); one send and one receive per rank."""
    return _ShiftRight.apply(x, group)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block ``j`` of dim 0 goes to rank ``j``; block ``i`` of the result came from rank ``i``."""
    return _AllToAll.apply(x, group)


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (result replicated on all ranks)."""
    return _AllGatherDim.apply(x, dim, group)
