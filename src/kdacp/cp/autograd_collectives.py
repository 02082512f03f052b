"""Differentiable exchanges used by the layer's context-parallel modes: all-to-all (Ulysses), gathers along
a dim, halo rows.

The only module in ``layers/`` that moves data between ranks, through the raw calls of
:mod:`kdacp.cp.collectives`. Every exchange is an
``autograd.Function`` whose backward is the adjoint exchange, so gradients cross ranks exactly
as activations did. Nothing here keeps state between calls: several forwards may be in flight
before their backwards, and non-reentrant checkpointing may re-run a forward.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .collectives import all_to_all_equal, exchange_blocks, gather_along, sum_own_block


class _Linear(torch.autograd.Function):
    """``move(x)``, a linear exchange between ranks; backward ``adjoint(grad)``, its adjoint exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, move, adjoint) -> torch.Tensor:
        ctx.adjoint = adjoint
        return move(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.adjoint(grad), None, None


class _AllToAllGather(torch.autograd.Function):
    """``all_to_all(x)`` and ``state`` of every rank concatenated along ``dim``, in one autograd node.

    Every rank holds the gathered state and may use it, so backward sums all ranks' gradients and
    keeps this rank's slice. Sharing the node with ``x`` (which every rank uses) makes every rank
    run that backward collective even where its loss ignores the state.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: torch.Tensor, dim: int, group):
        ctx.dim, ctx.group = dim, group
        return all_to_all_equal(x, group), gather_along(state, dim, group)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor, grad_state: torch.Tensor):
        # A whole-state all-reduce (states are small; gloo has no reduce-scatter).
        own = sum_own_block(grad_state, ctx.dim, ctx.group, reduce_scatter=False)
        return all_to_all_equal(grad_x, ctx.group), own, None, None


def exchange_rows(x: torch.Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], group) -> torch.Tensor:
    """Rows of ``x [B, n_send, ...]`` to the ranks of ``group``: the first ``send_counts[0]`` rows (dim 1) to
    rank 0, the next ``send_counts[1]`` to rank 1, ...; returns ``[B, sum(recv_counts), ...]``, the rows
    received from rank 0 first. Every rank's counts must match its peers' (``recv_counts[i]`` here is
    ``send_counts[rank]`` on rank ``i``). Point-to-point messages, in one batch; differentiable."""
    send_counts, recv_counts = tuple(send_counts), tuple(recv_counts)
    # backward: the same exchange with the counts swapped (each gradient block goes back to the rank that
    # sent its rows)
    return _Linear.apply(x, partial(exchange_blocks, send_counts=send_counts, recv_counts=recv_counts, group=group),
                         partial(exchange_blocks, send_counts=recv_counts, recv_counts=send_counts, group=group))


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block ``j`` of dim 0 goes to rank ``j``; block ``i`` of the result came from rank ``i`` (equal blocks: the
    exchange is its own adjoint)."""
    move = partial(all_to_all_equal, group=group)
    return _Linear.apply(x, move, move)


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


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along ``dim`` (rank order); differentiable: backward sums
    the gradients of all ranks and keeps this rank's block (a reduce-scatter: NCCL's, or an all-reduce where
    the backend has none, as gloo)."""
    return _Linear.apply(x, partial(gather_along, dim=dim, group=group), partial(sum_own_block, dim=dim, group=group))
