#!/usr/bin/env python
"""The scaling model's step prediction for each batch of a ``kdacp bench --suite overhead`` run, from the stage
times it measured per rank role, on the route of the run's own 3-rank plan (which roles send, receive, or hold
a chain's middle); no GPU needed.

    python benchmarks/packed_prediction.py OVERHEAD_JSON [--link-latency-us 10] [--link-gbps 100]

The scaling suite composes one sequence only. A packed batch whose documents never span a whole rank has
chains of at most two ranks, so its step does not grow with ``P``: the 3-rank plan's step is the prediction at
any ``P`` with the same pattern. Prints, per family and batch and strategy, the forward and backward critical
paths (ms) and the step over one device's on the slowest role's tokens (one layer), and the step model's
(:func:`~kdacp.bench.scaling_model.route_step_path`: a training step of ``--step-layers`` layers, ranks running
ahead as a wavefront, with and without an attention layer after every 3).
"""
from __future__ import annotations

import argparse
import json

from kdacp.bench.scaling import STEP_LAYERS
from kdacp.bench.scaling_model import route_path, route_step_path
from kdacp.cp.cost_model import DEFAULT_LINK, ROLES, Link, RoleStages, exchange_stage_times

# one message of Kimi Linear's states (32 heads of 128 x 128), the exchange's own products estimated
TIMES = exchange_stage_times(1, 32, 128, 128)


def predictions(rows: list[dict], link: Link, layers: int = STEP_LAYERS) -> list[dict]:
    """One row per family, batch and strategy of the overhead suite's ``rows``."""
    roles = {(r["family"], r["batch"], r["role"]): r for r in rows if "rank_fwd_ms" in r}
    stages = {(r["family"], r["batch"], r["role"], r["direction"]): RoleStages(
        r["ready_ms"] * 1e-3, r["between_ms"] * 1e-3, r["after_ms"] * 1e-3) for r in rows if "ready_ms" in r}
    out = []
    for family, batch in sorted({(f, b) for f, b, _ in roles}):
        by_role = [roles[(family, batch, role)] for role in ROLES]
        affine = tuple(bool(r["affine"]) for r in by_role)
        forward = (tuple(int(r["sends"]) for r in by_role), affine)
        backward = (tuple(int(r["receives"]) for r in reversed(by_role)), tuple(reversed(affine)))
        one = max((r["one_fwd_ms"] + r["one_bwd_ms"]) * 1e-3 for r in by_role)
        fwd_stages = [stages[(family, batch, role, "forward")] for role in ROLES]
        bwd_stages = [stages[(family, batch, role, "backward")] for role in reversed(ROLES)]
        for strategy in ("p2p", "allgather", "scan"):
            fwd = route_path(strategy, *forward, fwd_stages, TIMES, link)
            bwd = route_path(strategy, *backward, bwd_stages, TIMES, link)
            steps = {every: route_step_path(strategy, forward, backward, fwd_stages, bwd_stages, TIMES, layers, every,
                                            link) / (layers * one) for every in (0, 3)}
            out.append(dict(family=family, batch=batch, strategy=strategy, forward_ms=fwd * 1e3,
                            backward_ms=bwd * 1e3, one_device_ms=one * 1e3, ratio=(fwd + bwd) / one,
                            step_ratio=steps[0], step_ratio_sync3=steps[3]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overhead_json")
    parser.add_argument("--link-latency-us", type=float, default=DEFAULT_LINK.latency_s * 1e6)
    parser.add_argument("--link-gbps", type=float, default=DEFAULT_LINK.bandwidth / 1e9)
    parser.add_argument("--step-layers", type=int, default=STEP_LAYERS)
    args = parser.parse_args()
    link = Link(latency_s=args.link_latency_us * 1e-6, bandwidth=args.link_gbps * 1e9)
    with open(args.overhead_json) as f:
        rows = json.load(f)["rows"]
    print(f"| family | batch | strategy | forward ms | backward ms | one device ms | one layer / one device | "
          f"{args.step_layers} layers | with an attention layer every 3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in predictions(rows, link, args.step_layers):
        print(f"| {p['family']} | {p['batch']} | {p['strategy']} | {p['forward_ms']:.3f} | {p['backward_ms']:.3f} | "
              f"{p['one_device_ms']:.3f} | {p['ratio']:.3f} | {p['step_ratio']:.3f} | {p['step_ratio_sync3']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
