"""``allgather``: one all-gather of every rank's messages, each rank folding its own prefix."""
from __future__ import annotations

import torch

from ...affine import AffineMap
from ...host_copies import take_rows
from .. import collectives
from .base import ModelRoute, Pending, Route, chain_depths, register_exchange


def fold_chains(rows: torch.Tensor, chains: list[list[int]], V: int) -> list[torch.Tensor | None]:
    """Each chain's value folded from ``rows [R, n, HV, K, V (+K)]`` (a message a row: ``S`` in the first ``V``
    columns, ``M`` after them where it has one): ``chains[c]`` the rows applied, first applied first, the first a
    constant message. All chains advance together, one message each per step: a step is one
    ``M x + S`` over every chain still going (:meth:`~kdacp.affine.AffineMap.apply` over the rows gathered for
    it by host indices, :func:`~kdacp.host_copies.take_rows`: no device sync), so the launches follow the longest
    chain, not the sum of their lengths. Returns per chain a dense ``[n, HV, K, V]`` value (rows of one tensor),
    or ``None`` for an empty chain."""
    order = sorted(range(len(chains)), key=lambda c: -len(chains[c]))  # the chains still going: a prefix
    live = [chains[c] for c in order if chains[c]]
    out: list[torch.Tensor | None] = [None] * len(chains)
    if not live:
        return out
    # [chains, n, HV, K, V], apart from ``rows`` (the steps write into it)
    x = take_rows(rows, [chain[0] for chain in live])[..., :V].clone(memory_format=torch.contiguous_format)
    for step in range(1, len(live[0])):
        going = sum(len(chain) > step for chain in live)
        message = take_rows(rows, [chain[step] for chain in live[:going]])
        x[:going] = AffineMap(message[..., :V], message[..., V:]).apply(x[:going])
    for k, c in enumerate(order[:len(live)]):
        out[c] = x[k]
    return out


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
        pending.recv_work.wait()
        gathered = torch.stack(pending.gathered)                      # [P, slots, n, HV, K, V (+K)]
        rows = gathered.flatten(0, 1)                                 # row of position j: order[j] * slots + slot
        # position i's value folds the messages of the chain_depths[i] positions before it
        depths = chain_depths(route.emits, route.affine)
        chains = [[route.order[j] * gathered.shape[1] + route.slots[j] for j in range(i - depths[i], i)]
                  for i in route.positions]
        return fold_chains(rows, chains, route.shape[-1])

    def program(self, route: ModelRoute) -> list[list[tuple]]:
        """``gather(key, summary, with M when any position is through); compute(between); wait(key);
        compute(stack of the gathered summaries + the folds)``: the folds a step per message of the rank's longest
        chain (one ``apply_s`` each), and the bytes of every further chain's ``M x + S`` in those steps (its row of
        the gathered stack, its state in and out) at ``copy_s_per_byte``."""
        emits, affine, times = route.emits, route.affine, route.times
        chain = chain_depths(emits, affine)  # the messages position i's incoming value is folded from
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
                steps = max([0, *(chain[i] - 1 for i in mine)])
                further = (folds - steps) * (times.summary_bytes + 2 * times.state_bytes)
                prog.append(("compute", (route.ranks * nbytes + further) * times.copy_s_per_byte
                             + steps * times.apply_s))
            out.append(prog)
        return out
