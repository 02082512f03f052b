"""The short convolution's Triton kernels: the forward, the backward and the reduction of its per-program
partial sums (:mod:`kdacp.kernels.short_conv` has the math and the design; :mod:`.launch` launches them)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..precision import INTERPRET

UNROLL = 4
# The sigmoid in inline PTX (see _sigmoid): on NVIDIA GPUs; the interpreter and ROCm builds take tl.sigmoid.
FAST_SIGMOID = not INTERPRET and torch.version.hip is None
# sum_parts_kernel: rows of partial sums per step and channels per program
SUM_BR, SUM_BD = 32, 32


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
def fwd_kernel(x, halo, weight, bias, y, cu_seqlens, T, D, n_seqs, search_steps, rows_per_program,
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
def bwd_kernel(x, halo, weight, bias, dy, dx, dhalo, parts, cu_seqlens, T, D, n_seqs, search_steps,
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
    (the bias's in row ``W``), reduced once afterwards by :func:`sum_parts_kernel` (deterministic)."""
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
def sum_parts_kernel(parts, dweight, dbias, R, D, s_wd, s_ww, W: tl.constexpr, HAS_BIAS: tl.constexpr,
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
