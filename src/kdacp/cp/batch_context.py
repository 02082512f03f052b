"""The one per-batch context of a context-parallel step (FLA's ``build_cp_context`` shape): built once from
the global boundaries and the token layout, read by every layer call of the step.

:func:`build_cp_context` makes a :class:`CPContext`: the recurrence's plan, this rank's local boundaries on
the host and on the device (the only two forms they take on the way down), each local token's global
position (what softmax attention masks with; made on the device at its first use), and, per convolution
width, the route of the short convolution's halos (:meth:`CPContext.left_halos`). Its two calls are what
every token mixer (the layers, the torchtitan and Megatron-Core modules) runs:
:meth:`CPContext.short_convolution` and :meth:`CPContext.recurrence`. A layout is any
:class:`~kdacp.cp.layout.TokenLayout` or the name of a built-in one; a rank's local tokens are its ranges
concatenated in global order, and every range edge is a local sequence boundary.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.distributed as dist

from ..caches import HALO_ROUTES
from ..host_copies import host_boundaries, to_device
from ..kernels.short_conv import causal_conv1d
from ..validation import check_boundaries
from .autograd_collectives import exchange_rows
from .layout import TokenLayout, make_layout
from .plan import build_cp_plan, one_rank_plan


@dataclass(frozen=True)
class HaloRoute:
    """Where the ``width`` tokens before each of a rank's ranges come from, for one batch.

    Slot ``k * width + j`` of the halo buffer holds global token ``start_k - width + j`` (``start_k``: the
    rank's range ``k``) when that token exists and lies in the same document as ``start_k``; other slots stay
    zero. ``send_index [n_send]`` int64 (device): this rank's local tokens that others (or itself) need,
    grouped by destination rank (ascending), ``send_counts[j]`` for rank ``j``; ``recv_slots [n_recv]`` int64
    (device): the slot of each received token, grouped by source rank, ``recv_counts[i]`` from rank ``i``.
    """

    width: int
    num_ranges: int
    send_index: torch.Tensor
    send_counts: tuple[int, ...]
    recv_slots: torch.Tensor
    recv_counts: tuple[int, ...]


def _halo_needs(layout: TokenLayout, cu_seqlens: tuple[int, ...] | None, rank: int, width: int) -> list[tuple[int, int]]:
    """``(slot, global token)`` of every halo token ``rank`` needs (:class:`HaloRoute`), in slot order."""
    bounds = [0] if cu_seqlens is None else list(cu_seqlens)
    needs = []
    for k, (start, _) in enumerate(layout.ranges[rank]):
        document_start = bounds[bisect.bisect_right(bounds, start) - 1]
        needs += [(k * width + j, start - width + j) for j in range(width) if start - width + j >= document_start]
    return needs


@lru_cache(maxsize=HALO_ROUTES)
def halo_route(layout: TokenLayout, cu_seqlens: tuple[int, ...] | None, rank: int, width: int,
               device: torch.device) -> HaloRoute:
    """The :class:`HaloRoute` of ``rank`` for convolution halos of ``width`` tokens (``cu_seqlens``: the
    global boundaries of a packed row, None for rows); the last :data:`~kdacp.caches.HALO_ROUTES` are kept."""
    chain = layout.chain
    starts = [p.start for p in chain]

    def owner(token: int) -> tuple[int, int]:
        p = chain[bisect.bisect_right(starts, token) - 1]
        return p.rank, p.local_start + token - p.start

    P = layout.world_size
    send_index, send_counts = [], []
    for dst in range(P):
        mine = [local for _, g in _halo_needs(layout, cu_seqlens, dst, width) for r, local in [owner(g)] if r == rank]
        send_index += mine
        send_counts.append(len(mine))
    by_source = [[] for _ in range(P)]
    for slot, g in _halo_needs(layout, cu_seqlens, rank, width):
        by_source[owner(g)[0]].append(slot)
    recv_slots = [slot for slots in by_source for slot in slots]
    as_index = lambda xs: to_device(torch.tensor(xs, dtype=torch.int64), device)
    return HaloRoute(width, len(layout.ranges[rank]), as_index(send_index), tuple(send_counts), as_index(recv_slots),
                     tuple(len(s) for s in by_source))


@dataclass(frozen=True, eq=False)
class CPContext:
    """One batch as this rank's layers see it; build it with :func:`build_cp_context` (or let
    :class:`~kdacp.cp.ContextParallel` build it once per batch). Immutable; safe to share between calls
    in flight.

    Attributes:
        layout: the :class:`~kdacp.cp.layout.TokenLayout` over the ranks of ``group`` (of one row for
            ``batch_size`` rows).
        rank: this rank's index in ``group`` (0 on one device).
        group: the process group, or None on one device.
        batch_size: rows ``B`` (1 for a packed row).
        cu_seqlens: the global ``[N+1]`` boundaries of a packed row as ints, or None for rows.
        plan: the recurrence's :class:`~kdacp.cp.CPPlan`, or None (one device, or not asked for).
        local_cu_seqlens_cpu: ``[n+1]`` int64 on the host: this rank's local sequences (every document edge and
            every range edge is a boundary), or None for rows when the rank holds one range.
        local_cu_seqlens: the same on the device.
        device: where the context's device tensors live.
    """

    layout: TokenLayout
    rank: int
    group: object
    batch_size: int
    cu_seqlens: tuple[int, ...] | None
    plan: object
    local_cu_seqlens_cpu: torch.Tensor | None
    local_cu_seqlens: torch.Tensor | None
    device: torch.device

    @cached_property
    def local_plan(self):
        """On one device (``group`` None): the one-rank :class:`~kdacp.cp.CPPlan` of this rank's rows or packed
        sequences, which the ops run on when given this context (built once; the boundaries were checked when the
        context was built). None under context parallelism (see :attr:`plan`)."""
        if self.group is not None:
            return None
        cu = None if self.local_cu_seqlens_cpu is None else tuple(self.local_cu_seqlens_cpu.tolist())
        return one_rank_plan(cu, self.batch_size if cu is None else 1, self.layout.local_lengths[self.rank])

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """This rank's global ranges ``(start, end)``, ascending."""
        return self.layout.ranges[self.rank]

    @cached_property
    def range_starts(self) -> tuple[int, ...]:
        """The local token where each of this rank's ranges starts (the first is 0)."""
        starts, local = [], 0
        for s, e in self.ranges:
            starts.append(local)
            local += e - s
        return tuple(starts)

    @cached_property
    def attention_pieces(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(local_start, local_end, key_start, key_end)`` of each piece of this rank's tokens that lies in one
        range and one document: its queries (local tokens) attend causally the global keys
        ``[key_start, key_end)`` (the document's start up to the piece's last token), the queries being the
        last ``local_end - local_start`` of those keys."""
        return _attention_pieces(self.layout, self.cu_seqlens, self.rank)

    @cached_property
    def attention_work(self) -> tuple[int, ...]:
        """Causal query-key pairs of each rank's tokens (every rank's, from the layout): the per-rank FLOPs of
        softmax attention over the gathered keys, up to a constant."""
        return tuple(sum((e - a) * (a - k + 1 + e - k) // 2 for a, e, k, _ in _global_pieces(self.layout, self.cu_seqlens, r))
                     for r in range(self.layout.world_size))

    @cached_property
    def token_index(self) -> torch.Tensor:
        """``[T_local]`` int64 on the device: the global position of each local token (in its row). Made at the
        first use (softmax attention's), not with the context: a token mixer's context then holds no device
        tensor for one sequence, so its first call may be inside a CUDA-graph pool (Inductor's
        ``reduce-overhead`` warm-up) and leave no tensor there."""
        return to_device(self.layout.local_token_index(self.rank), self.device)

    @cached_property
    def all_token_index(self) -> torch.Tensor:
        """``[num_tokens]`` int64 on the device: the global position of every rank's local tokens laid end to end
        in rank order (what an all-to-all of equal time shards gathers)."""
        order = torch.cat([self.layout.local_token_index(r) for r in range(self.layout.world_size)])
        return to_device(order, self.device)

    @cached_property
    def gather_index(self) -> torch.Tensor:
        """``[num_tokens]`` int64 on the device: where global token ``g`` sits among every rank's local tokens
        laid end to end, each rank's padded to ``max(layout.local_lengths)`` (an all-gather's layout)."""
        L = max(self.layout.local_lengths)
        where = torch.empty(self.layout.num_tokens, dtype=torch.int64)
        for r in range(self.layout.world_size):
            where[self.layout.local_token_index(r)] = r * L + torch.arange(self.layout.local_lengths[r])
        return to_device(where, self.device)

    def left_halos(self, xs: list[torch.Tensor], width: int) -> list[torch.Tensor | None]:
        """The ``width`` tokens before each of this rank's ranges, of each ``x [B, T_local, C_i]``:
        ``[B, R, width, C_i]`` (``R`` ranges), zero where a token belongs to another document (or there is
        none), fetched from whichever ranks hold them (possibly this one) in one exchange for all ``xs``;
        differentiable, the gradient going back to the owner. Nones on one device (the rank holds whole
        sequences) or for ``width == 0``. A collective: every rank of ``group`` calls it with one ``width``."""
        if self.group is None or width == 0:
            return [None] * len(xs)
        route = halo_route(self.layout, self.cu_seqlens, self.rank, width, xs[0].device)
        send = torch.cat([x.index_select(1, route.send_index) for x in xs], dim=-1)     # [B, n_send, sum C_i]
        recv = exchange_rows(send, route.send_counts, route.recv_counts, self.group)   # [B, n_recv, sum C_i]
        halo = recv.new_zeros(recv.shape[0], route.num_ranges * width, recv.shape[-1])
        halo = halo.index_copy(1, route.recv_slots, recv).unflatten(1, (route.num_ranges, width))
        return list(halo.split([x.shape[-1] for x in xs], dim=-1))

    def short_convolution(self, xs: list[torch.Tensor], weights: list[torch.Tensor],
                          biases: list[torch.Tensor | None], *, fused: bool,
                          activation: str | None = "silu") -> list[torch.Tensor]:
        """The depthwise causal convolution of each of this rank's ``x [B, T_local, D_i]`` with ``weights[i]
        [D_i, W]`` (one ``W``) and ``biases[i] [D_i]`` (or None), then ``activation``: each of the rank's ranges
        continuing the ``W - 1`` tokens before it in its document, fetched from whichever rank holds them in one
        exchange for all ``xs`` (:meth:`left_halos`), each local sequence starting from zeros otherwise.
        ``fused``: kdacp's Triton kernels (:func:`~kdacp.kernels.short_conv.causal_conv1d`). A collective under
        context parallelism: every rank of ``group`` calls it with one ``W``."""
        halos = self.left_halos(xs, weights[0].shape[-1] - 1)
        return [causal_conv1d(x, weight, bias, halo=halo, cu_seqlens=self.local_cu_seqlens,
                              cu_seqlens_cpu=self.local_cu_seqlens_cpu, fused=fused, activation=activation,
                              range_starts=self.range_starts)
                for x, weight, bias, halo in zip(xs, weights, biases, halos)]

    def recurrence(self, op, q, k, v, g, beta, **kwargs):
        """``op`` (:func:`kdacp.chunk_kda` or :func:`kdacp.chunk_gated_delta_rule`, with its own keyword
        arguments but ``cu_seqlens``, ``cu_seqlens_cpu`` and ``cp``) on this rank's tokens of the batch, with
        this context as ``cp`` (the plan under context parallelism, else the local boundaries): ``op``'s
        ``(o, final_state)``. A collective under context parallelism."""
        return op(q, k, v, g, beta, cp=self, **kwargs)


def _global_pieces(layout: TokenLayout, cu_seqlens, rank: int) -> list[tuple[int, int, int, int]]:
    """``(start, end, document_start, local_start)`` of each piece of ``rank``'s ranges cut at document edges."""
    bounds = [0, layout.num_tokens] if cu_seqlens is None else list(cu_seqlens)
    pieces, local = [], 0
    for s, e in layout.ranges[rank]:
        cuts = [s] + [c for c in bounds if s < c < e] + [e]
        for a, b in zip(cuts[:-1], cuts[1:]):
            pieces.append((a, b, bounds[bisect.bisect_right(bounds, a) - 1], local + a - s))
        local += e - s
    return pieces


def _attention_pieces(layout: TokenLayout, cu_seqlens, rank: int) -> tuple[tuple[int, int, int, int], ...]:
    return tuple((ls, ls + b - a, d, b) for a, b, d, ls in _global_pieces(layout, cu_seqlens, rank))


def _global_tokens(layout, cu_seqlens, local_length: int, world_size: int) -> int:
    if isinstance(layout, TokenLayout):
        return layout.num_tokens
    return cu_seqlens[-1] if cu_seqlens is not None else local_length * world_size


def _plan(layout: TokenLayout, cu_seqlens, batch_size: int, group, strategy: str):
    """The recurrence's plan of the batch under ``layout`` (the contiguous one by its rank lengths)."""
    rows = None if cu_seqlens else batch_size
    if layout.is_contiguous:
        return build_cp_plan(cu_seqlens, local_lengths=layout.local_lengths, batch_size=rows, group=group,
                             strategy=strategy)
    return build_cp_plan(cu_seqlens, layout=layout, batch_size=rows, group=group, strategy=strategy)


def build_cp_context(cu_seqlens=None, *, local_length: int, batch_size: int = 1, layout="contiguous", group=None,
                     strategy: str = "p2p", with_plan: bool = True, device=None) -> CPContext:
    """The :class:`CPContext` of one batch on this rank; call it on every rank of ``group`` with the same
    global arguments (no collective runs here).

    Args:
        cu_seqlens: the global ``[N+1]`` boundaries of a packed row (int tensor or ints), or None for
            ``batch_size`` rows. Read on the host once (a device sync for a CUDA tensor).
        local_length: the tokens this rank holds (per row).
        batch_size: rows ``B`` without ``cu_seqlens`` (1 with them).
        layout: a :class:`~kdacp.cp.layout.TokenLayout`, one of :data:`~kdacp.cp.layout.LAYOUTS` (built-in
            layouts need every rank to hold ``local_length`` tokens) or a layout rule
            (:func:`~kdacp.cp.layout.is_layout_rule`: called with the batch's boundaries, ``P`` and ``device``).
        group: the context-parallel process group; None: one device (the whole batch here).
        strategy: the recurrence's state exchange (see :func:`kdacp.build_cp_plan`).
        with_plan: build the recurrence's plan (False: for softmax attention alone).
        device: where the device tensors live (default ``cu_seqlens``' device, else the CPU).

    Raises:
        ValueError: a layout that does not cover the batch, or gives this rank another number of tokens; on one
            device with a built-in layout, ``cu_seqlens`` not ``0 = c_0 < c_1 < ... < c_N = local_length``.
    """
    P = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
    device = torch.device(device)
    cu = None
    if cu_seqlens is not None:
        cu = host_boundaries(cu_seqlens) if isinstance(cu_seqlens, torch.Tensor) else tuple(int(c) for c in cu_seqlens)
        batch_size = 1
        if P == 1 and not isinstance(layout, TokenLayout):  # the whole batch here: the op's own message
            check_boundaries(cu, local_length)
    layout = make_layout(layout, P, _global_tokens(layout, cu, local_length, P), cu, device)
    if layout.local_lengths[rank] != local_length:
        raise ValueError(f"the layout gives rank {rank} {layout.local_lengths[rank]} tokens, but it holds "
                         f"local_length={local_length} (tokens per rank: {list(layout.local_lengths)})")
    plan = _plan(layout, cu, batch_size, group, strategy) if with_plan and P > 1 else None
    local_cpu = None
    if cu is not None or len(layout.ranges[rank]) > 1:
        local_cpu = torch.tensor(layout.local_cu_seqlens(rank, cu), dtype=torch.int64)
    return CPContext(layout, rank, group if P > 1 else None, batch_size, cu, plan, local_cpu,
                     None if local_cpu is None else to_device(local_cpu, device), device)
