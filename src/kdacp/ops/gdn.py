"""Gated DeltaNet (GDN; Qwen3-Next, Qwen3.5) with FLA's names, on one device and context-parallel.

GDN is KDA with one scalar decay per value head and token: ``g [B, T, HV]`` instead of
``[B, T, HV, K]``. The op checks the GDN shapes, broadcasts the gate over ``K``
(:func:`kdacp.reference.gdn.scalar_gate_as_kda`, a view) and runs the KDA op's prepared call
(:func:`kdacp.kda.run_prepared`) with GDN's own gate beside the broadcast one, so plans,
strategies and summaries are shared. The ``torch`` backend runs the KDA reference on the broadcast
gate; the ``fla`` backend runs FLA's GDN kernels on the scalar gate itself
(:class:`kdacp.backends.fla_gdn_backend.FlaGDNBackend`), except where FLA refuses its GDN backward and
a gradient is wanted (:func:`kdacp.backends.fla_adapter.fla_gated_gdn_backward_supported`): then
FLA's KDA kernels run on the broadcast gate.
"""
from __future__ import annotations

import functools

import torch

from ..caches import META_STAND_INS
from ..cp.split import check_split
from .kda import check_and_prepare, run_prepared
from ..reference.gdn import scalar_gate_as_kda
from ..validation import check_fla_only_options, check_tensor


def gdn_as_kda_arguments(q, v, g, use_gate_in_kernel, A_log, dt_bias) -> dict:
    """The KDA op's gate keywords for GDN's ``g [B, T, HV]`` (natural-log decay, or logits with
    ``use_gate_in_kernel`` and ``A_log, dt_bias [HV]``), after checking GDN's shapes: ``g [B, T, HV, K]``
    broadcast over ``K`` (a view), ``dt_bias``: a meta tensor of the broadcast's shape ``[HV * K]`` and
    dtype, for the KDA op's checks, ``A_log``, ``use_gate_in_kernel``, and ``scalar_gate``: GDN's own
    ``(g, dt_bias)``, which the ``fla`` backend runs FLA's GDN kernels on, and from which
    :func:`kdacp.backends.call.prepare_call` broadcasts ``dt_bias`` where KDA kernels run instead
    (:func:`kdacp.kda.check_and_prepare`'s keyword)."""
    for name, x, nd in (("q", q, 4), ("v", v, 4), ("g", g, 3)):
        check_tensor(name, x, nd)
    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if tuple(g.shape) != (B, T, HV):
        raise ValueError(f"g must have shape [B, T, HV] = {(B, T, HV)} (one decay per value head and token), "
                         f"got {tuple(g.shape)}")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("use_gate_in_kernel=True needs A_log of shape [HV]")
        if dt_bias is not None:
            check_tensor("dt_bias", dt_bias)
            if tuple(dt_bias.shape) != (HV,):
                raise ValueError(f"dt_bias must have shape [HV] = [{HV}], got {tuple(dt_bias.shape)}")
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    K = q.shape[-1]
    g_kda, _ = scalar_gate_as_kda(g, K)
    # The KDA op's checks read the broadcast dt_bias [HV * K] by shape and dtype only, so they get a meta
    # tensor; prepare_call forms the broadcast where KDA kernels run (FLA's GDN kernels read dt_bias [HV]).
    dt_bias_kda = None if dt_bias is None else _meta_stand_in(HV * K, dt_bias.dtype)
    return dict(g=g_kda, A_log=A_log, dt_bias=dt_bias_kda, use_gate_in_kernel=use_gate_in_kernel,
                scalar_gate=(g, dt_bias))


@functools.lru_cache(maxsize=META_STAND_INS)
def _meta_stand_in(numel: int, dtype) -> torch.Tensor:
    """A meta tensor ``[numel]`` of ``dtype``, made once (a new one per call cost a dispatched op)."""
    return torch.empty(numel, dtype=dtype, device="meta")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           cu_seqlens=None, cu_seqlens_cpu=None, backend="auto", cp=None, summary_precision=None, split=None,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk GDN, differentiable (FLA's ``chunk_gated_delta_rule`` arguments): on one device, or with
    ``cp`` over the tokens split across the ranks of ``cp.group`` (call it on every rank).

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, HV, V]`` (``HV % H == 0``); g ``[B, T, HV]``: natural-log
            decay, or raw logits with ``use_gate_in_kernel`` (``-exp(A_log) * softplus(g + dt_bias)``,
            ``A_log``, ``dt_bias`` ``[HV]``); beta ``[B, T, HV]``.
        scale, initial_state ``[N, HV, K, V]``, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, cu_seqlens_cpu, backend, cp, summary_precision, split, use_beta_sigmoid_in_kernel,
            allow_neg_eigval: as :func:`kdacp.chunk_kda` (same contract for states, gradients and errors under ``cp``).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64) or None)``.
    """
    check_fla_only_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    check_split(split)
    gate = gdn_as_kda_arguments(q, v, g, use_gate_in_kernel, A_log, dt_bias)
    prepared, plan = check_and_prepare(
        q, k, v, beta=beta, scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        lower_bound=None, safe_gate=False, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend,
        check_finite=False, output_final_state=output_final_state, cp=cp, summary_precision=summary_precision, **gate)
    return run_prepared(prepared, plan, initial_state, output_final_state, split)
