#!/usr/bin/env python
"""The state exchange of a packed batch cut per document (``document_zigzag``), on gloo ranks of the CPU.

Under ``document_zigzag`` every rank holds a piece of every document, so every document has its own chain
through the ranks and they run side by side. What the exchange costs there, per strategy, is measured with
:class:`~kdacp.bench.sleep_backend.SleepBackend` ranks (stages of zero seconds: only kdacp's orchestration and
the exchanges' messages over gloo run; one head of 16), ``--ranks`` processes, documents of ``2P``-multiple
lengths, one forward + backward per step (slowest rank, median of ``--rounds``), ``--docs`` documents a row.

    python benchmarks/document_chains.py [--ranks 4] [--docs 1,8,32] [--rounds 7]

Prints one row per document count: milliseconds per step for ``p2p``, ``allgather`` and ``scan``.
"""
from __future__ import annotations

import argparse

import torch

from kdacp.bench.harness import markdown_table
from kdacp.bench.sleep_backend import SLEEP_STAGES, SleepBackend, sleep_inputs
from kdacp.bench.timing import median_times
from kdacp.bench.rank_role import RankRole
from kdacp.cp import build_cp_plan
from kdacp.cp.plan import STRATEGIES
from kdacp.workers import launch

NO_SLEEP = dict.fromkeys(SLEEP_STAGES, 0.0)
PIECE = 8  # tokens of a document's piece per unit of its length (a document is 2P pieces of 8 to 24 tokens)


def document_lengths(P: int, docs: int) -> list[int]:
    """``docs`` documents of ``2P`` pieces, 8, 16 or 24 tokens each in turn."""
    return [2 * P * PIECE * (d % 3 + 1) for d in range(docs)]


def _rank(worker, doc_counts, rounds):
    import torch.distributed as dist
    P, rows = dist.get_world_size(), []
    for docs in doc_counts:
        lengths = document_lengths(P, docs)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        T = cu[-1] // P
        backend, inputs, do = SleepBackend(T, NO_SLEEP), sleep_inputs(T), torch.zeros(1, T, 1, 16)
        plans = {s: build_cp_plan(cu, layout="document_zigzag", strategy=s) for s in STRATEGIES}

        def step(plan):
            role = RankRole(plan, backend, inputs)
            role.backward(role.forward(), do)
        ms = median_times({s: (lambda p=plans[s]: step(p)) for s in STRATEGIES}, torch.device("cpu"), rounds,
                          group=dist.group.WORLD)
        rows.append(dict(P=P, docs=docs, positions_a_rank=len(plans["p2p"].rank_layouts[worker.rank].positions),
                         **{f"{s}_ms": round(ms[s] * 1e3, 3) for s in STRATEGIES}))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo processes (>= 2)")
    parser.add_argument("--docs", default="1,8,32", help="comma-separated document counts")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks must be at least 2, got {args.ranks}")
    try:
        doc_counts = [int(d) for d in args.docs.split(",")]
    except ValueError:
        parser.error(f"--docs must be comma-separated ints, got {args.docs!r}")
    if any(d < 1 for d in doc_counts):
        parser.error(f"--docs must be positive, got {args.docs!r}")
    rows = launch(_rank, args.ranks, (doc_counts, args.rounds), device="cpu")[0]
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
