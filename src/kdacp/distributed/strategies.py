"""State exchange strategies: how a rank's incoming state (forward) or state gradient (backward)
is obtained from the other ranks' messages.

Every rank that passes something on emits an :class:`AffineMessage` ``x_out = A x_in + b``:
``A`` is ``None`` where the rank knows its outgoing value outright (the first rank of a chain),
and ``M`` (forward) or ``M^T`` (backward) on ranks strictly inside a chain. A strategy turns the
messages into each rank's incoming value. Both directions use the same code on a :class:`Route`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from . import comm

__all__ = ["AffineMessage", "Route", "Pending", "StateExchange", "P2PExchange", "AllGatherExchange",
           "make_exchange"]


@dataclass
class AffineMessage:
    """``x_out = transition @ x_in + offset``; ``offset [n, HV, K, V]``, ``transition [n, HV, K, K]`` or ``None``."""

    offset: torch.Tensor
    transition: torch.Tensor | None = None

    def apply(self, x_in: torch.Tensor | None) -> torch.Tensor:
        if self.transition is None:
            return self.offset
        # One small product per hop: done in float64 so that no TF32 setting can round the chain.
        wide = torch.matmul(self.transition.double(), x_in.double()) + self.offset.double()
        return wide.to(torch.promote_types(self.offset.dtype, x_in.dtype))


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


def make_exchange(strategy: str) -> StateExchange:
    if strategy == "p2p":
        return P2PExchange()
    if strategy == "allgather":
        return AllGatherExchange()
    raise ValueError(f"strategy must be 'p2p' or 'allgather', got {strategy!r}")
