"""``p2p``: the wavefront exchange, each position receiving from its predecessor and sending on."""
from __future__ import annotations

import torch

from ...affine import apply_maps
from .. import collectives
from .base import ModelOutbox, ModelRoute, OrderedSends, Pending, Route, chain_depths, handling_order, register_exchange


@register_exchange("p2p", auto_priority=0)
class P2PExchange:
    """Wavefront: each position receives from its predecessor and sends ``A x_in + b`` to its successor.

    A position whose message does not depend on its input sends before anything is waited for, so only
    positions strictly inside a chain are serial, each adding one ``K x K`` by ``K x V`` product and one
    message; a rank's positions of one chain depth (a piece of each document, where a packed batch is cut per
    document) form their products in one launch (:attr:`Route.handling_steps`). A rank handles its positions
    in :attr:`Route.handling` order, in which every dependency points to a position handled earlier on its
    rank, so no layout can deadlock.
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
        for step in route.handling_steps:
            for i in step:
                incoming[i] = None if route.source(i) is None else pending.take(i)
            passing = [i for i in step if route.target(i) is not None and not pending.messages[i].constant]
            values = apply_maps([pending.messages[i] for i in passing], [incoming[i] for i in passing])
            for i, value in zip(passing, values):
                pending.post(i + 1, i, route.target(i), value.to(route.dtype))
        return [incoming[i] for i in route.positions]

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """``[map constant: send(i+1, state)]; compute(between); then per step of one chain depth
        (:attr:`Route.handling_steps`): [i > 0: recv(i-1)] for each of its positions; [any through: compute(its
        products); send(i+1, state) each]`` in :func:`handling_order`: after the through positions' ``ready`` the
        chain is one hop (link + apply) per step. A step's products are one ``apply_s`` and, for each further
        through position, the bytes its rows are stacked and multiplied in (``M`` and ``S`` copied and read, its
        state copied, read and written: ``3 summary_bytes + 4 state_bytes``) at ``copy_s_per_byte``."""
        emits, affine, holders, L, times = route.emits, route.affine, route.holders, route.length, route.times
        depths = chain_depths(emits, affine)
        further_bytes = 3 * times.summary_bytes + 4 * times.state_bytes
        out = []
        for r, mine in enumerate(route.own):
            mine = handling_order(mine, emits, affine)
            entered = handling_order([i + 1 for i in mine if emits[i] > 0 and i + 1 < L and holders[i + 1] != r],
                                     emits, affine)
            sends = [j - 1 for j in entered]
            outbox = ModelOutbox([(i, holders[i + 1], times.state_bytes) for i in sends])
            prog: list[tuple] = []
            for i in sends:
                if not affine[i]:
                    prog += outbox.release(i, holders[i + 1])
            prog.append(("compute", route.between[r]))
            for depth in sorted({depths[i] for i in mine}):
                step = [i for i in mine if depths[i] == depth]
                for i in step:
                    if route.incoming[i] and holders[i - 1] != r:
                        prog.append(("recv", holders[i - 1]))
                through = [i for i in step if emits[i] > 0 and i + 1 < L and affine[i]]
                if through:
                    prog.append(("compute", times.apply_s + (len(through) - 1) * further_bytes * times.copy_s_per_byte))
                    for i in through:
                        if i in sends:
                            prog += outbox.release(i, holders[i + 1])
            out.append(prog)
        return out
