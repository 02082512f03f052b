"""``allgather``: one all-gather of every rank's messages, each rank folding its own prefix."""
from __future__ import annotations

import torch

from ...affine import AffineMap
from .. import collectives
from .base import ModelRoute, Pending, Route, register_exchange


@register_exchange("allgather", auto_priority=2)
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

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """``gather(key, summary, with M when any position is through); compute(between); wait(key);
        compute(stack of the gathered summaries + (chain before i - 1) x apply)``."""
        emits, affine, times = route.emits, route.affine, route.times
        # chain[i]: the messages position i's incoming value is folded from
        chain = [0] * route.length
        for i in range(1, route.length):
            chain[i] = 0 if not route.incoming[i] else 1 if not affine[i - 1] else chain[i - 1] + 1
        out = []
        for r, mine in enumerate(route.own):
            prog: list[tuple] = []
            if any(emits):
                slots = max(len(o) for o in route.own)
                nbytes = slots * (times.summary_bytes if any(affine) else times.state_bytes)
                prog.append(("gather", route.gather_key, nbytes))
            prog.append(("compute", route.between[r]))
            if any(emits):
                prog.append(("wait", route.gather_key))
                folds = sum(max(chain[i] - 1, 0) for i in mine)
                prog.append(("compute", route.ranks * nbytes * times.copy_s_per_byte + folds * times.apply_s))
            out.append(prog)
        return out
