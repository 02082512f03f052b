"""Gated RMSNorm over the last dim, with FLA's ``FusedRMSNormGated`` parameter layout (``weight [D]``)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["RMSNormGated"]


class RMSNormGated(nn.Module):
    """``y = x * rsqrt(mean(x**2) + eps) * weight * act(gate)``, statistics in float32 or wider;
    ``act`` is ``sigmoid`` (KDA) or ``swish`` (``gate * sigmoid(gate)``, GDN), FLA's ``activation``.

    ``fused=True`` runs FLA's ``rms_norm_gated`` Triton kernel (CUDA, ``fla-core`` installed; float32
    arithmetic, one read of ``x`` and ``gate``); the PyTorch code is the CPU path and its reference.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "sigmoid", device=None, dtype=None):
        super().__init__()
        if activation not in ("sigmoid", "swish"):
            raise ValueError(f"activation must be 'sigmoid' or 'swish', got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``x, gate [..., D]`` -> ``[..., D]`` in ``x``'s dtype."""
        if fused:
            from ..backends.fla_adapter import load_fla
            return load_fla().rms_norm_gated(x=x, g=gate, weight=self.weight, bias=None, activation=self.activation,
                                             eps=self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        gate = gate.to(dtype)
        act = torch.sigmoid(gate) if self.activation == "sigmoid" else gate * torch.sigmoid(gate)
        return (y * act).to(x.dtype)
