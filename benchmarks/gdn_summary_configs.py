"""Tilings of the GDN summary kernels with raw keys and the scalar gate (what the ``fla`` GDN backend
runs), one H200, Qwen3-Next shapes (16 q/k heads, 32 value heads, K=V=128, bf16, 16K tokens): median
time (``triton.testing.do_bench``, warm) and error against float64 of the same inputs, per config.

    python benchmarks/gdn_summary_configs.py [--seq-len 16384] [--kernels G] [--block-v 16 32] [--warps 2 4]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kdacp import kernels as kn
from kdacp.bench.kernels import make_gdn_inputs, median_ms, rel_err


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--kernels", nargs="+", default=["S_ext+M", "G"], choices=["S_ext+M", "G"])
    ap.add_argument("--block-v", type=int, nargs="+", default=[32, 64], choices=[16, 32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8], choices=[1, 2, 4, 8, 16])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_summary_configs.py: needs a CUDA GPU")
    x, r = make_gdn_inputs(args.seq_len)
    runs = {
        "S_ext+M": (lambda c: kn.state_summary(x["k"], x["w"], x["u"], x["gc"], raw_keys=True, config=c),
                    lambda out: max(rel_err(out.state, r["S"]), rel_err(out.transition, r["M"]))),
        "G": (lambda c: kn.state_gradient_summary(x["q"], x["k"], x["w"], x["gc"], x["do"], x["dv"], x["scale"],
                                                  raw_keys=True, config=c),
              lambda out: rel_err(out, r["G"])),
    }
    print(f"{'kernel':8} {'block_v':>7} {'warps':>5} {'stages':>6} {'v_first':>7} {'ms':>7} {'err':>9}")
    runs = {name: runs[name] for name in args.kernels}
    for (name, (fn, err)), bv, nw, ns, vf in itertools.product(runs.items(), args.block_v, args.warps, args.stages,
                                                                (False, True)):
        cfg = kn.SummaryConfig(block_v=bv, num_warps=nw, num_stages=ns, v_first=vf)
        try:
            e = err(fn(cfg))
            ms = median_ms(lambda: fn(cfg))
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported, not fatal
            print(f"{name:8} {bv:>7} {nw:>5} {ns:>6} {vf!s:>7}  failed: {type(exc).__name__}: {str(exc)[:60]}")
            continue
        print(f"{name:8} {bv:>7} {nw:>5} {ns:>6} {vf!s:>7} {ms:>7.3f} {e:>9.2e}")
    print("defaults:", ", ".join(f"{name} {median_ms(lambda: fn(None)):.3f} ms" for name, (fn, _) in runs.items()))


if __name__ == "__main__":
    main()
