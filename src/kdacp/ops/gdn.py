"""Gated DeltaNet (GDN; Qwen3-Next, Qwen3.5) with FLA's names, on one device and context-parallel.

GDN is KDA with one scalar decay per value head and token: ``g [B, T, HV]`` instead of
``[B, T, HV, K]``. The op runs the KDA op's checks and prepared call
(:func:`kdacp.ops.kda.check_and_prepare`, :func:`kdacp.ops.kda.run_prepared`) on its own ``g [B, T, HV]`` and
``dt_bias [HV]`` with the gate's kind ``"scalar"`` (:attr:`kdacp.backends.base.KDAOptions.gate`), so
plans, strategies and summaries are shared and no KDA argument is made up. The backends dispatch on the
kind: the ``fla`` backend runs FLA's GDN kernels on the scalar gate itself
(:class:`kdacp.backends.fla_gdn_backend.FlaGDNBackend`), and so do ``attn_gym`` and ``flashqla``; the ``torch`` backend
runs the KDA reference, and ``fla`` FLA's KDA kernels where FLA refuses its GDN backward and a gradient is
wanted (:func:`kdacp.backends.fla_adapter.fla_gated_gdn_backward_supported`), on the gate broadcast over
``K`` inside the backend (:class:`kdacp.backends.gate.BroadcastGate`, the one place it is broadcast).
"""
from __future__ import annotations

from ..cp.split import check_split
from ..validation import check_fla_only_options
from .kda import check_and_prepare, run_prepared


def gdn_gate_arguments(g, use_gate_in_kernel, A_log, dt_bias) -> dict:
    """The KDA op's gate keywords for GDN's own gate: ``g [B, T, HV]`` (natural-log decay, or logits with
    ``use_gate_in_kernel`` and ``A_log, dt_bias [HV]``) and ``dt_bias`` as they are, ``A_log``,
    ``use_gate_in_kernel``, and ``gate="scalar"``, the gate's kind (:func:`kdacp.ops.kda.check_and_prepare`'s
    keyword), whose checks (:func:`kdacp.validation.check_kda_inputs` with ``gate="scalar"``, under ``cp`` on
    every rank alike) take the shapes. Raises ``ValueError`` for ``use_gate_in_kernel`` without ``A_log``
    (GDN's gate has no ``lower_bound`` form)."""
    if use_gate_in_kernel and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log of shape [HV]")
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return dict(g=g, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel, gate="scalar")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           cu_seqlens=None, cu_seqlens_cpu=None, backend="auto", cp=None, summary_precision=None, split="auto",
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Chunk GDN, differentiable (FLA's ``chunk_gated_delta_rule`` arguments): on one device, or with
    ``cp`` over the tokens split across the ranks of ``cp.group`` (call it on every rank).

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, HV, V]`` (``HV % H == 0``); g ``[B, T, HV]``: natural-log
            decay, or raw logits with ``use_gate_in_kernel`` (``-exp(A_log) * softplus(g + dt_bias)``,
            ``A_log``, ``dt_bias`` ``[HV]``); beta ``[B, T, HV]``.
        scale, initial_state ``[N, HV, K, V]``, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, cu_seqlens_cpu, backend, cp, summary_precision, split, use_beta_sigmoid_in_kernel,
            allow_neg_eigval: as :func:`kdacp.chunk_kda` (same contract for states, gradients and errors under ``cp``);
            ``backend`` also ``"flashqla"``, GDN only (FlashQLA's fused kernels, K = V = 128, bf16 or fp16:
            :mod:`kdacp.backends.flashqla_backend`).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 (float64 for float64) or None)``.
    """
    check_fla_only_options(use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    check_split(split)
    gate = gdn_gate_arguments(g, use_gate_in_kernel, A_log, dt_bias)
    prepared, plan = check_and_prepare(
        q, k, v, beta=beta, scale=scale, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        lower_bound=None, safe_gate=False, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend,
        check_finite=False, output_final_state=output_final_state, cp=cp, summary_precision=summary_precision, **gate)
    return run_prepared(prepared, plan, initial_state, output_final_state, split)
