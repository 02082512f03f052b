"""The sequences of a batch, on the host, written once: ``(batch row, first token, end token)`` of
each (:func:`sequence_bounds`: what the reference loops over, the summary kernels plan from and the
backends' spans carry) and each token's position inside its own sequence (:func:`sequence_positions`).

A batch is ``B`` rows of ``T`` tokens, or one row of packed sequences described by ``cu_seqlens``
``[N+1]`` (FLA's boundaries, ``B == 1``).
"""
from __future__ import annotations

import torch

from .host_copies import host_boundaries
from .validation import check_cu_seqlens


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None = None) -> tuple[tuple[int, int, int], ...]:
    """``(batch row, first token, end token)`` of every sequence, in order: ``B`` rows of ``T`` tokens, or
    the packed sequences of ``cu_seqlens`` (checked here: :func:`~kdacp.validation.check_cu_seqlens`;
    read on the host, a device sync for a CUDA tensor)."""
    if cu_seqlens is None:
        return tuple((b, 0, T) for b in range(B))
    check_cu_seqlens(cu_seqlens, B, T)
    cu = host_boundaries(cu_seqlens)
    return tuple((0, cu[n], cu[n + 1]) for n in range(len(cu) - 1))


def sequence_positions(cu_seqlens: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Position of each token ``start ... start+length-1`` of a packed batch inside its own sequence.

    Args:
        cu_seqlens: ``[N+1]`` int, global sequence offsets.
        start, length: the global token range of interest.

    Returns:
        ``[length]`` int64 on ``cu_seqlens``' device.
    """
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(start, start + length, device=cu.device)
    seq = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[seq]
