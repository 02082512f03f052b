"""The layers' short convolution module (FLA's ``ShortConvolution`` parameters: an ``nn.Conv1d`` with ``groups=D``,
``weight [D, 1, W]``, optional ``bias [D]``), running the functional contract
:func:`kdacp.kernels.short_conv.causal_conv1d` (re-exported here with :func:`~kdacp.sequences.sequence_positions`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.short_conv import causal_conv1d
from ..sequences import sequence_positions

__all__ = ["ShortConvolution", "causal_conv1d", "sequence_positions"]


class ShortConvolution(nn.Conv1d):
    """FLA-compatible depthwise causal convolution + SiLU over ``[B, T, D]`` inputs.

    Only the parameters and their initialisation come from ``nn.Conv1d``; :meth:`forward` runs
    :func:`causal_conv1d`, optionally on a channel slice (a head shard under Ulysses).
    """

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, halo: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                cu_seqlens_cpu: torch.Tensor | None = None, channels: slice = slice(None),
                fused: bool = False, range_starts: tuple[int, ...] = (0,)) -> torch.Tensor:
        """``x [B, T, D_shard]`` -> ``[B, T, D_shard]``, using weights of ``channels`` only."""
        bias = None if self.bias is None else self.bias[channels]
        return causal_conv1d(x, self.weight[channels, 0], bias, halo=halo, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, fused=fused, range_starts=range_starts)
