"""Token-by-token KDA: the oracle every other path is checked against."""
from __future__ import annotations

import torch

from ..validation import check_kda_inputs
from ..sequences import sequence_bounds
from .gates import prepare_inputs


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                  A_log=None, dt_bias=None, lower_bound=None):
    """Run the KDA recurrence one token at a time.

    Per token and value head, with state ``S [K, V]``::

        S <- Diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale S^T q_t

    Args follow FLA's ``chunk_kda``: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
    ``g [B, T, HV, K]`` (natural-log decay, or raw logits with ``use_gate_in_kernel``),
    ``beta [B, T, HV]``, ``initial_state [N, HV, K, V]``, ``cu_seqlens [N+1]`` (``B == 1``).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in float32 or wider, or None)``.
    """
    dims = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound)
    scale = dims.K ** -0.5 if scale is None else scale
    qe, ke, ve, ge, be = prepare_inputs(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                        dt_bias=dt_bias, lower_bound=lower_bound)
    outputs, finals = [], []
    for n, (b, bos, eos) in enumerate(sequence_bounds(dims.B, dims.T, cu_seqlens)):
        if initial_state is None:
            S = qe.new_zeros(dims.HV, dims.K, dims.V)
        else:
            S = initial_state[n].to(qe.dtype)
        for t in range(bos, eos):
            S = ge[b, t].exp()[..., None] * S
            pred = torch.einsum("hk,hkv->hv", ke[b, t], S)
            S = S + be[b, t][:, None, None] * ke[b, t][:, :, None] * (ve[b, t] - pred)[:, None, :]
            outputs.append(scale * torch.einsum("hk,hkv->hv", qe[b, t], S))
        finals.append(S)
    o = torch.stack(outputs).view(dims.B, dims.T, dims.HV, dims.V).to(v.dtype)
    return o, (torch.stack(finals) if output_final_state else None)
