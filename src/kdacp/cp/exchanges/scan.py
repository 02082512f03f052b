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


def _compose_pairs(pairs: list[tuple[AffineMap | None, AffineMap | None]]) -> list[AffineMap | None]:
    """``later o earlier`` for each pair ``(later, earlier)`` of composed runs of consecutive positions,
    ``None`` the empty run (the identity). A constant map holds a chain start: nothing earlier can change its
    outgoing value. Every map has the route's ``n`` rows; the products of one kind (open after open: a
    composition; open after closed: an ``M x + S``) are one product over all their pairs, their maps stacked
    along the rows, so a round's launches do not grow with the positions a rank holds."""
    out: list[AffineMap | None] = [None] * len(pairs)
    kinds: dict[bool, list[int]] = {True: [], False: []}  # earlier still open -> the pairs needing a product
    for k, (later, earlier) in enumerate(pairs):
        if later is None or earlier is None:
            out[k] = earlier if later is None else later
        elif later.constant:
            out[k] = later
        else:
            kinds[not earlier.constant].append(k)
    for is_open, members in kinds.items():
        if not members:
            continue
        later = AffineMap(*(torch.cat([getattr(pairs[k][0], f) for k in members]) for f in AffineMap._fields))
        earlier_parts = [pairs[k][1] for k in members]
        earlier = AffineMap(torch.cat([e.offset for e in earlier_parts]),
                            torch.cat([e.transition for e in earlier_parts]) if is_open else None)
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
        held = dict.fromkeys(route.positions)
        for d, transfers in enumerate(schedule.rounds):
            sending = [(src, dst, is_open) for src, dst, is_open in transfers
                       if src in held and d > 0 and not schedule.absolute[src]]
            payloads = _compose_pairs([(pending.own[src], held[src]) for src, _, _ in sending])
            for (src, dst, is_open), payload in zip(sending, payloads):
                pending.post((d, dst), src, route.order[dst], _pack(payload, is_open, route.dtype))
            arriving = [(dst, _unpack(pending.take((d, dst)), is_open, route.shape[-1]))
                        for _, dst, is_open in transfers if dst in held]
            for (dst, _), value in zip(arriving, _compose_pairs([(held[dst], message) for dst, message in arriving])):
                held[dst] = value
        return [held[i].offset.to(route.dtype).contiguous() if schedule.incoming[i] else None
                for i in route.positions]

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """The rounds of :func:`scan_schedule`, ``ceil(log2 L)`` of them: own payloads sent at once (every
        round's if the map is constant, else round 0's); ``compute(between)``; then per round ``d``:
        ``[compute(the sends' compositions); send(i + 2**d, payload) for each affine position sending in round
        d > 0]`` then ``[recv(i - 2**d) for each receiving position; compute(their compositions)]``. The
        compositions of one step are :func:`_compose_pairs`' products, one per kind (``compose_s`` for open after
        open, ``apply_s`` for open after closed) plus each further pair's two maps at ``copy_s_per_byte``
        twice (written by the stack, read by the product); nothing for a position that has composed nothing yet."""
        emits, affine, holders, times = route.emits, route.affine, route.holders, route.times
        schedule = scan_schedule(tuple(emits), tuple(affine))
        sends, receives = [{} for _ in range(route.length)], [{} for _ in range(route.length)]
        for d, transfers in enumerate(schedule.rounds):
            for src, dst, is_open in transfers:
                sends[src][d], receives[dst][d] = (dst, is_open), (src, is_open)

        def products(opens: list[bool]) -> list[tuple]:  # the step's pairs, by whether the earlier map is open
            cost = 0.0
            for is_open in (True, False):
                count = opens.count(is_open)
                if count:
                    further = (times.summary_bytes if is_open else times.state_bytes) + times.summary_bytes
                    cost += ((times.compose_s if is_open else times.apply_s)
                             + (count - 1) * 2 * further * times.copy_s_per_byte)
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
                prog += products([held[i][1] for i in sending if held[i][0]])
                for i in sending:
                    prog += post(d, sends[i][d][0])
                arriving = [i for i in mine if d in receives[i]]
                for i in arriving:
                    if holders[receives[i][d][0]] != r:
                        prog.append(("recv", holders[receives[i][d][0]]))
                prog += products([receives[i][d][1] for i in arriving if held[i][0]])
                for i in arriving:
                    held[i] = (True, held[i][1] and receives[i][d][1])
            out.append(prog)
        return out
