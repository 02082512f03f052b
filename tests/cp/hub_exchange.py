"""A test-only exchange added as one module and one registry line: every rank sends its messages to rank 0 of
the group (the hub), which folds every position's incoming value and sends each rank its own. Two message
latencies whatever the chain's length, all the folding on one rank. Its cost-model program sits beside it."""
from __future__ import annotations

import torch

from kdacp.affine import AffineMap
from kdacp.cp import collectives
from kdacp.cp.exchanges import ModelRoute, OrderedSends, Pending, Route, register_exchange

HUB = 0


def _ranks(order) -> list[int]:
    return sorted(set(order))


@register_exchange("hub")
class HubExchange:
    """Gather on the hub, fold there, scatter the incoming values."""

    def begin(self, route: Route) -> Pending:
        pending = Pending(route)
        if not any(route.emits):  # nothing crosses a range boundary (the same on every rank)
            return pending
        n, HV, K, V = route.shape
        slots = max(route.slots) + 1
        others = [r for r in _ranks(route.order) if r != HUB]
        if route.rank == HUB:
            for r in others:
                buffer = torch.empty(slots, n, HV, K, V + K, dtype=route.dtype, device=route.device)
                pending.receives[r] = (buffer, collectives.post_recv(buffer, r, route.group))
            pending.outbox = OrderedSends([(("result", r), r) for r in others], route.group)
        else:
            buffer = torch.empty(slots, n, HV, K, V, dtype=route.dtype, device=route.device)
            pending.receives["result"] = (buffer, collectives.post_recv(buffer, HUB, route.group))
            pending.outbox = OrderedSends([("summaries", HUB)], route.group)
        return pending

    def send(self, pending: Pending, messages) -> None:
        route = pending.route
        pending.messages = dict(zip(route.positions, messages))
        if not any(route.emits):
            return
        n, HV, K, V = route.shape
        packed = torch.zeros(max(route.slots) + 1, n, HV, K, V + K, dtype=route.dtype, device=route.device)
        for i, message in pending.messages.items():
            if message is not None and route.emits[i]:
                rows = message.offset.shape[0]
                packed[route.slots[i], :rows, ..., :V] = message.offset
                if message.transition is not None:
                    packed[route.slots[i], :rows, ..., V:] = message.transition
        if route.rank == HUB:
            pending.local["summaries"] = packed
        else:
            pending.post("summaries", None, HUB, packed)

    def receive(self, pending: Pending) -> list:
        route = pending.route
        if not any(route.emits):
            return [None] * len(route.positions)
        V = route.shape[-1]
        if route.rank == HUB:
            gathered = {r: pending.take(r) for r in _ranks(route.order) if r != HUB}
            gathered[HUB] = pending.take("summaries")
            incoming = [None] * len(route.order)
            for i in range(len(route.order)):  # flow order: a position's source is folded before it
                j = i - 1
                if route.source(i) is None:
                    continue
                row = gathered[route.order[j]][route.slots[j]]
                incoming[i] = AffineMap(row[..., :V], row[..., V:] if route.affine[j] else None).apply(incoming[j])
            for r in gathered:
                if r != HUB:
                    out = torch.zeros((max(route.slots) + 1,) + tuple(route.shape), dtype=route.dtype,
                                      device=route.device)
                    for i, holder in enumerate(route.order):
                        if holder == r and incoming[i] is not None:
                            out[route.slots[i]] = incoming[i]
                    pending.post(("result", r), None, r, out)
            return [None if incoming[i] is None else incoming[i].to(route.dtype).contiguous() for i in route.positions]
        result = pending.take("result")
        return [None if route.source(i) is None else result[route.slots[i]].contiguous() for i in route.positions]

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """Non-hub ranks: ``send(hub, summaries); compute(between); recv(hub)``; the hub: ``compute(between)``,
        a receive from every other rank, one apply per incoming position, a send to every other rank."""
        times, slots = route.times, max(len(o) for o in route.own)
        if not any(route.emits):
            return [[("compute", b)] for b in route.between]
        others = [r for r in range(route.ranks) if r != HUB and route.own[r]]
        out = []
        for r in range(route.ranks):
            if r == HUB:
                prog = [("compute", route.between[r])] + [("recv", q) for q in others]
                prog.append(("compute", sum(route.incoming) * times.apply_s))
                prog += [("send", q, slots * times.state_bytes) for q in others]
            elif r in others:
                prog = [("send", HUB, slots * times.summary_bytes), ("compute", route.between[r]), ("recv", HUB)]
            else:
                prog = [("compute", route.between[r])]
            out.append(prog)
        return out
