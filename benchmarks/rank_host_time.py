#!/usr/bin/env python
"""The host's time of one rank's token-mixer forward + backward, per rank role and layout, on the CPU.

A rank of many positions (a packed batch cut per document under ``document_zigzag``: one position per document
piece) runs kdacp's orchestration once per position: a message, an ``M x + S``, the bookkeeping. Where the device
work of a layer is a few milliseconds, that host time can decide the step. Here the local stages are
:class:`~kdacp.bench.sleep_backend.SleepBackend`'s with zero seconds (they return zeros of the right shapes at
once) and the incoming messages are ready-made as in the overhead suite (:class:`~kdacp.bench.overhead.
ReadyExchange`: the products of ``p2p``), so what is timed is kdacp's Python and the products on tiny states
(``--heads`` heads of ``--head-dim``). The roles and batches are the overhead suite's (contiguous roles of a
3-rank plan; zigzag roles at each ``P``).

    python benchmarks/rank_host_time.py [--t-local 16384] [--ranks 2,8] [--rounds 21] [--profile ROLE] [--no-products]

With ``--no-products`` the ``M x + S`` products return their input at once: what is timed is kdacp's own Python
alone (a GPU's host pays that, plus one product launch per message).

Prints one row per role: its positions and the median milliseconds of a forward + backward, of this process's CPU
time (``cpu_ms``: what kdacp's host work costs, steadier than the wall clock on a shared machine; one torch thread;
``cpu_min_ms`` the least of the rounds, the steadiest where other jobs share the CPU)
and of the wall clock (``wall_ms``); with
``--profile "document_zigzag lognormal 8 middle"`` the cProfile top functions of that role by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from kdacp.bench.harness import markdown_table
from kdacp.bench.overhead import ReadyExchange, layout_role_plans, rank_step, role_call, role_plans
from kdacp.bench.sleep_backend import SLEEP_STAGES, SleepBackend

NO_SLEEP = dict.fromkeys(SLEEP_STAGES, 0.0)


def cases(t_local: int, world_sizes) -> dict:
    """``{"layout batch P role": plan}``: the overhead suite's roles, contiguous and zigzag layouts."""
    out = {}
    for batch in ("one_sequence", "lognormal"):
        for role, (plan, _) in role_plans(batch, t_local).items():
            out[f"contiguous {batch} 3 {role}"] = plan
    for P in world_sizes:
        for layout, batch in (("zigzag", "one_sequence"), ("document_zigzag", "lognormal")):
            for role, (plan, _) in layout_role_plans(layout, batch, t_local, P).items():
                out[f"{layout} {batch} {P} {role}"] = plan
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-local", type=int, default=16384, help="tokens a rank (even)")
    parser.add_argument("--ranks", default="2,8", help="comma-separated P of the zigzag layouts (each >= 2)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--no-products", action="store_true", help="the products return their input at once")
    parser.add_argument("--profile", default=None, help='a role to profile, as its row names it ("layout batch P role")')
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(p) for p in args.ranks.split(",")]
        plans = cases(args.t_local, world_sizes)
    except ValueError as error:
        parser.error(f"--ranks / --t-local: {error}")
    if args.profile is not None and args.profile not in plans:
        parser.error(f"--profile must name a row, one of {sorted(plans)}; got {args.profile!r}")
    torch.set_num_threads(1)  # the CPU time of this thread's work, not of idle intra-op workers
    if args.no_products:
        import kdacp.affine
        kdacp.affine._products = lambda A, x, b=None, x2=None: (x, x2)
    call, do = role_call("kda", "torch", args.t_local, args.heads, args.head_dim, torch.float32, torch.device("cpu"))
    rows = []
    for name, plan in plans.items():
        forward, backward = rank_step(SleepBackend(args.t_local, NO_SLEEP), plan, call, do, torch.float32,
                                      ReadyExchange())
        for _ in range(2):  # warm-up: memoised plans and routes
            forward(), backward()
        cpu, wall = [], []
        for _ in range(args.rounds):
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            forward(), backward()
            cpu.append((time.process_time() - start_cpu) * 1e3)
            wall.append((time.perf_counter() - start_wall) * 1e3)
        layout, batch, P, role = name.split()
        rows.append(dict(layout=layout, batch=batch, P=int(P), role=role,
                         positions=len(plan.rank_layouts[plan.rank].positions),
                         cpu_ms=round(statistics.median(cpu), 3), cpu_min_ms=round(min(cpu), 3),
                         wall_ms=round(statistics.median(wall), 3)))
        if name == args.profile:
            profile = cProfile.Profile()
            profile.runcall(lambda: [(forward(), backward()) for _ in range(args.rounds)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
