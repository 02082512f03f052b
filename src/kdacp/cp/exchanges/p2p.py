"""``p2p``: the wavefront exchange, each position receiving from its predecessor and sending on."""
from __future__ import annotations

import torch

from ...affine import AffineMap
from .. import collectives
from .base import (ModelOutbox, ModelRoute, OrderedSends, Pending, Route, handling_groups, handling_order,
                   register_exchange)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` joined along their first dim (a single tensor itself, not copied)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


@register_exchange("p2p", auto_priority=0)
class P2PExchange:
    """Wavefront: each position receives from its predecessor and sends ``A x_in + b`` to its successor.

    A position whose message does not depend on its input sends before anything is waited for, so only
    positions strictly inside a chain are serial, each adding one ``K x K`` by ``K x V`` product and one
    message. A rank handles its positions in :attr:`Route.groups`, one chain depth at a time: it takes
    (waits for) every input of the depth in :attr:`Route.handling` order, then makes the values of the
    depth's affine messages in one product over their rows stacked (a packed batch cut per document holds
    one position per document piece: one launch a depth, not one a position; stacked in :meth:`send`,
    before anything is waited for) and posts them.

    No layout can deadlock, by induction on the depth ``d``: an input of depth ``d`` is a constant
    message (posted by :meth:`send`, before any wait) or the value of a position of depth ``d - 1``, posted
    once its rank has taken its inputs of depths up to ``d - 1``; and a send to a peer is held back only by
    sends that the peer reads before it (:attr:`Route.outgoing`, in handling order of the positions
    entered), which enter positions of depths up to ``d`` and so come from positions of depths below ``d``
    or constant messages, all posted by then. A value leaves at the same depth as when positions were handled
    one at a time (after its rank's other inputs of that depth, not only its own), so the longest run of
    messages each waiting on the one before is unchanged.
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
        """Post the constant messages; stack each depth's affine ones (``offset [n_i, HV, K, V]``,
        ``transition [n_i, HV, K, K]``) into ``pending.batches``: per run of :attr:`Route.groups`,
        ``(positions, rows of each, the stacked map or None)``."""
        route = pending.route
        messages = dict(zip(route.positions, messages))
        for i, message in messages.items():
            dst = route.target(i)
            if dst is not None and message.constant:
                pending.post(i + 1, i, dst, message.offset)
        for group in route.groups:
            through = [i for i in group if route.target(i) is not None and not messages[i].constant]
            maps = [messages[i] for i in through]
            stacked = AffineMap(_cat([m.offset for m in maps]), _cat([m.transition for m in maps])) if maps else None
            pending.batches.append((through, [m.offset.shape[0] for m in maps], stacked))

    def receive(self, pending: Pending) -> list:
        route = pending.route
        incoming = {}
        for group, (through, rows, stacked) in zip(route.groups, pending.batches):
            for i in group:
                incoming[i] = None if route.source(i) is None else pending.take(i)
            if through:
                values = stacked.apply(_cat([incoming[i] for i in through])).split(rows)
                for i, value in zip(through, values):
                    pending.post(i + 1, i, route.target(i), value.to(route.dtype))
        return [incoming[i] for i in route.positions]

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """``[map constant: send(i+1, state)]; compute(between)``, then per run of :func:`handling_groups`:
        ``[i > 0: recv(i-1)]`` per position, ``[any through: compute(apply); send(i+1, state) per through
        position]``. A run's product counts one apply whatever its rows: an apply costs its launch more than
        its flops (an H100 at 32 heads of 128, a loop's time a call: one row 133 us, 40 rows in one launch
        213 us, 40 launches of a row 4.5 ms). After the through positions' ``ready`` the chain is one hop
        (link + apply) per through position."""
        emits, affine, holders, L = route.emits, route.affine, route.holders, route.length
        out = []
        for r, mine in enumerate(route.own):
            entered = handling_order([i + 1 for i in mine if emits[i] > 0 and i + 1 < L and holders[i + 1] != r],
                                     emits, affine)
            sends = [j - 1 for j in entered]
            outbox = ModelOutbox([(i, holders[i + 1], route.times.state_bytes) for i in sends])
            prog: list[tuple] = []
            for i in sends:
                if not affine[i]:
                    prog += outbox.release(i, holders[i + 1])
            prog.append(("compute", route.between[r]))
            for group in handling_groups(mine, emits, affine):
                prog += [("recv", holders[i - 1]) for i in group if route.incoming[i] and holders[i - 1] != r]
                through = [i for i in group if emits[i] > 0 and i + 1 < L and affine[i]]
                if through:
                    prog.append(("compute", route.times.apply_s))
                for i in through:
                    if i in sends:
                        prog += outbox.release(i, holders[i + 1])
            out.append(prog)
        return out
