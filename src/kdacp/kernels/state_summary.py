"""Forward state summary: ``S_ext`` and the float32 transition ``M`` of a segment of chunks.

Both are responses of the chunk recurrence ``S <- Diag(exp2(gc_last)) S + kg^T (u - w S)``, which acts
column by column on ``S``: ``S_ext`` starts from zero with the real ``u``; ``M`` starts from the
identity with ``u = 0``, so ``M = prod_c (Diag(exp2(gc_last_c)) - kg_c^T w_c)`` (later chunks on the left).
One kernel walks the ``[K, V + K]`` state ``[S | M]`` in ``[K, BV]`` column tiles; a long sequence is cut
into sub-segments summarised in parallel (grid: column tiles x sub-segments x heads) and folded in
float32 by :func:`.compose.fold_summaries` (``S <- M_p S + S_p``, ``M <- M_p M``). A scalar gate (GDN)
makes ``Diag(exp2(gc_last))`` a multiple of the identity: the ``SCALAR_GATE`` variant reads one value
per chunk and head.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..affine import AffineMap, SummaryParts
from .checks import check_summary_inputs
from .config import SummaryConfig
from .summary_launcher import gate_strides, launch_summary, token_strides
from .precision import SummaryPrecision, chunk_decay, dot_state, dot_state_left, resolve_precision
from .tiles import (decay_tile, initial_tile, key_gate_rows, load_last_gate, load_row_gates, locate_program, store_tile,
                    walk_tile)

_OUTPUTS = ("both", "state", "transition")
# With gated keys the transposed tile (v_first) feeds both products' state operand from registers, where [K, BV]
# sends its state pieces through shared memory (13% faster at bf16, T=16K, 32 heads, K=V=128; two stages keep two
# programs on an SM). With raw keys, whose gate scales v_new in the loop, the transposed tile is not faster, so
# they keep [K, BV]. The walk is a serial chain of dependent products, not bound by tensor-core work: the
# two-piece products keep the tensor cores busy about half of the run (benchmarks/RESULTS.md, "Summary kernels";
# a Gluon version of the walk, 7.5% faster, is kept out: commit 5fffd72).
DEFAULT_CONFIG = SummaryConfig(block_v=64, num_warps=4, num_stages=2, v_first=True)
RAW_KEYS_DEFAULT = replace(DEFAULT_CONFIG, v_first=False)


@triton.jit
def _walk(st, p_kg, p_w, p_u, p_g, s_kt, s_wt, s_ut, s_gt, s_gk, start, end, n_chunks, o_k, o_c, m_u,
          BT: tl.constexpr, BV: tl.constexpr, HAS_S: tl.constexpr, VF: tl.constexpr, SCALAR_GATE: tl.constexpr,
          RAW_KEYS: tl.constexpr, PIECES: tl.constexpr):
    """``n_chunks`` chunk steps ``S <- Diag(decay) S + kg^T (u - w S)`` of one state tile (``RAW_KEYS``:
    ``p_kg`` holds raw keys, whose gate is applied to ``v_new``)."""
    o_t = tl.arange(0, BT)
    # each chunk's gate row is loaded one step ahead: its latency then hides behind the previous step
    g_next = load_last_gate(p_g, s_gt, s_gk, start, end, 0, o_k, n_chunks > 0, BT, SCALAR_GATE)
    for i in range(n_chunks):
        t0 = start + i * BT
        rows = t0 + o_t
        m_t = rows < end
        b_decay = chunk_decay(g_next, PIECES)
        g_last = g_next
        g_next = load_last_gate(p_g, s_gt, s_gk, start, end, i + 1, o_k, i + 1 < n_chunks, BT, SCALAR_GATE)
        if RAW_KEYS:
            g_rows = load_row_gates(p_g, s_gt, rows, m_t)
        # padded rows load as zero and add nothing
        if VF:  # st is S^T [BV, K]: v_new^T = u^T - S^T w^T;  S^T <- S^T Diag(decay) + v_new^T kg
            b_wt = tl.load(p_w + rows[None, :] * s_wt + o_k[:, None], mask=m_t[None, :], other=0.0)
            b_kg = tl.load(p_kg + rows[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0)
            if HAS_S:
                b_u = tl.load(p_u + rows[None, :] * s_ut + o_c[:, None], mask=m_t[None, :] & m_u[:, None],
                              other=0.0).to(tl.float32)
            else:
                b_u = tl.zeros([BV, BT], dtype=tl.float32)
            b_v = b_u - dot_state_left(st, b_wt, PIECES)
            if RAW_KEYS:  # v_new^T kg = (v_new^T Diag(e)) k
                b_v = b_v * key_gate_rows(g_last, g_rows, SCALAR_GATE)[None, :]
            st = decay_tile(st, b_decay, SCALAR_GATE, VF) + dot_state_left(b_v, b_kg, PIECES)
        else:  # st is S [K, BV]: v_new = u - w S;  S <- Diag(decay) S + kg^T v_new
            b_w = tl.load(p_w + rows[:, None] * s_wt + o_k[None, :], mask=m_t[:, None], other=0.0)
            b_kt = tl.load(p_kg + rows[None, :] * s_kt + o_k[:, None], mask=m_t[None, :], other=0.0)
            if HAS_S:
                b_u = tl.load(p_u + rows[:, None] * s_ut + o_c[None, :], mask=m_t[:, None] & m_u[None, :],
                              other=0.0).to(tl.float32)
            else:
                b_u = tl.zeros([BT, BV], dtype=tl.float32)
            b_v = b_u - dot_state(b_w, st, PIECES)
            if RAW_KEYS:  # kg^T v_new = k^T (Diag(e) v_new)
                b_v = b_v * key_gate_rows(g_last, g_rows, SCALAR_GATE)[:, None]
            st = decay_tile(st, b_decay, SCALAR_GATE, VF) + dot_state(b_kt, b_v, PIECES)
    return st


@triton.jit
def _state_summary_kernel(
    kg, w, u, gc, ws, work,
    s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_ub, s_ut, s_uh, s_gb, s_gt, s_gh, s_gk,
    head_start, HV, key_group,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NCOL: tl.constexpr,
    MOFF: tl.constexpr, HAS_S: tl.constexpr, PIECES: tl.constexpr, M_PIECES: tl.constexpr,
    VF: tl.constexpr, SCALAR_GATE: tl.constexpr, RAW_KEYS: tl.constexpr,
):
    """One ``BV``-column tile of ``[S | M]`` over one sub-segment ``work[i_w] = (b, start, end, needs_M)``.

    ``kg [B, T, HV, K]`` (``RAW_KEYS``: raw keys ``[B, T, HV / key_group, K]``, value head ``h`` reading
    key head ``h // key_group``), ``gc`` ``[B, T, HV, K]`` (channel stride ``s_gk``) or ``[B, T, HV]``
    with ``SCALAR_GATE``, ``w`` (any head/token order, via strides), ``u [B, T, HV, V]``; writes
    ``ws [NW, HV_out, K, NCOL]`` float32, transition columns from ``MOFF``; ``PIECES`` / ``M_PIECES``: the
    bf16 pieces of the float32 operands in the ``S`` / ``M`` columns (0: float32 products).
    """
    # the first sub-segment's M is never read in state-only mode: its chunk loop is skipped
    b, h, start, end, _, n_run, o_k, o_c = locate_program(work, head_start, MOFF, K, BT, BV)
    m_u = o_c < MOFF
    p_kg = kg + b * s_kb + (h // key_group) * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_u = u + b * s_ub + h * s_uh
    p_g = gc + b * s_gb + h * s_gh
    # S columns start from zero, M columns from the identity
    st = initial_tile(o_k, o_c, MOFF, VF)
    # the arguments as a literal tuple: one bound to a name first would lose its constexprs
    st = walk_tile(_walk, (st, p_kg, p_w, p_u, p_g, s_kt, s_wt, s_ut, s_gt, s_gk, start, end, n_run, o_k, o_c, m_u, BT,
                           BV, HAS_S, VF, SCALAR_GATE, RAW_KEYS), MOFF, BV, PIECES, M_PIECES)
    store_tile(ws, HV, st, o_k, o_c, K, NCOL, VF)


def _launch(kg, w, u, gc, dims, *, chunk_size, output, w_head_first, raw_keys, config, precision, parts=False):
    has_s = output != "transition"
    S, M, kept = launch_summary(
        _state_summary_kernel, (kg, w, u if has_s else kg, gc),
        (*token_strides(kg), *token_strides(w, w_head_first), *(token_strides(u) if has_s else (0, 0, 0)),
         *gate_strides(gc), dims.head_start, dims.HV, dims.key_group),
        dims, chunk_size=chunk_size,
        config=(config or SummaryConfig()).resolved(RAW_KEYS_DEFAULT if raw_keys else DEFAULT_CONFIG),
        precision=precision, a_cols=dims.V if has_s else 0, want_t=output != "state", reverse=False,
        constants=dict(MOFF=dims.V if has_s else 0, HAS_S=has_s, SCALAR_GATE=dims.scalar_gate, RAW_KEYS=raw_keys),
        parts=parts)
    if parts:
        S_parts, M_parts, plan = kept
        return SummaryParts(AffineMap(S, M), AffineMap(S_parts, M_parts),
                            tuple(s - plan.starts[0] for s in plan.starts), plan.counts)
    return AffineMap(S, M)


def state_summary(kg, w, u, gc, *, chunk_size: int = 64, output: str = "both", head_start: int = 0,
                  num_heads: int | None = None, w_head_first: bool = False, cu_seqlens=None, segment=None,
                  raw_keys: bool = False, config: SummaryConfig | None = None,
                  precision: SummaryPrecision | str | None = None, parts: bool = False) -> AffineMap | SummaryParts:
    """Affine summary ``S_out = M S_in + S_ext`` of each sequence, in float32.

    Args:
        kg: ``[B, T, HV, K]``: gated keys ``k exp2(gc_last - gc)``. With ``raw_keys``: the keys ``k``
            themselves, ``[B, T, H, K]`` with ``H`` dividing ``HV`` (value head ``i`` reads key head
            ``i // (HV // H)``, as in grouped value heads); the gate must then be constant over ``K``
            (GDN's: a scalar ``gc`` or its zero-stride view), and the kernel applies it to ``v_new`` in
            float32 (``kg^T v_new = k^T (Diag(exp2(gc_last - gc)) v_new)``), as FLA's GDN kernels do: no
            gated key is formed at ``HV`` heads or rounded to the input dtype.
        gc: the within-chunk cumulative log2 gate (restarting every chunk; a partial chunk's ``gc_last``
            is its last valid token; only ``gc_last`` is read), bf16, fp16 or fp32: ``[B, T, HV, K]`` per
            channel (KDA), or ``[B, T, HV]``, one value per token and head (GDN's scalar gate, FLA's
            ``g`` after its log2 chunk cumsum), which selects the scalar-gate kernels; a scalar gate as
            a ``[B, T, HV, K]`` view with stride 0 on ``K`` (``gc.unsqueeze(-1).expand(..., K)``) runs the
            per-channel kernels on it, nothing materialised.
        w: ``[B, T, HV, K]``, or ``[B, HV, T, K]`` with ``w_head_first``. ``u``: ``[B, T, HV, V]``.
            ``kg, w, u`` share one dtype (bf16, fp16 or fp32); any strides with a unit last dim.
        chunk_size: 16, 32, 64 or 128.
        output: ``"both"``, ``"state"`` (``S_ext`` only) or ``"transition"`` (``M`` only; ``u`` unused).
        head_start, num_heads: summarise heads ``[head_start, head_start + num_heads)`` of the given
            tensors (no copies); outputs have ``num_heads`` heads.
        cu_seqlens: ``[N+1]`` int64 with ``B == 1``: summarise every packed sequence (read on the host:
            a CPU tensor avoids a device sync).
        segment: ``(start, end)`` token offsets with ``B == 1``: summarise that one segment, chunked
            from ``start``.
        config: tiling, see :class:`SummaryConfig`.
        precision: the products' precision policy (:class:`~.precision.SummaryPrecision` or its name);
            ``None``: the default for the inputs' dtype (:func:`~.precision.resolve_precision`).
        parts: with ``output="both"`` and ``B == 1``: return :class:`~kdacp.affine.SummaryParts`, the
            summaries and those of the sub-segments the kernel cut each sequence into (no extra work:
            they are the kernel's own, before folding), from which a state pass can run over the
            sub-segments at once.

    Returns:
        ``AffineMap(S_ext [N, HV, K, V], M [N, HV, K, K])`` float32, the one not requested ``None``;
        ``N`` is ``B``, the number of sequences with ``cu_seqlens``, or 1 with ``segment``. With
        ``parts``: :class:`~kdacp.affine.SummaryParts`.

    Raises:
        TypeError, ValueError: on a bad argument (before any kernel runs); NotImplementedError for K=256.
    """
    if output not in _OUTPUTS:
        raise ValueError(f"output must be one of {_OUTPUTS}, got {output!r}")
    values = {} if output == "transition" else {"u": u}
    for name, flag in (("raw_keys", raw_keys), ("parts", parts)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if parts and output != "both":
        raise ValueError(f"parts=True needs output='both', got output={output!r}")
    dims = check_summary_inputs({"kg": kg, "w": w}, values, gc, chunk_size=chunk_size, head_start=head_start,
                                num_heads=num_heads, w_head_first=w_head_first, cu_seqlens=cu_seqlens,
                                segment=segment, raw=("kg",) if raw_keys else ())
    if parts and dims.B != 1:
        raise ValueError(f"parts=True needs one packed row (B == 1), got B={dims.B}")
    policy = resolve_precision(precision, kg.dtype)
    return _launch(kg, w, u, gc, dims, chunk_size=chunk_size, output=output, w_head_first=w_head_first,
                   raw_keys=raw_keys, config=config, precision=policy, parts=parts)


def transition(kg, w, gc, *, chunk_size: int = 64, head_start: int = 0, num_heads: int | None = None,
               w_head_first: bool = False, cu_seqlens=None, segment=None, raw_keys: bool = False,
               config: SummaryConfig | None = None, precision: SummaryPrecision | str | None = None) -> torch.Tensor:
    """``M [N, HV, K, K]`` float32: the product of the chunk factors ``Diag(exp2(gc_last)) - kg^T w``
    (later chunks on the left), accumulated in float32 (bf16 inputs: products split into exact bf16
    pieces as ``precision`` says; fp16/fp32 inputs: 3xTF32). Arguments as :func:`state_summary`.

    Measured error (H200, bf16, 16K tokens, 256 chunk factors, relative to float64 on the same
    inputs): 5.8e-6 with two pieces, 2.3e-6 with three (``precision="exact"``); fp32 inputs in the
    CPU tests: below 1e-6."""
    return state_summary(kg, w, None, gc, chunk_size=chunk_size, output="transition", head_start=head_start,
                         num_heads=num_heads, w_head_first=w_head_first, cu_seqlens=cu_seqlens, segment=segment,
                         raw_keys=raw_keys, config=config, precision=precision).transition
