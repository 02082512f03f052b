"""Triton helpers shared by the summary kernels: a program's place in the grid, and its state tile."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def locate_program(work, head_start, MOFF, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """This program's place in a ``(column tile, work item, head)`` grid.

    ``work`` rows are ``(batch row, first token, end token, needs transition)``; columns from ``MOFF``
    are transition columns. Returns ``(b, h, start, end, n_chunks, n_run, o_k, o_c)``: ``n_run`` is
    ``n_chunks``, or 0 for transition columns of a work item whose transition is never read.
    """
    i_c, i_w, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = work + 4 * i_w
    b, start, end, needs_t = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    n_chunks = tl.cdiv(end - start, BT)
    n_run = tl.where((i_c * BV >= MOFF) & (needs_t == 0), 0, n_chunks)
    h = (head_start + i_h).to(tl.int64)
    return b, h, start, end, n_chunks, n_run, tl.arange(0, K), i_c * BV + tl.arange(0, BV)


@triton.jit
def initial_tile(o_k, o_c, first_identity_col, VF: tl.constexpr):
    """A state tile's start, float32 ``[K, BV]`` (``[BV, K]`` with ``VF``): zero in columns before
    ``first_identity_col``, identity columns from there on."""
    if VF:
        st = tl.where((o_c - first_identity_col)[:, None] == o_k[None, :], 1.0, 0.0).to(tl.float32)
    else:
        st = tl.where(o_k[:, None] == (o_c - first_identity_col)[None, :], 1.0, 0.0).to(tl.float32)
    return st


@triton.jit
def walk_tile(walk, args, first_transition_col, BV: tl.constexpr, PIECES: tl.constexpr, M_PIECES: tl.constexpr):
    """``walk(*args, pieces)``, the chunk walk of this program's column tile, with the bf16 pieces of its
    columns: ``PIECES`` before ``first_transition_col``, ``M_PIECES`` from there on (one walk compiled
    where the two agree; a transition tile under a policy that rounds it differently, the other).
    ``args``: a tuple literal at the call (a tuple bound to a name loses its constexprs)."""
    if PIECES == M_PIECES:
        st = walk(*args, PIECES)
    elif tl.program_id(0) * BV < first_transition_col:
        st = walk(*args, PIECES)
    else:
        st = walk(*args, M_PIECES)
    return st


@triton.jit
def store_tile(ws, HV, st, o_k, o_c, K: tl.constexpr, NCOL: tl.constexpr, VF: tl.constexpr):
    """Write this program's state tile into ``ws [NW, HV, K, NCOL]`` (work item and head from the grid)."""
    base = (tl.program_id(1) * HV + tl.program_id(2)).to(tl.int64) * K
    if VF:
        tl.store(ws + (base + o_k[None, :]) * NCOL + o_c[:, None], st)
    else:
        tl.store(ws + (base + o_k[:, None]) * NCOL + o_c[None, :], st)


@triton.jit
def load_last_gate(p_g, s_gt, s_gk, start, end, chunk, o_k, valid, BT: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """``gc`` at the last token of chunk ``chunk`` of the segment ``[start, end)`` (zero where not
    ``valid``): ``[K]`` with channel stride ``s_gk`` (0: a broadcast scalar gate), or one value with
    ``SCALAR_GATE``."""
    last = tl.minimum(start + (chunk + 1) * BT, end) - 1
    if SCALAR_GATE:
        out = tl.load(p_g + last * s_gt, mask=valid, other=0.0)
    else:
        out = tl.load(p_g + last * s_gt + o_k * s_gk, mask=(o_k >= 0) & valid, other=0.0)
    return out


@triton.jit
def decay_tile(st, decay, SCALAR_GATE: tl.constexpr, VF: tl.constexpr):
    """``Diag(decay) st`` for a ``[K, BV]`` tile (``st Diag(decay)`` for ``[BV, K]`` with ``VF``);
    ``decay`` one value with ``SCALAR_GATE``, else ``[K]``."""
    if SCALAR_GATE:
        out = st * decay
    elif VF:
        out = st * decay[None, :]
    else:
        out = st * decay[:, None]
    return out


@triton.jit
def load_row_gates(p_g, s_gt, rows, m_t):
    """``gc`` of every token in ``rows`` (float32 ``[BT]``; zero where not ``m_t``), from channel 0:
    the gate of a scalar gate ``[B, T, HV]`` or of a view constant over ``K``."""
    return tl.load(p_g + rows * s_gt, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def key_gate_rows(g_last, g_rows, SCALAR_GATE: tl.constexpr):
    """``exp2(gc_last - gc)`` per row (float32 ``[BT]``) for a gate constant over ``K``: the factor of
    ``kg = k exp2(gc_last - gc)``. With raw keys the callers scale the *other* operand of each product
    by it, in float32 (``kg^T v = k^T (Diag(e) v)``, ``kg S = Diag(e) (k S)``), so gated keys are never
    rounded to the input dtype. ``g_last`` one value with ``SCALAR_GATE``, else ``[K]`` (all equal)."""
    if SCALAR_GATE:
        gl = g_last.to(tl.float32)
    else:
        gl = tl.max(g_last.to(tl.float32), axis=0)
    return tl.exp2(gl - g_rows)


@triton.jit
def load_stacked_columns(p_a, p_b, s_at, s_bt, t0, end, o_k, BT: tl.constexpr):
    """``[K, 2 BT]`` input-dtype tile: column ``j < BT`` is row ``t0 + j`` of ``a``, column ``BT + j`` row
    ``t0 + j`` of ``b`` (rows from ``end`` on load as zero); ``s_at, s_bt`` the row strides."""
    o_2t = tl.arange(0, 2 * BT)
    from_a = o_2t < BT
    rows = t0 + tl.where(from_a, o_2t, o_2t - BT)
    ptr = tl.where(from_a[None, :], p_a + rows[None, :] * s_at, p_b + rows[None, :] * s_bt) + o_k[:, None]
    return tl.load(ptr, mask=(rows < end)[None, :], other=0.0)
