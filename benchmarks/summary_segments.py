#!/usr/bin/env python
"""The summary kernels over one rank's segments, per tiling: what a rank of many short segments pays.

A rank of a packed batch cut per document (``document_zigzag``) summarises one segment per document piece (80
segments of about 150 tokens on a P = 8 middle rank at 16K tokens), where a zigzag rank of one sequence
summarises two of 8K: on an H200 the same tokens took 0.83 ms each way against 0.24 / 0.42 ms
(benchmarks/RESULTS.md, Per-rank overhead). Here the forward summary (``S_ext`` and ``M`` of every segment) and
the gradient summary (``G``) run over each case's segments for each tiling of :data:`TILINGS` (the first is the
kernels' default), with inputs from the reference chunked form (:func:`kdacp.bench.kernels.make_inputs`); each
tiling's results are checked against the default's. Device time on a GPU (median of ``--rounds``), the wall
clock elsewhere (under ``TRITON_INTERPRET=1``: a check that every tiling runs, not a speed).

    python benchmarks/summary_segments.py [--t-local 16384] [--cases "document_zigzag 8 middle,zigzag 8 middle"]
                                          [--tilings 10] [--rounds 20]

Prints one row per case and tiling: segments, ``fwd_ms``, ``grad_ms``, and the largest relative difference
from the default tiling's results.
"""
from __future__ import annotations

import argparse

import torch

from kdacp.bench.errors import rel_err
from kdacp.bench.harness import markdown_table
from kdacp.bench.kernels import make_inputs
from kdacp.bench.overhead import layout_role_plans
from kdacp.bench.timing import median_times
from kdacp.kernels import SummaryConfig, state_gradient_summary, state_summary

# (block_v, num_warps, num_stages, v_first); None: each kernel's default
TILINGS = (None, (64, 4, 1, True), (64, 8, 2, True), (32, 4, 2, True), (32, 4, 1, True), (32, 2, 2, True),
           (64, 4, 2, False), (32, 4, 2, False), (16, 4, 2, True), (16, 2, 1, True))
CASES = "document_zigzag 8 middle,zigzag 8 middle,document_zigzag 2 ends"


def case_segments(case: str, t_local: int) -> tuple[int, ...]:
    """The ``cu_seqlens`` of the rank's own segments in ``"layout P role"`` (the overhead suite's roles: one
    sequence under ``zigzag``, log-normal documents under ``document_zigzag``)."""
    layout, P, role = case.split()
    batch = "one_sequence" if layout == "zigzag" else "lognormal"
    plans = layout_role_plans(layout, batch, t_local, int(P))
    if role not in plans:
        raise ValueError(f"role {role!r} is not one of {sorted(plans)} at P = {P}")
    plan = plans[role][0]
    return tuple(plan.rank_layouts[plan.rank].whole.cu_seqlens)


def config_of(tiling) -> SummaryConfig | None:
    if tiling is None:
        return None
    block_v, num_warps, num_stages, v_first = tiling
    return SummaryConfig(block_v=block_v, num_warps=num_warps, num_stages=num_stages, v_first=v_first)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--t-local", type=int, default=None, help="tokens a rank (GPU: 16384, CPU: 256)")
    parser.add_argument("--heads", type=int, default=None, help="GPU: 32, CPU: 1")
    parser.add_argument("--head-dim", type=int, default=None, help="64 or 128 (GPU: 128, CPU: 64)")
    parser.add_argument("--cases", default=CASES, help='comma-separated "layout P role"')
    parser.add_argument("--tilings", type=int, default=len(TILINGS), help="the first N of TILINGS")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    T = args.t_local or (16384 if gpu else 256)
    heads, head_dim = args.heads or (32 if gpu else 1), args.head_dim or (128 if gpu else 64)
    if not 1 <= args.tilings <= len(TILINGS):
        parser.error(f"--tilings must be from 1 to {len(TILINGS)}, got {args.tilings}")
    try:
        cases = {case: case_segments(case, T) for case in args.cases.split(",")}
    except ValueError as error:
        parser.error(f"--cases: {error}")
    x = make_inputs(T=T, HV=heads, K=head_dim, V=head_dim, device=device)
    rows = []
    for case, cu in cases.items():
        cu_host = torch.tensor(cu, dtype=torch.int64)
        fns, results = {}, {}
        for tiling in TILINGS[:args.tilings]:
            config = config_of(tiling)
            name = "default" if tiling is None else "/".join(map(str, tiling))

            def fwd(config=config):
                return state_summary(x["kg"], x["w"], x["u"], x["gc"], cu_seqlens=cu_host, config=config)

            def grad(config=config):
                return state_gradient_summary(x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], x["scale"],
                                              cu_seqlens=cu_host, config=config)
            results[name] = (*fwd(), grad())
            fns[f"{name} fwd"], fns[f"{name} grad"] = fwd, grad
        seconds = median_times(fns, device, args.rounds)
        base = results["default"]
        for name, got in results.items():
            rows.append(dict(case=case, segments=len(cu) - 1, tiling=name,
                             fwd_ms=round(seconds[f"{name} fwd"] * 1e3, 4),
                             grad_ms=round(seconds[f"{name} grad"] * 1e3, 4),
                             diff=max(rel_err(a, b) for a, b in zip(got, base))))
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
