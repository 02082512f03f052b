"""Start, watch and stop the worker processes of a multi-rank run (``kdacp demo`` and friends).

Under ``torchrun`` the current process is one rank and nothing is spawned; a one-rank run also runs in
the calling process (no second interpreter to start and import into). Otherwise
:func:`launch` first checks that the machine can hold ``world_size`` workers (:func:`check_world_size`),
then spawns them, forwards their progress and results, and if one fails or dies, the run passes its
deadline (start-up included) or the launching process gets SIGINT, SIGTERM or SIGHUP, stops the others
within seconds and raises :class:`WorkerError` (:class:`Stopped` for a signal) naming the cause.
Workers watch their parent from the first line they run, before their imports: a launcher that is killed
outright leaves no worker behind, however long the workers take to start.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import resource_tracker, spawn

__all__ = ["WorkerRank", "WorkerError", "Stopped", "launch", "check_launch", "check_memory", "configure_logging",
           "deadline", "exit_cause", "free_port", "under_torchrun", "pick_backend"]

# CPU ranks (gloo, one thread each) allowed per core: past it each rank gets under an eighth of a core,
# and a run is better made smaller than left to crawl into its collectives' timeouts.
RANKS_PER_CORE = 8
# Resident memory of one CPU rank of the demo (the largest of kdacp's launched runs) at its peak, measured on
# the CI machine (2026-12-02, 2 ranks, default sizes): rank 1 840 MB, rank 0 (which also runs the reference)
# 1,020 MB; PSS 640 and 840 MB.
RANK_MEMORY_MB = 1000
# The signals that stop a run: Ctrl-C, kill, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What gloo's error says when a group's loopback connections fail while forming: launch starts the workers once more.
_GLOO_MESH_FAILED = "Gloo connectFullMesh failed"


class _Stderr(logging.Handler):
    """Writes each record to the ``sys.stderr`` of the moment (one replaced after the handler was made too)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's contract: a failed emit is reported, never raised
            self.handleError(record)


def configure_logging(level: int) -> None:
    """Set the ``kdacp`` logger (whose children every kdacp module logs to) to ``level`` and give it one
    stderr handler (however often called): the command line's ``-v``/``-q``, and each worker's, which
    :func:`launch` hands its launcher's level."""
    logger = logging.getLogger("kdacp")
    logger.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())


class WorkerError(RuntimeError):
    """A worker failed, died or timed out; the message says which rank and what to do."""


class Stopped(WorkerError):
    """The launching process got ``signum`` (SIGINT, SIGTERM or SIGHUP); every worker was stopped."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; every worker was stopped")


@dataclass(frozen=True)
class WorkerRank:
    """What a worker function receives: its rank, the world size, its device, and a ``report``
    callable that sends a picklable message to the launching process."""

    rank: int
    world_size: int
    device: torch.device
    report: Callable[[Any], None]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def free_port(exclude: int | None = None) -> int:
    """A TCP port free on 127.0.0.1 now, other than ``exclude``."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != exclude:
            return port


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
            raise WorkerError(f"--world-size {world_size} needs {world_size} GPUs for NCCL (one rank per GPU) but "
                              f"{n} are visible; lower --world-size or use --device cpu")
        return "nccl"
    if device != "cpu":
        raise WorkerError(f"--device must be 'cpu' or 'cuda', got {device!r}")
    return "gloo"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _available_mb() -> float:
    """Memory available to new processes (``MemAvailable``), in MB; ``inf`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def check_world_size(world_size: int, device: str) -> None:
    """Raise :class:`WorkerError` unless this machine can hold ``world_size`` workers on ``device``: on
    CUDA one GPU per rank; on CPU at most :data:`RANKS_PER_CORE` per core of this process's affinity and
    :data:`RANK_MEMORY_MB` each of the memory available now. The message names the limit."""
    if world_size < 1:
        raise WorkerError(f"--world-size must be >= 1, got {world_size}")
    if pick_backend(device, world_size) != "gloo":
        return
    cores, memory = _cores(), _available_mb()
    by_cores, by_memory = RANKS_PER_CORE * cores, int(memory // RANK_MEMORY_MB)
    if world_size > min(by_cores, by_memory):
        raise WorkerError(
            f"--world-size {world_size} is more than this machine holds: {cores} cores hold at most {by_cores} "
            f"CPU ranks ({RANKS_PER_CORE} per core) and {memory / 1024:.1f} GB of available memory at most "
            f"{by_memory} ({RANK_MEMORY_MB} MB per rank); lower --world-size to {min(by_cores, by_memory)} or less")


def check_memory(rank_bytes: float, world_size: int, device: str, sizes: str) -> None:
    """Raise :class:`WorkerError` unless the ranks of a ``world_size`` run on this machine (under torchrun its
    ``LOCAL_WORLD_SIZE``), each holding ``rank_bytes`` (a lower bound, from the run's sizes), fit on ``device``:
    on CUDA each rank's GPU (its total memory), on CPU the memory available now, less :data:`RANK_MEMORY_MB` a
    rank for the interpreter and its imports. ``sizes`` names the command line's arguments that set
    ``rank_bytes``; the message names them, the estimate and what is available."""
    gb = 2 ** 30
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if device == "cuda":
        gpus = range(min(here, torch.cuda.device_count()))
        available = min(torch.cuda.get_device_properties(i).total_memory for i in gpus) / gb
        need, where = rank_bytes / gb, "on each rank's GPU"
    else:
        available = (_available_mb() - here * RANK_MEMORY_MB) / 1024
        need, where = here * rank_bytes / gb, f"for {here} CPU ranks on this machine"
    if need > available:
        raise WorkerError(f"{sizes} need at least {need:,.1f} GB {where}, but {max(available, 0):,.1f} GB of memory "
                          "are available; lower them")


# Python that each spawned worker runs first, before multiprocessing's own start-up (which imports the launcher's
# main module, torch and kdacp: seconds, and tens of seconds on a loaded machine, all of it before _worker):
# from here on the kernel kills the worker when the launcher dies, whatever the worker is doing, and a
# launcher already gone ends it. {pid}: the launcher's.
_EARLY_WATCH = """\
import os
try:
    import ctypes; ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
if os.getppid() != {pid}:
    os._exit(1)
"""


@contextlib.contextmanager
def _workers_watch_from_their_start():
    """Inside the block, processes started by multiprocessing's ``spawn`` run :data:`_EARLY_WATCH` before
    anything else: an orphan lives no longer than its interpreter takes to start."""
    command_line = spawn.get_command_line

    def watched(**kwargs):
        cmd = command_line(**kwargs)
        if "-c" in cmd:  # absent in frozen executables
            i = cmd.index("-c") + 1
            cmd[i] = _EARLY_WATCH.format(pid=os.getpid()) + cmd[i]
        return cmd
    spawn.get_command_line = watched
    try:
        yield
    finally:
        spawn.get_command_line = command_line


def _watch_parent(parent_pid: int) -> None:
    """End this worker when the launching process ``parent_pid`` dies: at once through Linux's
    ``PR_SET_PDEATHSIG`` (SIGKILL; already set by :data:`_EARLY_WATCH` in a spawned worker, set here for one
    started otherwise), and by a poll of the parent's pid every second (other systems)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def poll():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)
    if os.getppid() != parent_pid:  # died before the watch was set
        os._exit(1)
    threading.Thread(target=poll, name="kdacp-watch-parent", daemon=True).start()


def _init_group(rank: int, world_size: int, device: str, timeout_s: float, init_method: str | None = None) -> torch.device:
    backend = pick_backend(device, world_size)
    dev = torch.device("cpu")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=dev if backend == "nccl" else None)
    return dev


def _worker(rank: int, world_size: int, port: int, device: str, timeout_s: float, fn, args, messages,
            prepare, parent_pid: int, log_level: int) -> None:
    _watch_parent(parent_pid)
    configure_logging(log_level)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if prepare is not None:
            prepare()
        try:
            dev = _init_group(rank, world_size, device, timeout_s)
        except RuntimeError as e:
            if _GLOO_MESH_FAILED not in str(e):
                raise
            messages.put(("group_failed", rank, f"{type(e).__name__}: {e}"))
            raise SystemExit(1) from None
        result = fn(WorkerRank(rank, world_size, dev, lambda m: messages.put(("report", rank, m))), *args)
        messages.put(("result", rank, result))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        messages.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        raise SystemExit(1)


@contextlib.contextmanager
def _stop_on_signals():
    """Inside the block (main thread only), SIGINT, SIGTERM and SIGHUP raise :class:`Stopped`; the first
    one received ignores the rest until the block has cleaned up; the former handlers are restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)
    former = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in former.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deadline(timeout_s: float):
    """Inside the block (main thread only; elsewhere no deadline), :class:`WorkerError` is raised once
    ``timeout_s`` seconds have passed (``SIGALRM``); the former timer and handler are restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def late(signum, frame):
        raise WorkerError(f"the run passed its {timeout_s:.0f} s limit and was stopped")
    former = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, former)


def _rank_here(fn: Callable, args: tuple, rank: int, world_size: int, device: str, timeout_s: float, on_report,
               prepare, init_method: str | None = None) -> list[Any]:
    """Rank ``rank`` of ``world_size`` in the calling process: ``prepare()``, the process group, ``[fn(...)]``;
    the group is destroyed at the end, also when an error, the deadline or a signal comes while it starts."""
    if prepare is not None:
        prepare()
    try:
        dev = _init_group(rank, world_size, device, timeout_s, init_method)
        return [fn(WorkerRank(rank, world_size, dev, lambda m: on_report and on_report(rank, m)), *args)]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_here(fn: Callable, args: tuple, device: str, port: int, timeout_s: float, on_report, prepare) -> list[Any]:
    """One rank in the calling process (no worker to start, no second round of imports), under the deadline
    and stop signals of :func:`launch`."""
    if dist.is_initialized():
        raise WorkerError("a one-rank run starts its own process group, but this process already has one; "
                          "call fn directly, or destroy the group first")
    with _stop_on_signals(), deadline(timeout_s):
        return _rank_here(fn, args, 0, 1, device, timeout_s, on_report, prepare,
                          init_method=f"tcp://127.0.0.1:{port or free_port()}")


@contextlib.contextmanager
def _terminal_signals_blocked():
    """Inside the block SIGINT and SIGHUP are blocked, a mask that processes started there inherit (and
    keep): Ctrl-C and a closed terminal reach the whole process group, and it is the launcher that stops
    its workers and multiprocessing's resource tracker, without tracebacks."""
    former = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, former)


def _start(process) -> None:
    with _terminal_signals_blocked(), _workers_watch_from_their_start():
        process.start()


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # a signal may have come before its start
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def exit_cause(code: int) -> str:
    """A process's end from its exit ``code`` (negative: the signal that killed it), in words; SIGKILL, which
    no worker sends itself, is most often the kernel's out-of-memory killer, and the words say so."""
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name
    return f"signal {name}, most often the out-of-memory killer" if -code == signal.SIGKILL else f"signal {name}"


def _raise_if_dead(procs, results, signals_only: bool = False, consequence: str = "") -> None:
    for r, p in enumerate(procs):
        code = p.exitcode
        if code is None or code == 0 or r in results or (signals_only and code > 0):
            continue
        raise WorkerError(f"worker rank {r} died ({exit_cause(code)}){consequence}; the other workers were stopped")


def _raise_if_exit_failed(procs, deadline: float, timeout_s: float) -> None:
    """After every result: wait (until ``deadline``) for the workers to exit, and raise if one did not exit
    cleanly (a crash in its process group's teardown or at interpreter exit still fails the run)."""
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            raise WorkerError(f"worker rank {r} returned its result but had not exited when the run passed its "
                              f"{timeout_s:.0f} s limit; all workers were stopped")
        if p.exitcode != 0:
            raise WorkerError(f"worker rank {r} died after returning its result ({exit_cause(p.exitcode)})")


def check_launch(world_size: int, device: str, port: int = 0) -> None:
    """Raise :class:`WorkerError` for what :func:`launch` would refuse before starting anything: a world size
    below 1 or one this machine cannot hold (:func:`check_world_size`; under torchrun, its own), a device
    without a GPU, a ``port`` in use."""
    if world_size < 1:
        raise WorkerError(f"--world-size must be >= 1, got {world_size}")
    if under_torchrun() or world_size == 1:
        pick_backend(device, world_size)
    else:
        check_world_size(world_size, device)
    if port and not under_torchrun():
        _check_port(port)


def launch(fn: Callable, world_size: int, args: tuple = (), *, device: str = "cpu", port: int = 0,
           timeout_s: float = 600.0, on_report: Callable[[int, Any], None] | None = None,
           prepare: Callable[[], Any] | None = None) -> list[Any]:
    """Run ``fn(worker: WorkerRank, *args)`` on ``world_size`` ranks and return their results by rank.

    Under torchrun, runs this process's rank only and returns ``[result]``; ``world_size == 1`` runs in
    this process too (its process group of one rank is destroyed at the end). Otherwise checks the world
    size (:func:`check_world_size`) and spawns the ranks (``gloo`` on CPU, ``nccl`` with one GPU per
    rank; each logs through the ``kdacp`` logger at this process's level, :func:`configure_logging`);
    ``on_report(rank, message)`` sees each ``worker.report`` message as it arrives. ``timeout_s``
    counts from the call: starting the workers, the run, and their exit. ``prepare()`` (picklable) runs in
    each rank's process before its process group exists: imports that must precede the group go there
    (transformers' model modules imported after it keep the default group alive until interpreter
    shutdown, where destroying it aborts the process now and then: SIGABRT, "terminate called without an
    active exception", torch 2.13 with gloo).

    Raises:
        WorkerError: the machine cannot hold ``world_size`` workers (before any starts); a worker raised,
            died (e.g. was killed, also after returning its result) or the run passed ``timeout_s``; a gloo
            group failed to connect twice (on a port left to kdacp, a first failure starts the workers once more
            on another, said at INFO; never once ``fn`` has run).
        Stopped: the launching process got SIGINT, SIGTERM or SIGHUP.
        In every case all workers are stopped first.
    """
    check_launch(world_size, device, port)  # fail before spawning anything
    if under_torchrun():
        return _rank_here(fn, args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, timeout_s,
                          on_report, prepare)
    if world_size == 1:
        return _run_here(fn, args, device, port, timeout_s, on_report, prepare)
    deadline = time.monotonic() + timeout_s
    tried = None
    while True:
        try:
            return _spawn(fn, world_size, args, device, port or free_port(exclude=tried), deadline, timeout_s,
                          on_report, prepare)
        except _GroupNotFormed as e:
            if port or tried is not None:  # a port the caller chose, or the second time
                raise WorkerError(str(e)) from None
            tried = e.port
            logging.getLogger("kdacp").info("%s; starting the workers again on another port", e)


class _GroupNotFormed(WorkerError):
    """A rank's gloo group failed to connect its full mesh before anything ran: on one machine a passing
    failure of the loopback connections (gloo's own tests see it too), worth one more start on a new port."""

    def __init__(self, message: str, port: int):
        super().__init__(message)
        self.port = port


def _spawn(fn, world_size, args, device, port, deadline, timeout_s, on_report, prepare) -> list[Any]:
    """One start of :func:`launch`'s workers on ``port``, the run, and their stop (see :func:`launch`).

    Raises:
        _GroupNotFormed: a rank's group failed to connect (all workers stopped; nothing of ``fn`` ran).
    """
    ctx = mp.get_context("spawn")
    results: dict[int, Any] = {}
    started: list = []
    late = WorkerError(f"the run passed its {timeout_s:.0f} s limit; all workers were stopped")
    with _stop_on_signals():
        try:
            with _terminal_signals_blocked():
                resource_tracker.ensure_running()  # the queue's semaphores start it otherwise
            messages = ctx.Queue()
            for r in range(world_size):
                if time.monotonic() > deadline:
                    raise WorkerError(f"the run passed its {timeout_s:.0f} s limit while starting its workers "
                                      f"({r} of {world_size} started); all were stopped")
                started.append(ctx.Process(target=_worker, daemon=True, args=(
                    r, world_size, port, device, timeout_s, fn, args, messages, prepare, os.getpid(),
                    logging.getLogger("kdacp").getEffectiveLevel())))
                _start(started[-1])
            while len(results) < world_size:
                try:
                    kind, rank, payload = messages.get(timeout=0.2)
                except queue.Empty:
                    _raise_if_dead(started, results)
                    if time.monotonic() > deadline:
                        raise late from None
                    continue
                if kind == "group_failed":
                    raise _GroupNotFormed(f"worker rank {rank}'s process group did not form: {payload}", port)
                if kind == "error":
                    # A peer killed mid-collective makes the others fail with connection errors:
                    # give the dead one a moment to show up, and name it as the cause.
                    for _ in range(10):
                        _raise_if_dead(started, results, signals_only=True,
                                       consequence=f" (rank {rank} then failed)")
                        time.sleep(0.1)
                    raise WorkerError(f"worker rank {rank} failed: {payload}")
                if kind == "report":
                    if on_report is not None:
                        on_report(rank, payload)
                else:
                    results[rank] = payload
            _raise_if_exit_failed(started, deadline, timeout_s)
        finally:
            _stop(started)
    return [results[r] for r in range(world_size)]
