"""Differentiable exchanges used by the layer's context-parallel modes.

The only module in ``layers/`` that moves data between ranks. Every exchange is an
``autograd.Function`` whose backward is the adjoint exchange, so gradients cross ranks exactly
as activations did. Nothing here keeps state between calls: several forwards may be in flight
before their backwards, and non-reentrant checkpointing may re-run a forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_along", "all_to_all", "all_to_all_gather", "heads_to_time", "shift_right", "time_to_heads"]


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


def time_to_heads(xs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Ulysses, there: time shards ``x_i [B, T, H_i, D_i]`` -> head shards ``[B, U*T, H_i/U, D_i]``
    (``U`` ranks in ``group``, ``H_i % U == 0``), every part in one all-to-all. Rank ``u`` receives heads
    ``u*H_i/U ... (u+1)*H_i/U - 1`` of every rank's tokens, in rank order: the whole global sequence."""
    U = dist.get_world_size(group)
    B, T = xs[0].shape[:2]
    # [U(dst), B, T, H_i/U * D_i] per part, one message per destination
    send = torch.cat([x.unflatten(2, (U, -1)).movedim(2, 0).reshape(U, B, T, -1) for x in xs], dim=-1)
    recv = all_to_all(send, group)                                          # [U(src), B, T, sum_i H_i/U * D_i]
    widths = [x.shape[2] // U * x.shape[3] for x in xs]
    # Contiguous parts: the gates and beta go straight to kernels.
    return [part.reshape(U, B, T, x.shape[2] // U, x.shape[3]).movedim(0, 1).reshape(
        B, U * T, x.shape[2] // U, x.shape[3]).contiguous() for x, part in zip(xs, recv.split(widths, dim=-1))]


def heads_to_time(o: torch.Tensor, group, state: torch.Tensor | None = None):
    """Ulysses, back: head shard ``o [B, U*T, Hs, D]`` -> time shard ``[B, T, U*Hs, D]`` (the inverse of
    :func:`time_to_heads`), in one all-to-all. ``state [N, Hs, ...]``, if given, is gathered along dim 1
    in the same autograd node (:func:`all_to_all_gather`) and returned second (None otherwise)."""
    U = dist.get_world_size(group)
    B, TU, Hs, D = o.shape
    send = o.reshape(B, U, TU // U, Hs, D).movedim(1, 0)                       # [U(dst), B, T, Hs, D]
    if state is None:
        recv = all_to_all(send, group)
    else:
        recv, state = all_to_all_gather(send, state, 1, group)
    # recv: [U(head shard), B, T, Hs, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, TU // U, U * Hs, D), state


class _AllGatherAlong(torch.autograd.Function):
    """Every rank's ``x`` concatenated along ``dim``, in rank order; backward sums the gradients of all
    ranks and keeps this rank's block (a reduce-scatter: NCCL's, or an all-reduce where the backend
    has none, as gloo)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        size = dist.get_world_size(group)
        if dist.get_backend(group) == "nccl":
            blocks = grad.movedim(dim, 0).unflatten(0, (size, -1)).contiguous()   # [P, T, ...]
            own = torch.empty_like(blocks[0])
            dist.reduce_scatter_tensor(own, blocks.flatten(0, 1), group=group)
            return own.movedim(0, dim), None, None
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size, dim)[dist.get_rank(group)], None, None


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` (rank order); differentiable."""
    return _AllGatherAlong.apply(x, dim, group)
