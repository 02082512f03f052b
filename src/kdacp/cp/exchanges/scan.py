"""``scan``: a segmented exclusive prefix scan of the affine messages by recursive doubling,
``ceil(log2 L)`` rounds of point-to-point messages over the ``L`` positions of a route."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ...affine import AffineMap
from ...caches import SCAN_SCHEDULES
from .. import collectives
from .base import ModelOutbox, ModelRoute, OrderedSends, Pending, Route, register_exchange


# A rank's pairs of a round are stacked into one product per kind when a pair's maps hold at most this many bytes:
# stacking copies them twice (written, then read), which at the cost model's 1e12 B/s costs under the ~2 us of
# device time (and the host's launch) that each product saved would; larger maps (32 heads of 128: 4 MB a summary)
# keep a product a pair, each formed as its message arrives.
STACK_MAX_BYTES = 1 << 20


def stacks(summary_bytes: int) -> bool:
    """Whether a route whose open maps hold ``summary_bytes`` bytes each stacks its rounds' pairs."""
    return 2 * summary_bytes <= STACK_MAX_BYTES


def _compose(later: AffineMap | None, earlier: AffineMap | None) -> AffineMap | None:
    """``later o earlier`` of composed runs of consecutive positions, ``None`` the empty run (the
    identity). A constant map holds a chain start: nothing earlier can change its outgoing value."""
    if later is None:
        return earlier
    return later if earlier is None else later.compose(earlier)


def _compose_stacked(pairs: list[tuple[AffineMap | None, AffineMap | None]]) -> list[AffineMap | None]:
    """:func:`_compose` of each pair ``(later, earlier)``, every map of the route's ``n`` rows: the pairs of one
    kind (open after open: a composition; open after closed: an ``M x + S``) in one product over all of them,
    their maps stacked along the rows, so a round's launches do not grow with the positions a rank holds."""
    out: list[AffineMap | None] = [None] * len(pairs)
    kinds: dict[bool, list[int]] = {True: [], False: []}  # earlier still open -> the pairs needing a product
    for k, (later, earlier) in enumerate(pairs):
        if later is None or earlier is None or later.constant:
            out[k] = _compose(later, earlier)
        else:
            kinds[not earlier.constant].append(k)
    for is_open, members in kinds.items():
        if len(members) < 2:  # nothing to stack
            for k in members:
                out[k] = _compose(*pairs[k])
            continue
        later = AffineMap(*(torch.cat([getattr(pairs[k][0], f) for k in members]) for f in AffineMap._fields))
        earlier = AffineMap(torch.cat([pairs[k][1].offset for k in members]),
                            torch.cat([pairs[k][1].transition for k in members]) if is_open else None)
        both = later.compose(earlier)
        rows = pairs[members[0]][0].offset.shape[0]
        for j, k in enumerate(members):
            out[k] = AffineMap(*(None if x is None else x[j * rows:(j + 1) * rows] for x in both))
    return out


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


@dataclass
class _ScanPending(Pending):
    schedule: ScanSchedule | None = None
    own: dict = field(default_factory=dict)   # position -> its own map (AffineMap)


@register_exchange("scan", auto_priority=1)
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
        pending.outbox = OrderedSends(keys, route.group)
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
        n, HV, K, V = route.shape
        stacked = stacks(n * HV * K * (K + V) * route.dtype.itemsize)
        held = dict.fromkeys(route.positions)
        for d, transfers in enumerate(schedule.rounds):
            sending = [(src, dst, is_open) for src, dst, is_open in transfers
                       if src in held and d > 0 and not schedule.absolute[src]]
            if stacked:
                payloads = _compose_stacked([(pending.own[src], held[src]) for src, _, _ in sending])
            else:  # each payload sent as soon as it is formed
                payloads = (_compose(pending.own[src], held[src]) for src, _, _ in sending)
            for (src, dst, is_open), payload in zip(sending, payloads):
                pending.post((d, dst), src, route.order[dst], _pack(payload, is_open, route.dtype))
            arriving = [(dst, is_open) for _, dst, is_open in transfers if dst in held]
            if stacked:
                messages = [_unpack(pending.take((d, dst)), is_open, V) for dst, is_open in arriving]
                for (dst, _), value in zip(arriving, _compose_stacked([(held[dst], m) for (dst, _), m
                                                                        in zip(arriving, messages)])):
                    held[dst] = value
            else:  # each formed as its message arrives
                for dst, is_open in arriving:
                    held[dst] = _compose(held[dst], _unpack(pending.take((d, dst)), is_open, V))
        return [held[i].offset.to(route.dtype).contiguous() if schedule.incoming[i] else None
                for i in route.positions]

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """The rounds of :func:`scan_schedule`, ``ceil(log2 L)`` of them: own payloads sent at once (every
        round's if the map is constant, else round 0's); ``compute(between)``; then per round ``d``, for the affine
        positions sending in it (``d > 0``) ``compute(own o held); send(i + 2**d, payload)`` each, then for the
        receiving ones ``recv(i - 2**d); compute(held o payload)`` each (``compose_s`` where the earlier map is
        open, ``apply_s`` where closed; nothing for a position that has composed nothing yet). Where the route's
        maps are small enough to stack (:func:`stacks`) the step's compositions are one ``compute`` before its
        sends and one after its receives: a product per kind, plus each further pair's two maps at
        ``copy_s_per_byte`` twice (written by the stack, read by the product)."""
        emits, affine, holders, times = route.emits, route.affine, route.holders, route.times
        schedule = scan_schedule(tuple(emits), tuple(affine))
        sends, receives = [{} for _ in range(route.length)], [{} for _ in range(route.length)]
        for d, transfers in enumerate(schedule.rounds):
            for src, dst, is_open in transfers:
                sends[src][d], receives[dst][d] = (dst, is_open), (src, is_open)

        stacked = stacks(times.summary_bytes)

        def product(is_open: bool) -> float:  # one pair's: the earlier map open (a composition) or closed
            return times.compose_s if is_open else times.apply_s

        def stacked_products(opens: list[bool]) -> list[tuple]:  # a step's pairs in one product per kind
            cost = 0.0
            for is_open in (True, False):
                count = opens.count(is_open)
                pair_bytes = (times.summary_bytes if is_open else times.state_bytes) + times.summary_bytes
                if count:
                    cost += product(is_open) + (count - 1) * 2 * pair_bytes * times.copy_s_per_byte
            return [("compute", cost)] if cost else []

        out = []
        for r, mine in enumerate(route.own):
            outbox = ModelOutbox([((d, dst), holders[dst], times.summary_bytes if is_open else times.state_bytes)
                                  for d, transfers in enumerate(schedule.rounds) for src, dst, is_open in transfers
                                  if holders[src] == r and holders[dst] != r])

            def post(d, dst, r=r, outbox=outbox):
                return [] if holders[dst] == r else outbox.release((d, dst), holders[dst])

            prog: list[tuple] = []
            for i in mine:
                constant = not affine[i] or not emits[i]
                for d, (dst, _) in sends[i].items():
                    if constant or d == 0:
                        prog += post(d, dst)
            prog.append(("compute", route.between[r]))
            held = {i: (False, True) for i in mine}  # what each position has composed so far, and whether open
            for d in range(len(schedule.rounds)):
                sending = [i for i in mine if d in sends[i] and d > 0 and affine[i] and emits[i]]
                if stacked:
                    prog += stacked_products([held[i][1] for i in sending if held[i][0]])
                for i in sending:
                    if not stacked and held[i][0]:  # own o held: nothing to compose while nothing has arrived
                        prog.append(("compute", product(held[i][1])))
                    prog += post(d, sends[i][d][0])
                arriving = [i for i in mine if d in receives[i]]
                for i in arriving:
                    src, is_open = receives[i][d]
                    if holders[src] != r:
                        prog.append(("recv", holders[src]))
                    if not stacked and held[i][0]:
                        prog.append(("compute", product(is_open)))
                if stacked:
                    prog += stacked_products([receives[i][d][1] for i in arriving if held[i][0]])
                for i in arriving:
                    held[i] = (True, held[i][1] and receives[i][d][1])
            out.append(prog)
        return out
