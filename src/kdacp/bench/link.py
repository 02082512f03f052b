"""The link between ranks, measured: point-to-point (ping-pong) and all-gather times of a small and a
large message, as the scaling model's :class:`~kdacp.cp.cost_model.Link`."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kdacp.cp.cost_model import Link

from .timing import median_time


def measure_link(nbytes: int, device, group=None, iters: int = 10) -> Link:
    """The link between ranks 0 and 1 of ``group`` (point-to-point) and over the group (all-gather), from
    4-byte messages (latency) and ``nbytes`` ones (bandwidth): medians over ``iters`` calls after one to warm
    up, each the slowest rank's (:func:`~kdacp.bench.timing.median_time`). Call on every rank of the group."""
    device = torch.device(device)
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    peer = {0: 1, 1: 0}.get(rank)
    peer_rank = None if peer is None else dist.get_global_rank(group, peer) if group is not None else peer

    def p2p_seconds(numel: int) -> float:
        """Half a ping-pong between ranks 0 and 1 (rank 0 sends first); the other ranks wait at the barrier."""
        buf = torch.zeros(numel, device=device)
        order = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)

        def ping_pong():
            if peer is not None:
                for move in order:
                    move(buf, peer_rank, group=group)
        return median_time(ping_pong, device, iters, group=group) / 2

    def gather_seconds(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        out = [torch.empty_like(buf) for _ in range(P)]
        return median_time(lambda: dist.all_gather(out, buf, group=group), device, iters, group=group)

    numel = max(nbytes // 4, 1)
    small, big, g_small, g_big = p2p_seconds(1), p2p_seconds(numel), gather_seconds(1), gather_seconds(numel)
    # A noisy pair can make the big message look no slower: floor the difference at 1% of its time.
    return Link(latency_s=small, bandwidth=nbytes / max(big - small, 0.01 * big), gather_latency_s=g_small / (P - 1),
                gather_bandwidth=(P - 1) * nbytes / max(g_big - g_small, 0.01 * g_big))
