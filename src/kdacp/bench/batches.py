"""The global batches the benchmarks run: one sequence, or packed documents cut at rank edges.

Real training batches are packed documents, so every multi-rank suite runs them beside one long
sequence. Lengths are deterministic (fixed lists, or a seeded draw), so runs compare across commits.
"""
from __future__ import annotations

import math
import random

__all__ = ["BATCHES", "DOCS_7", "document_lengths", "cu_seqlens_of"]

# Seven documents of a 32K-token batch (16K tokens per rank on 2 ranks); the third crosses the edge.
DOCS_7 = (7777, 3000, 12000, 513, 1000, 1000, 7478)
BATCHES = ("one_sequence", "docs7", "lognormal")


def document_lengths(batch: str, total: int, seed: int = 0, median: int = 2048, sigma: float = 1.0) -> tuple[int, ...]:
    """Document lengths adding up to ``total`` tokens.

    ``one_sequence``: ``(total,)``. ``docs7``: :data:`DOCS_7` repeated as needed and cut at ``total``.
    ``lognormal``: lengths drawn (``random.Random(seed)``) from a log-normal with the given median and
    ``sigma`` (a long tail: most documents short, a few long), the last one cut at ``total``.
    """
    if batch == "one_sequence":
        return (total,)
    if batch == "docs7":
        draw = iter(DOCS_7 * (total // sum(DOCS_7) + 1))
    elif batch == "lognormal":
        rng = random.Random(seed)
        draw = iter(lambda: max(1, round(rng.lognormvariate(math.log(median), sigma))), None)
    else:
        raise ValueError(f"batch must be one of {BATCHES}, got {batch!r}")
    lengths, left = [], total
    while left > 0:
        n = min(next(draw), left)
        lengths.append(n)
        left -= n
    return tuple(lengths)


def cu_seqlens_of(lengths) -> list[int]:
    """``[0, l0, l0+l1, ...]``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu
