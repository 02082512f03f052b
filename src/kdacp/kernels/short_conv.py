"""Depthwise causal short convolution (width 2..4) as Triton kernels, forward and backward.

    y[b, t, d] = act(bias[d] + sum_{j < W} weight[d, W-1-j] * x[b, t-j, d])        act: SiLU or identity

over each sequence: a tap reaching before its sequence's first token reads zero, except that the first
sequence's taps before token 0 read ``halo`` (the previous rank's last ``W-1`` tokens) when one is given.
Shapes are FLA's: ``x [B, T, D]`` (any strides), ``weight [D, W]``, ``bias [D]``, ``halo [B, W-1, D]``,
``cu_seqlens [N+1]`` with ``B == 1``. The plain-PyTorch contract, the CPU path and the reference these
kernels are tested against is :func:`kdacp.layers.short_conv.causal_conv1d`.

Traffic is the floor: the forward reads ``x`` and writes ``y``; the backward reads ``x`` and ``dy`` and
writes ``dx``, recomputing the pre-activation in registers (nothing is saved but the inputs). Each
backward tile computes the gradient ``g`` at the pre-activation once per row and shifts it along time in
registers (``tl.gather``), so tiles overlap by ``W-1`` rows. ``dweight`` and ``dbias`` are per-program
float32 partial sums reduced once afterwards (no atomics: the results are deterministic). Sequence
boundaries are found in the kernel (a binary search of ``cu_seqlens``): no host sync, no index tensor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..validation import check_cu_seqlens, check_tensor

__all__ = ["ShortConvGrads", "causal_conv1d", "short_conv_bwd", "short_conv_fwd"]

ACTIVATIONS = (None, "silu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_WIDTH, MAX_WIDTH = 2, 4


@dataclass(frozen=True)
class _Tiles:
    """Launch shape: a program runs ``rows`` consecutive rows (a multiple of ``unroll``) of ``BD`` channels,
    one row at a time, ``unroll`` rows per loop step (their loads issued together); ``maxnreg`` caps the
    registers per thread (None: the compiler's choice)."""

    rows: int
    BD: int
    num_warps: int
    unroll: int = 8
    maxnreg: int | None = None

    def __post_init__(self):
        if self.rows % self.unroll:
            raise ValueError(f"rows must be a multiple of unroll, got rows={self.rows}, unroll={self.unroll}")

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps} | ({} if self.maxnreg is None else {"maxnreg": self.maxnreg})


# Not measured on a GPU yet: four channels a thread (8-byte bf16 loads), 128 rows a program.
FWD_TILES = _Tiles(rows=128, BD=512, num_warps=4)
BWD_TILES = _Tiles(rows=128, BD=512, num_warps=4)


@triton.jit
def _seq_of(r, cu_seqlens, n_seqs, search_steps):
    """``(n, cu_seqlens[n], cu_seqlens[n+1])``: the sequence holding row ``r`` (a scalar in ``[0, T)``)."""
    lo = r * 0
    hi = lo + n_seqs - 1
    for _ in range(search_steps):  # largest n with cu_seqlens[n] <= r
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_seqlens + mid) <= r
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo, tl.load(cu_seqlens + lo).to(tl.int32), tl.load(cu_seqlens + lo + 1).to(tl.int32)


@triton.jit
def _row(x, halo, t, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """``x[t, cols]`` as float32 ``[BD]``: zero for ``t >= T``; rows ``t < 0`` read ``halo[W-1+t]`` (zero
    without a halo)."""
    val = tl.load(x + t.to(tl.int64) * s_xt + cols * s_xd, mask=m_d & (t >= 0) & (t < T), other=0.).to(tl.float32)
    if HAS_HALO:
        val += tl.load(halo + (t + W - 1).to(tl.int64) * s_ht + cols * s_hd, mask=m_d & (t < 0) & (t > -W),
                       other=0.).to(tl.float32)
    return val


@triton.jit
def _taps(weight, bias, cols, m_d, s_wd, s_ww, W: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``(w_0, w_1, w_2, w_3, b)``, each ``[BD]`` float32: ``w_j = weight[cols, W-1-j]`` (zero for ``j >= W``)
    multiplies ``x[t-j]``; ``b`` the bias (zero without). Loaded once per program."""
    zero = tl.zeros((BD,), dtype=tl.float32)
    w_0 = tl.load(weight + cols * s_wd + (W - 1) * s_ww, mask=m_d, other=0.).to(tl.float32)
    w_1 = tl.load(weight + cols * s_wd + (W - 2) * s_ww, mask=m_d, other=0.).to(tl.float32) if W > 1 else zero
    w_2 = tl.load(weight + cols * s_wd + (W - 3) * s_ww, mask=m_d, other=0.).to(tl.float32) if W > 2 else zero
    w_3 = tl.load(weight + cols * s_wd + (W - 4) * s_ww, mask=m_d, other=0.).to(tl.float32) if W > 3 else zero
    b = tl.load(bias + cols, mask=m_d, other=0.).to(tl.float32) if HAS_BIAS else zero
    return w_0, w_1, w_2, w_3, b


@triton.jit
def _fwd_row(x, halo, y, t, t0, cols, m_d, T, x_1, x_2, x_3, n, nxt, cu_seqlens, n_seqs, w_0, w_1, w_2, w_3, b,
             s_xt, s_xd, s_ht, s_hd, s_yt, s_yd,
             W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One row ``t`` of the forward: ``x_1, x_2, x_3`` hold ``x[t-1], x[t-2], x[t-3]`` of ``t``'s sequence
    (a sequence starting at ``t``, the one after ``n``, empties them first); ``y[t]`` is stored for
    ``t0 <= t < T``. Returns the window and the sequence state for row ``t + 1``."""
    x_0 = _row(x, halo, t, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    if IS_VARLEN:
        new = t == nxt
        x_1 = tl.where(new, 0., x_1)
        x_2 = tl.where(new, 0., x_2)
        x_3 = tl.where(new, 0., x_3)
        n += new.to(tl.int32)
        nxt = tl.where(new, tl.load(cu_seqlens + n + 1, mask=new & (n < n_seqs), other=2 ** 30).to(tl.int32), nxt)
    out = x_0 * w_0 + x_1 * w_1 + x_2 * w_2 + x_3 * w_3 + b
    if SILU:
        out = out * tl.sigmoid(out)
    tl.store(y + t.to(tl.int64) * s_yt + cols * s_yd, out.to(y.dtype.element_ty), mask=m_d & (t >= t0) & (t < T))
    return x_0, x_1, x_2, n, nxt


@triton.jit
def _fwd_kernel(x, halo, weight, bias, y, cu_seqlens, T, D, n_seqs, search_steps, rows,
                s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd,
                W: tl.constexpr, BD: tl.constexpr, UNROLL: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program ``(i_d, i_t, i_b)``: rows ``[i_t * rows, (i_t + 1) * rows)``, in order, after ``W-1`` rows that
    fill the window."""
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    y += i_b.to(tl.int64) * s_yb
    cols = i_d * BD + tl.arange(0, BD)
    m_d = cols < D
    w_0, w_1, w_2, w_3, b = _taps(weight, bias, cols, m_d, s_wd, s_ww, W, BD, HAS_BIAS)
    t0 = i_t * rows
    x_1 = tl.zeros((BD,), dtype=tl.float32)
    x_2 = x_1
    x_3 = x_1
    n = t0 * 0
    nxt = n + 2 ** 30
    if IS_VARLEN:
        n, _, nxt = _seq_of(tl.maximum(t0 - (W - 1), 0), cu_seqlens, n_seqs, search_steps)
    for k in tl.static_range(W - 1):
        x_1, x_2, x_3, n, nxt = _fwd_row(x, halo, y, t0 - (W - 1) + k, t0, cols, m_d, T, x_1, x_2, x_3, n, nxt,
                                         cu_seqlens, n_seqs, w_0, w_1, w_2, w_3, b, s_xt, s_xd, s_ht, s_hd, s_yt,
                                         s_yd, W, SILU, HAS_HALO, IS_VARLEN)
    for c in range(tl.cdiv(tl.minimum(rows, T - t0), UNROLL)):  # the last program stops at T
        for k in tl.static_range(UNROLL):
            x_1, x_2, x_3, n, nxt = _fwd_row(x, halo, y, t0 + c * UNROLL + k, t0, cols, m_d, T, x_1, x_2, x_3, n,
                                             nxt, cu_seqlens, n_seqs, w_0, w_1, w_2, w_3, b, s_xt, s_xd, s_ht, s_hd,
                                             s_yt, s_yd, W, SILU, HAS_HALO, IS_VARLEN)


@triton.jit
def _bwd_row(x, halo, dy, dx, dhalo, t, t0, t1, cols, m_d, T, x_0, x_1, x_2, g_1, g_2, g_3, n, start,
             dw_0, dw_1, dw_2, dw_3, db, cu_seqlens, w_0, w_1, w_2, w_3, b,
             s_xt, s_xd, s_ht, s_hd, s_yt, s_yd, s_gt, s_gd, s_qt, s_qd,
             W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr, IS_VARLEN: tl.constexpr):
    """One row ``t`` of the backward, rows in descending order: ``x_0, x_1, x_2`` hold ``x[t], x[t-1],
    x[t-2]``; ``g_1, g_2, g_3`` the gradients at the pre-activation of ``t+1, t+2, t+3`` in ``t``'s sequence
    (emptied when ``t`` falls below the start of the sequence ``n``). Owned rows ``t0 <= t < t1`` store
    ``dx[t]`` and add their ``dweight``, ``dbias`` terms; rows ``t < 0`` store ``dhalo``. Returns the state
    for row ``t - 1``."""
    x_3 = _row(x, halo, t - 3, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    if IS_VARLEN:
        below = t < start
        g_1 = tl.where(below, 0., g_1)
        g_2 = tl.where(below, 0., g_2)
        g_3 = tl.where(below, 0., g_3)
        n -= below.to(tl.int32)
        start = tl.where(below, tl.load(cu_seqlens + n).to(tl.int32), start)
        if HAS_HALO:
            start = tl.where(below & (n == 0), 1 - W, start)
        t_1 = tl.where(t - 1 >= start, x_1, 0.)
        t_2 = tl.where(t - 2 >= start, x_2, 0.)
        t_3 = tl.where(t - 3 >= start, x_3, 0.)
    else:
        t_1, t_2, t_3 = x_1, x_2, x_3
    g = tl.load(dy + t.to(tl.int64) * s_yt + cols * s_yd, mask=m_d & (t >= 0) & (t < T), other=0.).to(tl.float32)
    if SILU:
        pre = x_0 * w_0 + t_1 * w_1 + t_2 * w_2 + t_3 * w_3 + b
        sig = tl.sigmoid(pre)
        g = g * sig * (1 + pre * (1 - sig))
    out = g * w_0 + g_1 * w_1 + g_2 * w_2 + g_3 * w_3
    own = (t >= t0) & (t < t1)
    tl.store(dx + t.to(tl.int64) * s_gt + cols * s_gd, out.to(dx.dtype.element_ty), mask=m_d & own)
    if HAS_HALO:
        tl.store(dhalo + (t + W - 1).to(tl.int64) * s_qt + cols * s_qd, out.to(dhalo.dtype.element_ty),
                 mask=m_d & (t < 0))
    g_own = tl.where(own, g, 0.)
    dw_0 += g_own * x_0
    dw_1 += g_own * t_1
    dw_2 += g_own * t_2
    dw_3 += g_own * t_3
    db += g_own
    return x_1, x_2, x_3, g, g_1, g_2, n, start, dw_0, dw_1, dw_2, dw_3, db


@triton.jit
def _bwd_kernel(x, halo, weight, bias, dy, dx, dhalo, dw_part, db_part, cu_seqlens, T, D, n_seqs, search_steps,
                rows, s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd, s_gb, s_gt, s_gd,
                s_qb, s_qt, s_qd,
                W: tl.constexpr, BD: tl.constexpr, UNROLL: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program ``(i_d, i_t, i_b)`` owns rows ``[i_t * rows, (i_t + 1) * rows)`` (up to ``T``, rounded up to
    ``UNROLL``) and walks them downwards after ``W-1`` rows above them (the gradient of the owned rows' later taps); program 0 then walks the
    halo's rows (``dhalo``). ``dweight``/``dbias`` partial sums go to ``dw_part [B, programs, W, D]``."""
    i_d, i_t, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    dy += i_b.to(tl.int64) * s_yb
    dx += i_b.to(tl.int64) * s_gb
    dhalo += i_b.to(tl.int64) * s_qb
    cols = i_d * BD + tl.arange(0, BD)
    m_d = cols < D
    w_0, w_1, w_2, w_3, b = _taps(weight, bias, cols, m_d, s_wd, s_ww, W, BD, HAS_BIAS)
    t0 = i_t * rows
    t1 = tl.minimum(t0 + rows, T)
    span = tl.cdiv(t1 - t0, UNROLL) * UNROLL  # the last program starts at T, not at t0 + rows
    top = t0 + span + W - 2
    x_0 = _row(x, halo, top, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_1 = _row(x, halo, top - 1, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_2 = _row(x, halo, top - 2, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    zero = tl.zeros((BD,), dtype=tl.float32)
    g_1, g_2, g_3 = zero, zero, zero
    dw_0, dw_1, dw_2, dw_3, db = zero, zero, zero, zero, zero
    n = t0 * 0
    start = n + (1 - W if HAS_HALO else 0)
    if IS_VARLEN:
        n, start, _ = _seq_of(tl.minimum(top, T - 1), cu_seqlens, n_seqs, search_steps)
        if HAS_HALO:
            start = tl.where(n == 0, 1 - W, start)
    for k in tl.static_range(W - 1):
        x_0, x_1, x_2, g_1, g_2, g_3, n, start, dw_0, dw_1, dw_2, dw_3, db = _bwd_row(
            x, halo, dy, dx, dhalo, top - k, t0, t1, cols, m_d, T, x_0, x_1, x_2, g_1, g_2, g_3, n, start,
            dw_0, dw_1, dw_2, dw_3, db, cu_seqlens, w_0, w_1, w_2, w_3, b, s_xt, s_xd, s_ht, s_hd, s_yt, s_yd,
            s_gt, s_gd, s_qt, s_qd, W, SILU, HAS_HALO, IS_VARLEN)
    for c in range(span // UNROLL):
        for k in tl.static_range(UNROLL):
            x_0, x_1, x_2, g_1, g_2, g_3, n, start, dw_0, dw_1, dw_2, dw_3, db = _bwd_row(
                x, halo, dy, dx, dhalo, t0 + span - 1 - c * UNROLL - k, t0, t1, cols, m_d, T, x_0, x_1, x_2, g_1,
                g_2, g_3, n, start, dw_0, dw_1, dw_2, dw_3, db, cu_seqlens, w_0, w_1, w_2, w_3, b, s_xt, s_xd,
                s_ht, s_hd, s_yt, s_yd, s_gt, s_gd, s_qt, s_qd, W, SILU, HAS_HALO, IS_VARLEN)
    if HAS_HALO:
        if i_t == 0:
            for k in tl.static_range(W - 1):
                x_0, x_1, x_2, g_1, g_2, g_3, n, start, dw_0, dw_1, dw_2, dw_3, db = _bwd_row(
                    x, halo, dy, dx, dhalo, t0 - 1 - k, t0, t1, cols, m_d, T, x_0, x_1, x_2, g_1, g_2, g_3, n, start,
                    dw_0, dw_1, dw_2, dw_3, db, cu_seqlens, w_0, w_1, w_2, w_3, b, s_xt, s_xd, s_ht, s_hd, s_yt,
                    s_yd, s_gt, s_gd, s_qt, s_qd, W, SILU, HAS_HALO, IS_VARLEN)
    part = dw_part + (i_b * tl.num_programs(1) + i_t).to(tl.int64) * W * D + cols
    tl.store(part + (W - 1) * D, dw_0, mask=m_d)
    tl.store(part + (W - 2) * D, dw_1, mask=m_d)
    if W > 2:
        tl.store(part + (W - 3) * D, dw_2, mask=m_d)
    if W > 3:
        tl.store(part + (W - 4) * D, dw_3, mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + (i_b * tl.num_programs(1) + i_t).to(tl.int64) * D + cols, db, mask=m_d)


class ShortConvGrads(NamedTuple):
    """Gradients of :func:`causal_conv1d`: ``dx`` like ``x``; ``dweight [D, W]`` like ``weight``; ``dbias``
    and ``dhalo`` like theirs, or None where there is none (or none was asked for)."""

    dx: torch.Tensor
    dweight: torch.Tensor
    dbias: torch.Tensor | None
    dhalo: torch.Tensor | None


def _varlen_args(cu_seqlens: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """``(cu_seqlens or a dummy pointer, N, binary-search steps over [0, N-1])``."""
    if cu_seqlens is None:
        return x, 1, 0
    n = cu_seqlens.numel() - 1
    return cu_seqlens, n, (n - 1).bit_length()


def short_conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None, tiles: _Tiles | None = None) -> torch.Tensor:
    """``y [B, T, D]`` in ``x``'s dtype (contiguous), for checked inputs (see :func:`causal_conv1d`);
    ``tiles`` default :data:`FWD_TILES`."""
    tiles = tiles or FWD_TILES
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    grid = (triton.cdiv(D, tiles.BD), triton.cdiv(T, tiles.rows), B)
    _fwd_kernel[grid](x, h, weight, x if bias is None else bias, y, cu, T, D, n_seqs, steps, tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *y.stride(),
                      W=W, BD=tiles.BD, UNROLL=tiles.unroll, SILU=activation == "silu", HAS_HALO=halo is not None,
                      HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None, **tiles.launch_options())
    return y


def short_conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None, dy: torch.Tensor, want_dhalo: bool = True,
                   tiles: _Tiles | None = None) -> ShortConvGrads:
    """The gradients for ``dy [B, T, D]`` (any strides), recomputing the pre-activation from ``x``;
    ``want_dhalo=False`` skips ``dhalo``; ``tiles`` default :data:`BWD_TILES`."""
    tiles = tiles or BWD_TILES
    B, T, D = x.shape
    W = weight.shape[1]
    n_programs = triton.cdiv(T, tiles.rows)
    dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    dhalo = torch.empty(B, W - 1, D, dtype=halo.dtype, device=x.device) if halo is not None else None
    # every program writes its slice of the partial sums: no zero fill needed
    dw_part = torch.empty(B, n_programs, W, D, dtype=torch.float32, device=x.device)
    db_part = torch.empty(B, n_programs, D, dtype=torch.float32, device=x.device) if bias is not None else None
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    q = dx if dhalo is None else dhalo
    grid = (triton.cdiv(D, tiles.BD), n_programs, B)
    _bwd_kernel[grid](x, h, weight, x if bias is None else bias, dy, dx, q, dw_part,
                      dw_part if db_part is None else db_part, cu, T, D, n_seqs, steps, tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *dy.stride(), *dx.stride(), *q.stride(),
                      W=W, BD=tiles.BD, UNROLL=tiles.unroll, SILU=activation == "silu", HAS_HALO=halo is not None,
                      HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None, **tiles.launch_options())
    dweight = dw_part.sum((0, 1)).t().to(weight.dtype)
    dbias = None if db_part is None else db_part.sum((0, 1)).to(bias.dtype)
    return ShortConvGrads(dx, dweight, dbias, dhalo if want_dhalo else None)


class _ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, halo, cu_seqlens, activation):
        ctx.save_for_backward(x, weight, bias, halo, cu_seqlens)
        ctx.activation = activation
        return short_conv_fwd(x, weight, bias, halo, cu_seqlens, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, halo, cu_seqlens = ctx.saved_tensors
        grads = short_conv_bwd(x, weight, bias, halo, cu_seqlens, ctx.activation, dy,
                               want_dhalo=ctx.needs_input_grad[3])
        return grads.dx, grads.dweight, grads.dbias, grads.dhalo, None, None


def _check_inputs(x, weight, bias, halo, cu_seqlens, cu_seqlens_cpu, activation) -> None:
    check_tensor("x", x, ndim=3)
    check_tensor("weight", weight, ndim=2)
    if x.dtype not in DTYPES:
        raise TypeError(f"x must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x is on {x.device}; the kernels need a CUDA device (or TRITON_INTERPRET=1 set before "
                         "triton is imported)")
    B, T, D = x.shape
    if T < 1 or D < 1:
        raise ValueError(f"x must have at least one token and one channel, got shape {tuple(x.shape)}")
    if weight.shape[0] != D or not MIN_WIDTH <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight must have shape [D={D}, W] with {MIN_WIDTH} <= W <= {MAX_WIDTH}, "
                         f"got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != D:
            raise ValueError(f"bias must have shape [D={D}], got {tuple(bias.shape)}")
    if halo is not None:
        check_tensor("halo", halo, ndim=3)
        if tuple(halo.shape) != (B, W - 1, D):
            raise ValueError(f"halo must have shape [B={B}, W-1={W - 1}, D={D}], got {tuple(halo.shape)}")
        if halo.dtype != x.dtype:
            raise TypeError(f"halo must have x's dtype ({x.dtype}), got {halo.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("halo", halo), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must share a device")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, B, T)
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be cu_seqlens' host copy, got shapes {tuple(cu_seqlens_cpu.shape)} "
                             f"and {tuple(cu_seqlens.shape)}")
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens; pass cu_seqlens too")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  halo: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_cpu: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """``act(sum_j weight[:, W-1-j] * x[t-j] + bias)`` over each sequence, differentiable in ``x``,
    ``weight``, ``bias`` and ``halo`` (the module docstring has the math).

    Args:
        x: ``[B, T, D]`` bfloat16, float16 or float32, any strides (a q|k|v slice needs no copy).
        weight: ``[D, W]``, ``2 <= W <= 4``, any float dtype (tap ``W-1`` multiplies the current token).
        bias: ``[D]`` or None.
        halo: ``[B, W-1, D]`` in ``x``'s dtype: the ``W-1`` tokens before ``x[:, 0]`` of the sequence that
            continues into ``x[:, 0]``; None: ``x`` starts its sequences.
        cu_seqlens: ``[N+1]`` int boundaries of packed sequences (``B == 1``), on ``x``'s device.
        cu_seqlens_cpu: the same on the host, if at hand: the check then reads it instead of syncing.
        activation: ``"silu"`` or None.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype, contiguous.

    Raises:
        TypeError, ValueError: naming the argument, before any kernel runs.
    """
    _check_inputs(x, weight, bias, halo, cu_seqlens, cu_seqlens_cpu, activation)
    return _ShortConvFunction.apply(x, weight, bias, halo, cu_seqlens, activation)
