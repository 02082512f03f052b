"""Gate and normalisation preprocessing shared by every reference path.

Gates here are natural-log, per token (not cumulative); the chunked form converts them to
log2 units and accumulates them within each chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x**2, -1) + eps)`` along the last dim (FLA's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """Natural-log per-token decay ``[..., HV, K]`` from raw gate logits ``g [..., HV, K]``.

    Default: ``-exp(A_log) * softplus(g + dt_bias)``. With ``lower_bound`` (the safe gate):
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be ``None``).
    ``A_log`` is ``[HV]``, ``dt_bias`` ``[HV*K]``. Computed in float32 or wider.
    """
    HV, K = g.shape[-2:]
    x = g.to(compute_dtype(g))
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype).view(HV, K)
    if lower_bound is None:
        return -A_log.to(x.dtype).exp().view(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.to(x.dtype).exp().view(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the input is float64 (a comparison, not ``torch.promote_types``: that is a
    dispatched op, a few microseconds of host time on every op call)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def prepare_inputs(q, k, v, g, beta, *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                   A_log=None, dt_bias=None, lower_bound=None):
    """Upcast, normalise q/k, apply the gate, and repeat q/k over grouped value heads.

    Returns ``(q, k, v, g, beta)`` in the compute dtype with q, k ``[B, T, HV, K]``
    (q/k head ``h`` serves value heads ``h*HV/H ... (h+1)*HV/H - 1``) and ``g`` natural-log.
    Differentiable with respect to every input.
    """
    dtype = compute_dtype(q)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g
    g = g.to(dtype)
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return q, k, v, g, beta
