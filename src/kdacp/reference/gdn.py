"""Gated DeltaNet (GDN) in plain PyTorch: a token-by-token oracle, and the chunked form as KDA's.

GDN is the KDA recurrence with one scalar decay per value head and token (``g [B, T, HV]``):
``Diag(exp(g_t))`` becomes ``exp(g_t) I``. The chunked form and every summary are KDA's with the
gate broadcast over ``K`` (:func:`scalar_gate_as_kda`); the oracle here is written out separately,
so that it checks that sharing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk import chunk_kda
from ..sequences import sequence_bounds
from .gates import compute_dtype, l2norm


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Natural-log decay ``-exp(A_log) * softplus(g + dt_bias)`` from raw logits ``g [..., HV]``
    (FLA's GDN gate in kernel); ``A_log``, ``dt_bias`` ``[HV]``. Float32 or wider."""
    x = g.to(compute_dtype(g))
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype)
    return -A_log.to(x.dtype).exp() * F.softplus(x)


def scalar_gate_as_kda(g: torch.Tensor, K: int, dt_bias: torch.Tensor | None = None):
    """KDA's gate arguments for a GDN gate: ``g [B, T, HV]`` as ``[B, T, HV, K]`` (a broadcast view,
    nothing copied) and ``dt_bias [HV]`` as ``[HV*K]``. Both differentiable: gradients sum over ``K``."""
    g = g.unsqueeze(-1).expand(*g.shape, K)
    return g, None if dt_bias is None else dt_bias.repeat_interleave(K)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                               A_log=None, dt_bias=None):
    """Run GDN one token at a time (FLA's argument names and shapes)::

        S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale S^T q_t

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV]`` (natural-log decay, or raw logits with
    ``use_gate_in_kernel`` and ``A_log``, ``dt_bias [HV]``), ``beta [B, T, HV]``,
    ``initial_state [N, HV, K, V]``. Returns ``(o [B, T, HV, V] in v's dtype, final_state or None)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dtype = compute_dtype(q)
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = gdn_gate(g, A_log, dt_bias) if use_gate_in_kernel else g.to(dtype)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    scale = K ** -0.5 if scale is None else scale
    outputs, finals = [], []
    for n, (b, bos, eos) in enumerate(sequence_bounds(B, T, cu_seqlens)):
        S = q.new_zeros(HV, K, V) if initial_state is None else initial_state[n].to(dtype)
        for t in range(bos, eos):
            S = g[b, t].exp()[:, None, None] * S
            pred = torch.einsum("hk,hkv->hv", k[b, t], S)
            S = S + beta[b, t][:, None, None] * k[b, t][:, :, None] * (v[b, t] - pred)[:, None, :]
            outputs.append(scale * torch.einsum("hk,hkv->hv", q[b, t], S))
        finals.append(S)
    o = torch.stack(outputs).view(B, T, HV, V)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                           A_log=None, dt_bias=None, chunk_size: int = 64):
    """Chunked GDN: :func:`kdacp.reference.chunk_kda` on the broadcast gate; arguments as
    :func:`recurrent_gated_delta_rule`."""
    g, dt_bias = scalar_gate_as_kda(g, q.shape[-1], dt_bias)
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                     A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size)
