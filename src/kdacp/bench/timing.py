"""Timing shared by the suites and the scripts of ``benchmarks/``, on the device clock (:class:`Clock`: CUDA
events on a GPU, the wall clock on the CPU): contenders round-robin in one run, the slowest rank's figure (or one
process's, without a group); the mean of calls queued back to back (:func:`time_round_robin`, behind a device
sleep with the queued-ahead check: :func:`sleep_then_mark`, :func:`check_queued_ahead`) or the median of single
calls each started on an idle device (:func:`median_times`); and where the host limits a call, the host's time
per call beside the wall time of calls back to back (:func:`host_and_wall_times`), and a call captured in a CUDA
graph to replay without the host (:func:`capture`)."""
from __future__ import annotations

import statistics
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["Clock", "sync"]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queue (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Time stamps on ``device``'s clock: CUDA timing events recorded in stream order on a GPU (what lies
    between two stamps is device time, however far the host has run ahead), the wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def stamp(self):
        """A stamp at this point of the device's queue (the host's time on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Seconds from stamp ``start`` to stamp ``end`` (on a GPU, waits for the device to reach ``end``)."""
        if not self.cuda:
            return end - start
        sync(self.device)
        return start.elapsed_time(end) / 1e3


def sleep_then_mark(ms: float) -> torch.cuda.Event:
    """Queue a device sleep of about ``ms`` milliseconds on the current stream and return a timing event
    recorded after it: work the host queues next runs behind the sleep, so events around it time the
    device alone. ``mark.query()`` turning true before the host has queued that work means the device
    caught up (a host sync, or a sleep shorter than the host's time). ``ms <= 0``: the event alone."""
    if ms > 0:
        torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def check_queued_ahead(mark: torch.cuda.Event, ahead_ms: float, what: str) -> None:
    """Call right after queueing the work timed behind ``mark = sleep_then_mark(ahead_ms)``.

    Raises:
        RuntimeError: naming ``what``, if the device already reached ``mark`` (``ahead_ms > 0``): it started
            the work before the host had queued it all (a host sync inside it, or more host time than the
            sleep), so the events around it would count host time.
    """
    if ahead_ms > 0 and mark.query():
        raise RuntimeError(f"{what}: the device started it before the host had queued it (a host sync inside it, "
                           f"or more host time than the {ahead_ms:.1f} ms sleep); its time would include the host's")


def queue_ahead_for(fns, iters: int, device: torch.device) -> float:
    """The sleep (ms) under which the host queues ``iters`` calls of the slowest of ``fns`` (callables)
    before the device starts them: four times that many calls' wall time, each timed once between
    device syncs (so call it warm), at most 2 s; 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    walls = []
    for fn in fns:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    return min(4e3 * iters * max(walls), 2000.0)


def time_queued(fns: dict, warmup: int, rounds: int, iters: int, device: torch.device) -> dict:
    """:func:`time_round_robin` of this process alone, each contender's calls queued behind a device
    sleep (:func:`queue_ahead_for`, sized after the warm-up): device time per call on a GPU, however slow
    the host (wall clock on the CPU)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    return time_round_robin(fns, 0, rounds, iters, None, device, queue_ahead_ms=queue_ahead_for(fns.values(), iters,
                                                                                                 device))


def time_round_robin(fns: dict, warmup: int, rounds: int, iters: int, group, device: torch.device,
                     queue_ahead_ms: float = 0.0) -> dict:
    """Milliseconds per call of each of ``fns`` (name -> callable), the slowest rank's of ``group``
    (``None``: this process alone, no collective).

    After ``warmup`` calls of each, ``rounds`` times: each contender in turn runs ``iters`` calls
    back to back (a warm queue), timed by CUDA events (wall clock on CPU) after a barrier, so a
    context-parallel contender never waits for a peer still busy with the previous contender.
    ``queue_ahead_ms`` > 0 (CUDA): the device first sleeps that long, so the host queues the calls ahead
    of it and the events time the device alone (for calls shorter than their host-side launch cost);
    ``RuntimeError`` if the device started them before the host had queued them all (the time would
    include the host's)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock = Clock(device)
    total = dict.fromkeys(fns, 0.0)
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            if group is not None:
                dist.barrier(group)
            start = sleep_then_mark(queue_ahead_ms) if clock.cuda else clock.stamp()
            for _ in range(iters):
                fn()
            if clock.cuda:
                check_queued_ahead(start, queue_ahead_ms, f"time_round_robin, {iters} calls of {name!r}")
            total[name] += clock.seconds(start, clock.stamp()) * 1e3
    ms = {n: total[n] / (rounds * iters) for n in fns}
    if group is None:
        return ms
    slowest = torch.tensor(list(ms.values()), dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(fns, slowest.tolist()))


def median_times(fns: dict, device: torch.device, rounds: int, warmup: int = 1, group=None) -> dict:
    """Median seconds of one call of each of ``fns`` (name -> callable) over ``rounds`` rounds, after ``warmup``
    calls of each. The contenders take turns within each round, so that a machine whose load changes slows
    them alike; each call starts on an idle device (a sync, then a barrier of ``group`` where given) and is
    timed on the device clock (:class:`Clock`). With ``group`` each call counts as its slowest rank's time
    (every rank gets the same figures): a median, not a mean, because on a shared CPU a few calls take
    several times the others."""
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock = Clock(device)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            if group is not None:
                dist.barrier(group)
            start = clock.stamp()
            fn()
            times[name].append(clock.seconds(start, clock.stamp()))
    if group is not None:
        table = torch.tensor([times[n] for n in fns], dtype=torch.float64, device=device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        times = dict(zip(fns, table.tolist()))
    return {name: statistics.median(times[name]) for name in fns}


def median_time(fn, device: torch.device, iters: int, warmup: int = 1, group=None) -> float:
    """:func:`median_times` of ``fn`` alone: the median seconds of one call over ``iters`` calls."""
    return median_times({"fn": fn}, device, iters, warmup, group)["fn"]


def queued_device_time(fn, iters: int = 100, warmup: int = 3) -> tuple[float, float]:
    """``(device seconds, host seconds)`` per call of ``fn`` on the current CUDA device, as it costs
    when the host runs ahead of a busy device: the calls are queued behind a sleep kernel, so the
    events around them time only the device's execution (and the gaps between its kernels), and the
    host's enqueue time is taken apart. Keep ``iters`` times the kernels per call under the device's
    launch queue (about 1,000 kernels): past it the host waits for the queue. Raises ``RuntimeError`` if
    the sleep ended before the host had queued every call (the figure would then include host time)."""
    for _ in range(warmup):
        fn()
    clock = Clock(torch.device("cuda", torch.cuda.current_device()))
    ahead_ms = queue_ahead_for([fn], iters, clock.device)
    start = sleep_then_mark(ahead_ms)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    check_queued_ahead(start, ahead_ms, f"queued_device_time, {iters} calls")
    return clock.seconds(start, clock.stamp()) / iters, host


def host_and_wall_times(fn, iters: int, device: torch.device) -> tuple[float, float]:
    """``(host seconds, wall seconds)`` per call of ``iters`` calls of ``fn`` back to back, started on an idle
    ``device``: the host's time from each call until it returns (its queue not awaited), and the wall time until
    the device has run them all. Where the host limits a call the two agree; where the device does, the wall
    time is the device's."""
    sync(device)
    host, start = 0.0, time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    sync(device)
    return host / iters, (time.perf_counter() - start) / iters


def capture(fn, warmup: int = 3):
    """``(graph, static outputs)`` of ``fn()`` captured in a CUDA graph after ``warmup`` eager calls on a side
    stream (FLA's autotuning and kdacp's per-batch context are built there, before the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def timed_columns(fns: dict, names, base: str, warmup: int, rounds: int, iters: int, group,
                  device: torch.device, on_failure, queued: bool = False) -> dict:
    """``<name>_ms`` and ``<name>_ratio`` (over ``base``'s time) for every name of ``names``, timed by
    :func:`time_round_robin` (NaN for a name not in ``fns``). ``queued``: this process alone (``group`` must
    be None), timed by :func:`time_queued` (device time however slow the host), in columns
    ``<name>_device_ms`` and ``<name>_device_ratio``. When timing raises, ``on_failure(traceback text)`` is
    called and every time is NaN: one failing case must not lose the others' figures."""
    if queued and group is not None:
        raise ValueError("queued timing runs in this process alone: pass group=None")
    try:
        ms = (time_queued(fns, warmup, rounds, iters, device) if queued
              else time_round_robin(fns, warmup, rounds, iters, group, device))
    except Exception:  # noqa: BLE001 - reported through on_failure
        on_failure(traceback.format_exc())
        ms = {}
    tag = "_device" if queued else ""
    columns = {f"{name}{tag}_ms": ms.get(name, float("nan")) for name in names}
    columns.update({f"{name}{tag}_ratio": columns[f"{name}{tag}_ms"] / columns[f"{base}{tag}_ms"] for name in names})
    return columns


def peak_gb(fn, group, device: torch.device) -> float:
    """Peak allocated GiB during one call, the largest over ranks (0 on CPU)."""
    if device.type != "cuda":
        return 0.0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak.item()
