"""Command line: ``kdacp demo``."""
from __future__ import annotations

import argparse
import sys

import torch

from .reference import apply_state_summary, chunk_kda_intermediates, state_summary


def _rank_pieces(cu: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """``(sequence, first token, end token)`` of the global sequences that intersect ``[start, end)``."""
    return [(n, max(a, start), min(b, end)) for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if a < end and b > start]


def run_segment_demo(seq_lens: list[int], world_size: int, heads: int = 2, value_heads: int = 4,
                     head_dim: int = 32, seed: int = 0) -> tuple[list[dict], bool]:
    """Split a random packed batch into ``world_size`` equal token segments, summarise each
    segment's first local sequence piece, chain the summaries, and compare every incoming state
    and every final state with the unsplit float64 run. Returns (rows, ok)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    H, HV, K = heads, value_heads, head_dim
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64) + 3)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    cu_t = torch.tensor(cu)
    truth = chunk_kda_intermediates(q, k, v, g, beta, cu_seqlens=cu_t)

    def true_state_at(n: int, t: int) -> torch.Tensor:
        """State of sequence ``n`` after its tokens before global token ``t`` (unsplit run)."""
        sl = slice(cu[n], t)
        return chunk_kda_intermediates(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl]).final_state[0]

    bounds = [round(r * T / world_size) for r in range(world_size + 1)]
    carried: dict[int, torch.Tensor] = {}   # sequence -> state flowing from the previous segment
    final = torch.zeros_like(truth.final_state)
    rows, ok = [], True
    for r in range(world_size):
        pieces = _rank_pieces(cu, bounds[r], bounds[r + 1])
        local_cu = torch.tensor([0] + [e - bounds[r] for _, _, e in pieces])
        sl = slice(bounds[r], bounds[r + 1])
        inter = chunk_kda_intermediates(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], cu_seqlens=local_cu)
        summaries = state_summary(inter.kg, inter.w, inter.u, inter.gc, cu_seqlens=local_cu)
        in_err = 0.0
        for i, (n, s, e) in enumerate(pieces):
            S_in = carried.pop(n, torch.zeros_like(truth.final_state[n]))
            if s > cu[n]:
                in_err = max(in_err, ((S_in - true_state_at(n, s)).norm() / true_state_at(n, s).norm()).item())
            S_out = apply_state_summary(summaries.state[i], summaries.transition[i], S_in)
            if e < cu[n + 1]:
                carried[n] = S_out
            else:
                final[n] = S_out
        rows.append(dict(segment=r, tokens=bounds[r + 1] - bounds[r], pieces=len(pieces), incoming_state_err=in_err))
        ok &= in_err < 1e-10
    final_err = ((final - truth.final_state).norm() / truth.final_state.norm()).item()
    ok &= final_err < 1e-10
    rows.append(dict(segment="final", tokens=T, pieces=len(seq_lens), incoming_state_err=final_err))
    return rows, ok


def _demo(args: argparse.Namespace) -> int:
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    rows, ok = run_segment_demo(seq_lens, args.world_size, seed=args.seed)
    print(f"{'segment':>8} {'tokens':>7} {'pieces':>7} {'rel. error of state':>20}")
    for row in rows:
        print(f"{row['segment']!s:>8} {row['tokens']:>7} {row['pieces']:>7} {row['incoming_state_err']:>20.2e}")
    print("PASS: chained summaries reproduce the unsplit run" if ok else "FAIL: chained summaries differ")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kdacp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="split a packed batch into segments and check the chained state summaries")
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--seq-lens", default="300,150,420,130", help="comma-separated sequence lengths")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
