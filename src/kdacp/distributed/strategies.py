"""State exchange strategies: how a rank's incoming state (forward) or state gradient (backward)
is obtained from the other ranks' messages.

Every rank that passes something on emits an :class:`AffineMessage` ``x_out = A x_in + b``:
``A`` is ``None`` where the rank knows its outgoing value outright (the first rank of a chain),
and ``M`` (forward) or ``M^T`` (backward) on ranks strictly inside a chain. A strategy turns the
messages into each rank's incoming value. Both directions use the same code on a :class:`Route`:
``p2p`` (wavefront), ``allgather`` (one collective, local fold) and ``scan`` (segmented prefix scan
in ``ceil(log2 P)`` rounds of point-to-point messages).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

import torch

from ..affine import apply_state_summary, compose_state_summaries
from ..caches import SCAN_SCHEDULES
from . import comm

__all__ = ["AffineMessage", "Route", "Pending", "StateExchange", "P2PExchange", "AllGatherExchange",
           "ScanExchange", "ScanSchedule", "scan_schedule", "simulate_scan", "make_exchange"]


@dataclass
class AffineMessage:
    """``x_out = transition @ x_in + offset``; ``offset [n, HV, K, V]``, ``transition [n, HV, K, K]`` or ``None``."""

    offset: torch.Tensor
    transition: torch.Tensor | None = None

    def apply(self, x_in: torch.Tensor | None) -> torch.Tensor:
        if self.transition is None:
            return self.offset
        # one small product per hop, by the precision rule of kdacp.affine
        return apply_state_summary(self.offset, self.transition, x_in)


@dataclass(frozen=True)
class Route:
    """One direction of the exchange, seen from ``rank``.

    ``order`` lists the group's ranks in the direction states flow (ascending forward, descending
    backward). For every rank ``emits[r]``: messages it passes to its successor in ``order``
    (0 or ``n``); ``affine[r]``: its message depends on what it receives (it needs ``M``).
    ``shape`` is one message's ``[n, HV, K, V]``; messages travel in ``dtype`` on ``device``.
    """

    rank: int
    group: object
    order: tuple[int, ...]
    emits: tuple[int, ...]
    affine: tuple[bool, ...]
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    device: torch.device

    @property
    def predecessor(self) -> int | None:
        i = self.order.index(self.rank)
        return self.order[i - 1] if i > 0 and self.emits[self.order[i - 1]] else None

    @property
    def successor(self) -> int | None:
        i = self.order.index(self.rank)
        return self.order[i + 1] if self.emits[self.rank] and i + 1 < len(self.order) else None


@dataclass
class Pending:
    """An exchange in flight: the posted receive (or gather: ``gathered`` holds its parts), this
    rank's message, the sends to wait for."""

    route: Route
    recv_buffer: torch.Tensor | None = None
    recv_work: object = None
    message: AffineMessage | None = None
    sends: list = field(default_factory=list)
    gathered: list | None = None

    def finish_sends(self) -> None:
        comm.wait(self.sends)
        self.sends.clear()


class StateExchange(Protocol):
    """``begin`` before the local work (posts receives); ``send`` as soon as this rank's message is
    known; ``receive`` when the incoming ``[n, HV, K, V]`` is needed (``None`` when nothing comes in).
    Every rank calls all three, in this order, whether or not it has anything to pass on."""

    def begin(self, route: Route) -> Pending: ...

    def send(self, pending: Pending, message: AffineMessage | None) -> None: ...

    def receive(self, pending: Pending) -> torch.Tensor | None: ...


class P2PExchange:
    """Wavefront: receive from the predecessor, send ``A x_in + b`` to the successor.

    A rank whose message does not depend on its input sends before it waits, so only ranks
    strictly inside a chain are serial, each adding one ``K x K`` by ``K x V`` product and one message.
    """

    def begin(self, route: Route) -> Pending:
        pending = Pending(route)
        src = route.predecessor
        if src is not None:
            pending.recv_buffer = torch.empty(route.shape, dtype=route.dtype, device=route.device)
            pending.recv_work = comm.post_recv(pending.recv_buffer, src, route.group)
        return pending

    def send(self, pending: Pending, message: AffineMessage | None) -> None:
        pending.message = message
        dst = pending.route.successor
        if dst is not None and message.transition is None:
            pending.sends.append(comm.send(message.offset.to(pending.route.dtype), dst, pending.route.group))

    def receive(self, pending: Pending) -> torch.Tensor | None:
        route, message = pending.route, pending.message
        x_in = None
        if pending.recv_work is not None:
            pending.recv_work.wait()
            x_in = pending.recv_buffer
        if route.successor is not None and message.transition is not None:
            pending.sends.append(comm.send(message.apply(x_in).to(route.dtype), route.successor, route.group))
        return x_in


class AllGatherExchange:
    """One all-gather of every rank's message; each rank then folds the chain that ends at it.

    The gather is posted by :meth:`send`, the moment this rank's message exists, and waited for in
    :meth:`receive`: the collective then waits for each rank's summary, not for the local work that
    each rank does between the two calls.
    """

    def begin(self, route: Route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, message: AffineMessage | None) -> None:
        route = pending.route
        pending.message = message
        if not any(route.emits):  # no sequence crosses a rank boundary (the same on every rank)
            return
        n, HV, K, V = route.shape
        with_transition = any(route.affine)
        buffer = torch.zeros(n, HV, K, V + (K if with_transition else 0), dtype=route.dtype, device=route.device)
        if message is not None and route.emits[route.rank]:
            buffer[..., :V] = message.offset
            if message.transition is not None:
                buffer[..., V:] = message.transition
        pending.recv_buffer = buffer  # alive until the gather completes
        pending.recv_work, pending.gathered = comm.post_all_gather(buffer, route.group)

    def receive(self, pending: Pending) -> torch.Tensor | None:
        route = pending.route
        if pending.recv_work is None:
            return None
        V = route.shape[-1]
        pending.recv_work.wait()
        gathered = torch.stack(pending.gathered)                      # [P, n, HV, K, V (+K)]
        chain = []
        r = route.predecessor
        while r is not None:
            chain.append(r)
            if not route.affine[r]:
                break
            r = route.order[route.order.index(r) - 1]
        x = None
        for r in reversed(chain):
            x = AffineMessage(gathered[r, ..., :V], gathered[r, ..., V:] if route.affine[r] else None).apply(x)
        # a column slice of the gathered buffer: kernels downstream need a dense state
        return None if x is None else x.contiguous()


@dataclass(frozen=True)
class _Partial:
    """A composed summary of consecutive positions of a route, in the exchange's dtype (float32 or
    wider; products by :mod:`kdacp.affine`'s rule): ``x -> transition @ x + offset``.

    ``offset`` ``None``: the empty run (the identity). ``transition`` ``None`` with an offset: the run is
    *closed*, it holds a chain start (a rank whose message does not depend on its input, or one that
    emits nothing), so its outgoing value is known outright and nothing earlier can change it.
    """

    offset: torch.Tensor | None = None
    transition: torch.Tensor | None = None

    @property
    def closed(self) -> bool:
        return self.offset is not None and self.transition is None


def _compose(later: _Partial, earlier: _Partial) -> _Partial:
    """``later o earlier`` (``earlier`` acts first): ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)``."""
    if later.offset is None:
        return earlier
    if earlier.offset is None or later.transition is None:
        return later
    if earlier.transition is None:
        return _Partial(apply_state_summary(later.offset, later.transition, earlier.offset))
    return _Partial(*compose_state_summaries((earlier.offset, earlier.transition), (later.offset, later.transition)))


def _element(message: AffineMessage | None, emits: int, shape: tuple[int, ...], dtype: torch.dtype, device
             ) -> _Partial:
    """A rank's own map, padded to ``shape``'s ``n`` rows, in ``dtype``. A rank that emits nothing
    breaks the chain: its map is the constant zero (closed)."""
    def padded(x: torch.Tensor) -> torch.Tensor:
        x = x.to(dtype)
        if x.shape[0] == shape[0]:
            return x
        return torch.cat([x, x.new_zeros(shape[0] - x.shape[0], *x.shape[1:])])

    if message is None or not emits:
        return _Partial(torch.zeros(shape, dtype=dtype, device=device))
    if message.transition is None:
        return _Partial(padded(message.offset))
    return _Partial(padded(message.offset), padded(message.transition))


def _pack(partial: _Partial, is_open: bool, dtype: torch.dtype) -> torch.Tensor:
    """One message of the scan: ``[n, HV, K, V]`` (closed) or ``[n, HV, K, V + K]`` (offset | transition)."""
    if partial.closed == is_open or partial.offset is None:
        raise RuntimeError("scan schedule and payload disagree (a bug in kdacp's scan schedule)")
    if not is_open:
        return partial.offset.to(dtype)
    return torch.cat([partial.offset, partial.transition], -1).to(dtype)


def _unpack(buffer: torch.Tensor, is_open: bool, V: int) -> _Partial:
    return _Partial(buffer[..., :V], buffer[..., V:]) if is_open else _Partial(buffer)


@dataclass(frozen=True)
class ScanSchedule:
    """The rounds of the segmented exclusive scan over the positions ``0 .. P-1`` of ``Route.order``.

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
    ``affine`` as in :class:`Route`, but indexed by position in ``Route.order``.

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


def simulate_scan(messages: list[AffineMessage | None], emits, affine, dtype: torch.dtype = torch.float64
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
    held = [_Partial() for _ in messages]
    for transfers in schedule.rounds:
        payloads = [_pack(_compose(own[src], held[src]), is_open, dtype) for src, _, is_open in transfers]
        for (_, dst, is_open), payload in zip(transfers, payloads):
            held[dst] = _compose(held[dst], _unpack(payload, is_open, V))
    return [held[i].offset.to(dtype) if schedule.incoming[i] else None for i in range(len(messages))]


@dataclass
class _ScanPending(Pending):
    position: int = 0
    schedule: ScanSchedule | None = None
    receives: dict = field(default_factory=dict)  # round -> (buffer, work, is_open)
    own: _Partial | None = None
    keep: list = field(default_factory=list)      # send buffers, alive until their sends complete

    def finish_sends(self) -> None:
        super().finish_sends()
        self.keep.clear()


class ScanExchange:
    """Segmented exclusive prefix scan of the affine messages by recursive doubling.

    Variant: Kogge-Stone (Hillis-Steele) over the positions of ``Route.order``. In round ``d`` the
    rank at position ``i`` sends its composed map ``I_i = (A, b)`` of positions ``[i - 2**d + 1, i]`` to
    ``i + 2**d`` and composes what arrives from ``i - 2**d`` into ``E_i <- E_i o I`` (
    ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)``). After ``ceil(log2 P)`` rounds ``E_i`` is the exclusive
    prefix, applied to nothing (a chain always starts at a rank whose map is constant), so ``E_i``'s
    offset is the incoming value. Any ``P``: transfers past either end are simply absent.

    Why this variant: it has the fewest rounds, ``ceil(log2 P)`` (Brent-Kung needs about
    ``2 log2 P`` and Sklansky sends up to ``P/2`` messages from one rank in a round); each rank sends
    and receives at most one message per round. Its extra work (``O(P log P)`` compositions, each
    ``K x K`` by ``K x (K + V)`` per message row) is small next to the local KDA work. Compared with
    ``p2p``, whose serial path is one message per rank of the longest chain (up to ``P - 1`` hops),
    the serial path here is ``ceil(log2 P)`` messages; compared with ``allgather``, which moves all
    ``P`` summaries to every rank in one collective and folds up to ``P - 1`` of them serially, a rank
    here receives at most ``ceil(log2 P)`` summaries.

    Segments: whether a composed map is still affine or already *closed* (holds a chain start: a rank
    whose message does not depend on its input, or one that emits nothing) depends only on
    ``Route.emits`` / ``Route.affine``, so :func:`scan_schedule` computes it identically on every rank.
    No flag travels; a rank whose prefix is closed receives nothing more; transfers nobody needs are
    dropped; a closed map travels as its offset ``[n, HV, K, V]`` alone, an open one as
    ``[n, HV, K, V + K]`` (offset and transition in one tensor). A rank whose own map is constant
    sends all its payloads at once from ``send``; an affine rank sends round 0 (its own map) from
    ``send`` and round ``d`` after composing the receives of rounds ``< d``. Every dependency points
    from a round to a later one, so no ``P`` can deadlock; all receives are posted in ``begin``.

    Precision: products by :mod:`kdacp.affine`'s rule (as :meth:`AffineMessage.apply`), composed maps
    held and sent in ``Route.dtype`` (float32 or wider), so each composition is rounded to it once.
    """

    def begin(self, route: Route) -> Pending:
        # Route.emits / Route.affine are indexed by rank; the schedule by position in Route.order
        schedule = scan_schedule(tuple(route.emits[r] for r in route.order),
                                 tuple(route.affine[r] for r in route.order))
        position = route.order.index(route.rank)
        pending = _ScanPending(route, position=position, schedule=schedule)
        n, HV, K, V = route.shape
        for d, src, is_open in schedule.receives(position):
            buffer = torch.empty(n, HV, K, V + (K if is_open else 0), dtype=route.dtype, device=route.device)
            pending.receives[d] = (buffer, comm.post_recv(buffer, route.order[src], route.group), is_open)
        return pending

    def _send(self, pending: _ScanPending, payload: torch.Tensor, dst: int) -> None:
        route = pending.route
        pending.keep.append(payload)
        pending.sends.append(comm.send(payload, route.order[dst], route.group))

    def send(self, pending: Pending, message: AffineMessage | None) -> None:
        pending.message = message
        route, schedule, position = pending.route, pending.schedule, pending.position
        sends = schedule.sends(position)
        if not sends:  # the last position, or a rank whose map nobody needs (it emits nothing)
            return
        pending.own = own = _element(message, route.emits[route.rank], route.shape, route.dtype, route.device)
        constant = schedule.absolute[position]
        payload = None
        for d, dst, is_open in sends:
            if constant or d == 0:  # I = f o E is f itself: f is constant, or E is still empty
                if payload is None:
                    payload = _pack(own, is_open, route.dtype)
                self._send(pending, payload, dst)

    def receive(self, pending: Pending) -> torch.Tensor | None:
        route, schedule, position = pending.route, pending.schedule, pending.position
        constant = schedule.absolute[position]
        sends = {d: (dst, is_open) for d, dst, is_open in schedule.sends(position)}
        held = _Partial()
        for d in range(len(schedule.rounds)):
            if d in sends and d > 0 and not constant:
                dst, is_open = sends[d]
                self._send(pending, _pack(_compose(pending.own, held), is_open, route.dtype), dst)
            if d in pending.receives:
                buffer, work, is_open = pending.receives[d]
                work.wait()
                held = _compose(held, _unpack(buffer, is_open, route.shape[-1]))
        if not schedule.incoming[position]:
            return None
        return held.offset.to(route.dtype).contiguous()


def make_exchange(strategy: str) -> StateExchange:
    if strategy == "p2p":
        return P2PExchange()
    if strategy == "allgather":
        return AllGatherExchange()
    if strategy == "scan":
        return ScanExchange()
    raise ValueError(f"strategy must be 'p2p', 'allgather' or 'scan', got {strategy!r}")
