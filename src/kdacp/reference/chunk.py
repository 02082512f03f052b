"""Chunked (WY-form) KDA in plain PyTorch, with every intermediate the kernels are checked against.

Within a chunk of ``C`` tokens, ``gc`` is the cumulative gate in log2 units
(``cumsum(g) / ln 2``, restarting at each chunk). Per chunk and value head::

    kg_r = k_r exp2(gc_last - gc_r)            qg_r = q_r exp2(gc_r)
    Akk  = (I + strict_lower(diag(beta) (k exp2(gc)) (k exp2(-gc))^T))^-1 diag(beta)
    w = Akk (k exp2(gc))                       u = Akk v
    v_new = u - w S                            S' = Diag(exp2(gc_last)) S + kg^T v_new
    o = scale (qg S + tril(Aqk) v_new)         Aqk_ij = q_i . (k_j exp2(gc_i - gc_j))

The pairwise exponents are formed as differences (never ``exp2(-gc)`` alone), so the reference
stays finite for any gate. Every sequence is chunked from its own first token; the last chunk
may be partial.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validation import check_kda_inputs
from ..sequences import sequence_bounds
from .gates import prepare_inputs

_LN2 = math.log(2.0)
# Bound on the [chunks, C, C, HV, K] pairwise-gate tensor built at once (elements).
_PAIRWISE_BUDGET = 1 << 24


@dataclass
class ChunkIntermediates:
    """Everything the chunked form computes, token-first like FLA.

    Shapes: ``gc, qg, kg, w [B, T, HV, K]``; ``u, v_new [B, T, HV, V]``; ``Aqk [B, T, HV, C]``
    (row ``i`` of a chunk holds ``Aqk_ij`` for ``j`` in that chunk, zero above the diagonal);
    ``h [B, NT, HV, K, V]``: the state before each chunk (with ``cu_seqlens``, ``NT`` counts
    the chunks of all sequences); ``final_state [N, HV, K, V]``; ``o [B, T, HV, V]``.
    All in the compute dtype (float32, or float64 for float64 inputs).
    """

    gc: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    Aqk: torch.Tensor
    v_new: torch.Tensor
    h: torch.Tensor
    final_state: torch.Tensor
    o: torch.Tensor


def chunk_bounds(bos: int, eos: int, chunk_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` token offsets of the chunks of one sequence ``[bos, eos)``."""
    return [(s, min(s + chunk_size, eos)) for s in range(bos, eos, chunk_size)]


def _pad_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[L, ...] -> [NT, C, ...]``, zero-padded: zero k, v, beta and g make padded tokens inert."""
    L = x.shape[0]
    NT = -(-L // chunk_size)
    pad = NT * chunk_size - L
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return x.view(NT, chunk_size, *x.shape[1:])


def _sequence_terms(q, k, v, g, beta, chunk_size):
    """State-independent chunk terms of one sequence; inputs ``[L, HV, *]``, outputs ``[NT, C, HV, *]``."""
    q, k, v, g, beta = (_pad_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    C = chunk_size
    # The gate path runs in float64: cumulative log-gates of a chunk reach hundreds, and their
    # differences (the only thing the outputs depend on) would lose ~1e-5 relative in float32.
    gc = g.double().cumsum(1) / _LN2
    gc_last = gc[:, -1:]
    kg = k * torch.exp2(gc_last - gc).to(k.dtype)
    qg = q * torch.exp2(gc).to(q.dtype)
    idx = torch.arange(C, device=q.device)
    strict = (idx[:, None] > idx[None, :])[None, :, :, None, None]
    incl = (idx[:, None] >= idx[None, :])[None, :, :, None, None]
    group = max(1, _PAIRWISE_BUDGET // (C * C * g.shape[2] * g.shape[3]))
    Akk_raw, Aqk = [], []
    for s in range(0, gc.shape[0], group):
        gcs = gc[s:s + group]
        diff = gcs[:, :, None] - gcs[:, None, :]                      # [n, C(i), C(j), HV, K]
        e_strict = (torch.exp2(diff.masked_fill(~strict, 0.0)) * strict).to(q.dtype)
        e_incl = (torch.exp2(diff.masked_fill(~incl, 0.0)) * incl).to(q.dtype)
        Akk_raw.append(torch.einsum("nihk,njhk,nijhk->nhij", k[s:s + group], k[s:s + group], e_strict))
        Aqk.append(torch.einsum("nihk,njhk,nijhk->nihj", q[s:s + group], k[s:s + group], e_incl))
    Akk_raw, Aqk = torch.cat(Akk_raw), torch.cat(Aqk)
    bt = beta.permute(0, 2, 1)                                          # [NT, HV, C]
    lower = torch.eye(C, dtype=q.dtype, device=q.device) + bt[..., None] * Akk_raw
    ke = (k * torch.exp2(gc).to(k.dtype)).permute(0, 2, 1, 3)                        # [NT, HV, C, K]
    w = torch.linalg.solve_triangular(lower, bt[..., None] * ke, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(lower, bt[..., None] * v.permute(0, 2, 1, 3), upper=False,
                                      unitriangular=True)
    return gc.to(q.dtype), qg, kg, w.permute(0, 2, 1, 3), u.permute(0, 2, 1, 3), Aqk


def _sequence_state_pass(kg, w, u, gc, S):
    """States before each chunk ``[NT, HV, K, V]``, ``v_new [NT, C, HV, V]`` and the final state."""
    h, v_new = [], []
    decay = torch.exp2(gc[:, -1])                                        # [NT, HV, K]
    for c in range(kg.shape[0]):
        h.append(S)
        vn = u[c] - torch.einsum("chk,hkv->chv", w[c], S)
        S = decay[c][..., None] * S + torch.einsum("chk,chv->hkv", kg[c], vn)
        v_new.append(vn)
    return torch.stack(h), torch.stack(v_new), S


def _chunk_outputs(qg, h, Aqk, v_new, scale):
    """``o [NT, C, HV, V]`` of one sequence's chunks from ``qg [NT, C, HV, K]``, the states before each
    chunk ``h [NT, HV, K, V]``, ``Aqk [NT, C, HV, C]`` and ``v_new [NT, C, HV, V]``."""
    return scale * (torch.einsum("nchk,nhkv->nchv", qg, h) + torch.einsum("nihj,njhv->nihv", Aqk, v_new))


def chunk_output(qg, Aqk, v_new, h, scale, chunk_size=64, cu_seqlens=None) -> torch.Tensor:
    """``o [B, T, HV, V]`` from the state-independent ``qg [B, T, HV, K]``, ``Aqk [B, T, HV, C]`` and a
    state pass's ``v_new [B, T, HV, V]`` and ``h [B, NT, HV, K, V]`` (as :class:`ChunkIntermediates`),
    in their promoted dtype: what the output stage computes from a state pass made elsewhere."""
    dtype = torch.promote_types(torch.promote_types(qg.dtype, h.dtype), v_new.dtype)
    B, T = qg.shape[:2]
    o = qg.new_zeros(B, T, v_new.shape[2], v_new.shape[3], dtype=dtype)
    first_chunk = [0] * B
    for b, bos, eos in sequence_bounds(B, T, cu_seqlens):
        parts = [_pad_chunks(x[b, bos:eos].to(dtype), chunk_size) for x in (qg, Aqk, v_new)]
        n = parts[0].shape[0]
        states = h[b, first_chunk[b]:first_chunk[b] + n].to(dtype)
        first_chunk[b] += n
        o[b, bos:eos] = _chunk_outputs(parts[0], states, parts[1], parts[2], scale).reshape(-1, *o.shape[2:])[:eos - bos]
    return o


def chunk_kda_intermediates(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                            dt_bias=None, lower_bound=None, chunk_size=64) -> ChunkIntermediates:
    """Run the chunked form and return all its intermediates (differentiable); see
    :class:`ChunkIntermediates`. Arguments as :func:`chunk_kda`."""
    dims = check_kda_inputs(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound, chunk_size=chunk_size)
    scale = dims.K ** -0.5 if scale is None else scale
    qe, ke, ve, ge, be = prepare_inputs(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                        dt_bias=dt_bias, lower_bound=lower_bound)
    fields = {name: [[] for _ in range(dims.B)] for name in ("gc", "qg", "kg", "w", "u", "Aqk", "v_new", "o", "h")}
    finals = []
    for n, (b, bos, eos) in enumerate(sequence_bounds(dims.B, dims.T, cu_seqlens)):
        L = eos - bos
        gc, qg, kg, w, u, Aqk = _sequence_terms(qe[b, bos:eos], ke[b, bos:eos], ve[b, bos:eos],
                                                ge[b, bos:eos], be[b, bos:eos], chunk_size)
        S0 = qe.new_zeros(dims.HV, dims.K, dims.V) if initial_state is None else initial_state[n].to(qe.dtype)
        h, v_new, S = _sequence_state_pass(kg, w, u, gc, S0)
        o = _chunk_outputs(qg, h, Aqk, v_new, scale)
        for name, x in (("gc", gc), ("qg", qg), ("kg", kg), ("w", w), ("u", u), ("Aqk", Aqk),
                        ("v_new", v_new), ("o", o)):
            fields[name][b].append(x.reshape(-1, *x.shape[2:])[:L])
        fields["h"][b].append(h)
        finals.append(S)
    out = {name: torch.stack([torch.cat(rows) for rows in per_b]) for name, per_b in fields.items()}
    return ChunkIntermediates(final_state=torch.stack(finals), **out)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
              dt_bias=None, lower_bound=None, chunk_size=64):
    """Chunked KDA with :func:`recurrent_kda`'s signature plus ``chunk_size``.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or wider, or None)``.
    """
    inter = chunk_kda_intermediates(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                    lower_bound=lower_bound, chunk_size=chunk_size)
    return inter.o.to(v.dtype), (inter.final_state if output_final_state else None)
