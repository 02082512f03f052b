"""State exchange strategies: how each chain position's incoming state (forward) or state gradient
(backward) is obtained from the other positions' messages.

The chain's positions are the layout's ranges in the direction states flow (global token order forward,
reversed backward); a rank holds one position (the contiguous layout) or several. Every position that
passes something on emits a message ``x_out = A x_in + b`` (a :class:`kdacp.affine.AffineMap`): ``A`` is
``None`` where the
position knows its outgoing value outright (a chain start), and ``M`` (forward) or ``M^T`` (backward) on
positions strictly inside a chain. A strategy turns the messages into each position's incoming value.
Both directions use the same code on a :class:`Route`: ``p2p`` (wavefront), ``allgather`` (one
collective, local fold) and ``scan`` (segmented prefix scan in ``ceil(log2 L)`` rounds of point-to-point
messages over ``L`` positions). A message between two positions of one rank is handed over in memory.

Matching: NCCL and gloo match the point-to-point messages between two ranks in the order they were posted.
A rank posts its receives in the order it later reads them, and its sends to each peer go out in the same
order (:class:`_OrderedSends`), however early each one's value is known.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Protocol

import torch

from ..affine import AffineMap
from ..caches import SCAN_SCHEDULES
from . import collectives


@dataclass(frozen=True)
class Route:
    """One direction of the exchange, seen from ``rank``.

    ``order[i]``: the group rank holding position ``i`` of the chain, positions listed in the direction
    states flow (with one position a rank: the ranks ascending forward, descending backward). For every
    position ``emits[i]``: messages it passes to position ``i + 1`` (0 or ``n``); ``affine[i]``: its
    message depends on what it receives (it needs ``M``). ``shape`` is one message's ``[n, HV, K, V]``;
    messages travel in ``dtype`` on ``device``.
    """

    rank: int
    group: object
    order: tuple[int, ...]
    emits: tuple[int, ...]
    affine: tuple[bool, ...]
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    device: torch.device

    @cached_property
    def positions(self) -> tuple[int, ...]:
        """This rank's positions, in flow order."""
        return tuple(i for i, r in enumerate(self.order) if r == self.rank)

    @cached_property
    def handling(self) -> tuple[int, ...]:
        """This rank's positions in the order ``p2p`` handles them: :func:`handling_order`."""
        return handling_order(self.positions, self.emits, self.affine)

    @cached_property
    def outgoing(self) -> tuple[tuple[int, int], ...]:
        """``p2p``'s sends from this rank to others: ``(position entered, its rank)``, in the order each receiver
        reads them (:func:`handling_order` of the positions entered)."""
        entered = [i + 1 for i in self.positions if self.target(i) not in (None, self.rank)]
        return tuple((j, self.order[j]) for j in handling_order(entered, self.emits, self.affine))

    @cached_property
    def slots(self) -> tuple[int, ...]:
        """Per position, its index among its rank's positions."""
        seen: dict = {}
        out = []
        for r in self.order:
            out.append(seen.get(r, 0))
            seen[r] = out[-1] + 1
        return tuple(out)

    def source(self, i: int) -> int | None:
        """The rank whose message position ``i`` receives (``None``: nothing comes in)."""
        return self.order[i - 1] if i > 0 and self.emits[i - 1] else None

    def target(self, i: int) -> int | None:
        """The rank position ``i``'s message goes to (``None``: it passes nothing on)."""
        return self.order[i + 1] if self.emits[i] and i + 1 < len(self.order) else None

    def _only(self) -> int:
        if len(self.positions) != 1:
            raise ValueError(f"rank {self.rank} holds {len(self.positions)} positions of the route, not one")
        return self.positions[0]

    @property
    def predecessor(self) -> int | None:
        """:meth:`source` of this rank's only position."""
        return self.source(self._only())

    @property
    def successor(self) -> int | None:
        """:meth:`target` of this rank's only position."""
        return self.target(self._only())


def chain_depths(emits, affine) -> tuple[int, ...]:
    """Per position of a route (``emits``, ``affine`` as :class:`Route`'s), how many messages its incoming value
    waits on one after another: 0 where nothing comes in, 1 where it comes from a constant message (known
    before anything is waited for), one more than its source's where the source's message is affine."""
    out: list[int] = []
    for i in range(len(emits)):
        out.append(0 if i == 0 or not emits[i - 1] else out[-1] + 1 if affine[i - 1] else 1)
    return tuple(out)


def handling_order(positions, emits, affine) -> tuple[int, ...]:
    """``positions`` of a route (a rank's own, or those its messages enter) in the order ``p2p`` handles
    them: by :func:`chain_depths`, then in flow order. A position's input is either known
    before anything is waited for or made by a shallower position, handled earlier on its rank, so no rank
    waits on a position handled after its own; receives are posted, and sends to each peer released, in
    this order of the receiving positions, which is the order the receiver reads them. Where chains run
    side by side (a packed batch cut per document: a rank holds a piece of every document), they advance
    together, one hop a step, rather than each crossing every rank before the next may start."""
    depths = chain_depths(emits, affine)
    return tuple(sorted(positions, key=lambda i: (depths[i], i)))


class _OrderedSends:
    """The sends of one rank, each released to its peer in a fixed order per peer (the order the peer posted
    its receives in), as soon as it and every earlier one to that peer are known. ``keys``: every send's
    ``(key, peer)`` in that order."""

    def __init__(self, keys, group):
        self.group, self.queues, self.ready, self.works, self.kept = group, {}, {}, [], []
        for key, peer in keys:
            self.queues.setdefault(peer, []).append(key)

    def post(self, key, peer: int, tensor: torch.Tensor) -> None:
        self.ready[key] = tensor
        queue = self.queues[peer]
        while queue and queue[0] in self.ready:
            payload = self.ready.pop(queue.pop(0))
            self.kept.append(payload)  # alive until its send completes
            self.works.append(collectives.send(payload, peer, self.group))


@dataclass
class Pending:
    """An exchange in flight: the posted receives (``receives``: key -> ``(buffer, work)``; or a gather:
    its buffer ``recv_buffer``, ``recv_work`` and ``gathered``), this rank's messages by position, values
    handed over between its own positions (``local``), the sends (``outbox``)."""

    route: Route
    recv_buffer: torch.Tensor | None = None
    recv_work: object = None
    messages: dict = field(default_factory=dict)
    gathered: list | None = None
    receives: dict = field(default_factory=dict)
    local: dict = field(default_factory=dict)
    outbox: _OrderedSends | None = None

    def post(self, key, position: int, peer: int, tensor: torch.Tensor) -> None:
        """Send ``tensor`` (the value of ``key``, for ``position``) to ``peer``, or hand it over when ``peer``
        is this rank."""
        if peer == self.route.rank:
            self.local[key] = tensor
        else:
            self.outbox.post(key, peer, tensor.to(self.route.dtype))

    def take(self, key) -> torch.Tensor:
        """The value of ``key`` received (waiting for it) or handed over."""
        if key in self.local:
            return self.local.pop(key)
        buffer, work = self.receives.pop(key)
        work.wait()
        return buffer

    def finish_sends(self) -> None:
        """Wait for this rank's sends (their buffers are freed after)."""
        if self.outbox is not None:
            collectives.wait(self.outbox.works)
            self.outbox.works.clear()
            self.outbox.kept.clear()


class StateExchange(Protocol):
    """``begin`` before the local work (posts receives); ``send`` as soon as this rank's messages are
    known, one per position of ``route.positions`` (an :class:`~kdacp.affine.AffineMap`, or ``None`` where the
    position passes nothing on); ``receive`` when the incoming values are needed: one per position,
    ``[n, HV, K, V]`` or ``None`` where nothing comes in. Every rank calls all three, in this order,
    whether or not it has anything to pass on."""

    def begin(self, route: Route) -> Pending: ...

    def send(self, pending: Pending, messages) -> None: ...

    def receive(self, pending: Pending) -> list: ...


class P2PExchange:
    """Wavefront: each position receives from its predecessor and sends ``A x_in + b`` to its successor.

    A position whose message does not depend on its input sends before anything is waited for, so only
    positions strictly inside a chain are serial, each adding one ``K x K`` by ``K x V`` product and one
    message. A rank handles its positions in :attr:`Route.handling` order, in which every dependency points
    to a position handled earlier on its rank, so no layout can deadlock.
    """

    def begin(self, route: Route) -> Pending:
        pending = Pending(route)
        for i in route.handling:
            src = route.source(i)
            if src is not None and src != route.rank:
                buffer = torch.empty(route.shape, dtype=route.dtype, device=route.device)
                pending.receives[i] = (buffer, collectives.post_recv(buffer, src, route.group))
        pending.outbox = _OrderedSends(route.outgoing, route.group)  # a value keyed by the position it enters
        return pending

    def send(self, pending: Pending, messages) -> None:
        route = pending.route
        pending.messages = dict(zip(route.positions, messages))
        for i, message in pending.messages.items():
            dst = route.target(i)
            if dst is not None and message.constant:
                pending.post(i + 1, i, dst, message.offset)

    def receive(self, pending: Pending) -> list:
        route = pending.route
        incoming = {}
        for i in route.handling:
            incoming[i] = x_in = None if route.source(i) is None else pending.take(i)
            message, dst = pending.messages[i], route.target(i)
            if dst is not None and not message.constant:
                pending.post(i + 1, i, dst, message.apply(x_in).to(route.dtype))
        return [incoming[i] for i in route.positions]


class AllGatherExchange:
    """One all-gather of every rank's messages, stacked by position (padded to the most positions a rank
    holds); each rank then folds, for each of its positions, the chain that ends before it.

    The gather is posted by :meth:`send`, the moment this rank's messages exist, and waited for in
    :meth:`receive`: the collective then waits for each rank's summaries, not for the local work that
    each rank does between the two calls.
    """

    def begin(self, route: Route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, messages) -> None:
        route = pending.route
        pending.messages = dict(zip(route.positions, messages))
        if not any(route.emits):  # no sequence crosses a range boundary (the same on every rank)
            return
        n, HV, K, V = route.shape
        with_transition = any(route.affine)
        slots = max(route.slots) + 1
        buffer = torch.zeros(slots, n, HV, K, V + (K if with_transition else 0), dtype=route.dtype,
                             device=route.device)
        for i, message in pending.messages.items():
            if message is not None and route.emits[i]:
                buffer[route.slots[i], ..., :V] = message.offset
                if message.transition is not None:
                    buffer[route.slots[i], ..., V:] = message.transition
        pending.recv_buffer = buffer  # alive until the gather completes
        pending.recv_work, pending.gathered = collectives.post_all_gather(buffer, route.group)

    def receive(self, pending: Pending) -> list:
        route = pending.route
        if pending.recv_work is None:
            return [None] * len(route.positions)
        V = route.shape[-1]
        pending.recv_work.wait()
        gathered = torch.stack(pending.gathered)                      # [P, slots, n, HV, K, V (+K)]
        out = []
        for i in route.positions:
            chain = []
            j = i - 1 if route.source(i) is not None else None
            while j is not None:
                chain.append(j)
                if not route.affine[j] or j == 0 or not route.emits[j - 1]:
                    break
                j -= 1
            x = None
            for j in reversed(chain):
                row = gathered[route.order[j], route.slots[j]]
                x = AffineMap(row[..., :V], row[..., V:] if route.affine[j] else None).apply(x)
            # a column slice of the gathered buffer: kernels downstream need a dense state
            out.append(None if x is None else x.contiguous())
        return out


def _compose(later: AffineMap | None, earlier: AffineMap | None) -> AffineMap | None:
    """``later o earlier`` of composed runs of consecutive positions, ``None`` the empty run (the
    identity). A constant map holds a chain start: nothing earlier can change its outgoing value."""
    if later is None:
        return earlier
    return later if earlier is None else later.compose(earlier)


def _element(message: AffineMap | None, emits: int, shape: tuple[int, ...], dtype: torch.dtype, device
             ) -> AffineMap:
    """A rank's own map, padded to ``shape``'s ``n`` rows, in ``dtype`` (float32 or wider: the scan's maps
    are held and sent in it). A rank that emits nothing breaks the chain: its map is the constant zero."""
    def padded(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype)
        if x.shape[0] == shape[0]:
            return x
        return torch.cat([x, x.new_zeros(shape[0] - x.shape[0], *x.shape[1:])])

    if message is None or not emits:
        return AffineMap(torch.zeros(shape, dtype=dtype, device=device))
    if message.constant:
        return AffineMap(padded(message.offset))
    return AffineMap(padded(message.offset), padded(message.transition))


def _pack(partial: AffineMap | None, is_open: bool, dtype: torch.dtype) -> torch.Tensor:
    """One message of the scan: ``[n, HV, K, V]`` (closed: a constant map) or ``[n, HV, K, V + K]``
    (offset | transition)."""
    if partial is None or partial.constant == is_open:
        raise RuntimeError("scan schedule and payload disagree (a bug in kdacp's scan schedule)")
    if not is_open:
        return partial.offset.to(dtype)
    return torch.cat([partial.offset, partial.transition], -1).to(dtype)


def _unpack(buffer: torch.Tensor, is_open: bool, V: int) -> AffineMap:
    return AffineMap(buffer[..., :V], buffer[..., V:]) if is_open else AffineMap(buffer)


@dataclass(frozen=True)
class ScanSchedule:
    """The rounds of the segmented exclusive scan over the positions ``0 .. L-1`` of a :class:`Route`.

    ``rounds[d]`` lists the transfers ``(src, dst, is_open)`` of round ``d`` (``dst = src + 2**d``);
    ``is_open``: the payload is still affine and carries its transition, else only its offset.
    ``absolute[i]``: position ``i``'s own map is constant (chain start, or it emits nothing).
    ``incoming[i]``: position ``i`` receives a value (its predecessor emits).
    Everything follows from ``Route.emits`` and ``Route.affine``, identical on every rank: no flag
    travels with the data, and every rank knows every buffer's size before anything is sent.
    """

    rounds: tuple[tuple[tuple[int, int, bool], ...], ...]
    absolute: tuple[bool, ...]
    incoming: tuple[bool, ...]

    def sends(self, position: int) -> list[tuple[int, int, bool]]:
        """``(round, dst, is_open)`` of every transfer from ``position``."""
        return [(d, dst, o) for d, ts in enumerate(self.rounds) for src, dst, o in ts if src == position]

    def receives(self, position: int) -> list[tuple[int, int, bool]]:
        """``(round, src, is_open)`` of every transfer to ``position``."""
        return [(d, src, o) for d, ts in enumerate(self.rounds) for src, dst, o in ts if dst == position]


@lru_cache(maxsize=SCAN_SCHEDULES)
def scan_schedule(emits: tuple[int, ...], affine: tuple[bool, ...]) -> ScanSchedule:
    """The pruned recursive-doubling schedule for one route (see :class:`ScanExchange`); ``emits`` and
    ``affine`` as in :class:`Route` (by position).

    Before round ``d`` position ``i`` holds ``E_i``, the composition of positions
    ``[i - 2**d + 1, i - 1]`` (the empty map before round 0), and sends ``I_i = f_i o E_i``
    (positions ``[i - 2**d + 1, i]``) to ``i + 2**d``; the receiver sets ``E <- E o I``, which then
    covers ``[i - 2**(d+1) + 1, i - 1]``. After ``ceil(log2 P)`` rounds ``E_i`` covers every
    predecessor: the exclusive scan. A transfer is kept only when the receiver's ``E`` is still open
    (segmented scan: a closed ``E`` already holds a chain start and cannot change) and is needed,
    either as a result (the position receives a value) or to build a later payload.
    """
    P = len(emits)
    if len(affine) != P:
        raise ValueError(f"emits and affine must have one entry per rank, got {len(emits)} and {len(affine)}")
    absolute = tuple(not affine[i] or not emits[i] for i in range(P))
    incoming = tuple(i > 0 and emits[i - 1] > 0 for i in range(P))

    def e_closed(d: int, i: int) -> bool:  # E_i before round d holds a chain start
        return any(absolute[max(0, i - (1 << d) + 1):i])

    need = list(incoming)  # E_i is needed after the round being scheduled
    rounds = []
    for d in reversed(range((P - 1).bit_length())):
        step = 1 << d
        receivers = [i for i in range(step, P) if need[i] and not e_closed(d, i)]
        transfers = []
        for i in receivers:
            src = i - step
            is_open = not absolute[src] and not e_closed(d, src)
            if not absolute[src]:
                need[src] = True  # I_src = f_src o E_src needs E_src as it stands before round d
            transfers.append((src, i, is_open))
        rounds.append(tuple(transfers))
    return ScanSchedule(tuple(reversed(rounds)), absolute, incoming)


def simulate_scan(messages: list[AffineMap | None], emits, affine, dtype: torch.dtype = torch.float64
                  ) -> list[torch.Tensor | None]:
    """Run the scan's rounds in one process (for tests): every position's incoming value, with
    payloads packed and rounded to ``dtype`` as :class:`ScanExchange` sends them. ``messages``,
    ``emits`` and ``affine`` are indexed by position in the route's order."""
    emits, affine = tuple(int(e) for e in emits), tuple(bool(a) for a in affine)
    schedule = scan_schedule(emits, affine)
    first = next((m for m in messages if m is not None), None)
    if first is None:
        return [None] * len(messages)
    shape, V = tuple(first.offset.shape), first.offset.shape[-1]
    shape = (max(emits + (1,)),) + shape[1:]
    own = [_element(m, e, shape, dtype, first.offset.device) for m, e in zip(messages, emits)]
    held = [None] * len(messages)
    for transfers in schedule.rounds:
        payloads = [_pack(_compose(own[src], held[src]), is_open, dtype) for src, _, is_open in transfers]
        for (_, dst, is_open), payload in zip(transfers, payloads):
            held[dst] = _compose(held[dst], _unpack(payload, is_open, V))
    return [held[i].offset.to(dtype) if schedule.incoming[i] else None for i in range(len(messages))]


@dataclass
class _ScanPending(Pending):
    schedule: ScanSchedule | None = None
    own: dict = field(default_factory=dict)   # position -> its own map (AffineMap)


class ScanExchange:
    """Segmented exclusive prefix scan of the affine messages by recursive doubling.

    Variant: Kogge-Stone (Hillis-Steele) over the positions of the route. In round ``d`` position ``i``
    sends its composed map ``I_i = (A, b)`` of positions ``[i - 2**d + 1, i]`` to ``i + 2**d`` and
    composes what arrives from ``i - 2**d`` into ``E_i <- E_i o I`` (``(A2, b2) o (A1, b1) = (A2 A1,
    A2 b1 + b2)``). After ``ceil(log2 L)`` rounds ``E_i`` is the exclusive prefix, applied to nothing (a
    chain always starts at a position whose map is constant), so ``E_i``'s offset is the incoming value.
    Any ``L``: transfers past either end are simply absent.

    Why this variant: it has the fewest rounds, ``ceil(log2 L)`` (Brent-Kung needs about
    ``2 log2 L`` and Sklansky sends up to ``L/2`` messages from one position in a round); each position
    sends and receives at most one message per round. Its extra work (``O(L log L)`` compositions, each
    ``K x K`` by ``K x (K + V)`` per message row) is small next to the local KDA work. Compared with
    ``p2p``, whose serial path is one message per position of the longest chain, the serial path here is
    ``ceil(log2 L)`` messages; compared with ``allgather``, which moves all summaries to every rank in one
    collective and folds up to ``L - 1`` of them serially, a position here receives at most
    ``ceil(log2 L)`` summaries.

    Segments: whether a composed map is still affine or already *closed* (holds a chain start: a position
    whose message does not depend on its input, or one that emits nothing) depends only on
    ``Route.emits`` / ``Route.affine``, so :func:`scan_schedule` computes it identically on every rank.
    No flag travels; a position whose prefix is closed receives nothing more; transfers nobody needs are
    dropped; a closed map travels as its offset ``[n, HV, K, V]`` alone, an open one as
    ``[n, HV, K, V + K]`` (offset and transition in one tensor). A position whose own map is constant
    has all its payloads ready at ``send``; an affine one has round 0's (its own map) then, and round
    ``d``'s after composing the receives of rounds ``< d``. A rank runs round by round, in each the sends
    of all its positions before their receives; every dependency points from a round to a later one, so
    no layout can deadlock. All receives are posted in ``begin``, in (round, position) order, and the
    sends to each peer leave in that order.

    Precision: products by :mod:`kdacp.affine`'s rule (:meth:`~kdacp.affine.AffineMap.compose`), composed maps
    held and sent in ``Route.dtype`` (float32 or wider), so each composition is rounded to it once.
    """

    def begin(self, route: Route) -> Pending:
        schedule = scan_schedule(route.emits, route.affine)
        pending = _ScanPending(route, schedule=schedule)
        n, HV, K, V = route.shape
        mine = set(route.positions)
        keys = []
        for d, transfers in enumerate(schedule.rounds):
            for src, dst, is_open in transfers:  # ascending src (and dst) within a round
                if dst in mine and route.order[src] != route.rank:
                    buffer = torch.empty(n, HV, K, V + (K if is_open else 0), dtype=route.dtype, device=route.device)
                    pending.receives[(d, dst)] = (buffer, collectives.post_recv(buffer, route.order[src], route.group))
                if src in mine and route.order[dst] != route.rank:
                    keys.append(((d, dst), route.order[dst]))
        pending.outbox = _OrderedSends(keys, route.group)
        return pending

    def send(self, pending: Pending, messages) -> None:
        route, schedule = pending.route, pending.schedule
        pending.messages = dict(zip(route.positions, messages))
        for i, message in pending.messages.items():
            pending.own[i] = own = _element(message, route.emits[i], route.shape, route.dtype, route.device)
            payloads = {}
            for d, dst, is_open in schedule.sends(i):
                if schedule.absolute[i] or d == 0:  # I = f o E is f itself: f is constant, or E is still empty
                    if is_open not in payloads:
                        payloads[is_open] = _pack(own, is_open, route.dtype)
                    pending.post((d, dst), i, route.order[dst], payloads[is_open])

    def receive(self, pending: Pending) -> list:
        route, schedule = pending.route, pending.schedule
        held = dict.fromkeys(route.positions)
        for d, transfers in enumerate(schedule.rounds):
            for src, dst, is_open in transfers:
                if src in held and d > 0 and not schedule.absolute[src]:
                    payload = _pack(_compose(pending.own[src], held[src]), is_open, route.dtype)
                    pending.post((d, dst), src, route.order[dst], payload)
            for src, dst, is_open in transfers:
                if dst in held:
                    held[dst] = _compose(held[dst], _unpack(pending.take((d, dst)), is_open, route.shape[-1]))
        return [held[i].offset.to(route.dtype).contiguous() if schedule.incoming[i] else None
                for i in route.positions]


def make_exchange(strategy: str) -> StateExchange:
    if strategy == "p2p":
        return P2PExchange()
    if strategy == "allgather":
        return AllGatherExchange()
    if strategy == "scan":
        return ScanExchange()
    raise ValueError(f"strategy must be 'p2p', 'allgather' or 'scan', got {strategy!r}")
