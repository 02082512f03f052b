"""Depthwise causal short convolution with SiLU, aware of packed sequences and of a left halo.

Parameter layout matches FLA's ``ShortConvolution`` (an ``nn.Conv1d`` with ``groups=D``):
``weight [D, 1, W]``, optional ``bias [D]``; tap ``W-1`` multiplies the current token.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ShortConvolution", "causal_conv1d", "sequence_positions"]


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


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  halo: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(sum_i weight[:, W-1-i] * x[t-i] + bias)`` over each sequence.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, W]``; ``bias``: ``[D]`` or None.
        halo: ``[B, W-1, D]``, the ``W-1`` tokens before ``x[:, 0]`` (e.g. from the previous rank);
            None means zeros (``x`` starts its sequences).
        positions: ``[T]`` int, each token's position inside its sequence (packed batches); a tap
            reaching before the sequence start reads zero. None: no sequence starts inside the window
            except at ``x[:, 0]`` with a zero halo.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    if halo is None:
        halo = x.new_zeros(B, W - 1, D)
    xe = torch.cat([halo, x], dim=1)
    # Shift-and-add instead of F.conv1d: the per-tap mask is what keeps packed sequences apart.
    y = x * weight[:, W - 1]
    for i in range(1, W):
        tap = xe[:, W - 1 - i:W - 1 - i + T]
        if positions is not None:
            tap = tap * (positions >= i).to(x.dtype)[:, None]
        y = y + tap * weight[:, W - 1 - i]
    if bias is not None:
        y = y + bias
    return F.silu(y)


class ShortConvolution(nn.Conv1d):
    """FLA-compatible depthwise causal convolution + SiLU over ``[B, T, D]`` inputs.

    Only the parameters and their initialisation come from ``nn.Conv1d``; :meth:`forward` runs
    :func:`causal_conv1d`, optionally on a channel slice (a head shard under Ulysses).
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, halo: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                channels: slice = slice(None)) -> torch.Tensor:
        """``x [B, T, D_shard]`` -> ``[B, T, D_shard]``, using weights of ``channels`` only."""
        bias = None if self.bias is None else self.bias[channels]
        return causal_conv1d(x, self.weight[channels, 0], bias, halo=halo, positions=positions)
