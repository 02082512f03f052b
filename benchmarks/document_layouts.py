#!/usr/bin/env python
"""Layouts of a packed batch: the ranks' causal attention balance beside the states a rank passes on.

A packed batch's layout sets two costs that pull apart: the softmax attention layers wait for the rank with the
most key-query pairs, and the token mixers pass one state per piece of a document cut across ranks (a
``[HV, K, V]`` message and an ``M x + S`` product each, both directions). For log-normal documents
(:func:`kdacp.bench.batches.document_lengths`, ``--tokens`` a rank, ``--seeds`` batches), per rank count ``P`` and
layout: ``attention``, the max over mean of the ranks' pairs (:func:`kdacp.bench.hybrid_model.attention_balance`);
``receiving``, the most pieces on one rank whose first token is not a document's (each receives a state going
forward, and as many send one back); ``cut``, documents held by more than one rank; the worst over the seeds
of each. Layouts: ``contiguous``, ``document_zigzag``, and ``balanced`` / ``balanced/8``
(:func:`kdacp.cp.layout.balanced_document_layout` with documents under a quarter / an eighth of a rank's
tokens kept whole). Exact counts, no timing.

    python benchmarks/document_layouts.py [--ranks 2,8,16,64] [--tokens 16384] [--seeds 4]
"""
from __future__ import annotations

import argparse
import bisect

from kdacp.bench.batches import cu_seqlens_of, document_lengths
from kdacp.bench.harness import markdown_table
from kdacp.bench.hybrid_model import attention_balance
from kdacp.cp.layout import TokenLayout, balanced_document_layout, contiguous_layout, document_zigzag_layout

LAYOUTS = {
    "contiguous": lambda cu, P: contiguous_layout(cu[-1], P),
    "document_zigzag": document_zigzag_layout,
    "balanced": balanced_document_layout,
    "balanced/8": lambda cu, P: balanced_document_layout(cu, P, whole_below=max(1, cu[-1] // (8 * P))),
}


def receiving(layout: TokenLayout, cu: list[int]) -> int:
    """The most ranges on one rank that start inside a document."""
    starts = set(cu)
    return max(sum(s not in starts for s, _ in ranges) for ranges in layout.ranges)


def cut_documents(layout: TokenLayout, cu: list[int]) -> int:
    """Documents whose tokens more than one rank holds."""
    owners = [set() for _ in cu[:-1]]
    for rank, ranges in enumerate(layout.ranges):
        for s, e in ranges:
            doc = bisect.bisect_right(cu, s) - 1  # the document holding token s, then those after it
            while doc < len(cu) - 1 and cu[doc] < e:
                owners[doc].add(rank)
                doc += 1
    return sum(len(o) > 1 for o in owners)


def rows(ranks, tokens: int, seeds: int) -> list[dict]:
    out = []
    for P in ranks:
        batches = [cu_seqlens_of(document_lengths("lognormal", tokens * P, seed=seed)) for seed in range(seeds)]
        for name, make in LAYOUTS.items():
            layouts = [(make(cu, P), cu) for cu in batches]
            out.append(dict(P=P, layout=name, documents=max(len(cu) - 1 for cu in batches),
                            attention=round(max(attention_balance(L, cu) for L, cu in layouts), 3),
                            receiving=max(receiving(L, cu) for L, cu in layouts),
                            cut=max(cut_documents(L, cu) for L, cu in layouts)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8,16,64", help="comma-separated rank counts")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens a rank")
    parser.add_argument("--seeds", type=int, default=4, help="batches of log-normal documents")
    args = parser.parse_args(argv)
    ranks = [int(p) for p in args.ranks.split(",")]
    if args.tokens < 1 or args.seeds < 1 or any(p < 1 for p in ranks):
        parser.error("--ranks, --tokens and --seeds must be positive")
    print(markdown_table(rows(ranks, args.tokens, args.seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
