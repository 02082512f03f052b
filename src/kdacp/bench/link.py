"""The link between ranks, measured: point-to-point (ping-pong) and all-gather times of a small and a
large message, as the scaling model's :class:`~kdacp.distributed.cost_model.Link`."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from kdacp.distributed.cost_model import Link

from .stage_probe import sync

__all__ = ["measure_link"]


def measure_link(nbytes: int, device, group=None, iters: int = 10) -> Link:
    """The link between ranks 0 and 1 of ``group`` (point-to-point) and over the group (all-gather), from
    4-byte messages (latency) and ``nbytes`` ones (bandwidth). Call on every rank of the group."""
    device = torch.device(device)
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    peer = {0: 1, 1: 0}.get(rank)

    def p2p_seconds(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        times = []
        for i in range(iters + 1):
            dist.barrier(group)
            sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dist.get_global_rank(group, 1) if group is not None else 1, group=group)
                dist.recv(buf, dist.get_global_rank(group, 1) if group is not None else 1, group=group)
            elif rank == 1:
                dist.recv(buf, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
                dist.send(buf, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            sync(device)
            if i:
                times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times) if peer is not None else 0.0

    def gather_seconds(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        out = [torch.empty_like(buf) for _ in range(P)]
        times = []
        for i in range(iters + 1):
            dist.barrier(group)
            sync(device)
            t0 = time.perf_counter()
            dist.all_gather(out, buf, group=group)
            sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    numel = max(nbytes // 4, 1)
    figures = torch.tensor([p2p_seconds(1), p2p_seconds(numel), gather_seconds(1), gather_seconds(numel)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)  # rank 0's p2p figures reach every rank
    small, big, g_small, g_big = figures.tolist()
    # A noisy pair can make the big message look no slower: floor the difference at 1% of its time.
    return Link(latency_s=small, bandwidth=nbytes / max(big - small, 0.01 * big), gather_latency_s=g_small / (P - 1),
                gather_bandwidth=(P - 1) * nbytes / max(g_big - g_small, 0.01 * g_big))
