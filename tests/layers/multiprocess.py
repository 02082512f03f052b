"""Run a test function on several gloo ranks (spawned processes) with timeouts, so a failure fails fast."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    torch.set_num_threads(1)  # ranks share the machine's few cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 240.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; re-raise a rank's error;
    kill all ranks and fail after ``timeout_s``."""
    ctx = mp.start_processes(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world_size} ranks still running after {timeout_s:.0f} s")
