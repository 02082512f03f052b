"""Gated RMSNorm over the last dim, with FLA's ``FusedRMSNormGated`` parameter layout (``weight [D]``)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RMSNormGated"]


class RMSNormGated(nn.Module):
    """``y = x * rsqrt(mean(x**2) + eps) * weight * sigmoid(gate)``, statistics in float32 or wider.

    ``fused=True`` runs FLA's ``rms_norm_gated`` Triton kernel (CUDA, ``fla-core`` installed; float32
    arithmetic, one read of ``x`` and ``gate``); the PyTorch code is the CPU path and its reference.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``x, gate [..., D]`` -> ``[..., D]`` in ``x``'s dtype."""
        if fused:
            from ..backends.fla_adapter import load_fla
            return load_fla().rms_norm_gated(x=x, g=gate, weight=self.weight, bias=None, activation="sigmoid",
                                             eps=self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        return (y * torch.sigmoid(gate.to(dtype))).to(x.dtype)
