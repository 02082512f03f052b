"""Start, watch and stop the worker processes of a multi-rank run (``kdacp demo`` and friends).

Under ``torchrun`` the current process is one rank and nothing is spawned. Otherwise
:func:`launch` spawns ``world_size`` processes on this machine, forwards their progress and
results, and if one fails or dies, stops the others within seconds and raises
:class:`WorkerError` naming the rank and the cause. No process is left behind.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankContext", "WorkerError", "launch", "free_port", "under_torchrun", "pick_backend"]


class WorkerError(RuntimeError):
    """A worker failed, died or timed out; the message says which rank and what to do."""


@dataclass(frozen=True)
class RankContext:
    """What a worker function receives: its rank, the world size, its device, and a ``report``
    callable that sends a picklable message to the launching process."""

    rank: int
    world_size: int
    device: torch.device
    report: Callable[[Any], None]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise WorkerError(f"port {port} is in use ({e.strerror}); pass --port 0 to pick a free one") from None


def pick_backend(device: str, world_size: int) -> str:
    """``nccl`` for CUDA (checking there is one GPU per rank), ``gloo`` for CPU."""
    if device == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise WorkerError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
        if not under_torchrun() and n < world_size:
            raise WorkerError(f"--world-size {world_size} needs {world_size} GPUs for NCCL but {n} are visible; "
                              f"lower --world-size or use --device cpu")
        return "nccl"
    if device != "cpu":
        raise WorkerError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    return "gloo"


def _init_group(rank: int, world_size: int, device: str, timeout_s: float) -> torch.device:
    backend = pick_backend(device, world_size)
    dev = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if backend == "nccl" else None)
    return dev


def _worker(rank: int, world_size: int, port: int, device: str, timeout_s: float, fn, args, messages,
            prepare) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if prepare is not None:
            prepare()
        dev = _init_group(rank, world_size, device, timeout_s)
        result = fn(RankContext(rank, world_size, dev, lambda m: messages.put(("report", rank, m))), *args)
        messages.put(("result", rank, result))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        messages.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        raise SystemExit(1)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def _raise_if_dead(procs, results, signals_only: bool = False, consequence: str = "") -> None:
    for r, p in enumerate(procs):
        code = p.exitcode
        if code is None or code == 0 or r in results or (signals_only and code > 0):
            continue
        cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise WorkerError(f"worker rank {r} died ({cause}){consequence}; the other workers were stopped")


def launch(fn: Callable, world_size: int, args: tuple = (), *, device: str = "cpu", port: int = 0,
           timeout_s: float = 600.0, on_report: Callable[[int, Any], None] | None = None,
           prepare: Callable[[], Any] | None = None) -> list[Any]:
    """Run ``fn(ctx: RankContext, *args)`` on ``world_size`` ranks and return their results by rank.

    Under torchrun, runs this process's rank only and returns ``[result]``. Otherwise spawns the
    ranks (``gloo`` on CPU, ``nccl`` with one GPU per rank); ``on_report(rank, message)`` sees
    each ``ctx.report`` message as it arrives. ``prepare()`` (picklable) runs in each rank's process
    before its process group exists: imports that must precede the group go there (transformers'
    model modules imported after it keep the default group alive until interpreter shutdown, where
    destroying it aborts the process now and then: SIGABRT, "terminate called without an active
    exception", torch 2.13 with gloo).

    Raises:
        WorkerError: a worker raised, died (e.g. was killed) or the run passed ``timeout_s``;
            all other workers are stopped first.
    """
    if world_size < 1:
        raise WorkerError(f"--world-size must be >= 1, got {world_size}")
    if under_torchrun():
        rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if prepare is not None:
            prepare()
        dev = _init_group(rank, ws, device, timeout_s)
        try:
            return [fn(RankContext(rank, ws, dev, lambda m: on_report and on_report(rank, m)), *args)]
        finally:
            dist.destroy_process_group()
    pick_backend(device, world_size)  # fail before spawning anything
    if port:
        _check_port(port)
    else:
        port = free_port()
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, device, timeout_s, fn, args, messages, prepare),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                kind, rank, payload = messages.get(timeout=0.2)
            except queue.Empty:
                _raise_if_dead(procs, results)
                if time.monotonic() > deadline:
                    raise WorkerError(f"the run passed its {timeout_s:.0f} s limit; all workers were stopped")
                continue
            if kind == "error":
                # A peer killed mid-collective makes the others fail with connection errors:
                # give the dead one a moment to show up, and name it as the cause.
                for _ in range(10):
                    _raise_if_dead(procs, results, signals_only=True, consequence=f" (rank {rank} then failed)")
                    time.sleep(0.1)
                raise WorkerError(f"worker rank {rank} failed: {payload}")
            if kind == "report":
                if on_report is not None:
                    on_report(rank, payload)
            else:
                results[rank] = payload
    finally:
        _stop(procs)
    return [results[r] for r in range(world_size)]
