#!/usr/bin/env python
"""Where does kdacp's Gated DeltaNet forward lose time against FLA's own op on one GPU?

Contenders, on the same inputs (FLA's argument names) and the same FLA kernels:

- ``fla``:   ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (through kdacp's ``load_fla()``, so both
  run under the same ``FLA_CONFIG_DIR``/``FLA_CACHE_MODE``: kdacp sets them before FLA is imported);
- ``kdacp``: ``kdacp.chunk_gated_delta_rule(..., backend="fla")``.

Qwen3-Next shapes as ``kdacp.bench.gdn`` (B=1, 16 q/k heads, 32 value heads, K=V=128, bf16, 16K tokens,
``use_qk_l2norm_in_kernel=True``); inputs from ``kdacp.bench.inputs.random_inputs``. By default ``g [1, T, HV]``
is a natural-log decay (``kdacp.reference.gdn.gdn_gate`` of the bench's logits); ``--gate-in-kernel``
runs the bench's own options instead (raw logits, ``A_log``, ``dt_bias``). Cases (``--cases``):

- ``one_sequence``: one sequence of T tokens;
- ``docs7``: the packed batch of ``kdacp.bench.batches.document_lengths("docs7", T)`` (as the gdn suite:
  ``cu_seqlens`` on the device and ``cu_seqlens_cpu`` on the host, one tensor each, reused every call);
- ``docs7_nocpu``: the same batch with ``cu_seqlens`` on the device only (what a caller who does not
  know about ``cu_seqlens_cpu`` passes): shows host syncs that reading the boundaries back costs.

Each case runs twice: under ``torch.no_grad()`` (``no_grad``) and with ``requires_grad`` leaves and grad
enabled (``train_fwd``: the forward of a training step, which saves for backward; on Hopper with
Triton < 3.7.1 kdacp then runs FLA's *KDA* kernels on the broadcast gate, see
``kdacp.backends.call.prepare_call``; the report prints which backend class kdacp picked).

Per case and mode it measures:

1. device time, warm, CUDA events, contenders alternating call by call (median of ``--iters``):
   ``isolated`` (GPU idle before the call: latency of one call, host work before the first launch
   included), ``queued`` (``--queue`` calls back to back per event pair, as ``kdacp bench --suite gdn``
   times: throughput once the host runs ahead, or not) and ``device_only`` (the call enqueued behind a
   GPU sleep, the start event after the sleep: only the call's own GPU work, back to back, no host gaps);
2. host time of the Python call alone (wall time until it returns, measured while the GPU is kept busy;
   see :func:`time_behind_busy_gpu` for why that is sound) and whether the call waited for the GPU;
3. ``torch.profiler`` (CPU + CUDA, ``with_stack=False``) over ``--profile-calls`` calls of each: the GPU
   kernels (and memcpy/memset) each launches per call with device times, kernels kdacp runs that FLA
   does not (by name), CUDA runtime/driver API calls per call (cudaStreamSynchronize, cudaMemcpy*, DtoH
   copies, cudaHostAlloc, launches), and the top host-side ops by self CPU time; then ``cProfile`` over
   ``--cprofile-calls`` kdacp calls (``torch.cuda.synchronize()`` after), top 25 by cumulative time
   restricted to kdacp's own files, and the top 15 functions anywhere by own time.

Writes under ``--out``: ``report.txt`` (everything printed), ``summary.json``, a Chrome trace per case,
mode and contender (``trace_<case>_<mode>_<contender>.json``, open in chrome://tracing or Perfetto) and
the cProfile dumps (``cprofile_<case>_<mode>.pstats``). The summary table is printed last.

    python benchmarks/gdn_forward_profile.py --out /tmp/gdn_profile
    python benchmarks/gdn_forward_profile.py --out DIR --cases docs7 --modes no_grad --iters 100

Needs a CUDA GPU and fla-core 0.6.0 (as ``kdacp[fla]``); first calls compile FLA's kernels (and
autotune any shape without a shipped configuration), which the warm-up absorbs.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

CASES = ("one_sequence", "docs7", "docs7_nocpu")
MODES = ("no_grad", "train_fwd")
CONTENDERS = ("fla", "kdacp")
CALL_PREFIX = "gdn_call::"  # record_function name of one profiled call: CALL_PREFIX + contender

# Kineto Chrome-trace categories
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


# --------------------------------------------------------------------------------------------------------------
# arguments, output


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for report.txt, summary.json, traces")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES} (default all)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES} (default both)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens T (default 16384)")
    p.add_argument("--heads", type=int, default=16, help="q/k heads H (default 16)")
    p.add_argument("--v-heads", type=int, default=32, help="value heads HV (default 32)")
    p.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate-in-kernel", action="store_true",
                   help="raw gate logits with A_log/dt_bias, as kdacp.bench.gdn.OPTIONS (default: log-decay g)")
    p.add_argument("--output-final-state", action="store_true", help="also return the final states")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls of each contender first (default 5)")
    p.add_argument("--iters", type=int, default=50, help="timed samples per contender (default 50)")
    p.add_argument("--queue", type=int, default=5, help="calls per event pair in the queued timing (default 5, "
                                                         "as the gdn suite)")
    p.add_argument("--queue-rounds", type=int, default=20, help="samples of the queued timing (default 20)")
    p.add_argument("--sleep-ms", type=float, default=20.0,
                   help="GPU sleep that each busy-GPU sample is queued behind (default 20 ms)")
    p.add_argument("--profile-calls", type=int, default=5, help="calls of each under torch.profiler (default 5)")
    p.add_argument("--cprofile-calls", type=int, default=20, help="kdacp calls under cProfile (default 20)")
    args = p.parse_args(argv)
    args.cases = _choices(p, "--cases", args.cases, CASES)
    args.modes = _choices(p, "--modes", args.modes, MODES)
    for name in ("iters", "queue", "queue_rounds", "profile_calls", "cprofile_calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads < 1 or args.v_heads % args.heads:
        p.error("--v-heads must be a multiple of --heads")
    return args


def _choices(parser, flag, text, allowed) -> list:
    picked = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in picked if c not in allowed]
    if bad or not picked:
        parser.error(f"{flag}: expected a comma-separated subset of {allowed}, got {text!r}")
    return picked


class Report:
    """Prints and keeps every line for ``report.txt``."""

    def __init__(self, path: Path):
        self.file = open(path, "w")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def log(message: str) -> None:
    """Progress on stderr (not in the report): first calls compile FLA's kernels, which can take minutes."""
    print(f"[gdn_forward_profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _median(xs) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _fmt(x, digits=3) -> str:
    if isinstance(x, float):
        return "nan" if x != x else f"{x:.{digits}f}"
    return str(x)


def table(rows: list[dict], columns: list[str]) -> str:
    """A plain text table of ``rows`` (dicts) in ``columns`` order."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def short(name: str, n: int = 110) -> str:
    """A kernel name cut to ``n`` characters (ATen template names run to hundreds)."""
    name = " ".join(name.split())
    return name if len(name) <= n else name[: n - 3] + "..."


# --------------------------------------------------------------------------------------------------------------
# the Chrome trace: per-call GPU work and API calls (pure functions of the trace, testable without a GPU)


def _call_windows(events: list, call_name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "user_annotation" and e.get("name") == call_name and "dur" in e)


def _window_of(ts: float, windows) -> int | None:
    for i, (s, e) in enumerate(windows):
        if s <= ts <= e:
            return i
    return None


def per_call_activity(trace: dict, call_name: str) -> list[dict]:
    """For each profiled call (``record_function(call_name)`` range, in order): ``host_us`` (the range),
    ``api`` (Counter of CUDA runtime/driver API names called inside it), ``launches``, ``first_launch_us``
    (host time from the call's start to its first kernel launch), ``gpu`` (the GPU kernels, memcpys and
    memsets it caused, in start order: dicts ``name, cat, ts, dur``), ``gpu_busy_us`` (their summed
    durations) and ``gpu_span_us`` (first start to last end).

    GPU work is tied to its call through the launching API call's correlation id; work whose launch is
    not in the trace falls back to the call whose range (up to the next call's start) holds its start,
    which is sound here because the profiled calls are separated by ``torch.cuda.synchronize()``.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    windows = _call_windows(events, call_name)
    calls = [dict(host_us=e - s, api=Counter(), launches=0, first_launch_us=float("nan"), gpu=[])
             for s, e in windows]
    if not calls:
        return []
    launch_of: dict = {}  # correlation id -> call index
    for e in sorted((e for e in events if e.get("cat") in API_CATS), key=lambda e: e["ts"]):
        i = _window_of(e["ts"], windows)
        if i is None:
            continue
        name = e.get("name", "?")
        calls[i]["api"][name] += 1
        if "LaunchKernel" in name or "cuLaunch" in name:
            calls[i]["launches"] += 1
            if calls[i]["first_launch_us"] != calls[i]["first_launch_us"]:
                calls[i]["first_launch_us"] = e["ts"] - windows[i][0]
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launch_of[corr] = i
    open_windows = [(s, windows[i + 1][0] if i + 1 < len(windows) else float("inf")) for i, (s, _) in enumerate(windows)]
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        corr = (e.get("args") or {}).get("correlation")
        i = launch_of.get(corr) if corr is not None else None
        if i is None:
            i = next((j for j, (s, nxt) in enumerate(open_windows) if s <= e["ts"] < nxt), None)
        if i is not None:
            calls[i]["gpu"].append(dict(name=e.get("name", "?"), cat=e["cat"], ts=e["ts"], dur=e.get("dur", 0.0)))
    for c in calls:
        c["gpu"].sort(key=lambda g: g["ts"])
        c["gpu_busy_us"] = sum(g["dur"] for g in c["gpu"])
        c["gpu_span_us"] = (max(g["ts"] + g["dur"] for g in c["gpu"]) - c["gpu"][0]["ts"]) if c["gpu"] else 0.0
    return calls


SYNC_APIS = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpy(DtoH|HtoD)(_v2)?$|^cudaFreeHost$|^cudaHostAlloc$|"
                       r"^cudaMallocHost$|^cudaMalloc$|^cudaFree$")


def summarize_calls(calls: list[dict]) -> dict:
    """Per-call means over the profiled calls of :func:`per_call_activity` and the GPU work by name."""
    n = max(len(calls), 1)
    api = Counter()
    for c in calls:
        api.update(c["api"])
    by_name: dict = defaultdict(lambda: dict(count=0, us=0.0, cat=""))
    for c in calls:
        for g in c["gpu"]:
            k = by_name[g["name"]]
            k["count"] += 1
            k["us"] += g["dur"]
            k["cat"] = g["cat"]
    memcpy = Counter()
    for c in calls:
        for g in c["gpu"]:
            if g["cat"] == "gpu_memcpy":
                memcpy[g["name"]] += 1
    dtoh = sum(v for k, v in memcpy.items() if "DtoH" in k or "Device -> Pageable" in k or "Device -> Pinned" in k)
    syncs = sum(v for k, v in api.items() if "Synchronize" in k)
    return dict(
        calls=len(calls),
        host_ms=_median([c["host_us"] for c in calls]) / 1e3,
        first_launch_ms=_median([c["first_launch_us"] for c in calls]) / 1e3,
        gpu_busy_ms=_median([c["gpu_busy_us"] for c in calls]) / 1e3,
        gpu_span_ms=_median([c["gpu_span_us"] for c in calls]) / 1e3,
        launches=sum(c["launches"] for c in calls) / n,
        gpu_ops=sum(len(c["gpu"]) for c in calls) / n,
        kernels=sum(1 for c in calls for g in c["gpu"] if g["cat"] == "kernel") / n,
        syncs=syncs / n,
        dtoh=dtoh / n,
        api={k: v / n for k, v in sorted(api.items(), key=lambda kv: -kv[1])},
        sync_like={k: v / n for k, v in api.items() if SYNC_APIS.search(k)},
        memcpy={k: v / n for k, v in memcpy.items()},
        by_name={k: dict(per_call=v["count"] / n, mean_us=v["us"] / max(v["count"], 1), us_per_call=v["us"] / n,
                         cat=v["cat"]) for k, v in by_name.items()},
    )


def kernel_diff(fla: dict, kdacp: dict) -> list[dict]:
    """GPU ops (by name) whose count per call differs between the two summaries: kdacp's extras first."""
    rows = []
    for name in sorted(set(fla["by_name"]) | set(kdacp["by_name"])):
        a, b = fla["by_name"].get(name), kdacp["by_name"].get(name)
        na, nb = (a or {}).get("per_call", 0.0), (b or {}).get("per_call", 0.0)
        if abs(na - nb) > 1e-9:
            rows.append(dict(op=short(name, 90), fla_per_call=na, kdacp_per_call=nb,
                             kdacp_us_per_call=(b or {}).get("us_per_call", 0.0),
                             fla_us_per_call=(a or {}).get("us_per_call", 0.0)))
    return sorted(rows, key=lambda r: r["fla_per_call"] - r["kdacp_per_call"])


# --------------------------------------------------------------------------------------------------------------
# timing (CUDA)


def _events(torch, n):
    return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]


def _order(names, i):
    """Alternate which contender goes first, so neither always follows the other."""
    return names if i % 2 == 0 else names[::-1]


def time_isolated(torch, fns: dict, iters: int) -> dict:
    """Per contender: ``device_ms`` (CUDA events around one call, the GPU idle before it: the call's
    latency, host work before its first launch included) and ``host_idle_ms`` (wall time of the call
    returning, the GPU idle at its start: includes any wait for the GPU inside the call, but only for
    the call's own earlier kernels), median of ``iters``; contenders alternate call by call."""
    names = list(fns)
    dev, host = defaultdict(list), defaultdict(list)
    for i in range(iters):
        for name in _order(names, i):
            (start, end), = _events(torch, 1)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            out = fns[name]()
            t1 = time.perf_counter()
            end.record()
            del out
            end.synchronize()
            dev[name].append(start.elapsed_time(end))
            host[name].append((t1 - t0) * 1e3)
    return {n: dict(isolated_ms=_median(dev[n]), isolated_min_ms=min(dev[n]), host_idle_ms=_median(host[n]))
            for n in names}


def time_queued(torch, fns: dict, rounds: int, queue: int) -> dict:
    """Per contender: ``queued_ms``, the CUDA-event time of ``queue`` calls back to back divided by
    ``queue`` (median of ``rounds``; how ``kdacp bench --suite gdn`` times, there with 3 rounds of 5).
    Once the host runs ahead of the GPU this is the GPU's time per call; when the host is slower (or a
    call syncs) it is the host's. Note: FLA memoises ``prepare_chunk_offsets`` on the identity of
    ``cu_seqlens`` in a 4-entry cache (``FLA_TENSOR_CACHE_SIZE``). Before 0859fa2 kdacp handed FLA a fresh
    ``cu_seqlens`` tensor every call, so 4 or more kdacp calls in a row evicted FLA's entry and FLA's next
    call recomputed it (a few tiny kernels); kdacp now passes the same tensor per batch, which shares
    FLA's entry."""
    names = list(fns)
    ms = defaultdict(list)
    for r in range(rounds):
        for name in _order(names, r):
            (start, end), = _events(torch, 1)
            torch.cuda.synchronize()
            start.record()
            for _ in range(queue):
                fns[name]()
            end.record()
            end.synchronize()
            ms[name].append(start.elapsed_time(end) / queue)
    return {n: dict(queued_ms=_median(ms[n])) for n in names}


def sleep_cycles(torch, ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds on this GPU (measured)."""
    probe = 10_000_000
    (start, end), = _events(torch, 1)
    for _ in range(2):  # the first one also pays for the clock ramp
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    per_cycle_ms = start.elapsed_time(end) / probe
    return max(1, int(ms / per_cycle_ms))


def time_behind_busy_gpu(torch, fns: dict, iters: int, cycles: int) -> dict:
    """Host time alone, device time alone, and whether a call waits for the GPU.

    Each sample: sync; enqueue a GPU sleep (``--sleep-ms``, far longer than a call's host work); record
    the start event; call; record the end event. While the GPU sleeps, every launch of the call only
    enqueues work and returns, so the wall time of the call returning is its host work alone (Python,
    validation, argument preparation, launch overhead) and nothing of the GPU's. This is sound where
    "many calls without a sync" is not: there, once the host is ahead the launch queue and the caching
    allocator make it wait for the GPU, and a hidden sync makes each call wait for all earlier ones.
    A call that does wait for the GPU (``.item()``, ``.tolist()`` / ``.cpu()`` of a CUDA tensor, a copy
    from pageable memory, ``cudaFreeHost``) is caught: the GPU has passed the start event (after the
    sleep) by the time the call returns, so ``blocked`` counts the samples where ``start.query()`` is
    already true; its host time then includes the sleep, and the isolated ``host_idle_ms`` is the
    better host figure. The start event runs when the sleep ends, by when the whole call is queued, so
    end - start is the call's GPU work back to back, with no host gaps (``device_only_ms``, over the
    unblocked samples only)."""
    names = list(fns)
    host, dev, blocked = defaultdict(list), defaultdict(list), Counter()
    for i in range(iters):
        for name in _order(names, i):
            (start, end), = _events(torch, 1)
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            start.record()
            t0 = time.perf_counter()
            out = fns[name]()
            t1 = time.perf_counter()
            end.record()
            waited = start.query()
            del out
            end.synchronize()
            host[name].append((t1 - t0) * 1e3)
            if waited:
                blocked[name] += 1
            else:
                dev[name].append(start.elapsed_time(end))
    return {n: dict(host_busy_ms=_median(host[n]), device_only_ms=_median(dev[n]), blocked=blocked[n], samples=iters)
            for n in names}


# --------------------------------------------------------------------------------------------------------------
# profilers


def run_torch_profiler(torch, fn, name: str, calls: int, trace_path: Path):
    """``calls`` calls of ``fn`` under torch.profiler (CPU + CUDA, no stacks), each in a
    ``record_function(CALL_PREFIX + name)`` range and followed by a sync outside it; returns the
    profiler and the exported Chrome trace (parsed)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False,
                 record_shapes=False) as prof:
        for _ in range(calls):
            with record_function(CALL_PREFIX + name):
                out = fn()
            del out
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    return prof, json.loads(trace_path.read_text())


def annotation_self_ms(prof, name: str, calls: int) -> float:
    """Self CPU time per call of the call's ``record_function`` range: host time spent in Python, outside
    every op and API call the profiler records."""
    for e in prof.key_averages():
        if e.key == CALL_PREFIX + name:
            return getattr(e, "self_cpu_time_total", float("nan")) / 1e3 / calls
    return float("nan")


def host_op_table(prof, calls: int, rows: int = 25) -> str:
    text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70)
    return f"(totals over {calls} calls; with_stack=False, so Python frames are not split out: the " \
           f"{CALL_PREFIX}<name> row's self time is Python outside every recorded op, an autograd Function " \
           f"row's (ChunkKDAFunction, ChunkGatedDeltaRuleFunction) Python inside its forward)\n{text}"


def run_cprofile(torch, fn, calls: int, kdacp_dir: str, dump: Path) -> str:
    """cProfile over ``calls`` calls of ``fn`` and one ``torch.cuda.synchronize()`` after: the top 25 by
    cumulative time in kdacp's own files (``kdacp_dir``), then the top 15 anywhere by own time; times in
    microseconds per profiled call (cProfile's own overhead inflates them, evenly)."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        out = fn()
        del out
    torch.cuda.synchronize()
    prof.disable()
    prof.dump_stats(str(dump))
    return cprofile_tables(pstats.Stats(prof), calls, kdacp_dir)


def cprofile_tables(stats: pstats.Stats, calls: int, kdacp_dir: str, top: int = 25, anywhere: int = 15) -> str:
    """The two tables of :func:`run_cprofile` from ``stats``."""
    root = os.path.join(os.path.abspath(kdacp_dir), "")
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        mine = os.path.abspath(path).startswith(root) if not path.startswith("~") else False
        where = f"{os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))}:{line}({func})" if mine else \
            (f"{path}:{line}({func})" if not path.startswith("~") else func)
        rows.append(dict(mine=mine, ncalls_per_call=ncalls / calls, own_us_per_call=tottime * 1e6 / calls,
                         cum_us_per_call=cumtime * 1e6 / calls, function=short(where, 120)))
    cols = ["ncalls_per_call", "own_us_per_call", "cum_us_per_call", "function"]
    ours = sorted((r for r in rows if r["mine"]), key=lambda r: -r["cum_us_per_call"])[:top]
    every = sorted(rows, key=lambda r: -r["own_us_per_call"])[:anywhere]
    total = sum(r["own_us_per_call"] for r in rows)
    return (f"(per call: {total:.1f} us under cProfile in all, over {calls} calls and the sync after them)\n"
            f"top {top} by cumulative time, kdacp's own files ({kdacp_dir}):\n{table(ours, cols)}\n"
            f"top {anywhere} anywhere by own time:\n{table(every, cols)}")


# --------------------------------------------------------------------------------------------------------------
# the cases


def build_case(torch, case: str, args) -> tuple[dict, dict, dict, tuple]:
    """``(tensors, options, varlen, lengths)``: the inputs as ``requires_grad`` leaves (FLA's names),
    the op options both contenders get, the packed-sequence arguments and the document lengths."""
    from kdacp.bench.batches import cu_seqlens_of, document_lengths
    from kdacp.bench.gdn import OPTIONS as BENCH_OPTIONS
    from kdacp.bench.inputs import random_inputs
    from kdacp.reference.gdn import gdn_gate

    lengths = document_lengths("one_sequence" if case == "one_sequence" else "docs7", args.seq_len, seed=args.seed)
    cu_list = cu_seqlens_of(lengths)
    varlen = {}
    if len(lengths) > 1:
        # one tensor of each for every call, as the gdn suite (and a training step's layers) pass them
        varlen["cu_seqlens"] = torch.tensor(cu_list, device="cuda")
        if case != "docs7_nocpu":
            varlen["cu_seqlens_cpu"] = torch.tensor(cu_list)
    x = random_inputs(args.seq_len, args.heads, args.v_heads, args.head_dim, args.head_dim, gate="gdn", seed=args.seed,
                      leaves=True)
    if args.gate_in_kernel:
        tensors, options = x, dict(BENCH_OPTIONS)
    else:
        with torch.no_grad():  # natural-log decay [1, T, HV] in the inputs' dtype (kdacp wants g in q's dtype)
            g = gdn_gate(x["g"], x["A_log"], x["dt_bias"]).to(x["q"].dtype)
        tensors = dict(q=x["q"], k=x["k"], v=x["v"], g=g.requires_grad_(), beta=x["beta"])
        options = dict(use_qk_l2norm_in_kernel=True)
    options.update(scale=None, initial_state=None, output_final_state=bool(args.output_final_state))
    return tensors, options, varlen, lengths


def contenders(fla, tensors: dict, options: dict, varlen: dict) -> dict:
    from kdacp.gdn import chunk_gated_delta_rule
    return {
        "fla": lambda: fla.chunk_gated_delta_rule(**tensors, **options, **varlen),
        "kdacp": lambda: chunk_gated_delta_rule(**tensors, **options, **varlen, backend="fla"),
    }


def kdacp_backend_class(fn) -> str:
    """The class of the local backend kdacp builds for this call (one call, with a spy on
    ``kdacp.backends.call.make_backend``)."""
    import kdacp.backends.call as call
    seen, original = [], call.make_backend

    def spy(*a, **kw):
        backend = original(*a, **kw)
        seen.append(type(backend).__name__)
        return backend

    call.make_backend = spy
    try:
        fn()
    finally:
        call.make_backend = original
    return ",".join(seen) or "?"


def compare_outputs(torch, a, b) -> tuple[bool, float]:
    """``(bitwise equal, max |a - b|)`` over the output and the final state (when returned)."""
    pairs = [(a[0], b[0])] + ([(a[1], b[1])] if a[1] is not None and b[1] is not None else [])
    equal = all(torch.equal(x, y) for x, y in pairs)
    diff = max((x.float() - y.float()).abs().max().item() for x, y in pairs)
    return equal, diff


def run_case_mode(torch, fla, case: str, mode: str, args, report: Report, kdacp_dir: str) -> dict:
    tensors, options, varlen, lengths = build_case(torch, case, args)
    train = mode == "train_fwd"
    if not train:
        tensors = {n: t.detach() for n, t in tensors.items()}
    fns = contenders(fla, tensors, options, varlen)
    row = dict(case=case, mode=mode, docs=len(lengths))
    report(f"\n{'=' * 110}\n{case} ({len(lengths)} documents: {list(lengths)}), {mode}; "
           f"varlen args: {sorted(varlen) or 'none'}; options: {options}\n{'=' * 110}")
    with torch.set_grad_enabled(train):
        log(f"{case} {mode}: warm-up ({args.warmup} calls each; the first compiles FLA's kernels)")
        for name in CONTENDERS:
            for _ in range(args.warmup):
                fns[name]()
        torch.cuda.synchronize()
        row["kdacp_backend"] = kdacp_backend_class(fns["kdacp"])
        equal, diff = compare_outputs(torch, fns["fla"](), fns["kdacp"]())
        row.update(bitwise_equal=equal, max_abs_diff=diff)
        report(f"kdacp backend class: {row['kdacp_backend']}; outputs bitwise equal to FLA's: {equal} "
               f"(max |diff| {diff:.3g})")

        log(f"{case} {mode}: timing")
        cycles = sleep_cycles(torch, args.sleep_ms)
        timing = {n: {} for n in CONTENDERS}
        for part in (time_isolated(torch, fns, args.iters), time_queued(torch, fns, args.queue_rounds, args.queue),
                     time_behind_busy_gpu(torch, fns, args.iters, cycles)):
            for n in CONTENDERS:
                timing[n].update(part[n])
        rows = [dict(contender=n, **timing[n]) for n in CONTENDERS]
        report("\n-- timing (ms per call, medians; isolated/device_only/host over "
               f"{args.iters} samples, queued over {args.queue_rounds} x {args.queue} calls) --")
        report(table(rows, ["contender", "isolated_ms", "isolated_min_ms", "queued_ms", "device_only_ms",
                            "host_busy_ms", "host_idle_ms", "blocked", "samples"]))
        for n in CONTENDERS:
            t = timing[n]
            verdict = ("waits for the GPU inside the call (host sync)" if t["blocked"] > t["samples"] // 2 else
                       "host-bound (host work per call > its GPU work)" if t["host_busy_ms"] > t["device_only_ms"] else
                       "GPU-bound")
            report(f"{n}: {verdict}")
        for key in ("isolated_ms", "queued_ms", "device_only_ms", "host_busy_ms", "host_idle_ms"):
            row[f"fla_{key}"], row[f"kdacp_{key}"] = timing["fla"][key], timing["kdacp"][key]
            row[f"ratio_{key}"] = timing["kdacp"][key] / timing["fla"][key] if timing["fla"][key] else float("nan")
        row["kdacp_blocked"] = f"{timing['kdacp']['blocked']}/{args.iters}"
        row["fla_blocked"] = f"{timing['fla']['blocked']}/{args.iters}"

        log(f"{case} {mode}: torch.profiler")
        summaries = {}
        for n in CONTENDERS:
            path = args.out / f"trace_{case}_{mode}_{n}.json"
            prof, trace = run_torch_profiler(torch, fns[n], n, args.profile_calls, path)
            calls = per_call_activity(trace, CALL_PREFIX + n)
            s = summaries[n] = summarize_calls(calls)
            s["python_self_ms"] = annotation_self_ms(prof, n, args.profile_calls)
            report(f"\n-- {n}: torch.profiler, {len(calls)} calls (trace: {path.name}) --")
            report(f"per call: host {s['host_ms']:.3f} ms (under the profiler), of which Python outside any op "
                   f"{s['python_self_ms']:.3f} ms; first kernel launch {s['first_launch_ms']:.3f} ms after the call "
                   f"starts; {s['launches']:.1f} launches, {s['kernels']:.1f} kernels, {s['gpu_ops']:.1f} GPU ops; "
                   f"GPU busy {s['gpu_busy_ms']:.3f} ms, span {s['gpu_span_ms']:.3f} ms; "
                   f"syncs {s['syncs']:.1f}, DtoH copies {s['dtoh']:.1f}")
            last = calls[-1]["gpu"] if calls else []
            t0 = last[0]["ts"] if last else 0.0
            report("GPU ops per call by name (means over the profiled calls):")
            report(table([dict(op=short(k), cat=v["cat"], per_call=v["per_call"], mean_us=v["mean_us"],
                               us_per_call=v["us_per_call"])
                          for k, v in sorted(s["by_name"].items(), key=lambda kv: -kv[1]["us_per_call"])],
                         ["op", "cat", "per_call", "mean_us", "us_per_call"]))
            report("GPU ops of the last profiled call, in order (start offset from its first op, duration, us):")
            report(table([dict(i=i, start_us=g["ts"] - t0, dur_us=g["dur"], cat=g["cat"], op=short(g["name"]))
                          for i, g in enumerate(last)], ["i", "start_us", "dur_us", "cat", "op"]))
            report("CUDA runtime/driver API calls per call:")
            report(table([dict(api=k, per_call=v) for k, v in s["api"].items()], ["api", "per_call"]))
            if s["memcpy"]:
                report("GPU memcpys per call: " + ", ".join(f"{k}: {v:.1f}" for k, v in s["memcpy"].items()))
            report("top host-side ops by self CPU time:")
            report(host_op_table(prof, args.profile_calls))
        diff_rows = kernel_diff(summaries["fla"], summaries["kdacp"])
        report("\n-- GPU ops whose count per call differs (kdacp's extras first) --")
        report(table(diff_rows, ["op", "fla_per_call", "kdacp_per_call", "fla_us_per_call", "kdacp_us_per_call"])
               if diff_rows else "none: kdacp launches exactly FLA's GPU ops (by name and count)")
        for n in CONTENDERS:
            s = summaries[n]
            for key in ("launches", "kernels", "syncs", "dtoh", "first_launch_ms", "python_self_ms", "gpu_busy_ms"):
                row[f"{n}_{key}"] = s[key]
        row["extra_kdacp_ops"] = sum(max(0.0, r["kdacp_per_call"] - r["fla_per_call"]) for r in diff_rows)

        log(f"{case} {mode}: cProfile")
        report(f"\n-- kdacp: cProfile over {args.cprofile_calls} calls --")
        report(run_cprofile(torch, fns["kdacp"], args.cprofile_calls, kdacp_dir,
                            args.out / f"cprofile_{case}_{mode}.pstats"))
    del fns, tensors
    torch.cuda.empty_cache()
    return row


# (label, row key): the two summary tables, times and per-call counts
SUMMARY_TIMES = [
    ("case", "case"), ("mode", "mode"), ("kdacp backend", "kdacp_backend"), ("equal", "bitwise_equal"),
    ("iso fla", "fla_isolated_ms"), ("iso kdacp", "kdacp_isolated_ms"), ("iso x", "ratio_isolated_ms"),
    ("queued fla", "fla_queued_ms"), ("queued kdacp", "kdacp_queued_ms"), ("queued x", "ratio_queued_ms"),
    ("dev-only fla", "fla_device_only_ms"), ("dev-only kdacp", "kdacp_device_only_ms"),
    ("host fla", "fla_host_busy_ms"), ("host kdacp", "kdacp_host_busy_ms"), ("kdacp blocked", "kdacp_blocked"),
]
SUMMARY_COUNTS = [
    ("case", "case"), ("mode", "mode"), ("kernels fla", "fla_kernels"), ("kernels kdacp", "kdacp_kernels"),
    ("extra kdacp ops", "extra_kdacp_ops"), ("launches fla", "fla_launches"), ("launches kdacp", "kdacp_launches"),
    ("syncs fla", "fla_syncs"), ("syncs kdacp", "kdacp_syncs"), ("DtoH kdacp", "kdacp_dtoh"),
    ("1st launch fla ms", "fla_first_launch_ms"), ("1st launch kdacp ms", "kdacp_first_launch_ms"),
]


def labelled(rows: list[dict], spec) -> str:
    return table([{label: r.get(key, "") for label, key in spec} for r in rows], [label for label, _ in spec])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("gdn_forward_profile.py: no CUDA device here (torch.cuda.is_available() is False); this script "
                 "times FLA's CUDA kernels and needs an NVIDIA GPU with fla-core 0.6.0 installed")
    if not hasattr(torch.cuda, "_sleep"):
        sys.exit("gdn_forward_profile.py: this torch has no torch.cuda._sleep, which the busy-GPU timing needs")
    import kdacp
    from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported, load_fla
    try:
        fla = load_fla()  # before anything imports fla: kdacp points FLA at its shipped kernel configurations
    except ImportError as e:
        sys.exit(f"gdn_forward_profile.py: FLA is not usable: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "report.txt")
    import triton
    import fla as fla_pkg
    kdacp_dir = os.path.dirname(os.path.abspath(kdacp.__file__))
    report("GDN forward: kdacp.chunk_gated_delta_rule(backend='fla') vs FLA's chunk_gated_delta_rule")
    report(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
           f"fla {getattr(fla_pkg, '__version__', '?')}, kdacp {kdacp.__version__} ({kdacp_dir}); "
           f"FLA_CONFIG_DIR={os.environ.get('FLA_CONFIG_DIR')}, FLA_CACHE_MODE={os.environ.get('FLA_CACHE_MODE')}")
    report(f"T={args.seq_len}, H={args.heads}, HV={args.v_heads}, K=V={args.head_dim}, bf16, "
           f"{'gate in kernel (bench OPTIONS)' if args.gate_in_kernel else 'log-decay g'}, "
           f"output_final_state={args.output_final_state}; FLA's GDN backward supported here: "
           f"{fla_gated_gdn_backward_supported()} (False: kdacp's train_fwd runs FLA's KDA kernels on the broadcast gate)")
    rows = []
    try:
        for case in args.cases:
            for mode in args.modes:
                rows.append(run_case_mode(torch, fla, case, mode, args, report, kdacp_dir))
                (args.out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
        report(f"\nwritten: {args.out / 'report.txt'}, {args.out / 'summary.json'}, Chrome traces "
               f"(trace_*.json) and cProfile dumps (cprofile_*.pstats) in {args.out}")
        report("\n" + "=" * 110 + "\nSUMMARY, ms per call (medians; x = kdacp / fla). iso: one call, GPU idle before "
               "it; queued: calls back to back (the gdn suite's timing); dev-only: the call's own GPU work, no host "
               "gaps; host: the Python call alone, GPU kept busy; kdacp blocked: samples where the kdacp call waited "
               "for the GPU\n" + "=" * 110)
        report(labelled(rows, SUMMARY_TIMES))
        report("\nper call, from torch.profiler (GPU ops, launches, API syncs, DtoH copies; host time to the first launch):")
        report(labelled(rows, SUMMARY_COUNTS))
    finally:
        report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
