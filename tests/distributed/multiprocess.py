"""Spawn real ranks for multi-process tests: gloo on CPU, a free local port, and a hard deadline."""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo ranks.

    Re-raises the first rank failure; kills the ranks and fails if they run past ``timeout`` s.
    """
    context = mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
