"""Issue 34 on one GPU, in one process: sweep the short-convolution kernels' tilings, take the fastest of
each pass, then time the kernels against FLA's (``kdacp bench --suite kernels --family conv``) and the
layer against FLA's layer (``kdacp bench --suite layer``, one rank: it runs in this process) with them.

    python benchmarks/conv_round.py OUT_DIR [--seq-lens 16384 65536] [--no-sweep | --passes bwd]

``--no-sweep`` keeps the shipped tilings (``short_conv.FWD_TILES`` / ``BWD_TILES``); ``--passes`` sweeps only
those passes (the others keep theirs). The sweep's rows and
the tilings chosen are printed; each bench writes its tables under ``OUT_DIR``.
"""
from __future__ import annotations

import argparse
import os

from kdacp import cli
from kdacp.bench.kernels import sweep_conv
from kdacp.kernels import short_conv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"])
    args = parser.parse_args()
    if not args.no_sweep:
        _, best = sweep_conv(passes=tuple(args.passes))
        short_conv.FWD_TILES = best.get("fwd", short_conv.FWD_TILES)
        short_conv.BWD_TILES = best.get("bwd", short_conv.BWD_TILES)
    print(f"tilings: forward {short_conv.FWD_TILES}, backward {short_conv.BWD_TILES}", flush=True)
    status = cli.main(["bench", "--suite", "kernels", "--family", "conv", "--out", os.path.join(args.out, "conv")])
    status |= cli.main(["bench", "--suite", "layer", "--device", "cuda", "--world-size", "1",
                        "--seq-lens", ",".join(map(str, args.seq_lens)), "--batches", "one_sequence,lognormal",
                        "--out", os.path.join(args.out, "layer")])
    return status


if __name__ == "__main__":
    raise SystemExit(main())
