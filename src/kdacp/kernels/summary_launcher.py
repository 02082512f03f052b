"""The host side shared by the summary launchers: plan, workspace, grid, launch and fold.

Both summary kernels walk ``[A | T]`` column tiles of a ``[K, NCOL]`` float32 state per sub-segment
and head: ``A`` (``S_ext`` or ``G``, ``a_cols`` columns) and, where read, the ``K`` transition
columns (``M`` or ``M^T``); :func:`launch_summary` sizes, launches and folds them the same way.
"""
from __future__ import annotations

import torch

from .compose import fold_summaries
from .config import SummaryConfig
from .subsegments import pick_chunks_per_program, plan_summary
from .precision import SummaryPrecision
from .pipelining import launch_fitting_stages


def token_strides(x: torch.Tensor, head_first: bool = False) -> tuple[int, int, int]:
    """``(batch, token, head)`` strides of a 4-d tensor stored token-first or head-first."""
    return (x.stride(0), x.stride(2), x.stride(1)) if head_first else (x.stride(0), x.stride(1), x.stride(2))


def gate_strides(gc: torch.Tensor) -> tuple[int, int, int, int]:
    """``(batch, token, head, channel)`` strides of ``gc [B, T, HV, K]``, or of a scalar gate ``[B, T, HV]``
    (channel stride 0)."""
    return (*token_strides(gc), gc.stride(3) if gc.dim() == 4 else 0)


def launch_summary(kernel, inputs: tuple, scalars: tuple, dims, *, chunk_size: int, config: SummaryConfig,
                   precision: SummaryPrecision, a_cols: int, want_t: bool, reverse: bool, constants: dict | None = None,
                   parts: bool = False):
    """Run ``kernel(*inputs, ws, work, *scalars, K=, V=, BT=, BV=, NCOL=, PIECES=, M_PIECES=, VF=,
    **constants)`` over the sub-segments of ``dims.bounds`` and fold them per sequence.

    Args:
        inputs: the kernel's tensor arguments; the first one fixes the device and, with ``precision``
            (resolved for its dtype), the products' pieces.
        scalars: the kernel's strides and scalars after ``ws, work``.
        dims: the checked :class:`.checks.SummaryDims`.
        config: resolved (no ``None`` fields).
        a_cols: columns of the additive part (``V``, or 0 for a transition alone).
        want_t: the transition is an output (every sub-segment then walks its ``K`` columns).
        reverse: chunks run backward (the gradient), sub-segments fold from the last.
        parts: also return every sub-segment's own summary, unfolded.

    Returns:
        ``(A [N, HV, K, a_cols] or None, T [N, HV, K, K] or None, parts)`` float32; ``parts`` is ``None``,
        or with ``parts`` ``(A_p [NW, HV, K, a_cols], T_p [NW, HV, K, K] or None, plan)``: each
        sub-segment's summary from its own first token (views of one workspace), and the
        :class:`.subsegments.SummaryPlan` (their first tokens and the count per sequence).
    """
    device = inputs[0].device
    pieces, m_pieces = precision.pieces(inputs[0].dtype, backward=reverse)
    K, V, HV = dims.K, dims.V, dims.HV
    block_v = min(config.block_v, K, a_cols or K)
    # cutting a summary without transition output into sub-segments adds transition columns: only
    # worth it on a small grid
    serial = None if want_t else HV * a_cols // block_v
    L = config.chunks_per_program or pick_chunks_per_program(dims.bounds, HV * (a_cols + K) // block_v, chunk_size,
                                                             device, serial_programs=serial)
    plan = plan_summary(dims.bounds, chunk_size, L, reverse=reverse, transition_everywhere=want_t, device=device)
    # one sub-segment per sequence and no transition output: no transition columns at all
    ncol = a_cols + (K if want_t or plan.max_subsegments > 1 else 0)
    ws = torch.empty(plan.num_work, HV, K, ncol, dtype=torch.float32, device=device)
    grid = (ncol // block_v, plan.num_work, HV)
    launch_fitting_stages(
        kernel, grid, (*inputs, ws, plan.work, *scalars),
        dict(K=K, V=V, BT=chunk_size, BV=block_v, NCOL=ncol, PIECES=pieces, M_PIECES=m_pieces,
             VF=config.v_first, **(constants or {})),
        config.num_warps, config.num_stages, config.max_registers)
    A, T = fold_summaries(ws, plan.seqs, len(dims.bounds), a_cols=a_cols, want_a=a_cols > 0, want_t=want_t,
                          reverse=reverse, block_v=block_v)
    kept = None
    if parts:
        kept = (ws[..., :a_cols], ws[..., a_cols:] if ncol > a_cols else None, plan)
    return A, T, kept
