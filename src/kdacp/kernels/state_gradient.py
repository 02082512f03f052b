"""Backward state summary ``G``: the gradient of a segment's own outputs w.r.t. its input state.

From ``dS = 0`` at the segment end, chunks in reverse::

    dv' = kg dS + dv;    dS <- Diag(exp2(gc_last)) dS + scale qg^T do - w^T dv'

The recurrence acts column by column on ``dS [K, V]``: the grid runs over heads x ``[K, BV]`` column
tiles. A long sequence may be cut into sub-segments run in parallel; each then also walks ``K`` extra
columns from the identity with ``do = dv = 0``, which yields its ``M^T`` (no ``dM`` is formed), and the
fold computes ``G = G_1 + M_1^T (G_2 + M_2^T (...))`` in float32. ``dv`` is only read.

With raw keys (GDN) the ``[K, BV]`` tile's update is one product, ``[q^T | w^T] [scale do_g ; -dv']``,
with both bf16 pieces side by side, and so is ``k dS``: two tensor-core products per chunk instead of
six. Measured on one H200 (bf16, Qwen3-Next shapes, 16K tokens): 0.58 -> 0.47 ms; with float32 inputs
(3xTF32 products) the stacked form is slower, 2.40 -> 2.78 ms; the per-channel (KDA) path keeps its
separate products, where pairing the pieces gained nothing, but loading ``do`` with ``k`` and ``dv``, ahead
of the first product, took it from 0.445 to 0.408 ms (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_summary_inputs
from .config import SummaryConfig
from .summary_launcher import gate_strides, launch_summary, token_strides
from .precision import (SummaryPrecision, chunk_decay, dot_inputs, dot_state, dot_state_left, dot_state_paired,
                        resolve_precision, stack_rows)
from .tiles import (decay_tile, initial_tile, key_gate_rows, load_last_gate, load_row_gates,
                    load_stacked_columns, locate_program, store_tile, walk_tile)

# Measured on one H200 (bf16, T=16K, 32 heads, K=V=128; benchmarks/RESULTS.md): a serial walk over
# heads x V tiles beats cutting into sub-segments (which doubles the columns with M^T); three stages let
# each step's input copies overlap the step before (two wait for them at once).
DEFAULT_CONFIG = SummaryConfig(block_v=32, num_warps=4, num_stages=3, v_first=False)


@triton.jit
def _walk_back(st, p_q, p_k, p_w, p_g, p_do, p_dv, s_qt, s_kt, s_wt, s_gt, s_gk, s_ot, s_vt, scale, start, end,
               n_chunks, n_run, o_k, o_c, m_v, BT: tl.constexpr, VF: tl.constexpr, SCALAR_GATE: tl.constexpr,
               RAW_KEYS: tl.constexpr, PIECES: tl.constexpr):
    """The last ``n_run`` of ``n_chunks`` chunk steps, in reverse, of one state-gradient tile
    (``RAW_KEYS``: ``p_q``, ``p_k`` hold raw queries and keys; their gates scale the float32 operand
    they meet, ``dS`` products or ``do``, so no gated value is rounded to the input dtype)."""
    o_t = tl.arange(0, BT)
    # each chunk's gate row is loaded one step ahead: its latency then hides behind the previous step
    g_next = load_last_gate(p_g, s_gt, s_gk, start, end, n_chunks - 1, o_k, n_run > 0, BT, SCALAR_GATE)
    for i in range(n_run):
        t0 = start + (n_chunks - 1 - i) * BT
        rows = t0 + o_t
        m_t = rows < end
        b_decay = chunk_decay(g_next, PIECES)
        g_last = g_next
        g_next = load_last_gate(p_g, s_gt, s_gk, start, end, n_chunks - 2 - i, o_k, i + 1 < n_run, BT, SCALAR_GATE)
        if RAW_KEYS:
            g_rows = load_row_gates(p_g, s_gt, rows, m_t)
        if VF:  # st is dS^T [BV, K]
            m_tv = m_v[:, None] & m_t[None, :]
            b_kt = tl.load(p_k + rows[None, :] * s_kt + o_k[:, None], mask=m_t[None, :], other=0.0)
            b_dv = tl.load(p_dv + rows[None, :] * s_vt + o_c[:, None], mask=m_tv, other=0.0).to(tl.float32)
            # dv'^T = dS^T kg^T + dv^T, from the state before this chunk's update
            b_kds = dot_state_left(st, b_kt, PIECES)
            if RAW_KEYS:  # dS^T kg^T = (dS^T k^T) Diag(e)
                b_kds = b_kds * key_gate_rows(g_last, g_rows, SCALAR_GATE)[None, :]
            b_dvp = b_dv + b_kds
            b_do = tl.load(p_do + rows[None, :] * s_ot + o_c[:, None], mask=m_tv, other=0.0)
            b_q = tl.load(p_q + rows[:, None] * s_qt + o_k[None, :], mask=m_t[:, None], other=0.0)
            if RAW_KEYS:  # do^T qg = (do^T Diag(exp2(gc))) q
                b_dog = b_do.to(tl.float32) * tl.exp2(g_rows)[None, :]
                b_dsq = dot_state_left(b_dog, b_q, PIECES)
            else:
                b_dsq = dot_inputs(b_do, b_q, PIECES)
            acc = decay_tile(st, b_decay, SCALAR_GATE, VF) + scale * b_dsq
            b_w = tl.load(p_w + rows[:, None] * s_wt + o_k[None, :], mask=m_t[:, None], other=0.0)
            st = acc - dot_state_left(b_dvp, b_w, PIECES)
        else:  # st is dS [K, BV]
            m_tv = m_t[:, None] & m_v[None, :]
            b_k = tl.load(p_k + rows[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_dv = tl.load(p_dv + rows[:, None] * s_vt + o_c[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_do = tl.load(p_do + rows[:, None] * s_ot + o_c[None, :], mask=m_tv, other=0.0)
            # dv' = kg dS + dv, from the state before this chunk's update
            if RAW_KEYS:  # kg dS = Diag(e) (k dS)
                b_dvp = b_dv + dot_state_paired(b_k, st, PIECES) * key_gate_rows(
                    g_last, g_rows, SCALAR_GATE)[:, None]
                # both updates in one product: scale qg^T do - w^T dv' = [q^T | w^T] [scale Diag(exp2(gc)) do ; -dv']
                b_dog = b_do.to(tl.float32) * (scale * tl.exp2(g_rows))[:, None]
                b_qwt = load_stacked_columns(p_q, p_w, s_qt, s_wt, t0, end, o_k, BT)
                st = decay_tile(st, b_decay, SCALAR_GATE, VF) + dot_state_paired(
                    b_qwt, stack_rows(b_dog, -b_dvp), PIECES)
            else:
                b_dvp = b_dv + dot_state(b_k, st, PIECES)
                b_qt = tl.load(p_q + rows[None, :] * s_qt + o_k[:, None], mask=m_t[None, :], other=0.0)
                acc = decay_tile(st, b_decay, SCALAR_GATE, VF) + scale * dot_inputs(b_qt, b_do, PIECES)
                b_wt = tl.load(p_w + rows[None, :] * s_wt + o_k[:, None], mask=m_t[None, :], other=0.0)
                st = acc - dot_state(b_wt, b_dvp, PIECES)
    return st


@triton.jit
def _state_gradient_kernel(
    qg, kg, w, gc, do, dv, ws, work,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_gb, s_gt, s_gh, s_gk,
    s_ob, s_ot, s_oh, s_vb, s_vt, s_vh,
    scale, head_start, HV, key_group,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NCOL: tl.constexpr,
    PIECES: tl.constexpr, M_PIECES: tl.constexpr, VF: tl.constexpr, SCALAR_GATE: tl.constexpr,
    RAW_KEYS: tl.constexpr,
):
    """One ``BV``-column tile of ``[G | M^T]`` over one sub-segment ``work[i_w] = (b, start, end, needs_M)``,
    chunks in reverse. ``qg, kg [B, T, HV, K]`` (``RAW_KEYS``: raw ``q, k [B, T, HV / key_group, K]``),
    ``gc`` as in the forward kernel, ``w`` via strides,
    ``do, dv [B, T, HV, V]``;
    writes ``ws [NW, HV_out, K, NCOL]`` float32 (``M^T`` columns from ``V``); ``PIECES`` / ``M_PIECES``: the
    bf16 pieces of the float32 operands in the ``G`` / ``M^T`` columns (0: float32 products)."""
    # the last sub-segment's M^T is never read: its chunk loop is skipped
    b, h, start, end, n_chunks, n_run, o_k, o_c = locate_program(work, head_start, V, K, BT, BV)
    m_v = o_c < V
    p_q = qg + b * s_qb + (h // key_group) * s_qh
    p_k = kg + b * s_kb + (h // key_group) * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_g = gc + b * s_gb + h * s_gh
    p_do = do + b * s_ob + h * s_oh
    p_dv = dv + b * s_vb + h * s_vh
    # G columns start from zero, M^T columns from the identity
    st = initial_tile(o_k, o_c, V, VF)
    st = walk_tile(_walk_back, (st, p_q, p_k, p_w, p_g, p_do, p_dv, s_qt, s_kt, s_wt, s_gt, s_gk, s_ot, s_vt, scale,
                                start, end, n_chunks, n_run, o_k, o_c, m_v, BT, VF, SCALAR_GATE, RAW_KEYS),
                   V, BV, PIECES, M_PIECES)
    store_tile(ws, HV, st, o_k, o_c, K, NCOL, VF)


def state_gradient_summary(qg, kg, w, gc, do, dv, scale, *, chunk_size: int = 64, head_start: int = 0,
                           num_heads: int | None = None, w_head_first: bool = False, cu_seqlens=None, segment=None,
                           raw_keys: bool = False, config: SummaryConfig | None = None,
                           precision: SummaryPrecision | str | None = None) -> torch.Tensor:
    """``G [N, HV, K, V]`` float32: ``dS_in = M^T dS_out + G`` for each sequence.

    Args:
        qg, kg: ``[B, T, HV, K]`` (``qg = q exp2(gc)``, ``kg = k exp2(gc_last - gc)``); ``gc``: ``[B, T, HV, K]``,
            or ``[B, T, HV]`` for a scalar gate (GDN; selects the scalar-gate kernel), or a zero-``K``-stride
            view, as in :func:`.state_summary.state_summary`; ``w`` ``[B, T, HV, K]`` or ``[B, HV, T, K]``
            with ``w_head_first``; ``do`` ``[B, T, HV, V]`` in the dtype of ``qg, kg, w``;
            ``dv`` ``[B, T, HV, V]`` (bf16, fp16 or fp32; only read): the gradient reaching ``v_new``
            from each chunk's own outputs. ``scale``: the output scale.
        raw_keys: ``qg, kg`` are the raw ``q, k [B, T, H, K]``; the kernel applies their gates to the
            float32 operand each meets (``kg dS = Diag(e) (k dS)``, ``qg^T do = q^T (Diag(exp2(gc)) do)``),
            so no gated value is rounded; the conditions of :func:`.state_summary.state_summary`'s
            ``raw_keys`` apply.
        Other arguments (``precision`` too) as :func:`.state_summary.state_summary`.

    Raises:
        TypeError, ValueError: on a bad argument (before any kernel runs); NotImplementedError for K=256.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not isinstance(raw_keys, bool):
        raise TypeError(f"raw_keys must be a bool, got {type(raw_keys).__name__}")
    dims = check_summary_inputs({"qg": qg, "kg": kg, "w": w}, {"do": do}, gc, chunk_size=chunk_size,
                                head_start=head_start, num_heads=num_heads, w_head_first=w_head_first,
                                cu_seqlens=cu_seqlens, segment=segment, dv=dv,
                                raw=("qg", "kg") if raw_keys else ())
    policy = resolve_precision(precision, qg.dtype)
    G, _, _ = launch_summary(
        _state_gradient_kernel, (qg, kg, w, gc, do, dv),
        (*token_strides(qg), *token_strides(kg), *token_strides(w, w_head_first), *gate_strides(gc),
         *token_strides(do), *token_strides(dv), float(scale), dims.head_start, dims.HV, dims.key_group),
        dims, chunk_size=chunk_size, config=(config or SummaryConfig()).resolved(DEFAULT_CONFIG),
        precision=policy, a_cols=dims.V, want_t=False, reverse=True,
        constants=dict(SCALAR_GATE=dims.scalar_gate, RAW_KEYS=raw_keys))
    return G
