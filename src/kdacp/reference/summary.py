"""Affine state summaries of a segment of chunks, and their gradient counterparts.

Forward: ``S_out = M S_in + S_ext`` with ``M = prod_c (Diag(exp2(gc_last_c)) - kg_c^T w_c)``
(later chunks on the left) and ``S_ext`` the segment's final state from ``S_in = 0``.
Backward: ``dS_in = M^T dS_out + G`` with ``G`` the gradient of the segment's own outputs with
respect to ``S_in`` when ``dS_out = 0``, from the explicit reverse recurrence::

    dv' = kg dS + dv_local;   dS <- Diag(exp2(gc_last)) dS + scale qg^T dO - w^T dv'

Inputs are the token-first intermediates of :mod:`.chunk` (``[B, T, HV, K]``); each sequence
(a batch row, or a ``cu_seqlens`` segment) is chunked from its own first token. Results are
``[N, HV, ...]`` in float32, or float64 for float64 inputs. The algebra itself (apply, compose) is
:mod:`kdacp.affine`'s, re-exported here.
"""
from __future__ import annotations

import torch

from ..affine import AffineMap, apply_state_gradient_summary, apply_state_summary, compose_state_summaries
from .chunk import chunk_bounds
from ..sequences import sequence_bounds
from .gates import compute_dtype


def _segments(x: torch.Tensor, cu_seqlens, chunk_size: int):
    B, T = x.shape[:2]
    for b, bos, eos in sequence_bounds(B, T, cu_seqlens):
        yield b, chunk_bounds(bos, eos, chunk_size)


def state_summary(kg, w, u, gc, chunk_size=64, cu_seqlens=None) -> AffineMap:
    """``(S_ext [N, HV, K, V], M [N, HV, K, K])`` of each sequence from ``kg, w, gc [B, T, HV, K]``
    and ``u [B, T, HV, V]``."""
    dtype = compute_dtype(kg)
    kg, w, u, gc = (x.to(dtype) for x in (kg, w, u, gc))
    HV, K, V = kg.shape[2], kg.shape[3], u.shape[3]
    states, transitions = [], []
    for b, chunks in _segments(kg, cu_seqlens, chunk_size):
        S = kg.new_zeros(HV, K, V)
        M = torch.eye(K, dtype=dtype, device=kg.device).expand(HV, K, K)
        for s, e in chunks:
            decay = torch.exp2(gc[b, e - 1])[..., None]
            S = decay * S + torch.einsum("chk,chv->hkv", kg[b, s:e], u[b, s:e] - torch.einsum("chk,hkv->chv", w[b, s:e], S))
            M = decay * M - torch.einsum("chk,chj->hkj", kg[b, s:e], torch.einsum("chk,hkj->chj", w[b, s:e], M))
        states.append(S)
        transitions.append(M)
    return AffineMap(torch.stack(states), torch.stack(transitions))


def transition(kg, w, gc, chunk_size=64, cu_seqlens=None) -> torch.Tensor:
    """``M [N, HV, K, K]``: the product of the chunk factors ``Diag(exp2(gc_last)) - kg^T w``."""
    u = kg.new_zeros(*kg.shape[:3], 1)
    return state_summary(kg, w, u, gc, chunk_size, cu_seqlens).transition


def state_gradient_summary(qg, kg, w, gc, do, dv, scale, chunk_size=64, cu_seqlens=None) -> torch.Tensor:
    """``G [N, HV, K, V]`` from ``qg, kg, w, gc [B, T, HV, K]``, the output gradient ``do`` and
    ``dv = dv_local`` (the gradient reaching ``v_new`` from each chunk's own outputs), ``[B, T, HV, V]``."""
    dtype = compute_dtype(qg)
    qg, kg, w, gc, do, dv = (x.to(dtype) for x in (qg, kg, w, gc, do, dv))
    HV, K, V = kg.shape[2], kg.shape[3], do.shape[3]
    grads = []
    for b, chunks in _segments(kg, cu_seqlens, chunk_size):
        dS = kg.new_zeros(HV, K, V)
        for s, e in reversed(chunks):
            dvp = torch.einsum("chk,hkv->chv", kg[b, s:e], dS) + dv[b, s:e]
            dS = (torch.exp2(gc[b, e - 1])[..., None] * dS
                  + scale * torch.einsum("chk,chv->hkv", qg[b, s:e], do[b, s:e])
                  - torch.einsum("chk,chv->hkv", w[b, s:e], dvp))
        grads.append(dS)
    return torch.stack(grads)


def chunk_dv_local(Aqk, do, scale, chunk_size=64, cu_seqlens=None) -> torch.Tensor:
    """``dv_local = scale tril(Aqk)^T dO`` per chunk: ``Aqk [B, T, HV, C]``, ``do [B, T, HV, V]`` -> ``[B, T, HV, V]``."""
    dtype = compute_dtype(Aqk)
    Aqk, do = Aqk.to(dtype), do.to(dtype)
    out = torch.zeros_like(do)
    for b, chunks in _segments(Aqk, cu_seqlens, chunk_size):
        for s, e in chunks:
            out[b, s:e] = scale * torch.einsum("ihj,ihv->jhv", Aqk[b, s:e, :, : e - s], do[b, s:e])
    return out
