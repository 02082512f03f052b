#!/usr/bin/env python
"""The chain kernel's tilings: what carrying the states along a sequence's pieces costs per piece.

The split inside one device (:mod:`kdacp.cp.split`) carries each segment's state from piece to piece in one
launch (:func:`kdacp.affine.chain.chain_states`): a program walks one ``[K, block_v]`` column tile of one head
through the pieces in order, so the launch holds ``HV x V / block_v`` programs for one sequence (8 at 4 heads of
128 with the default ``block_v = 64``) and each step is a ``[K, K]`` by ``[K, block_v]`` product after loading the
piece's ``M`` (``K^2`` float32) and ``S_ext``. On one H100 at 4 heads and 8 pieces the launch took 0.113 ms, about
14 us a piece (benchmarks/RESULTS.md, Split inside one GPU). Narrower tiles give more programs and a shorter
product per step for the same loads of ``M``. Times each tiling and warp count, forward and reversed, per head
count and piece count (one sequence, K = V = 128, float32 states), as medians on the device clock.

    python benchmarks/chain_kernel.py [--heads 2,4,8] [--pieces 8,16,32] [--block-v 16,32,64] [--warps 4,8]

Prints one row per case: ms per launch and us per piece, and each over the default tiling's.
"""
from __future__ import annotations

import argparse

import torch

from kdacp.affine.chain import chain_states
from kdacp.bench.harness import markdown_table
from kdacp.bench.timing import median_times


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=_ints, default=[2, 4, 8])
    parser.add_argument("--pieces", type=_ints, default=[8, 16, 32])
    parser.add_argument("--block-v", type=_ints, default=[16, 32, 64])
    parser.add_argument("--warps", type=_ints, default=[4, 8])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    K = V = 128
    rows = []
    print(f"# {torch.cuda.get_device_name()}")
    for HV in args.heads:
        for n in args.pieces:
            offsets = torch.randn(n, HV, K, V, device=device)
            transitions = torch.randn(n, HV, K, K, device=device) * K ** -0.5
            initial = torch.randn(1, HV, K, V, device=device)
            seqs = torch.tensor([(0, n)], dtype=torch.int64, device=device)
            for reverse in (False, True):
                fns = {(bv, w): (lambda bv=bv, w=w, back=reverse: chain_states(
                    offsets, transitions, seqs, initial, back, block_v=bv, num_warps=w))
                       for bv in args.block_v for w in args.warps}
                seconds = median_times(fns, device, rounds=args.rounds, warmup=2)
                default = seconds.get((64, 4))
                for (bv, w), s in seconds.items():
                    rows.append(dict(heads=HV, pieces=n, reverse=reverse, block_v=bv, warps=w,
                                     programs=HV * (V // bv), ms=round(s * 1e3, 4),
                                     us_per_piece=round(s * 1e6 / n, 2),
                                     over_default=None if default is None else round(s / default, 3)))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
