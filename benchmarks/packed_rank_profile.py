#!/usr/bin/env python
"""Where a packed rank's extra work goes: its forward and backward split into kernels (torch.profiler, device
time per step), beside one device's on the same tokens, for each rank role of the overhead suite's 3-rank plan.

    python benchmarks/packed_rank_profile.py [--seq-len 16384] [--batch docs7] [--family kda] [--steps 10]

The overhead suite times backend stages only; what the orchestration itself runs between them (the
concatenation of the spans' outputs and gradients, the slicing of states) shows here as kernels. Prints, per
role, every kernel whose time per step differs from one device's by more than 2 us (ms per step), and the
totals. ``--device cpu`` (kdacp's torch backend, tiny sizes) only checks that the script runs.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kdacp.bench.overhead import ReadyExchange, device_role_call, rank_step, role_plans


def kernel_ms(fn, steps: int, device: torch.device) -> dict:
    """``{kernel name: ms per call of fn}`` over ``steps`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    out = defaultdict(float)
    for e in prof.key_averages():
        total = e.device_time_total if cuda else e.self_cpu_time_total
        if total > 0:
            out[e.key] += total / 1e3 / steps
    return dict(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=None, help="tokens per rank (default 16384; 256 on CPU)")
    p.add_argument("--batch", default="docs7")
    p.add_argument("--family", default="kda", choices=("kda", "gdn"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    T, call, do = device_role_call(a.family, device, a.seq_len)
    exchange = ReadyExchange()
    for role, (plan, one) in role_plans(a.batch, T).items():
        got = {}
        for name, pl in (("rank", plan), ("one", one)):
            fwd, bwd = rank_step(call.backend, pl, call, do, torch.float32, exchange)
            got[name] = kernel_ms(lambda: (fwd(), bwd()), a.steps, device)
        print(f"## {a.family} {a.batch} {role}: rank {sum(got['rank'].values()):.3f} ms, "
              f"one device {sum(got['one'].values()):.3f} ms per forward + backward")
        print("| kernel | rank ms | one device ms | difference |")
        print("|---|---|---|---|")
        names = sorted(set(got["rank"]) | set(got["one"]),
                       key=lambda n: -abs(got["rank"].get(n, 0.0) - got["one"].get(n, 0.0)))
        for n in names:
            r, o = got["rank"].get(n, 0.0), got["one"].get(n, 0.0)
            if abs(r - o) > 0.002:
                print(f"| {n[:80]} | {r:.4f} | {o:.4f} | {r - o:+.4f} |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
