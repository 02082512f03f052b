"""The global batches the benchmarks run: one sequence, or packed documents cut at rank edges.

Real training batches are packed documents, so every multi-rank suite runs them beside one long
sequence. Lengths are deterministic (fixed lists, or a seeded draw), so runs compare across commits,
and each batch holds what its name says at any size, the small ones of CPU runs included.
"""
from __future__ import annotations

import math
import random

from ..choices import BATCHES

# Seven documents of a 32K-token batch (16K tokens per rank on 2 ranks); the third crosses the edge.
DOCS_7 = (7777, 3000, 12000, 513, 1000, 1000, 7478)


def document_lengths(batch: str, total: int, seed: int = 0, median: int = 2048, sigma: float = 1.0) -> tuple[int, ...]:
    """Document lengths adding up to ``total`` tokens.

    ``one_sequence``: ``(total,)``. ``docs7``: seven documents, :data:`DOCS_7` (repeated as needed and
    cut at ``total``); below its 32,768 tokens, its lengths scaled down to ``total`` (at least 7 tokens).
    ``lognormal``: lengths drawn (``random.Random(seed)``) from a log-normal with the given median, at
    most an eighth of ``total`` (so that small batches hold several documents too), and ``sigma`` (a
    long tail: most documents short, a few long), the last one cut at ``total``.
    """
    if batch == "one_sequence":
        return (total,)
    if batch == "docs7":
        if total < sum(DOCS_7):
            return _scaled(DOCS_7, total)
        draw = iter(DOCS_7 * (total // sum(DOCS_7) + 1))
    elif batch == "lognormal":
        rng = random.Random(seed)
        mu = math.log(max(1, min(median, total // 8)))
        draw = iter(lambda: max(1, round(rng.lognormvariate(mu, sigma))), None)
    else:
        raise ValueError(f"batch must be one of {BATCHES}, got {batch!r}")
    lengths, left = [], total
    while left > 0:
        n = min(next(draw), left)
        lengths.append(n)
        left -= n
    return tuple(lengths)


def _scaled(lengths: tuple[int, ...], total: int) -> tuple[int, ...]:
    """``lengths`` scaled to add up to ``total`` (largest remainders get the rounding), each at least 1."""
    if total < len(lengths):
        raise ValueError(f"{len(lengths)} documents need at least {len(lengths)} tokens, got total={total}")
    spare = total - len(lengths)  # every document keeps one token
    exact = [spare * n / sum(lengths) for n in lengths]
    got = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: got[i] - exact[i])[:spare - sum(got)]:
        got[i] += 1
    return tuple(1 + g for g in got)


def cu_seqlens_of(lengths) -> list[int]:
    """``[0, l0, l0+l1, ...]``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def local_cu_seqlens(cu_seqlens, start: int, end: int) -> list[int]:
    """The boundaries of global tokens ``[start, end)`` of a packed batch (global ``cu_seqlens``) as a
    batch of their own: sequences cut at the edges, offsets relative to ``start``."""
    return [0] + [c - start for c in cu_seqlens if start < c < end] + [end - start]
