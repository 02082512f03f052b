"""Differentiable exchanges used by the layer's context-parallel modes.

The only module in ``layers/`` that moves data between ranks. Every exchange is a custom op
(``torch.library``, with a fake implementation for ``torch.compile``) whose backward is the adjoint
exchange, so gradients cross ranks exactly as activations did, and a compiled graph holds each exchange
as one call. Nothing here keeps state between calls: several forwards may be in flight before their
backwards, and non-reentrant checkpointing may re-run a forward.
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


# The exchanges are custom ops (``torch.library``), so that ``torch.compile`` puts each in its graph as one call
# instead of breaking the graph at a collective; the group travels by name.

def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("kdacp::shift", mutates_args=())
def _shift_op(x: torch.Tensor, step: int, group: str) -> torch.Tensor:
    """Rank ``r`` receives rank ``r - step``'s ``x`` (zeros where there is no such rank); the adjoint of a
    shift by ``step`` is the shift by ``-step`` (a tensor that reached nobody has a zero gradient)."""
    return _shift(x, step, _group(group))


@_shift_op.register_fake
def _(x, step, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _shift_setup(ctx, inputs, output):
    _, ctx.step, ctx.group = inputs


_shift_op.register_autograd(lambda ctx, grad: (_shift_op(grad, -ctx.step, ctx.group), None, None),
                            setup_context=_shift_setup)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


@torch.library.custom_op("kdacp::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, group: str) -> torch.Tensor:
    """Equal-split ``all_to_all_single`` along dim 0; with equal splits it is its own adjoint."""
    return _all_to_all(x, _group(group))


@_all_to_all_op.register_fake
def _(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _group_setup(ctx, inputs, output):
    ctx.group = inputs[-1]


_all_to_all_op.register_autograd(lambda ctx, grad: (_all_to_all_op(grad, ctx.group), None),
                                 setup_context=_group_setup)


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _sum_own_block(grad: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The adjoint of :func:`_gather`: every rank's ``grad`` summed, this rank's block along ``dim`` kept (a
    reduce-scatter: NCCL's, or an all-reduce where the backend has none, as gloo)."""
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        blocks = grad.movedim(dim, 0).unflatten(0, (size, -1)).contiguous()   # [P, T, ...]
        own = torch.empty_like(blocks[0])
        dist.reduce_scatter_tensor(own, blocks.flatten(0, 1), group=group)
        return own.movedim(0, dim)
    total = grad.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _gathered_shape(x: torch.Tensor, dim: int, group: str) -> list:
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(_group(group))
    return shape


@torch.library.custom_op("kdacp::sum_own_block", mutates_args=())
def _sum_own_block_op(grad: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    return _sum_own_block(grad, dim, _group(group))


@_sum_own_block_op.register_fake
def _(grad, dim, group):
    shape = list(grad.shape)
    shape[dim] //= dist.get_world_size(_group(group))
    return grad.new_empty(shape)


@torch.library.custom_op("kdacp::all_gather_along", mutates_args=())
def _all_gather_along_op(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order; backward :func:`_sum_own_block`."""
    return _gather(x, dim, _group(group))


@_all_gather_along_op.register_fake
def _(x, dim, group):
    return x.new_empty(_gathered_shape(x, dim, group))


def _dim_group_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group = inputs


_all_gather_along_op.register_autograd(lambda ctx, grad: (_sum_own_block_op(grad, ctx.dim, ctx.group), None, None),
                                       setup_context=_dim_group_setup)


@torch.library.custom_op("kdacp::all_to_all_gather", mutates_args=())
def _all_to_all_gather_op(x: torch.Tensor, state: torch.Tensor, dim: int, group: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_to_all(x)`` and ``state`` of every rank concatenated along ``dim``, in one autograd node.

    Every rank holds the gathered state and may use it, so backward sums all ranks' gradients and keeps
    this rank's slice. Sharing the node with ``x`` (which every rank uses) makes every rank run that
    backward collective even where its loss ignores the state.
    """
    pg = _group(group)
    gathered = _gather(state, dim, pg)
    return _all_to_all(x, pg), gathered


@_all_to_all_gather_op.register_fake
def _(x, state, dim, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format), state.new_empty(_gathered_shape(state, dim, group))


def _all_to_all_gather_backward(ctx, grad_x, grad_state):
    # A whole-state all-reduce (states are small; gloo has no reduce-scatter).
    return (_all_to_all_op(grad_x, ctx.group), _sum_own_block_op(grad_state, ctx.dim, ctx.group), None, None)


def _x_state_setup(ctx, inputs, output):
    _, _, ctx.dim, ctx.group = inputs


_all_to_all_gather_op.register_autograd(_all_to_all_gather_backward, setup_context=_x_state_setup)


def shift_right(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of the previous rank of ``group`` (zeros on rank 0); one send and one receive per rank."""
    return _shift_op(x, 1, group.group_name)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block ``j`` of dim 0 goes to rank ``j``; block ``i`` of the result came from rank ``i``."""
    return _all_to_all_op(x, group.group_name)


def all_to_all_gather(x: torch.Tensor, state: torch.Tensor, dim: int, group):
    """``(all_to_all(x), states of all ranks concatenated along dim)``; the gathered state's
    gradients from all ranks add up (the convention of ``chunk_kda``'s final state)."""
    return _all_to_all_gather_op(x, state, dim, group.group_name)


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
    """``x`` of every rank of ``group`` concatenated along ``dim`` (rank order); differentiable."""
    return _all_gather_along_op(x, dim, group.group_name)
