"""The state-exchange interface, what every exchange shares, and the registry of exchanges.

An exchange (a *strategy*: ``p2p``, ``allgather``, ``scan``, one module each beside this one) decides how
each chain position's incoming state (forward) or state gradient (backward) is obtained from the other
positions' messages. The chain's positions are the layout's ranges in the direction states flow (global
token order forward, reversed backward); a rank holds one position (the contiguous layout) or several.
Every position that passes something on emits a message ``x_out = A x_in + b`` (a
:class:`kdacp.affine.AffineMap`): ``A`` is ``None`` where the position knows its outgoing value outright (a
chain start), and ``M`` (forward) or ``M^T`` (backward) on positions strictly inside a chain. Both
directions use the same code on a :class:`Route`. A message between two positions of one rank is handed
over in memory.

Each exchange also supplies its cost-model program (:meth:`StateExchange.program`, on a
:class:`ModelRoute`): :mod:`kdacp.cp.cost_model` simulates those programs and ``strategy="auto"``
compares every registered exchange that takes part in the choice (:data:`EXCHANGES`,
:func:`register_exchange`).

Matching: NCCL and gloo match the point-to-point messages between two ranks in the order they were posted.
A rank posts its receives in the order it later reads them, and its sends to each peer go out in the same
order (:class:`OrderedSends`), however early each one's value is known.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Protocol

import torch

from .. import collectives


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


class OrderedSends:
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
    outbox: OrderedSends | None = None

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

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """The cost model's view of this exchange on ``route``: per rank, the ops (see
        :mod:`kdacp.cp.cost_model`) between its ``ready`` work and its ``after`` work, holding
        ``("compute", route.between[r])`` where that work runs."""
        ...


@dataclass(frozen=True)
class ModelRoute:
    """One route as the cost model sees it: ``emits``/``affine`` by position (as :class:`Route`'s),
    ``holders[i]`` the rank holding position ``i``, ``times`` a :class:`~kdacp.cp.cost_model.StageTimes`
    (``state_bytes``, ``summary_bytes``, ``apply_s``, ``compose_s``, ``copy_s_per_byte`` read here),
    ``between[r]``: rank ``r``'s work after posting that needs no incoming value, ``gather_key``: the name
    of a collective the exchange joins (one per layer of a whole step)."""

    emits: tuple[int, ...]
    affine: tuple[bool, ...]
    holders: tuple[int, ...]
    times: object
    between: tuple[float, ...]
    gather_key: object = 0

    @property
    def length(self) -> int:
        return len(self.emits)

    @cached_property
    def ranks(self) -> int:
        return max(self.holders) + 1

    @cached_property
    def own(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, its positions in flow order."""
        return tuple(tuple(i for i in range(self.length) if self.holders[i] == r) for r in range(self.ranks))

    @cached_property
    def incoming(self) -> tuple[bool, ...]:
        """Per position, whether a value comes in (its predecessor emits)."""
        return tuple(i > 0 and self.emits[i - 1] > 0 for i in range(self.length))


class ModelOutbox:
    """One rank's sends in the cost model, in a fixed order per peer (as :class:`Pending` releases them): a send
    leaves once it and every earlier one to that peer are ready. ``keys``: ``(key, peer, bytes)`` in order."""

    def __init__(self, keys):
        self.queues, self.size, self.ready = {}, {}, set()
        for key, peer, nbytes in keys:
            self.queues.setdefault(peer, []).append(key)
            self.size[key] = nbytes

    def release(self, key, peer: int) -> list[tuple]:
        """Mark ``key`` ready; the send ops that leave now."""
        self.ready.add(key)
        ops, queue = [], self.queues[peer]
        while queue and queue[0] in self.ready:
            ops.append(("send", peer, self.size[queue.pop(0)]))
        return ops


# name -> exchange class, in registration order (kdacp's own: p2p, allgather, scan)
EXCHANGES: dict[str, type] = {}
# name -> its place among ``strategy="auto"``'s candidates (ties go to the lower); absent: auto never picks it
AUTO_PRIORITY: dict[str, int] = {}


def register_exchange(name: str, *, auto_priority: int | None = None) -> Callable[[type], type]:
    """Class decorator: register an exchange (a :class:`StateExchange` with a no-argument constructor) under
    ``name``, which ``build_cp_plan(strategy=name)`` then accepts. ``auto_priority``: it is also a candidate
    of ``strategy="auto"`` (the cost model runs its :meth:`~StateExchange.program`), ties going to the lower.

    Raises:
        ValueError: ``name`` is taken or is ``"auto"``.
    """
    def register(cls: type) -> type:
        if name in EXCHANGES or name == "auto":
            raise ValueError(f"exchange {name!r} is already registered")
        EXCHANGES[name] = cls
        if auto_priority is not None:
            AUTO_PRIORITY[name] = auto_priority
        return cls
    return register


def make_exchange(strategy: str) -> StateExchange:
    """A new instance of the exchange registered as ``strategy``.

    Raises:
        ValueError: no exchange of that name.
    """
    if strategy not in EXCHANGES:
        names = tuple(EXCHANGES)
        choices = f"{', '.join(repr(n) for n in names[:-1])} or {names[-1]!r}" if len(names) > 1 else repr(names[0])
        raise ValueError(f"strategy must be {choices}, got {strategy!r}")
    return EXCHANGES[strategy]()


def auto_candidates() -> tuple[str, ...]:
    """The exchanges ``strategy="auto"`` compares, in tie order."""
    return tuple(sorted(AUTO_PRIORITY, key=lambda s: AUTO_PRIORITY[s]))


