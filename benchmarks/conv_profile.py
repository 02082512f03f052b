#!/usr/bin/env python
"""The short convolution's passes split into their GPU kernels (torch.profiler, device time per call).

    python benchmarks/conv_profile.py [--seq-len 16384] [--dim 4096]

One sequence, bf16, W=4, SiLU, no bias, shipped tilings; 20 calls of the backward and the forward after 5
warm-up calls. The backward's pass is the Triton kernel plus the reduction of its float32 ``dweight`` partial
sums, cast to the weight's dtype in the same kernel.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kdacp.bench.kernels import make_conv_inputs
from kdacp.kernels import short_conv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    a = p.parse_args()
    x = make_conv_inputs(a.seq_len, a.dim, 4, packed=False, dtype=torch.bfloat16, device="cuda")
    args = (x["x"], x["weight"], None, None, None, "silu")

    def both():
        short_conv.short_conv_bwd(*args, x["dy"])
        short_conv.short_conv_fwd(*args)
    for _ in range(5):
        both()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            both()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_time_total > 0:
            print(f"{e.key[:70]:70s} calls {e.count:4d} mean_us {e.device_time_total / e.count:8.2f}")


if __name__ == "__main__":
    main()
