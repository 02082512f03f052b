"""The fold kernel behind the summary launchers: sub-segment summaries composed on the GPU.

A summary acts as ``S_out = M S_in + S_ext`` (forward) or ``dS_in = M^T dS_out + G`` (backward);
``(M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2)``. The same algebra on the host is :mod:`kdacp.affine`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .precision import F32_DOT


@triton.jit
def _fold_kernel(ws, seqs, out_a, out_t, HV, K: tl.constexpr, NCOL: tl.constexpr, TOFF: tl.constexpr,
                 BV: tl.constexpr, REVERSE: tl.constexpr):
    """Fold each sequence's sub-segment summaries, one ``[K, BV]`` column tile per program.

    ``ws [NW, HV, K, NCOL]`` float32 holds ``[A | T]`` per sub-segment: ``A`` (columns ``< TOFF``) is
    ``S_ext`` or ``G``, ``T`` (``K`` columns from ``TOFF``) is ``M`` or ``M^T``. Forward:
    ``acc <- T_p acc + A_p`` over ``p = 1..P-1``; ``REVERSE``: the same from the last sub-segment down.
    ``out_a [N, HV, K, TOFF]``, ``out_t [N, HV, K, K]``.
    """
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(seqs + 2 * i_n)
    count = tl.load(seqs + 2 * i_n + 1)
    o_k = tl.arange(0, K)
    o_c = i_c * BV + tl.arange(0, BV)
    m_a = o_c < TOFF
    p0 = first + count - 1 if REVERSE else first
    tile = o_k[:, None] * NCOL + o_c[None, :]
    acc = tl.load(ws + (p0 * HV + i_h).to(tl.int64) * K * NCOL + tile)
    for j in range(1, count):
        p = first + count - 1 - j if REVERSE else first + j
        base = ws + (p * HV + i_h).to(tl.int64) * K * NCOL
        b_t = tl.load(base + o_k[:, None] * NCOL + TOFF + o_k[None, :])
        # transition columns have no additive part
        b_a = tl.load(base + tile, mask=m_a[None, :], other=0.0)
        acc = tl.dot(b_t, acc, b_a, input_precision=F32_DOT)
    out_base = (i_n * HV + i_h).to(tl.int64) * K
    if TOFF > 0:
        tl.store(out_a + (out_base + o_k[:, None]) * TOFF + o_c[None, :], acc, mask=m_a[None, :])
    tl.store(out_t + (out_base + o_k[:, None]) * K + (o_c - TOFF)[None, :], acc, mask=(o_c >= TOFF)[None, :])


def fold_summaries(ws: torch.Tensor, seqs: torch.Tensor, num_seqs: int, a_cols: int, want_a: bool, want_t: bool,
                   reverse: bool, block_v: int):
    """Fold ``ws [NW, HV, K, a_cols + K]`` (``a_cols + K`` columns when the transition part is present,
    else ``a_cols``) into ``(A [N, HV, K, a_cols] or None, T [N, HV, K, K] or None)``."""
    _, HV, K, NCOL = ws.shape
    toff = a_cols if want_a else 0
    out_a = ws.new_empty(num_seqs, HV, K, a_cols) if want_a else None
    out_t = ws.new_empty(num_seqs, HV, K, K) if want_t else None
    ncols = (a_cols if want_a else 0) + (K if want_t else 0)
    grid = (triton.cdiv(ncols, block_v), num_seqs, HV)
    if want_t and not want_a:
        # transition-only workspaces hold just the K transition columns
        assert NCOL == K
    _fold_kernel[grid](ws, seqs, ws if out_a is None else out_a, ws if out_t is None else out_t, HV, K=K,
                       NCOL=NCOL, TOFF=toff, BV=block_v, REVERSE=reverse, num_warps=4)
    return out_a, out_t
