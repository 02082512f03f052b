"""Gated RMSNorm over the last dim, with FLA's ``FusedRMSNormGated`` parameter layout (``weight [D]``)."""
from __future__ import annotations

import torch
import torch.nn as nn

ACTIVATIONS = ("sigmoid", "swish")


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str,
                   fused: bool = False) -> torch.Tensor:
    """``y = x * rsqrt(mean(x**2) + eps) * weight * act(gate)``, statistics in float32 or wider; ``act`` is
    ``sigmoid`` (KDA) or ``swish`` (``gate * sigmoid(gate)``, GDN), FLA's ``activation``.

    Args:
        x, gate: ``[..., D]``; weight: ``[D]``.
        fused: FLA's ``rms_norm_gated`` Triton kernel (CUDA, ``fla-core`` installed; float32 arithmetic,
            one read of ``x`` and ``gate``); the PyTorch code is the CPU path and its reference.

    Returns:
        ``[..., D]`` in ``x``'s dtype.
    """
    if fused:
        from ..backends.fla_adapter import load_fla
        return load_fla().rms_norm_gated(x=x, g=gate, weight=weight, bias=None, activation=activation, eps=eps)
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype)
    gate = gate.to(dtype)
    act = torch.sigmoid(gate) if activation == "sigmoid" else gate * torch.sigmoid(gate)
    return (y * act).to(x.dtype)


class RMSNormGated(nn.Module):
    """:func:`rms_norm_gated` with its own ``weight [hidden_size]`` (ones at start)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "sigmoid", device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``x, gate [..., D]`` -> ``[..., D]`` in ``x``'s dtype."""
        return rms_norm_gated(x, gate, self.weight, self.eps, self.activation, fused)
