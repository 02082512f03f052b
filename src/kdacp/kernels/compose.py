"""Composition of affine state summaries: the fold kernel behind the launchers, and the small
float32 apply/compose helpers used by the exchange.

A summary acts as ``S_out = M S_in + S_ext`` (forward) or ``dS_in = M^T dS_out + G`` (backward);
``(M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2)``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .utils import F32_DOT

__all__ = ["StateSummary", "apply_state_summary", "apply_state_gradient_summary", "compose_state_summaries",
           "fold_summaries"]


class StateSummary(NamedTuple):
    """``S_out = M S_in + S_ext``: ``state`` is ``S_ext [N, HV, K, V]``, ``transition`` is ``M [N, HV, K, K]``
    (float32; either may be ``None`` when not requested)."""

    state: torch.Tensor | None
    transition: torch.Tensor | None


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


class _Float32Math:
    """Float32 math with autocast off; where matmuls may run in TF32, compute in float64 instead."""

    def __init__(self, device: torch.device):
        self.device = device
        self.autocast = torch.autocast(device_type=device.type, enabled=False)

    def __enter__(self):
        self.autocast.__enter__()
        return torch.float64 if torch.get_float32_matmul_precision() != "highest" else torch.float32

    def __exit__(self, *exc):
        self.autocast.__exit__(*exc)


def _check_pair(name_a, a, name_b, b, b_last):
    for n, x in ((name_a, a), (name_b, b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{n} must have at least 2 dims [..., K, *], got shape {tuple(x.shape)}")
    K = a.shape[-2]
    if tuple(a.shape[-2:]) != (K, K):
        raise ValueError(f"{name_a} must be square in its last two dims [..., K, K], got {tuple(a.shape)}")
    if b.shape[-2] != K or (b_last is not None and b.shape[-1] != b_last):
        raise ValueError(f"{name_b} must have shape [..., K={K}, *], got {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}")


def apply_state_summary(S_ext: torch.Tensor, M: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """``M S_in + S_ext``: ``M [..., K, K]``, ``S_in, S_ext [..., K, V]`` -> float32 (also under autocast)."""
    _check_pair("M", M, "S_in", S_in, None)
    _check_pair("M", M, "S_ext", S_ext, S_in.shape[-1])
    with _Float32Math(M.device) as dt:
        return (M.to(dt) @ S_in.to(dt) + S_ext.to(dt)).float()


def apply_state_gradient_summary(G: torch.Tensor, M: torch.Tensor, dS_out: torch.Tensor) -> torch.Tensor:
    """``M^T dS_out + G``: ``M [..., K, K]``, ``dS_out, G [..., K, V]`` -> float32 (also under autocast)."""
    _check_pair("M", M, "dS_out", dS_out, None)
    _check_pair("M", M, "G", G, dS_out.shape[-1])
    with _Float32Math(M.device) as dt:
        return (M.to(dt).transpose(-1, -2) @ dS_out.to(dt) + G.to(dt)).float()


def compose_state_summaries(first, second) -> StateSummary:
    """Summary of ``first`` followed by ``second`` (each ``(S_ext, M)``): ``(M2 S1 + S2, M2 M1)``, float32."""
    (S1, M1), (S2, M2) = first, second
    _check_pair("second M", M2, "first M", M1, M2.shape[-1])
    _check_pair("second M", M2, "first S_ext", S1, None)
    _check_pair("second M", M2, "second S_ext", S2, S1.shape[-1])
    with _Float32Math(M2.device) as dt:
        M2w = M2.to(dt)
        return StateSummary((M2w @ S1.to(dt) + S2.to(dt)).float(), (M2w @ M1.to(dt)).float())
