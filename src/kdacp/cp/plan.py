"""The context-parallel partition plan: which tokens of which global sequences each rank holds.

Every rank builds the same plan from the same global description, once per batch. The plan is
frozen and holds no per-call state, so any number of ``chunk_kda`` calls (and their backward
passes) may share it.

Which tokens a rank holds is the plan's :class:`~kdacp.cp.layout.TokenLayout`: its ranges of
the global stream, in ascending order (contiguous: one range a rank). A rank's local tokens are processed
as one packed row ``[1, B * T_local]``. With ``cu_seqlens`` (packed sequences, ``B == 1``) they are its
ranges of the packed stream, concatenated; without it, batch row ``b`` of the local ``[B, T_local]`` input
holds its ranges of global sequence ``b``. The state chain runs through the ranges in global order (the
layout's *chain*; a *position* is one range of it), a rank appearing once per range it holds.
"""
from __future__ import annotations

import bisect
import zlib
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch
import torch.distributed as dist

from ..backends.base import Span
from ..caches import RANK_LAYOUTS
from ..choices import STRATEGIES
from ..validation import check_cu_seqlens
from . import cost_model
from .exchanges import EXCHANGES
from .layout import TokenLayout, check_layout, contiguous_layout, make_layout


def strategy_choices() -> tuple[str, ...]:
    """Every registered exchange's name (:data:`~kdacp.cp.exchanges.EXCHANGES`), and ``"auto"``."""
    return tuple(EXCHANGES) + ("auto",)


def check_strategy(strategy: str) -> None:
    """Raise ``ValueError`` unless ``strategy`` is one of :func:`strategy_choices`."""
    if strategy not in strategy_choices():
        raise ValueError(f"strategy must be one of {strategy_choices()}, got {strategy!r}")


# (HV, K, V) that "auto" sizes messages with when not told: Kimi Linear's (H=HV=32, K=V=128)
AUTO_STATE_SHAPE = (32, 128, 128)


@dataclass(frozen=True)
class LocalSegment:
    """The part of global sequence ``sequence`` held by one rank in one of its ranges, as local tokens
    ``[start, end)``; ``position``: that range's index in the layout's chain.

    ``receives``: the sequence began before the range (its state arrives from chain position - 1).
    ``sends``: the sequence continues after the range (its state goes to chain position + 1).
    """

    sequence: int
    start: int
    end: int
    receives: bool
    sends: bool
    position: int


@dataclass(frozen=True)
class RankLayout:
    """One rank's local segments, in token order, and its named spans.

    ``positions``: the chain positions of the rank's ranges, ascending. The named spans below describe a
    rank of one position (the contiguous layout's), whose receiving segments form a prefix and sending
    segments a suffix (one of each with packed sequences, all ``B`` with equal-length batch rows); a rank
    of several positions is run over ``whole`` with each segment's flags. The spans are named by where they
    lie, so each name means the same tokens forward and backward:

    - ``head``: the segments begun on an earlier rank. Forward they wait for the incoming state;
      backward their initial-state gradient is what the previous rank waits for.
    - ``tail``: the segments continued on a later rank. Forward their final state is what the next
      rank waits for; backward they wait for the incoming gradient.
    - ``after_head`` (everything but the head): on a rank with a tail, the forward's state pass that
      makes the tail's message, its last rows (:mod:`~kdacp.cp.schedule`).
    """

    segments: tuple[LocalSegment, ...]

    @cached_property
    def positions(self) -> tuple[int, ...]:
        return tuple(sorted({s.position for s in self.segments}))

    @cached_property
    def num_tokens(self) -> int:
        return self.segments[-1].end

    @cached_property
    def sending_by_position(self) -> dict[int, tuple[int, ...]]:
        """Per position, the indices of its segments that send, ascending (positions with none left out)."""
        return self._by_position("sends")

    @cached_property
    def receiving_by_position(self) -> dict[int, tuple[int, ...]]:
        """Per position, the indices of its segments that receive, ascending (positions with none left out)."""
        return self._by_position("receives")

    def _by_position(self, flag: str) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for j, s in enumerate(self.segments):
            if getattr(s, flag):
                out.setdefault(s.position, []).append(j)
        return {p: tuple(js) for p, js in out.items()}

    @cached_property
    def num_receive(self) -> int:
        return sum(s.receives for s in self.segments)

    @cached_property
    def num_send(self) -> int:
        return sum(s.sends for s in self.segments)

    @cached_property
    def through(self) -> bool:
        """Strictly inside a chain: every segment both receives and sends, so the outgoing
        state is affine in the incoming one and the rank needs the transition ``M``."""
        return all(s.receives and s.sends for s in self.segments)

    @cached_property
    def head_end(self) -> int:
        """End token of the head."""
        return sum(s.end - s.start for s in self.segments if s.receives)

    @cached_property
    def tail_start(self) -> int:
        """First token of the tail."""
        return self.num_tokens - sum(s.end - s.start for s in self.segments if s.sends)

    def cu_seqlens(self, start: int, end: int) -> list[int]:
        """Boundaries of the segments inside local tokens ``[start, end)``, relative to ``start``
        (``start`` and ``end`` must fall on segment boundaries)."""
        cuts = [s.start for s in self.segments if start <= s.start < end] + [end]
        return [c - start for c in cuts]

    def span(self, start: int, end: int) -> Span:
        """The :class:`Span` of local tokens ``[start, end)`` (segment boundaries; empty if ``end <= start``)."""
        return Span(start, end, tuple(self.cu_seqlens(start, end)) if end > start else (0,))

    @cached_property
    def whole(self) -> Span:
        return self.span(0, self.num_tokens)

    @cached_property
    def head(self) -> Span:
        return self.span(0, self.head_end)

    @cached_property
    def tail(self) -> Span:
        return self.span(self.tail_start, self.num_tokens)

    @cached_property
    def after_head(self) -> Span:
        return self.span(self.head_end, self.num_tokens)


def rank_layouts(cu_seqlens, batch_size: int, lengths) -> tuple[RankLayout, ...]:
    """Every rank's :class:`RankLayout` under the contiguous layout of tokens per rank ``lengths``: packed
    sequences ``cu_seqlens`` (global boundaries), or ``batch_size`` rows split along time (any int
    sequences). The newest are kept (:data:`~kdacp.caches.RANK_LAYOUTS`; layouts are frozen, their spans
    computed once)."""
    return _contiguous_rank_layouts(None if cu_seqlens is None else tuple(cu_seqlens), batch_size, tuple(lengths))


@lru_cache(maxsize=RANK_LAYOUTS)
def _contiguous_rank_layouts(cu_seqlens: tuple | None, batch_size: int, lengths: tuple) -> tuple[RankLayout, ...]:
    return layout_rank_layouts(cu_seqlens, batch_size, contiguous_layout(sum(lengths), len(lengths), lengths))


@lru_cache(maxsize=RANK_LAYOUTS)
def layout_rank_layouts(cu_seqlens: tuple | None, batch_size: int, layout: TokenLayout) -> tuple[RankLayout, ...]:
    """Every rank's :class:`RankLayout` under ``layout`` (of ``cu_seqlens[-1]`` tokens, or of each of
    ``batch_size`` rows): a rank's segments are its ranges cut at the documents' boundaries, in local order
    (row by row without ``cu_seqlens``). Every rank must hold at least one token."""
    index = {(p.rank, p.index): i for i, p in enumerate(layout.chain)}
    T = layout.num_tokens
    out = []
    for r, ranges in enumerate(layout.ranges):
        L, segs = layout.local_lengths[r], []
        rows = range(batch_size) if cu_seqlens is None else (0,)
        for b in rows:
            local = b * L
            for j, (s, e) in enumerate(ranges):
                if cu_seqlens is None:
                    segs.append(LocalSegment(b, local, local + e - s, s > 0, e < T, index[(r, j)]))
                else:  # the documents overlapping [s, e): from the last boundary at or before s
                    n = bisect.bisect_right(cu_seqlens, s) - 1
                    while n + 1 < len(cu_seqlens) and cu_seqlens[n] < e:
                        bos, eos = cu_seqlens[n], cu_seqlens[n + 1]
                        segs.append(LocalSegment(n, local + max(bos, s) - s, local + min(eos, e) - s, bos < s, eos > e,
                                                 index[(r, j)]))
                        n += 1
                local += e - s
        out.append(RankLayout(tuple(segs)))
    return tuple(out)


@dataclass(frozen=True)
class ChainLink:
    """One position of the chain seen by the exchange: the ``rank`` holding it, ``num_send`` states it passes
    to the next position (0 or ``n``), ``num_receive`` it takes from the previous one, and ``through``: every
    segment of it both receives and sends, so its outgoing state is affine in the incoming one (it needs
    the transition ``M``)."""

    rank: int
    num_send: int
    num_receive: int
    through: bool


@lru_cache(maxsize=RANK_LAYOUTS)
def chain_links(layouts: tuple[RankLayout, ...]) -> tuple[ChainLink, ...]:
    """The :class:`ChainLink` of every position of ``layouts``' chain, in chain order."""
    by_position = {}
    for r, lay in enumerate(layouts):
        for s in lay.segments:
            by_position.setdefault(s.position, (r, []))[1].append(s)
    links = []
    for p in range(len(by_position)):
        r, segs = by_position[p]
        links.append(ChainLink(r, sum(s.sends for s in segs), sum(s.receives for s in segs),
                               all(s.receives and s.sends for s in segs)))
    return tuple(links)


def chain_routes(layouts: tuple[RankLayout, ...]) -> tuple[tuple, tuple]:
    """``(forward, backward)``: each ``(emits, affine, holders)`` by position of ``layouts``' chain in the
    direction states flow (the chain in token order forward, reversed backward), as the cost model's
    :func:`~kdacp.cp.cost_model.programs` takes a route: messages each position passes on, whether
    its message is affine in its input, the rank holding it."""
    links = chain_links(layouts)
    holders, through = tuple(link.rank for link in links), tuple(link.through for link in links)
    return ((tuple(link.num_send for link in links), through, holders),
            (tuple(link.num_receive for link in reversed(links)), through[::-1], holders[::-1]))


def resolve_strategy(strategy: str, layouts: tuple[RankLayout, ...], state_shape=None, link=None) -> tuple[str, str]:
    """``(strategy, reason)``: ``strategy`` itself (reason ``"given"``), or for ``"auto"`` the one the
    cost model (:func:`kdacp.cp.cost_model.choose_strategy`) predicts fastest for these
    layouts' chain (its positions and the ranks holding them), messages of ``state_shape`` ``(HV, K, V)`` (default :data:`AUTO_STATE_SHAPE`) and ``link``
    (default :data:`~kdacp.cp.cost_model.DEFAULT_LINK`). Plan-level facts only, so every rank
    resolves the same.

    Raises:
        ValueError: unknown strategy, or a ``state_shape`` that is not three positive ints.
    """
    check_strategy(strategy)
    if strategy != "auto":
        return strategy, "given"
    shape = AUTO_STATE_SHAPE if state_shape is None else tuple(state_shape)
    if len(shape) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shape):
        raise ValueError(f"state_shape must be (HV, K, V), three positive ints, got {state_shape!r}")
    n = max(max(link.num_send for link in chain_links(layouts)), 1)
    forward, backward = chain_routes(layouts)
    chosen, why = cost_model.choose_strategy(forward, backward, cost_model.exchange_stage_times(n, *shape),
                                             cost_model.DEFAULT_LINK if link is None else link)
    return chosen, f"auto: {why}"


@dataclass(frozen=True)
class CPPlan:
    """Partition of one batch over a process group (see :func:`build_cp_plan`); frozen and complete.

    ``cu_seqlens`` is the global packed layout (``None`` for ``batch_size`` equal-length rows);
    ``layout`` the :class:`~kdacp.cp.layout.TokenLayout` (``None`` for an open split: rows whose
    length is read from the call, split by the layout named ``layout_name``; see :meth:`layout_for`);
    ``local_lengths`` the tokens per rank and ``rank_layouts`` every rank's :class:`RankLayout` (both
    ``None`` for an open split; a plan made with ``local_lengths`` and no ``layout`` is contiguous).
    ``check_every_call``: run the cross-rank input check on every call instead of once per call
    signature. ``strategy`` is always a concrete one (``"auto"`` is resolved when the plan is built);
    ``strategy_reason`` says why (``"given"``, or the cost model's comparison).
    """

    rank: int
    world_size: int
    group: object
    strategy: str
    batch_size: int
    cu_seqlens: tuple[int, ...] | None
    local_lengths: tuple[int, ...] | None
    check_every_call: bool = False
    rank_layouts: tuple[RankLayout, ...] | None = field(default=None, repr=False, compare=False)
    strategy_reason: str = "given"
    layout: TokenLayout | None = field(default=None, repr=False)
    layout_name: str = "contiguous"

    @property
    def num_sequences(self) -> int:
        return self.batch_size if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @cached_property
    def description(self) -> tuple[tuple[str, object], ...]:
        """The global description every rank must share, as ``(name, value)`` pairs (host values)."""
        return (("world_size", self.world_size), ("strategy", self.strategy), ("batch_size", self.batch_size),
                ("cu_seqlens", self.cu_seqlens), ("local_lengths", self.local_lengths),
                ("check_every_call", self.check_every_call),
                ("layout ranges", self.layout.ranges) if self.layout is not None else ("layout", self.layout_name))

    @cached_property
    def signature(self) -> int:
        """A 63-bit fingerprint of :attr:`description`, compared across ranks on each call."""
        text = repr(tuple(value for _, value in self.description))
        return zlib.crc32(text.encode()) | (zlib.adler32(text.encode()) << 31)

    def layout_for(self, local_length: int) -> TokenLayout:
        """The token layout, given this rank's ``T_local`` when the plan left the split open (then the
        layout ``layout_name`` of ``world_size * T_local`` tokens a row)."""
        if self.layout is not None:
            return self.layout
        if self.local_lengths is not None:
            return _contiguous(self.local_lengths)
        return _named_layout(self.layout_name, self.world_size, local_length * self.world_size)

    def lengths_for(self, local_length: int) -> tuple[int, ...]:
        """Tokens per rank, given this rank's ``T_local`` when the plan left the split open."""
        if self.local_lengths is not None:
            return self.local_lengths
        return self.layout_for(local_length).local_lengths

    def layouts(self, local_length: int) -> tuple[RankLayout, ...]:
        """The :class:`RankLayout` of every rank (``local_length``: this rank's ``T_local``, read only
        when the plan left the split open)."""
        if self.rank_layouts is not None:
            return self.rank_layouts
        return layout_rank_layouts(self.cu_seqlens, self.batch_size, self.layout_for(local_length))


@lru_cache(maxsize=RANK_LAYOUTS)
def _contiguous(lengths: tuple[int, ...]) -> TokenLayout:
    return contiguous_layout(sum(lengths), len(lengths), lengths)


@lru_cache(maxsize=RANK_LAYOUTS)
def _named_layout(name: str, world_size: int, num_tokens: int) -> TokenLayout:
    return make_layout(name, world_size, num_tokens)


def one_rank_plan(cu_seqlens: tuple[int, ...] | None, batch_size: int, length: int) -> CPPlan:
    """The plan of a batch one process holds whole, with no process group: ``batch_size`` rows of
    ``length`` tokens, or (``batch_size == 1``) the packed sequences ``cu_seqlens`` of ``length``
    tokens, already validated. :func:`kdacp.chunk_kda` without ``cp`` runs the schedule on it, which
    then exchanges nothing (its layouts come from :func:`rank_layouts`' cache)."""
    lengths = (length,)
    return CPPlan(rank=0, world_size=1, group=None, strategy="p2p", batch_size=batch_size, cu_seqlens=cu_seqlens,
                  local_lengths=lengths, rank_layouts=rank_layouts(cu_seqlens, batch_size, lengths),
                  strategy_reason="one rank")


def build_cp_plan(cu_seqlens=None, *, layout=None, local_lengths=None, batch_size=None, group=None,
                  strategy: str = "p2p", check_every_call: bool = False, state_shape=None, link=None) -> CPPlan:
    """Build the context-parallel plan of one batch; call it on every rank with the same arguments.

    Args:
        cu_seqlens: global ``[N+1]`` boundaries of the packed batch (int tensor or sequence of ints),
            or ``None`` for ``batch_size`` equal-length sequences. It is read on the host: a CUDA
            tensor costs one device sync, a CPU tensor or a list none.
        layout: which tokens each rank holds: a :class:`~kdacp.cp.layout.TokenLayout` (of
            ``cu_seqlens[-1]`` tokens, or of one batch row) or one of
            :data:`~kdacp.cp.layout.LAYOUTS`: ``"contiguous"`` (the default), ``"zigzag"``,
            ``"document_zigzag"`` (each document of ``cu_seqlens`` zigzagged), ``"balanced_documents"``
            (:func:`~kdacp.cp.layout.balanced_document_layout`); the last two without ``cu_seqlens``
            the same as ``"zigzag"``. A name without ``cu_seqlens`` is resolved per call from ``T_local``
            (rows of ``world_size * T_local`` tokens). Each rank passes its ranges' tokens, concatenated
            in ascending order.
        local_lengths: tokens held by each rank under the contiguous layout, ``[world_size]`` positive
            ints; default an equal split (of ``cu_seqlens[-1]``, or of whatever ``T_local`` every rank
            passes). Not together with ``layout`` (give uneven ranges as a TokenLayout).
        batch_size: number of equal-length sequences when ``cu_seqlens`` is ``None`` (default 1).
        group: the ``torch.distributed`` process group (default: the world); on NCCL prefer one
            from :func:`new_cp_group` (high-priority streams: see there why).
        strategy: state exchange, ``"p2p"`` (wavefront), ``"allgather"``, ``"scan"`` (log-step
            prefix scan: ``ceil(log2 L)`` rounds of point-to-point messages over the ``L`` positions of
            the layout's chain) or ``"auto"``: the one :mod:`kdacp.cp.cost_model` predicts
            fastest for this plan's chain (see :func:`resolve_strategy`); the plan's
            ``strategy_reason`` says why.
        check_every_call: ``chunk_kda`` checks that the ranks agree (shapes, dtypes, options, plan)
            with one small all-gather, which ends in a host sync. By default it does so once per
            call signature: later calls whose own signature was already verified skip it, so a rank
            that alone changes its inputs afterwards is not caught (it waits in the check while the
            others go on). ``True`` checks every call (for debugging).
        state_shape: ``(HV, K, V)`` of the states, read only by ``"auto"`` to size messages (default
            :data:`AUTO_STATE_SHAPE`, Kimi Linear's).
        link: a :class:`~kdacp.cp.cost_model.Link`, read only by ``"auto"`` (default: an
            order of magnitude for one node's NVLink; pass measured figures, e.g. across nodes).

    Raises:
        ValueError: unknown strategy or layout, ``layout`` with ``local_lengths``, a layout that leaves a
            rank without tokens or does not match the batch, bad ``state_shape``, invalid ``cu_seqlens``,
            lengths that do not add up.
    """
    check_strategy(strategy)
    if layout is not None and local_lengths is not None:
        raise ValueError("pass layout or local_lengths, not both: local_lengths are the contiguous layout's "
                         "lengths; give any other split as layout=kdacp.cp.layout.ranges_layout(...)")
    if layout is not None:
        check_layout(layout, rules=False)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_cp_plan needs an initialised torch.distributed process group")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = None
    if cu_seqlens is not None:
        if batch_size not in (None, 1):
            raise ValueError(f"batch_size must be None or 1 with cu_seqlens (packed sequences), got {batch_size}")
        cu_tensor = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(list(cu_seqlens))
        if cu_tensor.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_tensor.dtype}")
        cu_tensor = cu_tensor.cpu()  # the one device-to-host copy (a sync for a CUDA tensor)
        total = int(cu_tensor[-1]) if cu_tensor.numel() else 0
        check_cu_seqlens(cu_tensor, 1, total)
        if total < 1:
            raise ValueError("cu_seqlens must describe at least one token")
        cu = tuple(int(c) for c in cu_tensor.tolist())
        batch_size = 1
    elif batch_size is None:
        batch_size = 1
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    token_layout, name = None, "contiguous"
    if local_lengths is not None:
        local_lengths = tuple(int(x) for x in local_lengths)
        if len(local_lengths) != world_size or any(x < 1 for x in local_lengths):
            raise ValueError(f"local_lengths must hold {world_size} positive ints (one per rank), got {local_lengths}")
        if cu is not None and sum(local_lengths) != cu[-1]:
            raise ValueError(f"local_lengths must add up to cu_seqlens[-1]={cu[-1]}, got sum {sum(local_lengths)}")
        token_layout = _contiguous(local_lengths)
    elif isinstance(layout, TokenLayout):
        if cu is not None and layout.num_tokens != cu[-1]:
            raise ValueError(f"layout must cover cu_seqlens[-1]={cu[-1]} tokens, it covers {layout.num_tokens}")
        token_layout = make_layout(layout, world_size, layout.num_tokens)
    elif cu is not None:
        name = layout or "contiguous"
        if name == "contiguous" and cu[-1] % world_size:
            raise ValueError(f"cu_seqlens[-1]={cu[-1]} tokens do not split evenly over {world_size} ranks; "
                             "pass local_lengths")
        token_layout = make_layout(name, world_size, cu[-1], cu)
    else:
        name = layout or "contiguous"
    if token_layout is not None:
        empty = [r for r, n in enumerate(token_layout.local_lengths) if n == 0]
        if empty:
            raise ValueError(f"layout must give every rank at least one token; rank(s) {empty} hold none")
    layouts = None if token_layout is None else layout_rank_layouts(cu, batch_size, token_layout)
    # An open split (rows of T_local on every rank) has the same chain for every T_local; one of 2P tokens
    # a row has every zigzag chunk.
    probe = layouts or layout_rank_layouts(None, batch_size, _named_layout(name, world_size, 2 * world_size))
    strategy, reason = resolve_strategy(strategy, probe, state_shape, link)
    return CPPlan(rank=rank, world_size=world_size, group=group, strategy=strategy, batch_size=batch_size,
                  cu_seqlens=cu, local_lengths=None if token_layout is None else token_layout.local_lengths,
                  check_every_call=bool(check_every_call), rank_layouts=layouts, strategy_reason=reason,
                  layout=token_layout, layout_name=name)
