"""Depthwise causal short convolution (then SiLU, or none), aware of packed sequences and of a left halo.

Parameter layout matches FLA's ``ShortConvolution`` (an ``nn.Conv1d`` with ``groups=D``):
``weight [D, 1, W]``, optional ``bias [D]``; tap ``W-1`` multiplies the current token.

Two implementations of one contract (:func:`causal_conv1d`): kdacp's Triton kernels on CUDA
(``fused=True``, :mod:`kdacp.kernels.short_conv`: forward and backward each read ``x`` (and ``dy``) once) and
a plain PyTorch one, which is the CPU path and the reference the kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import short_conv
from ..sequences import sequence_positions

__all__ = ["ShortConvolution", "causal_conv1d", "sequence_positions"]


def _eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
           cu_seqlens: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    B, T, D = x.shape
    W = weight.shape[-1]
    xe = torch.cat([x.new_zeros(B, W - 1, D) if halo is None else halo, x], dim=1)
    positions = None
    if cu_seqlens is not None:
        positions = sequence_positions(cu_seqlens.to(x.device), 0, T)
        if halo is not None:  # the first sequence continues the halo's: its taps may reach back into it
            positions = torch.where(torch.arange(T, device=x.device) < cu_seqlens[1].item(), positions + W, positions)
    # Shift-and-add instead of F.conv1d: the per-tap mask is what keeps packed sequences apart
    # (torch.where, not a product, so that a NaN in one sequence stays there).
    y = x * weight[:, W - 1]
    for i in range(1, W):
        tap = xe[:, W - 1 - i:W - 1 - i + T]
        if positions is not None:
            tap = torch.where((positions >= i)[:, None], tap, 0)
        y = y + tap * weight[:, W - 1 - i]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  halo: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_cpu: torch.Tensor | None = None, fused: bool = False,
                  activation: str | None = "silu") -> torch.Tensor:
    """``act(sum_i weight[:, W-1-i] * x[t-i] + bias)`` over each sequence, ``act`` SiLU or the identity.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, W]``; ``bias``: ``[D]`` or None.
        halo: ``[B, W-1, D]``, the ``W-1`` tokens before ``x[:, 0]`` of the sequence that continues into
            ``x[:, 0]`` (e.g. from the previous rank); None: ``x`` starts its sequences.
        cu_seqlens: ``[N+1]`` int64 boundaries of packed sequences inside ``x`` (``B == 1``); a tap
            reaching before a sequence's start reads zero, except that the first sequence reads the halo.
        cu_seqlens_cpu: the same on the host, if at hand (spares the fused path a device sync).
        fused: run kdacp's Triton kernels (:mod:`kdacp.kernels.short_conv`; CUDA, ``2 <= W <= 4``; other
            widths run the PyTorch code) instead of the PyTorch code.
        activation: ``"silu"`` or None.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.
    """
    if fused and short_conv.MIN_WIDTH <= weight.shape[-1] <= short_conv.MAX_WIDTH:
        return short_conv.causal_conv1d(x, weight, bias, halo=halo, cu_seqlens=cu_seqlens,
                                        cu_seqlens_cpu=cu_seqlens_cpu, activation=activation)
    return _eager(x, weight, bias, halo, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, activation)


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
                fused: bool = False) -> torch.Tensor:
        """``x [B, T, D_shard]`` -> ``[B, T, D_shard]``, using weights of ``channels`` only."""
        bias = None if self.bias is None else self.bias[channels]
        return causal_conv1d(x, self.weight[channels, 0], bias, halo=halo, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, fused=fused)
