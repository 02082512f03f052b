"""Depthwise causal short convolution (width 2..4) as Triton kernels, forward and backward.

    y[b, t, d] = act(bias[d] + sum_{j < W} weight[d, W-1-j] * x[b, t-j, d])        act: SiLU or identity

over each sequence: a tap reaching before its sequence's first token reads zero, except that the first
sequence's taps before token 0 read ``halo`` (the previous rank's last ``W-1`` tokens) when one is given.
Shapes are FLA's: ``x [B, T, D]`` (any strides), ``weight [D, W]``, ``bias [D]``, ``halo [B, W-1, D]``,
``cu_seqlens [N+1]`` with ``B == 1``. The plain-PyTorch contract, the CPU path and the reference these
kernels are tested against is :func:`kdacp.layers.short_conv.causal_conv1d`.

The bytes moved are the floor: the forward reads ``x`` and writes ``y``; the backward reads ``x`` and ``dy``
and writes ``dx``, recomputing the pre-activation in registers (nothing is saved but the inputs). Each program
walks a strip of rows of ``BD`` channels one row at a time (the loads of ``UNROLL`` rows issued together),
keeping the ``W-1`` previous rows of ``x`` (and, walking backward, the ``W-1`` next rows' gradient ``g`` at the
pre-activation) in registers, so every row is read once: no shifted reloads, no shuffles across threads.
``dweight`` and ``dbias`` are per-program float32 partial sums reduced once afterwards (no atomics: the
results are deterministic). Sequence boundaries are found in the kernel (one binary search of ``cu_seqlens``
per program, then scalar steps): no host sync, no index tensor. A group of four rows whose taps all lie in one
sequence and in the program's rows (all but a few per sequence start and program edge) runs without the
per-tap masks, and the sigmoid takes the hardware's approximate ``exp2`` and reciprocal: the backward was
bound by instruction issue (offline SASS for sm_90: about 50 -> 33 per element, 0.155 -> 0.141 ms). A step may
load two groups of four rows before computing them (``ConvTiles.groups``): the forward, bound by loads in
flight, gains (0.086 -> 0.078 ms). The backward instead issues the next step's loads before computing its own
(``ConvTiles.ahead``: kernel 129.7 -> 121.5 us), or Triton pipelines its loop (``ConvTiles.stages``, the loads
staged through shared memory: 111 us, shipped). Both passes reach about three quarters of the memory
bandwidth that torch's own copy and add reach (benchmarks/RESULTS.md, "Short convolution").
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..validation import check_cu_seqlens, check_tensor
from .precision import INTERPRET

__all__ = ["ConvTiles", "ShortConvGrads", "causal_conv1d", "short_conv_bwd", "short_conv_fwd"]

ACTIVATIONS = (None, "silu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_WIDTH, MAX_WIDTH = 2, 4


@dataclass(frozen=True)
class ConvTiles:
    """Launch shape: each program walks ``rows`` rows of ``BD`` channels, ``groups`` groups of ``UNROLL`` rows
    per step (their loads issued together, 1 or 2); ``maxnreg`` caps the registers per thread (None: the
    compiler's choice); ``ahead`` (the backward, one group per step): each step issues the next step's
    loads before computing its own, in registers; ``stages`` (the backward): Triton's software pipelining of
    the row loop (``tl.range(num_stages=stages)``: ``stages - 1`` steps' loads in flight through shared
    memory; 1: none)."""

    rows: int
    BD: int
    num_warps: int
    maxnreg: int | None = None
    groups: int = 1
    ahead: bool = False
    stages: int = 1

    def __post_init__(self):
        if self.groups not in (1, 2):
            raise ValueError(f"groups must be 1 or 2, got {self.groups}")
        if self.ahead and self.groups != 1:
            raise ValueError(f"ahead loads the next step's one group: it needs groups=1, got groups={self.groups}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"stages must be 1 to 4, got {self.stages}")

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps} | ({} if self.maxnreg is None else {"maxnreg": self.maxnreg})


UNROLL = 4
# The sigmoid in inline PTX (see _sigmoid): on NVIDIA GPUs; the interpreter and ROCm builds take tl.sigmoid.
FAST_SIGMOID = not INTERPRET and torch.version.hip is None
# The fastest of kdacp.bench.kernels.sweep_conv's tilings (least time summed over one sequence and 13 documents
# after a halo; T=16K, D=4096, bf16, W=4) on an H200; the backward's loop pipelined in 3 stages; 512 channels on
# 2 warps tie 1024 on 4 at D=4096 and win at D=6144 (benchmarks/RESULTS.md, "Short convolution").
FWD_TILES = ConvTiles(rows=32, BD=256, num_warps=2, groups=2)
BWD_TILES = ConvTiles(rows=256, BD=512, num_warps=2, stages=3)
# _sum_parts_kernel: rows of partial sums per step and channels per program
_SUM_BR, _SUM_BD = 32, 32


@triton.jit
def _find_sequence(r, cu_seqlens, n_seqs, search_steps):
    """The index of the sequence that holds row ``r`` (a scalar in ``[0, T)``): the largest ``n`` with
    ``cu_seqlens[n] <= r``, by binary search."""
    lo = r * 0
    hi = lo + n_seqs - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        below = tl.load(cu_seqlens + mid).to(tl.int32) <= r
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@triton.jit
def _first_row(n, cu_seqlens, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """The first row sequence ``n``'s taps may read: its first token, or ``-(W-1)`` (the halo) for the first
    sequence when there is a halo."""
    start = tl.load(cu_seqlens + n).to(tl.int32)
    if HAS_HALO:
        start = tl.where(n == 0, 1 - W, start)
    return start


@triton.jit
def _sequence_of(r, cu_seqlens, n_seqs, search_steps, T, W: tl.constexpr, HAS_HALO: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """``(n, start, end)`` of the sequence holding row ``r`` (a scalar in ``[0, T)``): its index, the first row
    its taps may read (:func:`_first_row`) and the next sequence's first row."""
    if IS_VARLEN:
        n = _find_sequence(r, cu_seqlens, n_seqs, search_steps)
        start = _first_row(n, cu_seqlens, W, HAS_HALO)
        end = tl.load(cu_seqlens + n + 1).to(tl.int32)
    else:
        n = r * 0
        start = n + (1 - W if HAS_HALO else 0)
        end = n + T
    return n, start, end


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
def _program_block(weight, bias, T, D, rows_per_program, s_wd, s_ww, W: tl.constexpr, BD: tl.constexpr,
                   HAS_BIAS: tl.constexpr):
    """Program ``(i_d, i_p, .)``'s block: its channels ``cols [BD]`` and their mask ``cols < D``, their taps
    (:func:`_taps`), and its rows ``[lo, hi) = [i_p L, min((i_p+1) L, T))``."""
    cols = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = cols < D
    w_0, w_1, w_2, w_3, b = _taps(weight, bias, cols, m_d, s_wd, s_ww, W, BD, HAS_BIAS)
    lo = tl.program_id(1) * rows_per_program
    hi = tl.minimum(lo + rows_per_program, T)
    return cols, m_d, w_0, w_1, w_2, w_3, b, lo, hi


@triton.jit
def _load_raw(x, r, cols, m_d, T, s_xt, s_xd):
    """Row ``r`` (a scalar) of ``x`` in ``x``'s dtype ``[BD]``, zero outside ``[0, T)`` and where ``m_d`` is
    false."""
    return tl.load(x + tl.cast(r, tl.int64) * s_xt + cols * s_xd, mask=m_d & (r >= 0) & (r < T), other=0.)


@triton.jit
def _with_halo(raw, halo, r, cols, m_d, s_ht, s_hd, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """``raw`` (:func:`_load_raw`'s row ``r``) as float32, plus ``halo[W-1+r]`` for ``-(W-1) <= r < 0`` with a
    halo."""
    val = raw.to(tl.float32)
    if HAS_HALO:
        val += tl.load(halo + (r + W - 1) * s_ht + cols * s_hd, mask=m_d & (r < 0) & (r >= 1 - W),
                       other=0.).to(tl.float32)
    return val


@triton.jit
def _load_row(x, halo, r, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """Row ``r`` (a scalar) of ``x`` as float32 ``[BD]``: ``halo[W-1+r]`` for ``-(W-1) <= r < 0`` (with a
    halo), zero outside ``[0, T)`` otherwise."""
    return _with_halo(_load_raw(x, r, cols, m_d, T, s_xt, s_xd), halo, r, cols, m_d, s_ht, s_hd, W, HAS_HALO)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """``1 / (1 + exp(-x))`` in float32; ``FAST``: the hardware's approximate ``exp2`` and reciprocal with
    subnormals flushed (four instructions, within a few ulp), else ``tl.sigmoid`` (its subnormal and range
    fix-ups cost about seven more per element). The interpreter runs no PTX: it takes ``tl.sigmoid``."""
    if FAST:
        out = tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
            "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        out = tl.sigmoid(x)
    return out


@triton.jit
def _pre(u, start, x_0, x_1, x_2, x_3, w_0, w_1, w_2, w_3, b, W: tl.constexpr, MASKED: tl.constexpr):
    """The pre-activation of row ``u`` from its raw taps ``x_j = x[u-j]``, each masked (``tl.where``: a NaN in
    another sequence stays there) to ``u - j >= start`` when ``MASKED`` (else the caller knows every tap is in
    ``u``'s sequence); also returns the masked taps."""
    t_1, t_2, t_3 = x_1, x_2, x_3
    if MASKED:
        t_1 = tl.where(u - 1 >= start, x_1, 0.)
        t_2 = tl.where(u - 2 >= start, x_2, 0.)
        t_3 = tl.where(u - 3 >= start, x_3, 0.)
    pre = x_0 * w_0 + t_1 * w_1 + b
    if W > 2:
        pre += t_2 * w_2
    if W > 3:
        pre += t_3 * w_3
    return pre, t_1, t_2, t_3


@triton.jit
def _fwd_row(u, x_0, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d, s_yt, s_yd,
             w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
             IS_VARLEN: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr):
    """One forward step at row ``u`` (ascending): moves to ``u``'s sequence, stores ``y[u]`` if ``u < hi``.
    Without ``MASKED`` the caller knows ``u`` and its taps lie in the current sequence and ``u < hi``."""
    if IS_VARLEN and MASKED:
        while (u >= end) & (n < n_seqs - 1):
            n += 1
            start = _first_row(n, cu_seqlens, W, HAS_HALO)
            end = tl.load(cu_seqlens + n + 1).to(tl.int32)
    out, _, _, _ = _pre(u, start, x_0, x_1, x_2, x_3, w_0, w_1, w_2, w_3, b, W, MASKED)
    if SILU:
        out = out * _sigmoid(out, FAST)
    m_y = m_d & (u < hi) if MASKED else m_d
    tl.store(y + tl.cast(u, tl.int64) * s_yt + cols * s_yd, out.to(y.dtype.element_ty), mask=m_y)
    return n, start, end


@triton.jit
def _fwd_rows(u, x_a, x_b, x_c, x_d, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d, s_yt,
              s_yd, w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
              IS_VARLEN: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr):
    """Forward steps at rows ``u .. u+3`` (``x_a .. x_d``), after rows ``u-1 .. u-3`` (``x_1 .. x_3``)."""
    n, start, end = _fwd_row(u, x_a, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d,
                             s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    n, start, end = _fwd_row(u + 1, x_b, x_a, x_1, x_2, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d,
                             s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    n, start, end = _fwd_row(u + 2, x_c, x_b, x_a, x_1, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d,
                             s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    n, start, end = _fwd_row(u + 3, x_d, x_c, x_b, x_a, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d,
                             s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    return n, start, end


@triton.jit
def _fwd_group(u, x_a, x_b, x_c, x_d, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d, s_yt,
               s_yd, w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
               IS_VARLEN: tl.constexpr, FAST: tl.constexpr):
    """:func:`_fwd_rows` without masks when rows ``u .. u+3`` and their taps lie in the current sequence and
    below ``hi``, else with them (and the moves to later sequences)."""
    if (u - (W - 1) >= start) & (u + 4 <= end) & (u + 4 <= hi):
        _fwd_rows(u, x_a, x_b, x_c, x_d, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi, cols, m_d,
                  s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, False, FAST)
    else:
        n, start, end = _fwd_rows(u, x_a, x_b, x_c, x_d, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi,
                                  cols, m_d, s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, True,
                                  FAST)
    return n, start, end


@triton.jit
def _fwd_kernel(x, halo, weight, bias, y, cu_seqlens, T, D, n_seqs, search_steps, rows_per_program,
                s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd,
                W: tl.constexpr, BD: tl.constexpr, UNROLL_ROWS: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr, FAST: tl.constexpr,
                GROUPS: tl.constexpr):
    """Program ``(i_d, i_p, i_b)`` walks rows ``[lo, hi) = [i_p L, min((i_p+1) L, T))`` upward, one row of
    ``BD`` channels per step, keeping the last ``W-1`` rows of ``x`` in registers: each row is read once.
    Each step loads ``GROUPS`` groups of four rows, then computes them; a group whose rows and taps lie in
    one sequence, inside ``[lo, hi)``, runs without masks."""
    tl.static_assert(UNROLL_ROWS == 4)
    tl.static_assert((GROUPS == 1) | (GROUPS == 2))
    i_b = tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    y += i_b.to(tl.int64) * s_yb
    cols, m_d, w_0, w_1, w_2, w_3, b, lo, hi = _program_block(weight, bias, T, D, rows_per_program, s_wd, s_ww, W,
                                                             BD, HAS_BIAS)
    n, start, end = _sequence_of(lo, cu_seqlens, n_seqs, search_steps, T, W, HAS_HALO, IS_VARLEN)
    x_1 = _load_row(x, halo, lo - 1, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_2 = _load_row(x, halo, lo - 2, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_3 = _load_row(x, halo, lo - 3, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    for u in range(lo, hi, UNROLL_ROWS * GROUPS):
        x_a = _load_row(x, halo, u, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
        x_b = _load_row(x, halo, u + 1, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
        x_c = _load_row(x, halo, u + 2, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
        x_d = _load_row(x, halo, u + 3, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
        if GROUPS == 2:  # the second group's loads in flight while the first computes
            x_e = _load_row(x, halo, u + 4, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
            x_f = _load_row(x, halo, u + 5, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
            x_g = _load_row(x, halo, u + 6, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
            x_h = _load_row(x, halo, u + 7, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
        n, start, end = _fwd_group(u, x_a, x_b, x_c, x_d, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs, hi,
                                   cols, m_d, s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, FAST)
        x_1, x_2, x_3 = x_d, x_c, x_b
        if GROUPS == 2:
            n, start, end = _fwd_group(u + 4, x_e, x_f, x_g, x_h, x_1, x_2, x_3, n, start, end, y, cu_seqlens, n_seqs,
                                       hi, cols, m_d, s_yt, s_yd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO,
                                       IS_VARLEN, FAST)
            x_1, x_2, x_3 = x_h, x_g, x_f


@triton.jit
def _bwd_row(u, x_0, x_1, x_2, x_3, dy_u, g_1, g_2, g_3, n, start, end, dw_0, dw_1, dw_2, dw_3, db,
             dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd,
             w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
             IS_VARLEN: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr):
    """One backward step at row ``u`` (descending), with the raw taps ``x_j = x[u-j]``, ``dy[u]`` (zero
    outside ``[0, T)``) and ``g_i = g[u+i]`` of the rows after it: moves to ``u``'s sequence; ``g[u]``;
    ``dx[u] = sum_i weight[W-1-i] g[u+i]`` over ``u+i`` in ``u``'s sequence, stored for ``lo <= u < hi``
    (``dhalo`` for ``u < 0`` when ``halo_rows``); for those rows the ``dweight`` terms ``g[u] x[u-j]`` and
    ``dbias`` terms ``g[u]`` accumulate. Returns ``g[u]``, the sequence and the sums. Without ``MASKED`` the
    caller knows that ``u``, its taps and the rows ``u+i`` lie in the current sequence and ``lo <= u < hi``."""
    if IS_VARLEN and MASKED:
        while (u < start) & (n > 0):
            n -= 1
            end = start
            start = _first_row(n, cu_seqlens, W, HAS_HALO)
    pre, t_1, t_2, t_3 = _pre(u, start, x_0, x_1, x_2, x_3, w_0, w_1, w_2, w_3, b, W, MASKED)
    g = dy_u
    if SILU:
        sig = _sigmoid(pre, FAST)
        g = g * sig * (1 + pre * (1 - sig))
    if MASKED:
        g_1 = tl.where(u + 1 < end, g_1, 0.)
        g_2 = tl.where(u + 2 < end, g_2, 0.)
        g_3 = tl.where(u + 3 < end, g_3, 0.)
    acc = g * w_0 + g_1 * w_1
    if W > 2:
        acc += g_2 * w_2
    if W > 3:
        acc += g_3 * w_3
    own = (u >= lo) & (u < hi)
    g_own = tl.where(own, g, 0.) if MASKED else g
    db += g_own
    dw_0 += g_own * x_0
    dw_1 += g_own * t_1
    if W > 2:
        dw_2 += g_own * t_2
    if W > 3:
        dw_3 += g_own * t_3
    tl.store(dx + tl.cast(u, tl.int64) * s_gt + cols * s_gd, acc.to(dx.dtype.element_ty),
             mask=m_d & own if MASKED else m_d)
    if HAS_HALO and MASKED:
        tl.store(dhalo + (u + W - 1) * s_qt + cols * s_qd, acc.to(dhalo.dtype.element_ty),
                 mask=m_d & halo_rows & (u < 0) & (u >= 1 - W))
    return g, n, start, end, dw_0, dw_1, dw_2, dw_3, db


@triton.jit
def _bwd_pair(u, FIRST: tl.constexpr, x_0, x_1, x_2, x_3, x_4, dy_0, dy_1, g_1, g_2, g_3, n, start, end, dw_0,
              dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd, w_0,
              w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr, IS_VARLEN: tl.constexpr,
              MASKED: tl.constexpr, FAST: tl.constexpr):
    """Backward steps at rows ``r = u - FIRST`` and ``r - 1`` (``x_j = x[r-j]``, ``dy_0, dy_1`` rows ``r, r-1``,
    ``g_i = g[r+i]``); returns the two rows' ``g`` (``r`` first). Each row index is formed as ``u`` minus a
    constant where its step starts, as four steps written in a row form them: the same compiled code."""
    g_a, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_row(
        u - FIRST, x_0, x_1, x_2, x_3, dy_0, g_1, g_2, g_3, n, start, end, dw_0, dw_1, dw_2, dw_3, db, dx, dhalo,
        cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd, w_0, w_1, w_2, w_3, b,
        W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    g_b, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_row(
        u - (FIRST + 1), x_1, x_2, x_3, x_4, dy_1, g_a, g_1, g_2, n, start, end, dw_0, dw_1, dw_2, dw_3, db, dx, dhalo,
        cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd, w_0, w_1, w_2, w_3, b,
        W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    return g_a, g_b, n, start, end, dw_0, dw_1, dw_2, dw_3, db


@triton.jit
def _bwd_rows(u, x_0, x_1, x_2, x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d, g_1, g_2, g_3, n, start, end,
              dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
              s_qd, w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
              IS_VARLEN: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr):
    """Backward steps at rows ``u .. u-3`` (``x_0, x_1, x_2`` rows ``u .. u-2``, ``x_a .. x_d`` rows ``u-3 ..
    u-6``, ``dy_a .. dy_d`` rows ``u .. u-3``, ``g_i = g[u+i]``); returns the four rows' ``g`` (``u`` first)."""
    g_a, g_b, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_pair(
        u, 0, x_0, x_1, x_2, x_a, x_b, dy_a, dy_b, g_1, g_2, g_3, n, start, end, dw_0, dw_1, dw_2, dw_3, db, dx,
        dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd, w_0, w_1, w_2, w_3, b,
        W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_pair(
        u, 2, x_2, x_a, x_b, x_c, x_d, dy_c, dy_d, g_b, g_a, g_1, n, start, end, dw_0, dw_1, dw_2, dw_3, db, dx,
        dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt, s_qd, w_0, w_1, w_2, w_3, b,
        W, SILU, HAS_HALO, IS_VARLEN, MASKED, FAST)
    return g_a, g_b, g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db


@triton.jit
def _bwd_group(u, x_0, x_1, x_2, x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d, g_1, g_2, g_3, n, start, end,
               dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
               s_qd, w_0, w_1, w_2, w_3, b, W: tl.constexpr, SILU: tl.constexpr, HAS_HALO: tl.constexpr,
               IS_VARLEN: tl.constexpr, FAST: tl.constexpr):
    """:func:`_bwd_rows` without masks when rows ``u .. u-3`` are owned and their taps (``x`` down to
    ``u-3-(W-1)``, ``g`` up to ``u+W-1``) lie in the current sequence, else with them (and the moves to
    earlier sequences)."""
    if (u - 3 - (W - 1) >= start) & (u + W - 1 < end) & (u - 3 >= lo) & (u < hi):
        g_a, g_b, g_c, g_d, _, _, _, dw_0, dw_1, dw_2, dw_3, db = _bwd_rows(
            u, x_0, x_1, x_2, x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d, g_1, g_2, g_3, n, start, end,
            dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
            s_qd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, False, FAST)
    else:
        g_a, g_b, g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_rows(
            u, x_0, x_1, x_2, x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d, g_1, g_2, g_3, n, start, end,
            dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
            s_qd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, True, FAST)
    return g_a, g_b, g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db


@triton.jit
def _bwd_raw_group(x, dy, u, cols, m_d, T, s_xt, s_xd, s_yt, s_yd):
    """The loads of one backward group at row ``u`` in their own dtypes (:func:`_load_raw`): ``x`` rows
    ``u-3 .. u-6``, then ``dy`` rows ``u .. u-3``."""
    return (_load_raw(x, u - 3, cols, m_d, T, s_xt, s_xd), _load_raw(x, u - 4, cols, m_d, T, s_xt, s_xd),
            _load_raw(x, u - 5, cols, m_d, T, s_xt, s_xd), _load_raw(x, u - 6, cols, m_d, T, s_xt, s_xd),
            _load_raw(dy, u, cols, m_d, T, s_yt, s_yd), _load_raw(dy, u - 1, cols, m_d, T, s_yt, s_yd),
            _load_raw(dy, u - 2, cols, m_d, T, s_yt, s_yd), _load_raw(dy, u - 3, cols, m_d, T, s_yt, s_yd))


@triton.jit
def _bwd_group_f32(r_a, r_b, r_c, r_d, q_a, q_b, q_c, q_d, halo, u, cols, m_d, s_ht, s_hd, W: tl.constexpr,
                   HAS_HALO: tl.constexpr):
    """:func:`_bwd_raw_group`'s loads at row ``u`` as float32: ``x`` rows ``u-3 .. u-6`` with the halo's
    (:func:`_with_halo`), then ``dy`` rows ``u .. u-3``."""
    return (_with_halo(r_a, halo, u - 3, cols, m_d, s_ht, s_hd, W, HAS_HALO),
            _with_halo(r_b, halo, u - 4, cols, m_d, s_ht, s_hd, W, HAS_HALO),
            _with_halo(r_c, halo, u - 5, cols, m_d, s_ht, s_hd, W, HAS_HALO),
            _with_halo(r_d, halo, u - 6, cols, m_d, s_ht, s_hd, W, HAS_HALO),
            q_a.to(tl.float32), q_b.to(tl.float32), q_c.to(tl.float32), q_d.to(tl.float32))


@triton.jit
def _bwd_kernel(x, halo, weight, bias, dy, dx, dhalo, parts, cu_seqlens, T, D, n_seqs, search_steps,
                rows_per_program,
                s_xb, s_xt, s_xd, s_hb, s_ht, s_hd, s_wd, s_ww, s_yb, s_yt, s_yd, s_gb, s_gt, s_gd, s_qb, s_qt, s_qd,
                W: tl.constexpr, BD: tl.constexpr, UNROLL_ROWS: tl.constexpr, SILU: tl.constexpr,
                HAS_HALO: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr, FAST: tl.constexpr,
                GROUPS: tl.constexpr, AHEAD: tl.constexpr, STAGES: tl.constexpr):
    """Program ``(i_d, i_p, i_b)`` owns rows ``[lo, hi) = [i_p L, min((i_p+1) L, T))`` (and, the first one
    with a halo, the halo's rows ``[-(W-1), 0)``) and walks them downward from ``hi + W - 2`` (the rows whose
    ``g`` its ``dx`` needs), one row of ``BD`` channels per step, keeping the ``g`` of the ``W-1`` rows after
    the current one and its ``W-1`` earlier ``x`` rows in registers: each row of ``x`` and ``dy`` is read
    once (plus ``W-1`` rows past the program's end). A group of rows whose taps all lie in one sequence,
    inside ``[lo, hi)``, runs without masks; each step loads ``GROUPS`` groups of four rows, then computes
    them (``AHEAD``, with one group: each step issues the next step's loads before computing its own;
    ``STAGES``: the loop software-pipelined by Triton).
    ``dweight`` and ``dbias`` are per-program float32 partial sums, ``parts [B, programs, W + HAS_BIAS, D]``
    (the bias's in row ``W``), reduced once afterwards by :func:`_sum_parts_kernel` (deterministic)."""
    tl.static_assert(UNROLL_ROWS == 4)
    tl.static_assert((GROUPS == 1) | (GROUPS == 2))
    tl.static_assert(not (AHEAD and GROUPS == 2))
    i_p, i_b = tl.program_id(1), tl.program_id(2)
    x += i_b.to(tl.int64) * s_xb
    halo += i_b.to(tl.int64) * s_hb
    dy += i_b.to(tl.int64) * s_yb
    dx += i_b.to(tl.int64) * s_gb
    dhalo += i_b.to(tl.int64) * s_qb
    cols, m_d, w_0, w_1, w_2, w_3, b, lo, hi = _program_block(weight, bias, T, D, rows_per_program, s_wd, s_ww, W,
                                                             BD, HAS_BIAS)
    top = tl.minimum(hi + W - 1, T) - 1
    halo_rows = HAS_HALO & (i_p == 0)
    bottom = tl.where(halo_rows, 1 - W, lo)
    n, start, end = _sequence_of(top, cu_seqlens, n_seqs, search_steps, T, W, HAS_HALO, IS_VARLEN)
    zero = tl.zeros((BD,), dtype=tl.float32)
    dw_0, dw_1, dw_2, dw_3, db = zero, zero, zero, zero, zero
    g_1, g_2, g_3 = zero, zero, zero
    x_0 = _load_row(x, halo, top, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_1 = _load_row(x, halo, top - 1, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    x_2 = _load_row(x, halo, top - 2, cols, m_d, T, s_xt, s_xd, s_ht, s_hd, W, HAS_HALO)
    n_steps = tl.cdiv(top - bottom + 1, UNROLL_ROWS * GROUPS)
    if AHEAD:  # the first step's rows; each step then loads the next one's before computing its own
        r_a, r_b, r_c, r_d, q_a, q_b, q_c, q_d = _bwd_raw_group(x, dy, top, cols, m_d, T, s_xt, s_xd, s_yt, s_yd)
    for k in tl.range(n_steps, num_stages=STAGES):
        u = top - k * UNROLL_ROWS * GROUPS
        if AHEAD:  # masked off after the last step
            n_a, n_b, n_c, n_d, p_a, p_b, p_c, p_d = _bwd_raw_group(x, dy, u - UNROLL_ROWS, cols,
                                                                    m_d & (k + 1 < n_steps), T, s_xt, s_xd, s_yt,
                                                                    s_yd)
        else:
            r_a, r_b, r_c, r_d, q_a, q_b, q_c, q_d = _bwd_raw_group(x, dy, u, cols, m_d, T, s_xt, s_xd, s_yt,
                                                                    s_yd)
        x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d = _bwd_group_f32(r_a, r_b, r_c, r_d, q_a, q_b, q_c, q_d, halo, u,
                                                                    cols, m_d, s_ht, s_hd, W, HAS_HALO)
        if GROUPS == 2:  # the second group's loads in flight while the first computes
            e_x, f_x, g_x, h_x, e_dy, f_dy, g_dy, h_dy = _bwd_raw_group(x, dy, u - 4, cols, m_d, T, s_xt, s_xd, s_yt,
                                                                        s_yd)
            x_e, x_f, x_g, x_h, dy_e, dy_f, dy_g, dy_h = _bwd_group_f32(e_x, f_x, g_x, h_x, e_dy, f_dy, g_dy, h_dy,
                                                                        halo, u - 4, cols, m_d, s_ht, s_hd, W,
                                                                        HAS_HALO)
        g_a, g_b, g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_group(
            u, x_0, x_1, x_2, x_a, x_b, x_c, x_d, dy_a, dy_b, dy_c, dy_d, g_1, g_2, g_3, n, start, end,
            dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
            s_qd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, FAST)
        x_0, x_1, x_2 = x_b, x_c, x_d
        g_1, g_2, g_3 = g_d, g_c, g_b
        if GROUPS == 2:
            g_a, g_b, g_c, g_d, n, start, end, dw_0, dw_1, dw_2, dw_3, db = _bwd_group(
                u - 4, x_0, x_1, x_2, x_e, x_f, x_g, x_h, dy_e, dy_f, dy_g, dy_h, g_1, g_2, g_3, n, start, end,
                dw_0, dw_1, dw_2, dw_3, db, dx, dhalo, cu_seqlens, lo, hi, halo_rows, cols, m_d, s_gt, s_gd, s_qt,
                s_qd, w_0, w_1, w_2, w_3, b, W, SILU, HAS_HALO, IS_VARLEN, FAST)
            x_0, x_1, x_2 = x_f, x_g, x_h
            g_1, g_2, g_3 = g_d, g_c, g_b
        if AHEAD:
            r_a, r_b, r_c, r_d, q_a, q_b, q_c, q_d = n_a, n_b, n_c, n_d, p_a, p_b, p_c, p_d
    part = parts + (i_b * tl.num_programs(1) + i_p).to(tl.int64) * (W + HAS_BIAS) * D + cols
    tl.store(part + (W - 1) * D, dw_0, mask=m_d)
    tl.store(part + (W - 2) * D, dw_1, mask=m_d)
    if W > 2:
        tl.store(part + (W - 3) * D, dw_2, mask=m_d)
    if W > 3:
        tl.store(part + (W - 4) * D, dw_3, mask=m_d)
    if HAS_BIAS:
        tl.store(part + W * D, db, mask=m_d)


@triton.jit
def _sum_parts_kernel(parts, dweight, dbias, R, D, s_wd, s_ww, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                      C_PAD: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``dweight[d, j] = sum_r parts[r, j, d]`` (and ``dbias[d] = sum_r parts[r, W, d]``) for ``BD`` channels,
    in float32, ``BR`` rows at a time in a fixed order (deterministic), cast to the outputs' dtypes on store.
    ``parts [R, W + HAS_BIAS, D]`` float32, contiguous."""
    cols = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = cols < D
    o_c = tl.arange(0, C_PAD)
    m_cd = (o_c < W + HAS_BIAS)[:, None] & m_d[None, :]
    tile = o_c[:, None] * D + cols[None, :]
    acc = tl.zeros((C_PAD, BD), dtype=tl.float32)
    for r0 in tl.range(0, R, BR, num_stages=3):
        o_r = r0 + tl.arange(0, BR)
        block = tl.load(parts + o_r.to(tl.int64)[:, None, None] * (W + HAS_BIAS) * D + tile[None, :, :],
                        mask=(o_r < R)[:, None, None] & m_cd[None, :, :], other=0.)
        acc += tl.sum(block, axis=0)
    tl.store(dweight + cols[None, :] * s_wd + o_c[:, None] * s_ww, acc.to(dweight.dtype.element_ty),
             mask=(o_c < W)[:, None] & m_d[None, :])
    if HAS_BIAS:
        db = tl.sum(tl.where((o_c == W)[:, None], acc, 0.), axis=0)
        tl.store(dbias + cols, db.to(dbias.dtype.element_ty), mask=m_d)


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
    if tiles.ahead or tiles.stages != 1:
        raise ValueError("tiles.ahead and tiles.stages are the backward's options; the forward's steps take "
                         "groups=2 instead")
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    grid = (triton.cdiv(D, tiles.BD), triton.cdiv(T, tiles.rows), B)
    _fwd_kernel[grid](x, h, weight, x if bias is None else bias, y, cu, T, D, n_seqs, steps, tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *y.stride(),
                      W=W, BD=tiles.BD, UNROLL_ROWS=UNROLL, SILU=activation == "silu", HAS_HALO=halo is not None,
                      HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None, FAST=FAST_SIGMOID,
                      GROUPS=tiles.groups, **tiles.launch_options())
    return y


def short_conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None, dy: torch.Tensor, want_dhalo: bool = True,
                   tiles: ConvTiles | None = None) -> ShortConvGrads:
    """The gradients for ``dy [B, T, D]`` (any strides), recomputing the pre-activation from ``x``;
    ``want_dhalo=False`` skips ``dhalo``; ``tiles`` default :data:`BWD_TILES`."""
    B, T, D = x.shape
    tiles = tiles or BWD_TILES
    W = weight.shape[1]
    n_programs = triton.cdiv(T, tiles.rows)  # the first also owns the halo's rows
    dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    dhalo = torch.empty(B, W - 1, D, dtype=halo.dtype, device=x.device) if halo is not None else None
    # every program writes its slice of the partial sums: no zero fill needed
    has_bias = bias is not None
    parts = torch.empty(B, n_programs, W + has_bias, D, dtype=torch.float32, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    q = dx if dhalo is None else dhalo
    grid = (triton.cdiv(D, tiles.BD), n_programs, B)
    _bwd_kernel[grid](x, h, weight, x if bias is None else bias, dy, dx, q, parts, cu, T, D, n_seqs, steps,
                      tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *dy.stride(), *dx.stride(), *q.stride(),
                      W=W, BD=tiles.BD, UNROLL_ROWS=UNROLL, SILU=activation == "silu",
                      HAS_HALO=halo is not None, HAS_BIAS=has_bias, IS_VARLEN=cu_seqlens is not None,
                      FAST=FAST_SIGMOID, GROUPS=tiles.groups, AHEAD=tiles.ahead, STAGES=tiles.stages,
                      **tiles.launch_options())
    dweight = torch.empty(D, W, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(D, dtype=bias.dtype, device=x.device) if has_bias else None
    _sum_parts_kernel[(triton.cdiv(D, _SUM_BD),)](parts, dweight, dweight if dbias is None else dbias,
                                                   B * n_programs, D, *dweight.stride(), W=W, HAS_BIAS=has_bias,
                                                   C_PAD=triton.next_power_of_2(W + has_bias), BR=_SUM_BR,
                                                   BD=_SUM_BD, num_warps=4)
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
