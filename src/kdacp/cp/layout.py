"""Token layouts: which global token ranges of the packed stream each rank of a context-parallel group holds.

A layout gives every rank an ordered list of ranges ``[start, end)`` of the global token stream (the
packed batch's ``cu_seqlens[-1]`` tokens, or one batch row of equal-length rows). A rank's local tokens
are its ranges concatenated in that order, which is ascending global order: the same rule Megatron-Core's
zigzag shards and torchtitan's head-tail load balancer follow. Together the ranges cover the stream once.

The recurrence does not care who holds a range: the state chain runs through the ranges in global token
order (:meth:`TokenLayout.chain`), a rank appearing once per range it holds.

Built-ins:

- :func:`contiguous_layout`: rank ``r`` holds one range, ``lengths[r]`` tokens (equal by default).
- :func:`zigzag_layout`: the stream cut into ``2P`` chunks, rank ``r`` holding chunks ``r`` and
  ``2P-1-r``; it balances causal attention (every rank attends the same number of key-query pairs
  to within one chunk's rounding).
- :func:`document_zigzag_layout`: each document of a packed batch cut into ``2P`` chunks, rank ``r``
  holding chunks ``r`` and ``2P-1-r`` of every document (Megatron-Core's packed (THD) format).
- :func:`balanced_document_layout`: a packed batch with its long documents cut as
  :func:`document_zigzag_layout` cuts them and its short ones kept whole, placed so that the ranks' causal
  attention work stays level: most documents then cross no rank, so a rank sends and receives a few states
  where per-document zigzag has it pass one per document piece.
- :func:`ranges_layout`: any ranges a caller gives (uneven, several per rank, cut anywhere).

:func:`make_layout` turns a name, a layout or a layout rule (a callable from a batch's boundaries and ``P`` to a
layout: :func:`is_layout_rule`) into a layout for one batch; :func:`check_layout` is the one check of a layout
argument.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import torch

from ..choices import LAYOUTS

__all__ = ["TokenLayout", "Position", "LAYOUTS", "contiguous_layout", "zigzag_layout", "document_zigzag_layout",
           "balanced_document_layout", "ranges_layout", "make_layout", "check_layout", "is_layout_rule", "causal_pairs"]



@dataclass(frozen=True)
class Position:
    """One link of the state chain: range ``index`` of ``rank``, global tokens ``[start, end)``,
    local tokens ``[local_start, local_start + end - start)`` of that rank."""

    rank: int
    index: int
    start: int
    end: int
    local_start: int


@dataclass(frozen=True)
class TokenLayout:
    """``ranges[r]``: the global ranges ``(start, end)`` rank ``r`` holds, ascending, non-empty and not
    touching (adjacent ranges of one rank are merged when the layout is made); together they cover
    ``[0, num_tokens)`` once. Build one with the functions of this module, which validate."""

    ranges: tuple[tuple[tuple[int, int], ...], ...]
    num_tokens: int

    def __hash__(self) -> int:
        # computed once: plans, routes and rank layouts are looked up by their layout on every op call
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.ranges, self.num_tokens))

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    @cached_property
    def local_lengths(self) -> tuple[int, ...]:
        """Tokens each rank holds."""
        return tuple(sum(e - s for s, e in rs) for rs in self.ranges)

    @cached_property
    def is_contiguous(self) -> bool:
        """Rank ``r`` holds one range and the ranges follow rank order (what the contiguous machinery assumes)."""
        return all(len(rs) == 1 for rs in self.ranges) and [p.rank for p in self.chain] == list(range(self.world_size))

    @cached_property
    def chain(self) -> tuple[Position, ...]:
        """Every range of every rank, in global token order: the links of the state chain."""
        links = []
        for r, rs in enumerate(self.ranges):
            local = 0
            for i, (s, e) in enumerate(rs):
                links.append(Position(r, i, s, e, local))
                local += e - s
        return tuple(sorted(links, key=lambda p: p.start))

    def local_token_index(self, rank: int) -> torch.Tensor:
        """``[local_lengths[rank]]`` int64: the global token of each of ``rank``'s local tokens."""
        parts = [torch.arange(s, e, dtype=torch.int64) for s, e in self.ranges[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def owner(self, token: int) -> tuple[int, int]:
        """``(rank, local index)`` of global ``token``."""
        for p in self.chain:
            if p.start <= token < p.end:
                return p.rank, p.local_start + token - p.start
        raise ValueError(f"token must be in [0, {self.num_tokens}), got {token}")

    def local_cu_seqlens(self, rank: int, cu_seqlens=None) -> list[int]:
        """The boundaries of ``rank``'s local tokens as a packed batch of their own: the documents of global
        ``cu_seqlens`` (ints; ``None``: one sequence) cut at the edges of each range. Every range edge is a
        boundary: a rank's ranges are never adjacent in the stream (adjacent ones are merged), so pieces
        of one document in two of its ranges are separate local sequences."""
        cuts, local = [0], 0
        bounds = [0, self.num_tokens] if cu_seqlens is None else list(cu_seqlens)
        for s, e in self.ranges[rank]:
            cuts += [local + c - s for c in bounds if s < c < e]
            local += e - s
            cuts.append(local)
        return cuts


def _normalised(ranges, num_tokens: int | None) -> TokenLayout:
    """Validate and merge ``ranges`` (per rank, a sequence of ``(start, end)``) into a :class:`TokenLayout`."""
    if not isinstance(ranges, (list, tuple)) or not ranges:
        raise ValueError(f"ranges must list each rank's ranges (one entry per rank), got {ranges!r}")
    merged, cover = [], []
    for r, rs in enumerate(ranges):
        out = []
        for item in rs:
            if len(item) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in item):
                raise ValueError(f"ranges[{r}] must hold (start, end) pairs of ints, got {item!r}")
            s, e = item
            if not 0 <= s < e:
                raise ValueError(f"ranges[{r}] holds an empty or negative range {item!r}: need 0 <= start < end")
            if out and s < out[-1][1]:
                raise ValueError(f"ranges[{r}] must be ascending and disjoint (a rank's local tokens follow global "
                                 f"order), got {list(rs)!r}")
            if out and s == out[-1][1]:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
            cover.append((s, e, r))
        merged.append(tuple(out))
    cover.sort()
    end = 0
    for s, e, r in cover:
        if s != end:
            what = "overlap" if s < end else "gap"
            raise ValueError(f"ranges must cover the token stream once: {what} at token {min(s, end)} "
                             f"(rank {r}'s range [{s}, {e}))")
        end = e
    if num_tokens is not None and end != num_tokens:
        raise ValueError(f"ranges must cover num_tokens={num_tokens} tokens, they cover {end}")
    return TokenLayout(tuple(merged), end)


def ranges_layout(ranges, num_tokens: int | None = None) -> TokenLayout:
    """The layout of caller-given ranges: ``ranges[r]`` lists rank ``r``'s global ``(start, end)`` ranges,
    ascending. A rank may hold no range (an empty list). Raises ``ValueError`` unless together they cover
    ``[0, num_tokens)`` exactly once (``num_tokens`` default: where they end)."""
    return _normalised(ranges, num_tokens)


def _boundaries(cu_seqlens) -> list[int]:
    """``cu_seqlens`` (ints or a 1-D tensor) as a list of ints, checked to be ``[0, ..., T]``, strictly increasing."""
    cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must be [0, ..., T], strictly increasing, got {cu}")
    return cu


def _check_positive(name: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")


def contiguous_layout(num_tokens: int, world_size: int, lengths=None) -> TokenLayout:
    """Rank ``r`` holds ``lengths[r]`` consecutive tokens after those of ranks ``< r`` (default: an equal split,
    which needs ``num_tokens % world_size == 0``)."""
    _check_positive("num_tokens", num_tokens)
    _check_positive("world_size", world_size)
    if lengths is None:
        if num_tokens % world_size:
            raise ValueError(f"num_tokens={num_tokens} does not split evenly over world_size={world_size}; "
                             "pass lengths")
        lengths = [num_tokens // world_size] * world_size
    lengths = [int(x) for x in lengths]
    if len(lengths) != world_size or any(x < 1 for x in lengths) or sum(lengths) != num_tokens:
        raise ValueError(f"lengths must be {world_size} positive ints adding up to num_tokens={num_tokens}, "
                         f"got {lengths}")
    offsets = [sum(lengths[:r]) for r in range(world_size + 1)]
    return _normalised([[(offsets[r], offsets[r + 1])] for r in range(world_size)], num_tokens)


def _zigzag_ranges(start: int, length: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Per rank, its two chunks of ``[start, start + length)`` cut into ``2P`` chunks whose sizes differ by
    at most one (the longer ones first); empty chunks are left out."""
    n = 2 * world_size
    sizes = [length // n + (i < length % n) for i in range(n)]
    edges = [start + sum(sizes[:i]) for i in range(n + 1)]
    out = []
    for r in range(world_size):
        out.append([(edges[c], edges[c + 1]) for c in (r, n - 1 - r) if edges[c + 1] > edges[c]])
    return out


def zigzag_layout(num_tokens: int, world_size: int) -> TokenLayout:
    """The stream cut into ``2 * world_size`` chunks, rank ``r`` holding chunks ``r`` and ``2P-1-r``. With
    ``num_tokens % (2P) == 0`` every rank holds the same number of tokens; otherwise chunk sizes differ by one."""
    _check_positive("num_tokens", num_tokens)
    _check_positive("world_size", world_size)
    return _normalised(_zigzag_ranges(0, num_tokens, world_size), num_tokens)


def document_zigzag_layout(cu_seqlens, world_size: int) -> TokenLayout:
    """Each document ``[cu_seqlens[n], cu_seqlens[n+1])`` cut into ``2 * world_size`` chunks, rank ``r``
    holding chunks ``r`` and ``2P-1-r`` of every document, documents in order (Megatron-Core's zigzag of a
    packed batch). Equal rank lengths need every document's length divisible by ``2P``."""
    _check_positive("world_size", world_size)
    cu = _boundaries(cu_seqlens)
    ranges = [[] for _ in range(world_size)]
    for a, b in zip(cu[:-1], cu[1:]):
        for r, rs in enumerate(_zigzag_ranges(a, b - a, world_size)):
            ranges[r] += rs
    return _normalised(ranges, cu[-1])


def causal_pairs(ranges, cu_seqlens) -> int:
    """Key-query pairs that the queries of ``ranges`` (global ``(start, end)`` pairs) attend under causal
    attention with the document mask of global ``cu_seqlens`` (ints): for each token ``t``, ``t - start(its
    document) + 1``."""
    total = 0
    for s, e in ranges:
        n = bisect.bisect_right(cu_seqlens, s) - 1  # the document holding token s, then those after it
        while n < len(cu_seqlens) - 1 and cu_seqlens[n] < e:
            d0 = cu_seqlens[n]
            a, b = max(s, d0), min(e, cu_seqlens[n + 1])
            lo, hi = a - d0 + 1, b - d0  # queries a .. b-1 of the document starting at d0: a-d0+1 .. b-d0 keys
            total += (lo + hi) * (hi - lo + 1) // 2
            n += 1
    return total


def _level_shares(held: list[int], total: int) -> list[int]:
    """Per rank, tokens to hold in all: as equal as ``total`` allows without going below ``held`` (what a rank
    already holds), the remainder to the lowest ranks among those at the level."""
    P = len(held)
    for free in range(P, 0, -1):  # the ranks above the level keep what they hold; the others share the rest
        ranks = sorted(range(P), key=lambda r: held[r])[:free]
        rest = total - sum(held[r] for r in range(P) if r not in ranks)
        level, extra = divmod(rest, free)
        if level >= max(held[r] for r in ranks):
            out = list(held)
            for i, r in enumerate(sorted(ranks)):
                out[r] = level + (i < extra)
            return out
    raise AssertionError("unreachable: one rank alone can always take the rest")


def balanced_document_layout(cu_seqlens, world_size: int, whole_below: int | None = None) -> TokenLayout:
    """A packed batch placed for level causal attention work with few documents cut across ranks.

    Each document of at least ``whole_below`` tokens is cut into ``2 * world_size`` chunks, rank ``r`` holding
    chunks ``r`` and ``2P-1-r`` (as :func:`document_zigzag_layout`: level attention work by construction).
    The shorter documents stay whole: longest first, each goes to the rank with the fewest key-query pairs so
    far (:func:`causal_pairs`) among those with room for it; a document no rank has room for is cut over the
    ranks with room left, in rank order. Room: every rank holds ``T // P`` tokens (the lowest ranks one
    more), unless its long documents' chunks alone hold more. A document kept whole sends and receives no
    state, so a rank passes on about two states per long document (plus the few cut short ones) where
    per-document zigzag passes two per document; the cost is some imbalance of attention work, less the
    lower ``whole_below`` (``benchmarks/document_layouts.py`` counts both).

    Args:
        cu_seqlens: the global document boundaries ``[0, ..., T]`` (ints or a 1-D tensor), strictly increasing.
        world_size: ranks ``P``.
        whole_below: documents shorter than this many tokens stay whole; default a quarter of a rank's tokens,
            ``max(1, T // (4 P))``.
    """
    _check_positive("world_size", world_size)
    cu = _boundaries(cu_seqlens)
    T, P = cu[-1], world_size
    if whole_below is None:
        whole_below = max(1, T // (4 * P))
    _check_positive("whole_below", whole_below)
    ranges = [[] for _ in range(P)]
    short = []
    for a, b in zip(cu[:-1], cu[1:]):
        if b - a >= whole_below:
            for r, rs in enumerate(_zigzag_ranges(a, b - a, P)):
                ranges[r] += rs
        else:
            short.append((a, b))
    held = [sum(e - s for s, e in rs) for rs in ranges]
    room = [share - h for share, h in zip(_level_shares(held, T), held)]
    pairs = [causal_pairs(rs, cu) for rs in ranges]
    left = []
    for a, b in sorted(short, key=lambda d: (d[0] - d[1], d[0])):  # longest first, then in stream order
        fits = [r for r in range(P) if room[r] >= b - a]
        if not fits:
            left.append((a, b))
            continue
        r = min(fits, key=lambda r: (pairs[r], r))
        ranges[r].append((a, b))
        room[r] -= b - a
        pairs[r] += (b - a) * (b - a + 1) // 2  # a whole document's
    r = 0
    for a, b in sorted(left):  # cut over the room left, rank by rank
        while a < b:
            while room[r] == 0:
                r += 1
            take = min(room[r], b - a)
            ranges[r].append((a, a + take))
            room[r] -= take
            a += take
    return _normalised([sorted(rs) for rs in ranges], T)


def is_layout_rule(layout) -> bool:
    """Whether ``layout`` is a layout rule: a callable ``rule(cu_seqlens, world_size, device) -> TokenLayout``
    (``cu_seqlens`` the global boundaries as host ints, or None for rows), called once per batch: a layout that
    depends on the batch (torchtitan's load balancers, :class:`kdacp.integrations.torchtitan.BalancedLayout`)."""
    return callable(layout) and not isinstance(layout, (str, TokenLayout))


def check_layout(layout, *, rules: bool = True) -> None:
    """Raise ``ValueError`` unless ``layout`` is a :class:`TokenLayout`, one of :data:`LAYOUTS` or (with
    ``rules``) a layout rule (:func:`is_layout_rule`)."""
    if isinstance(layout, TokenLayout) or (rules and is_layout_rule(layout)) or (isinstance(layout, str) and
                                                                                  layout in LAYOUTS):
        return
    rule = " or a layout rule (a callable (cu_seqlens, world_size, device) -> TokenLayout)" if rules else ""
    raise ValueError(f"layout must be a TokenLayout, one of {LAYOUTS}{rule}, got {layout!r}")


def make_layout(layout, world_size: int, num_tokens: int, cu_seqlens=None, device=None) -> TokenLayout:
    """The :class:`TokenLayout` of one batch of ``num_tokens`` tokens over ``world_size`` ranks: ``layout`` is a
    :class:`TokenLayout` (checked against both), one of :data:`LAYOUTS` (``"document_zigzag"`` and
    ``"balanced_documents"``, :func:`balanced_document_layout` at its default, read the global ``cu_seqlens``;
    without them each is ``"zigzag"``) or a layout rule (:func:`is_layout_rule`), called with the boundaries as
    host ints, ``world_size`` and ``device`` (where it may build what it needs; default the CPU), its layout
    checked as a given one's."""
    if is_layout_rule(layout):
        cu = None if cu_seqlens is None else tuple(_boundaries(cu_seqlens))
        made = layout(cu, world_size, torch.device("cpu") if device is None else torch.device(device))
        if not isinstance(made, TokenLayout):
            raise TypeError(f"the layout rule {layout!r} must return a TokenLayout, got {type(made).__name__}")
        layout = made
    if isinstance(layout, TokenLayout):
        if layout.world_size != world_size or layout.num_tokens != num_tokens:
            raise ValueError(f"layout must cover {num_tokens} tokens over {world_size} ranks, got one of "
                             f"{layout.num_tokens} tokens over {layout.world_size} ranks")
        return layout
    if layout == "contiguous":
        return contiguous_layout(num_tokens, world_size)
    if layout == "zigzag" or (layout in ("document_zigzag", "balanced_documents") and cu_seqlens is None):
        return zigzag_layout(num_tokens, world_size)  # one sequence (or rows): one document, zigzagged
    if layout == "document_zigzag":
        return document_zigzag_layout(cu_seqlens, world_size)
    if layout == "balanced_documents":
        return balanced_document_layout(cu_seqlens, world_size)
    check_layout(layout)
    raise AssertionError("unreachable: check_layout accepts only the cases above")
