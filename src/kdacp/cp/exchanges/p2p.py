"""``p2p``: the wavefront exchange, each position receiving from its predecessor and sending on."""
from __future__ import annotations

import torch

from .. import collectives
from .base import ModelOutbox, ModelRoute, OrderedSends, Pending, Route, handling_order, register_exchange


@register_exchange("p2p", auto_priority=0)
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
        pending.outbox = OrderedSends(route.outgoing, route.group)  # a value keyed by the position it enters
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

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """``[map constant: send(i+1, state)]; compute(between); [i > 0: recv(i-1)];
        [through: compute(apply); send(i+1, state)]`` per position, in :func:`handling_order`: after the
        through positions' ``ready`` the chain is one hop (link + apply) per through position."""
        emits, affine, holders, L = route.emits, route.affine, route.holders, route.length
        out = []
        for r, mine in enumerate(route.own):
            mine = handling_order(mine, emits, affine)
            entered = handling_order([i + 1 for i in mine if emits[i] > 0 and i + 1 < L and holders[i + 1] != r],
                                     emits, affine)
            sends = [j - 1 for j in entered]
            outbox = ModelOutbox([(i, holders[i + 1], route.times.state_bytes) for i in sends])
            prog: list[tuple] = []
            for i in sends:
                if not affine[i]:
                    prog += outbox.release(i, holders[i + 1])
            prog.append(("compute", route.between[r]))
            for i in mine:
                if route.incoming[i] and holders[i - 1] != r:
                    prog.append(("recv", holders[i - 1]))
                if emits[i] > 0 and i + 1 < L and affine[i]:
                    prog.append(("compute", route.times.apply_s))
                    if i in sends:
                        prog += outbox.release(i, holders[i + 1])
            out.append(prog)
        return out
