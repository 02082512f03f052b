"""Per-rank traces of one step: a Chrome trace per rank and a breakdown of where the step's time goes.

The breakdown reads the GPU kernels of the trace (``torch.profiler``): ``step_ms`` from the first
kernel's start to the last kernel's end; ``compute_ms``: time covered by non-NCCL kernels;
``nccl_ms``: time covered by NCCL kernels, which includes a receive's wait for its peer; ``wait_ms``:
NCCL time with no compute kernel running beside it (the rank blocked on a peer); ``idle_ms``: no
kernel at all (host-bound gaps). ``waits``: the three longest such waits, as (start offset ms, ms).
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["breakdown", "top_ops"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (disjoint, sorted) intervals ``a`` not covered by the disjoint sorted ``b``."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def breakdown(trace: dict) -> dict:
    """The breakdown (see the module docstring) of a Chrome trace's GPU kernels; times in ms."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    nccl = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    waits = _minus(nccl, compute)
    busy = _union(nccl + compute)
    longest = sorted(waits, key=lambda w: w[0] - w[1])[:3]
    return dict(step_ms=(end - start) / 1e3, compute_ms=_length(compute) / 1e3, nccl_ms=_length(nccl) / 1e3,
                wait_ms=_length(waits) / 1e3, idle_ms=(end - start - _length(busy)) / 1e3,
                waits=[(round((s - start) / 1e3, 3), round((e - s) / 1e3, 3)) for s, e in longest])


def trace_step(fn, path: str | Path) -> dict:
    """Run ``fn`` once under ``torch.profiler`` (CUDA activity), write the Chrome trace to ``path``
    and return its :func:`breakdown`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return breakdown(json.loads(path.read_text()))


def top_ops(fn, cuda: bool, rows: int = 12) -> str:
    """Run ``fn`` once under ``torch.profiler`` and describe it: its wall ms, the summed self time of its
    operations and kernels (device time where ``cuda``, else CPU time; nested ranges such as an autograd
    function and its kernels both count, so the sum can exceed the wall), and the top ``rows`` by self time."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) / 1e3
    lines = [f"wall {wall * 1e3:.1f} ms, summed self {'device' if cuda else 'CPU'} time {total:.1f} ms; top:"]
    for e in sorted(events, key=lambda e: -getattr(e, key))[:rows]:
        lines.append(f"  {getattr(e, key) / 1e3:9.2f} ms {e.count:6d}x  {e.key[:100]}")
    return "\n".join(lines)
