"""The raw ``torch.distributed`` messages and collectives of kdacp, in one place: the op's state exchange
(point-to-point messages, gathers, sums, the cross-rank checks' signatures) and the blocks the layers'
differentiable exchanges move (:mod:`kdacp.cp.autograd_collectives`). Process groups: :mod:`.groups`.

Ranks are ranks of the given group; point-to-point calls translate them to global ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _global_rank(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _note(error: Exception, what: str) -> None:
    """Say, in the traceback of a failed wait, what kdacp was waiting for and the likely cause."""
    if hasattr(error, "add_note"):
        error.add_note(f"kdacp: {what} did not complete; a peer rank probably failed (see the error raised "
                       "there) or the group's timeout passed (kdacp.new_cp_group(timeout=...))")


class _Work:
    """A ``dist.Work`` whose ``wait`` failure names the peer (everything else is the work's own)."""

    def __init__(self, work: dist.Work, what: str):
        self._work, self._what = work, what

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            _note(e, self._what)
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)


def post_recv(buffer: torch.Tensor, src: int, group) -> dist.Work:
    """Post a non-blocking receive into ``buffer`` from group rank ``src``."""
    return _Work(dist.irecv(buffer, src=_global_rank(group, src), group=group),
                 f"the receive from group rank {src}")


def send(tensor: torch.Tensor, dst: int, group) -> dist.Work:
    """Start a non-blocking send of ``tensor`` to group rank ``dst``; keep ``tensor`` alive until waited."""
    return _Work(dist.isend(tensor.contiguous(), dst=_global_rank(group, dst), group=group),
                 f"the send to group rank {dst}")


def wait(works) -> None:
    for work in works:
        work.wait()


def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[world_size, *tensor.shape]``: every rank's ``tensor``."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, tensor.contiguous(), group=group)
    except RuntimeError as e:
        _note(e, "an all-gather over the context-parallel group")
        raise
    return torch.stack(parts)


def all_gather_objects(obj, group) -> list:
    """Every rank's picklable ``obj``, in rank order (a slow path: for error messages, not for data)."""
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        _note(e, "an all-gather over the context-parallel group")
        raise
    return out


def post_all_gather(tensor: torch.Tensor, group):
    """Start a non-blocking all-gather of ``tensor``; returns ``(work, parts)``: after ``work.wait()``,
    ``torch.stack(parts)`` is ``[world_size, *tensor.shape]``. Keep ``tensor`` alive until then."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True)
    return _Work(work, "an all-gather over the context-parallel group"), parts


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``tensor`` over the group (in place, returned)."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as e:
        _note(e, "an all-reduce over the context-parallel group")
        raise
    return tensor


def all_gather_signatures(signature: list[int], group, device: torch.device,
                          extra: torch.Tensor | None = None) -> list[list[int]]:
    """Every rank's small int64 ``signature``, gathered in one collective (on ``device``, which
    must suit the group's backend: CUDA for NCCL). ``extra``: int64 values already on ``device``
    appended to the row without a host sync (e.g. a non-finite flag computed there)."""
    local = torch.tensor(signature, dtype=torch.int64, device=device)
    if extra is not None:
        local = torch.cat([local, extra.to(device=device, dtype=torch.int64).reshape(-1)])
    return all_gather(local, group).tolist()


def exchange_blocks(x: torch.Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], group
                    ) -> torch.Tensor:
    """Block ``j`` of ``x``'s dim 1 (``send_counts[j]`` rows) goes to rank ``j``; block ``i`` of the result
    (``recv_counts[i]`` rows) came from rank ``i``. A rank's own block is copied; empty blocks move nothing."""
    rank = dist.get_rank(group)
    sends = x.split(list(send_counts), dim=1)
    recvs = [x.new_empty(x.shape[0], n, *x.shape[2:]) for n in recv_counts]
    ops = [dist.P2POp(dist.irecv, recvs[i], dist.get_global_rank(group, i), group)
           for i, n in enumerate(recv_counts) if n and i != rank]
    ops += [dist.P2POp(dist.isend, sends[j].contiguous(), dist.get_global_rank(group, j), group)
            for j, n in enumerate(send_counts) if n and j != rank]
    if recv_counts[rank]:
        recvs[rank].copy_(sends[rank])
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return torch.cat(recvs, dim=1)


def all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split ``all_to_all_single`` along dim 0: block ``j`` goes to rank ``j``, block ``i`` of the result came
    from rank ``i`` (a new contiguous tensor)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out

def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def sum_own_block(x: torch.Tensor, dim: int, group, reduce_scatter: bool = True) -> torch.Tensor:
    """The sum of every rank's ``x``, cut into equal blocks along ``dim``: this rank's block (rank order).
    ``reduce_scatter``: NCCL's reduce-scatter where the group is NCCL; otherwise (and on gloo, which has none)
    an all-reduce of the whole."""
    size = dist.get_world_size(group)
    if reduce_scatter and dist.get_backend(group) == "nccl":
        blocks = x.movedim(dim, 0).unflatten(0, (size, -1)).contiguous()   # [P, T, ...]
        own = torch.empty_like(blocks[0])
        dist.reduce_scatter_tensor(own, blocks.flatten(0, 1), group=group)
        return own.movedim(0, dim)
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(size, dim)[dist.get_rank(group)]
