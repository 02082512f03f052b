#!/usr/bin/env python
"""The short-convolution kernels of this tree against an earlier version's, in one process, rounds alternating.

    git show REV:src/kdacp/kernels/short_conv.py | sed 's/from \\.\\.validation/from kdacp.validation/;
        s/from \\.planning/from kdacp.kernels.planning/' > OLD.py
    python benchmarks/conv_ab.py OLD.py [--rounds 5]

Each version runs with its own shipped tilings on the kernels suite's inputs (T=16K, D=4096 and 6144, W=4, bf16,
SiLU; one sequence, and 13 documents after a halo). Prints ms medians (of the rounds' medians), the % of 4.8
TB/s over the bytes each pass must move (forward x, y; backward x, dy, dx), and the largest difference between
the versions' outputs in units of the output's bf16 rounding.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

from kdacp.bench.harness import load_module_file
from kdacp.bench.kernels import make_conv_inputs
from kdacp.kernels import short_conv

PEAK_GBS = 4800.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    versions = {"old": load_module_file(a.old, "short_conv_old"), "new": short_conv}
    print("| D | batch | pass | old ms | new ms | new / old | old % | new % | max diff (bf16 ulps) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D in (4096, 6144):
        for packed in (False, True):
            x = make_conv_inputs(16384, D, 4, packed=packed, dtype=torch.bfloat16, device="cuda")
            halo = x["x"][:, :3].clone() if packed else None
            args = (x["x"], x["weight"], None, halo, x["cu"], "silu")
            calls = {(v, "fwd"): (lambda m=m: m.short_conv_fwd(*args)) for v, m in versions.items()}
            calls |= {(v, "bwd"): (lambda m=m: m.short_conv_bwd(*args, x["dy"]).dx) for v, m in versions.items()}
            times = {k: [] for k in calls}
            for _ in range(a.rounds):
                for k, fn in calls.items():
                    times[k].append(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))
            for pas, n_bytes in (("fwd", 2), ("bwd", 3)):
                old, new = (statistics.median(times[(v, pas)]) for v in ("old", "new"))
                out_old, out_new = calls[("old", pas)]().float(), calls[("new", pas)]().float()
                ulp = out_old.abs().clamp_min(1e-30) * 2.0 ** -8
                diff = ((out_new - out_old).abs() / ulp).max().item()
                gb = n_bytes * 16384 * D * 2 / 1e9
                print(f"| {D} | {'13 documents, halo' if packed else 'one sequence'} | {pas} | {old:.4f} | {new:.4f} "
                      f"| {new / old:.3f} | {gb / old * 1e3 / PEAK_GBS * 100:.0f} | {gb / new * 1e3 / PEAK_GBS * 100:.0f} "
                      f"| {diff:.2f} |", flush=True)


if __name__ == "__main__":
    main()
