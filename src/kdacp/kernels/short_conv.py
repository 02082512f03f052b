"""Depthwise causal short convolution (width 2..4) as Triton kernels, forward and backward.

    y[b, t, d] = act(bias[d] + sum_{j < W} weight[d, W-1-j] * x[b, t-j, d])        act: SiLU or identity

over each sequence: a tap reaching before its sequence's first token reads zero, except that the first
sequence's taps before token 0 read ``halo`` (the previous rank's last ``W-1`` tokens) when one is given.
Shapes are FLA's: ``x [B, T, D]`` (any strides), ``weight [D, W]``, ``bias [D]``, ``halo [B, W-1, D]``,
``cu_seqlens [N+1]`` with ``B == 1``. The plain-PyTorch contract, the CPU path and the reference these
kernels are tested against is :func:`kdacp.layers.short_conv.causal_conv1d`.

The bytes moved are the floor: the forward reads ``x`` and writes ``y``; the backward reads ``x`` and ``dy``
and writes ``dx``, recomputing the pre-activation in registers (nothing is saved but the inputs). The speed
is not (one H200: about 50% of the memory bandwidth forward, 22% backward; README, Limits). Each
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
class ConvTiles:
    """Launch shape: ``BT`` rows x ``BD`` channels per tile, ``tiles`` tiles per program;
    ``maxnreg`` caps the registers per thread (None: the compiler's choice)."""

    BT: int
    BD: int
    num_warps: int
    tiles: int = 1
    maxnreg: int | None = None

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps} | ({} if self.maxnreg is None else {"maxnreg": self.maxnreg})


# The fastest of kdacp.bench.kernels.sweep_conv's tilings (least time summed over one sequence and 13 documents
# after a halo; T=16K, D=4096, bf16, W=4) on one H200, 2026-12-02.
FWD_TILES = ConvTiles(BT=32, BD=128, num_warps=4)
BWD_TILES = ConvTiles(BT=64, BD=32, num_warps=4, tiles=1, maxnreg=128)


@triton.jit
def _seq_bounds(rows, cu_seqlens, n_seqs, search_steps, T, W: tl.constexpr, HAS_HALO: tl.constexpr,
                IS_VARLEN: tl.constexpr):
    """``(start, end)`` of each row's sequence: ``start`` the first row its taps may read (the sequence's
    first token, or ``-(W-1)``, the halo, in the first sequence when there is a halo), ``end`` the next
    sequence's first token. ``rows`` outside ``[0, T)`` count as the nearest row in it."""
    if IS_VARLEN:
        r = tl.minimum(tl.maximum(rows, 0), T - 1)
        lo = tl.zeros_like(rows)
        hi = lo + n_seqs - 1
        for _ in range(search_steps):  # largest n with cu_seqlens[n] <= r
            mid = (lo + hi + 1) // 2
            below = tl.load(cu_seqlens + mid) <= r
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid - 1)
        start = tl.load(cu_seqlens + lo).to(tl.int32)
        end = tl.load(cu_seqlens + lo + 1).to(tl.int32)
        if HAS_HALO:
            start = tl.where(lo == 0, 1 - W, start)
    else:
        start = tl.zeros_like(rows) + (1 - W if HAS_HALO else 0)
        end = tl.zeros_like(rows) + T
    return start, end


@triton.jit
def _load_rows(x, halo, rows, cols, mask, s_xt, s_xd, s_ht, s_hd, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """``x[rows, cols]`` as float32 where ``mask`` (zero elsewhere); rows ``< 0`` read ``halo[W-1+rows]``."""
    r = rows.to(tl.int64)[:, None]
    val = tl.load(x + r * s_xt + cols[None, :] * s_xd, mask=mask & (r >= 0), other=0.).to(tl.float32)
    if HAS_HALO:
        val += tl.load(halo + (r + W - 1) * s_ht + cols[None, :] * s_hd, mask=mask & (r < 0), other=0.).to(tl.float32)
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
def _tap_rows(x, halo, rows, start, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, j: tl.constexpr, W: tl.constexpr,
              HAS_HALO: tl.constexpr):
    """``x[rows - j]`` (float32 ``[BT, BD]``) where that tap stays inside its row's sequence, zero elsewhere."""
    m = ((rows < T) & (rows - j >= start))[:, None] & m_d[None, :]
    return _load_rows(x, halo, rows - j, cols, m, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)


@triton.jit
def _fwd_kernel(x, halo, weight, bias, y, cu_seqlens, T, D, n_seqs, search_steps, tiles_per_program,
                s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd,
                W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program ``(i_d, i_p, i_b)``: ``tiles_per_program`` tiles of ``BT`` rows from row
    ``i_p * BT * tiles_per_program``, each tap ``x[t-j]`` loaded shifted (the earlier rows come from cache)."""
    i_d, i_p, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    y += i_b.to(tl.int64) * s_yb
    cols = i_d * BD + tl.arange(0, BD)
    m_d = cols < D
    w_0, w_1, w_2, w_3, b = _taps(weight, bias, cols, m_d, s_wd, s_ww, W, BD, HAS_BIAS)
    for k in range(tiles_per_program):
        rows = (i_p * tiles_per_program + k) * BT + tl.arange(0, BT)
        m = (rows < T)[:, None] & m_d[None, :]
        start, _ = _seq_bounds(rows, cu_seqlens, n_seqs, search_steps, T, W, HAS_HALO, IS_VARLEN)
        out = _load_rows(x, halo, rows, cols, m, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO) * w_0[None, :] + b[None, :]
        for j in tl.static_range(1, W):
            w_j = w_1 if j == 1 else (w_2 if j == 2 else w_3)
            out += _tap_rows(x, halo, rows, start, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, j, W, HAS_HALO) * w_j[None, :]
        if SILU:
            out = out * tl.sigmoid(out)
        tl.store(y + rows.to(tl.int64)[:, None] * s_yt + cols[None, :] * s_yd, out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _bwd_kernel(x, halo, weight, bias, dy, dx, dhalo, dw_part, db_part, cu_seqlens, T, D, n_seqs, search_steps,
                n_blocks, tiles_per_program,
                s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd, s_gb, s_gt, s_gd, s_qb, s_qt, s_qd,
                W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program ``(i_d, i_p, i_b)``: ``tiles_per_program`` tiles of ``S = BT-(W-1)`` owned rows each from
    row ``i_p * S * tiles_per_program``; program ``i_p == n_blocks`` (launched with a halo) owns the halo
    rows ``[-(W-1), 0)``. A tile computes ``g = dy * act'(pre)`` on all its ``BT`` rows (its taps ``x[v-j]``
    loaded shifted, inside ``v``'s sequence) and, for each owned row ``u``, ``dx[u] = sum_i weight[W-1-i] g[u+i]``
    over the ``i`` where row ``u+i`` is in ``u``'s sequence (``g`` shifted along time in registers by
    ``tl.gather``); the ``dweight`` terms ``g[v] x[v-j]`` and the ``dbias`` terms ``g[v]`` of owned rows ``v``
    accumulate element-wise in ``[BT, BD]`` float32 and are summed over rows once, at the program's end.
    The next tile's ``x`` and ``dy`` rows are loaded before the current tile's arithmetic, so that their
    latency hides behind it."""
    S: tl.constexpr = BT - (W - 1)
    i_d, i_p, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    dy += i_b.to(tl.int64) * s_yb
    dx += i_b.to(tl.int64) * s_gb
    dhalo += i_b.to(tl.int64) * s_qb
    cols = i_d * BD + tl.arange(0, BD)
    m_d = cols < D
    o_t = tl.arange(0, BT)
    is_halo = i_p == n_blocks
    first = tl.where(is_halo, 1 - W, i_p * S * tiles_per_program)
    n_tiles = tl.where(is_halo, 1, tiles_per_program)
    own_end = tl.where(is_halo, 0, T)
    w_0, w_1, w_2, w_3, b = _taps(weight, bias, cols, m_d, s_wd, s_ww, W, BD, HAS_BIAS)
    dw_0 = tl.zeros((BT, BD), dtype=tl.float32)  # terms of weight[:, W-1-j] in dw_j
    dw_1 = tl.zeros((BT, BD), dtype=tl.float32)
    dw_2 = tl.zeros((BT, BD), dtype=tl.float32)
    dw_3 = tl.zeros((BT, BD), dtype=tl.float32)
    db = tl.zeros((BT, BD), dtype=tl.float32)
    rows = first + o_t
    x_next = _load_rows(x, halo, rows, cols, (rows < T)[:, None] & m_d[None, :], s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    valid = ((rows >= 0) & (rows < T))[:, None] & m_d[None, :]
    dy_next = tl.load(dy + rows.to(tl.int64)[:, None] * s_yt + cols[None, :] * s_yd, mask=valid, other=0.)
    for k in range(n_tiles):
        rows = first + k * S + o_t
        x_0, g = x_next, dy_next.to(tl.float32)
        ahead = rows + S
        m_ahead = (k + 1 < n_tiles) & (ahead < T)
        x_next = _load_rows(x, halo, ahead, cols, m_ahead[:, None] & m_d[None, :], s_xt, s_xd, s_ht, s_hd, W,
                            HAS_HALO)
        dy_next = tl.load(dy + ahead.to(tl.int64)[:, None] * s_yt + cols[None, :] * s_yd,
                          mask=(m_ahead & (ahead >= 0))[:, None] & m_d[None, :], other=0.)
        own = (o_t < S) & (rows < own_end)
        start, end = _seq_bounds(rows, cu_seqlens, n_seqs, search_steps, T, W, HAS_HALO, IS_VARLEN)
        valid = ((rows >= 0) & (rows < T))[:, None] & m_d[None, :]
        x_1 = _tap_rows(x, halo, rows, start, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, 1, W, HAS_HALO)
        x_2 = _tap_rows(x, halo, rows, start, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, 2, W, HAS_HALO) if W > 2 else x_1
        x_3 = _tap_rows(x, halo, rows, start, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, 3, W, HAS_HALO) if W > 3 else x_1
        if SILU:
            pre = x_0 * w_0[None, :] + x_1 * w_1[None, :] + x_2 * w_2[None, :] + x_3 * w_3[None, :] + b[None, :]
            sig = tl.sigmoid(pre)
            g = g * sig * (1 + pre * (1 - sig))
        g = tl.where(valid, g, 0.)
        g_own = tl.where(own[:, None], g, 0.)
        db += g_own
        dw_0 += g_own * x_0
        dw_1 += g_own * x_1
        if W > 2:
            dw_2 += g_own * x_2
        if W > 3:
            dw_3 += g_own * x_3
        acc = g_own * w_0[None, :]
        for i in tl.static_range(1, W):
            shifted = tl.gather(g, tl.broadcast_to(tl.minimum(o_t + i, BT - 1)[:, None], (BT, BD)), 0)
            reads = own & (rows + i < end)  # row u + i is in row u's sequence
            w_i = w_1 if i == 1 else (w_2 if i == 2 else w_3)
            acc += tl.where(reads[:, None], shifted, 0.) * w_i[None, :]
        m_own = own[:, None] & m_d[None, :]
        r = rows.to(tl.int64)[:, None]
        tl.store(dx + r * s_gt + cols[None, :] * s_gd, acc.to(dx.dtype.element_ty), mask=m_own & (r >= 0))
        if HAS_HALO:
            tl.store(dhalo + (r + W - 1) * s_qt + cols[None, :] * s_qd, acc.to(dhalo.dtype.element_ty),
                     mask=m_own & (r < 0))
    part = dw_part + (i_b * tl.num_programs(1) + i_p).to(tl.int64) * W * D + cols
    tl.store(part + (W - 1) * D, tl.sum(dw_0, 0), mask=m_d)
    tl.store(part + (W - 2) * D, tl.sum(dw_1, 0), mask=m_d)
    if W > 2:
        tl.store(part + (W - 3) * D, tl.sum(dw_2, 0), mask=m_d)
    if W > 3:
        tl.store(part + (W - 4) * D, tl.sum(dw_3, 0), mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + (i_b * tl.num_programs(1) + i_p).to(tl.int64) * D + cols, tl.sum(db, 0), mask=m_d)


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
                   cu_seqlens: torch.Tensor | None, activation: str | None,
                   tiles: ConvTiles | None = None) -> torch.Tensor:
    """``y [B, T, D]`` in ``x``'s dtype (contiguous), for checked inputs (see :func:`causal_conv1d`);
    ``tiles`` default :data:`FWD_TILES`."""
    tiles = tiles or FWD_TILES
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    grid = (triton.cdiv(D, tiles.BD), triton.cdiv(T, tiles.BT * tiles.tiles), B)
    _fwd_kernel[grid](x, h, weight, x if bias is None else bias, y, cu, T, D, n_seqs, steps, tiles.tiles,
                      *x.stride(), *h.stride(), *weight.stride(), *y.stride(),
                      W=W, BT=tiles.BT, BD=tiles.BD, SILU=activation == "silu", HAS_HALO=halo is not None,
                      HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None, **tiles.launch_options())
    return y


def short_conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None, dy: torch.Tensor, want_dhalo: bool = True,
                   tiles: ConvTiles | None = None) -> ShortConvGrads:
    """The gradients for ``dy [B, T, D]`` (any strides), recomputing the pre-activation from ``x``;
    ``want_dhalo=False`` skips ``dhalo``; ``tiles`` default :data:`BWD_TILES`."""
    tiles = tiles or BWD_TILES
    B, T, D = x.shape
    W = weight.shape[1]
    S = tiles.BT - (W - 1)
    n_blocks = triton.cdiv(T, S * tiles.tiles)
    # the halo's program runs whenever there is a halo: it also owns the dweight terms of the halo's rows
    n_programs = n_blocks + int(halo is not None)
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
                      dw_part if db_part is None else db_part, cu, T, D, n_seqs, steps, n_blocks, tiles.tiles,
                      *x.stride(), *h.stride(), *weight.stride(), *dy.stride(), *dx.stride(), *q.stride(),
                      W=W, BT=tiles.BT, BD=tiles.BD, SILU=activation == "silu",
                      HAS_HALO=halo is not None, HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None,
                      **tiles.launch_options())
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
