#!/usr/bin/env python
"""Time chosen short-convolution backward tilings against the shipped ones on one GPU, each output compared
with the shipped kernel's (``dx``: the same sums in the same order, expected bitwise equal; ``dweight`` too where
the rows per program are the same).

    python benchmarks/conv_candidates.py [--d 4096 6144]

For each ``D`` (T=16K, bf16, W=4; one sequence, and 13 documents after a halo): ``triton.testing.do_bench``
medians (L2 flushed between calls, as :func:`kdacp.bench.kernels.sweep_conv`), % of 4.8 TB/s over the 3 tensors
the backward must move, and the largest difference of ``dx`` and ``dweight`` from the shipped tiling's.
"""
from __future__ import annotations

import argparse

import torch
import triton.testing

from kdacp.bench.kernels import conv_sweep_inputs
from kdacp.kernels import short_conv as sc
from kdacp.precompile import precompile

T_ = sc.ConvTiles
CANDIDATES = [  # the shipped tiling's neighbours, and the thirteenth session's two (step ahead, no pipelining)
    T_(rows=256, BD=512, num_warps=2, stages=2), T_(rows=256, BD=512, num_warps=2, stages=4),
    T_(rows=128, BD=512, num_warps=2, stages=3), T_(rows=512, BD=512, num_warps=2, stages=3),
    T_(rows=256, BD=512, num_warps=4, stages=3), T_(rows=256, BD=1024, num_warps=4, stages=3),
    T_(rows=256, BD=2048, num_warps=16, ahead=True), T_(rows=512, BD=512, num_warps=4, ahead=True),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, nargs="+", default=[4096, 6144])
    args = parser.parse_args()
    T, W = 16384, 4
    print("| D | batch | tiles | ms | % of 4.8 TB/s | max diff dx | max diff dweight |")
    print("|---|---|---|---|---|---|---|")
    shipped = sc.BWD_TILES
    tilings = [shipped] + [t for t in CANDIDATES if t != shipped]
    for D in args.d:
        cases = conv_sweep_inputs(T, D, W, dtype=torch.bfloat16, device="cuda")
        precompile(lambda: [sc.short_conv_bwd(*a, dy, tiles=t) for t in tilings for _, a, dy in cases], device="cuda")
        for batch, a, dy in cases:
            ref = sc.short_conv_bwd(*a, dy, tiles=shipped)
            for tiles in tilings:
                out = sc.short_conv_bwd(*a, dy, tiles=tiles)
                ms = triton.testing.do_bench(lambda: sc.short_conv_bwd(*a, dy, tiles=tiles), warmup=5, rep=40,
                                             return_mode="median")
                pct = 100 * 3 * T * D * 2 / (ms * 1e-3) / 4.8e12
                name = ("shipped " if tiles == shipped else "") + str(tiles).replace("ConvTiles", "")
                print(f"| {D} | {batch} | {name} | {ms:.4f} | {pct:.1f} | "
                      f"{(out.dx.float() - ref.dx.float()).abs().max().item():.2e} | "
                      f"{(out.dweight.float() - ref.dweight.float()).abs().max().item():.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
