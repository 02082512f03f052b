"""The chain kernel: the state entering every piece of a sequence cut into pieces, in one launch.

A sequence cut into pieces ``0..c-1`` with summaries ``(A_j, M_j)`` carries its state as
``x_{j+1} = M_j x_j + A_j`` (forward: ``A = S_ext``) or, reversed, ``x_j = M_{j+1}^T x_{j+1} + A_{j+1}``
(backward: ``A = G``, ``x`` the gradient of each piece's final state). One program walks one ``[K, BV]``
column tile of one sequence and head through its pieces, storing the state entering each, so the split
inside one device (:mod:`kdacp.cp.split`) pays one launch for what is otherwise ``c - 1`` small
products in sequence. Products run in 3xTF32 (the summary kernels' float32 products,
:data:`kdacp.kernels.precision.F32_DOT`) and add in float32, as :mod:`kdacp.affine.product`'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _chain_kernel(a, m, x0, seqs, entries, out, HV, s_an, s_ah, s_ak, s_mn, s_mh, s_mr, s_mc,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_X0: tl.constexpr, REVERSE: tl.constexpr):
    """``a [NW, HV, K, V]`` and ``m [NW, HV, K, K]`` (any strides), ``x0 [N, HV, K, V]``, ``seqs [N, 2]``
    ``(first piece, count)``; writes ``entries [NW, HV, K, V]`` and ``out [N, HV, K, V]`` (contiguous)."""
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(seqs + 2 * i_n)
    count = tl.load(seqs + 2 * i_n + 1)
    o_k = tl.arange(0, K)
    o_c = i_c * BV + tl.arange(0, BV)
    m_c = o_c < V
    tile = o_k[:, None] * V + o_c[None, :]
    if HAS_X0:
        acc = tl.load(x0 + (i_n * HV + i_h).to(tl.int64) * K * V + tile, mask=m_c[None, :], other=0.0)
    else:
        acc = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(0, count):
        p = (first + count - 1 - j) if REVERSE else (first + j)
        p64 = p.to(tl.int64)
        tl.store(entries + (p64 * HV + i_h) * K * V + tile, acc, mask=m_c[None, :])
        b_a = tl.load(a + p64 * s_an + i_h * s_ah + o_k[:, None] * s_ak + o_c[None, :], mask=m_c[None, :], other=0.0)
        if REVERSE:  # M^T: row r of the tile is column r of M
            b_m = tl.load(m + p64 * s_mn + i_h * s_mh + o_k[None, :] * s_mr + o_k[:, None] * s_mc)
        else:
            b_m = tl.load(m + p64 * s_mn + i_h * s_mh + o_k[:, None] * s_mr + o_k[None, :] * s_mc)
        # from zero: a float32 sum passed to tl.dot as its accumulator is truncated by the tensor cores
        acc = tl.dot(b_m, acc, input_precision="tf32x3") + b_a
    tl.store(out + (i_n * HV + i_h).to(tl.int64) * K * V + tile, acc, mask=m_c[None, :])


def chain_states(offsets: torch.Tensor, transitions: torch.Tensor, seqs: torch.Tensor, initial: torch.Tensor | None,
                 reverse: bool, block_v: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The states entering each piece, and leaving each sequence, along chains of pieces.

    Args:
        offsets: ``[NW, HV, K, V]`` float32, each piece's ``S_ext`` (or ``G`` with ``reverse``); unit last stride.
        transitions: ``[NW, HV, K, K]`` float32, each piece's ``M`` (read transposed with ``reverse``).
        seqs: ``[N, 2]`` int64 on the same device, ``(first piece, count)`` of each sequence; pieces in order.
        initial: ``[N, HV, K, V]`` float32, the state entering each sequence (``reverse``: its final state's
            gradient), or ``None`` for zeros.
        reverse: walk each sequence from its last piece.
        block_v: the state columns a program walks (a power of two; default ``min(64, V)`` rounded up to one),
            so ``N x HV x V / block_v`` programs in all; ``num_warps`` each. For timing other tilings
            (``benchmarks/chain_kernel.py``).

    Returns:
        ``(entries [NW, HV, K, V], out [N, HV, K, V])`` float32: the state entering each piece (``reverse``: the
        gradient of its final state) and the state leaving each sequence (``reverse``: the gradient of its
        initial state).
    """
    NW, HV, K, V = offsets.shape
    if transitions.shape != (NW, HV, K, K) or offsets.stride(-1) != 1:
        raise ValueError(f"transitions must have shape {(NW, HV, K, K)} and offsets a unit last stride, got "
                         f"{tuple(transitions.shape)} and strides {offsets.stride()}")
    N = seqs.shape[0]
    if initial is not None:
        initial = initial.contiguous()
        if tuple(initial.shape) != (N, HV, K, V):
            raise ValueError(f"initial must have shape {(N, HV, K, V)}, got {tuple(initial.shape)}")
    entries = offsets.new_empty(NW, HV, K, V)
    out = offsets.new_empty(N, HV, K, V)
    if block_v is None:
        block_v = min(64, triton.next_power_of_2(V))
    elif block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    grid = (triton.cdiv(V, block_v), N, HV)
    _chain_kernel[grid](offsets, transitions, out if initial is None else initial, seqs, entries, out, HV,
                        offsets.stride(0), offsets.stride(1), offsets.stride(2),
                        *transitions.stride(), K=K, V=V, BV=block_v, HAS_X0=initial is not None,
                        REVERSE=reverse, num_warps=num_warps)
    return entries, out
