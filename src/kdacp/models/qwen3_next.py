"""Context parallelism for Hugging Face transformers' ``Qwen3NextForCausalLM``, applied from outside.

As for Kimi Linear (:mod:`kdacp.models.kimi_linear`): the model's own parameters are used in place
(``model.state_dict()`` keeps its keys and tensors), the model code is not forked, and every rank holds
the whole model and one equal time shard of the global batch (:func:`kdacp.shard_batch`).

* Gated DeltaNet layers (``Qwen3NextGatedDeltaNet``): their ``forward`` is replaced, on the instance, by
  :func:`_gdn_forward`: the model's projections ``in_proj_qkvz`` / ``in_proj_ba`` (split per key-head group
  by the module's own ``fix_query_key_value_ordering``), the fused q|k|v depthwise convolution sliced per
  part with the left halo from the previous rank, the gate ``-exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` into kdacp's GDN recurrence through ``cp.chunk_kda`` (the scalar gate broadcast
  over ``K``, as :func:`kdacp.cp_chunk_gated_delta_rule`; state exchange, Ulysses or both, as ``cp``
  says; grouped value heads), the gated RMSNorm on ``z`` and ``out_proj``. ``del module.forward``
  restores the model's own.
* Gated softmax attention layers (``Qwen3NextAttention``): Ulysses through transformers' attention
  registry, the function shared with Kimi Linear (:mod:`kdacp.models.common`). The module's own forward
  computes q (with its output gate), k, v, the q/k norms and the partial rotary embedding on the local
  tokens from the global positions of :func:`kdacp.shard_batch`'s ``position_ids`` slice, so the rotary
  embedding stays the one-process one; grouped-query attention shards query and key/value heads alike.
  Needs ``num_attention_heads % P == 0`` and ``num_key_value_heads % P == 0`` (checked, ``ValueError``).

Documents: transformers' ``Qwen3NextDecoderLayer`` forwards its keyword arguments (``cu_seq_lens_q`` ...,
from the model's ``forward``) to the linear-attention module as well as to the attention module, so
``batch.model_kwargs()``'s global boundaries reach both without a hook (checked by the tests on the
installed version: a packed batch would fail its tolerance otherwise).

Not supported under ``parallelize``: caches (``use_cache`` must be False), padding masks, returned
attention weights, ``flex_attention``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..backends import resolve_backend
from ..gdn import gdn_as_kda_arguments
from ..layers.context_parallel import KDAContextParallel
from ..layers.delta_rule import beta_from_logits
from ..layers.norm import RMSNormGated
from .common import (SILU_NAMES, check_attention, check_training_call, fused_short_conv, gated_norm, global_cu_seqlens,
                     install, kernel_fallbacks, load_model_module, token_mixers)
from .prefill import layer_prefill

__all__ = ["load_qwen3_next", "parallelize", "torch_fallbacks"]

# transformers' functions that bind a kernel package (FLA; causal-conv1d) where it imports, at import time.
_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update")


def load_qwen3_next():
    """transformers' ``modeling_qwen3_next`` module (``Qwen3NextForCausalLM``, ...), with FLA loaded first by
    kdacp (see :func:`kdacp.models.load_kimi_linear`: the same reason).

    Raises:
        ImportError: transformers missing or without Qwen3-Next (the ``models`` extra).
    """
    return load_model_module("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3-Next")


def torch_fallbacks():
    """Inside the block, transformers' unmodified Qwen3-Next models run its own PyTorch code (GDN and the
    short convolution) instead of FLA's GPU-only kernels, as :func:`kdacp.models.kimi_linear.torch_fallbacks`.
    That code ignores packed-sequence boundaries: one sequence per row."""
    return kernel_fallbacks(load_qwen3_next(), _KERNEL_FUNCTIONS)


def _gdn_forward(module: nn.Module, cp: KDAContextParallel, norm: RMSNormGated, hidden_states: torch.Tensor,
                 cache=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``Qwen3NextGatedDeltaNet.forward`` on this rank's time shard ``hidden_states [B, T/P, hidden]``, with
    kdacp's halo'd convolution and context-parallel GDN recurrence; ``kwargs['cu_seq_lens_q']`` holds the
    global ``[N+1]`` boundaries of a packed batch (``B == 1``) or is absent. Returns ``[B, T/P, hidden]``."""
    cp, cache = layer_prefill(cp, cache, module.layer_idx, kwargs)  # under kdacp.models.prefill: its hooks
    check_training_call(cache, attention_mask, kwargs)
    cu_seqlens = global_cu_seqlens(kwargs)
    x = hidden_states
    H, HV, K, V = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    backend = cp.backend or "auto"
    fused = resolve_backend(backend, x.device) == "fla"
    # q, k [B, T, H, K]; v, z [B, T, HV, V]; b, a [B, T, HV] (value head j uses key head j // (HV/H))
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
    # Ulysses moves the convolution's inputs, so it then sees whole sequences of its head shard; z stays here.
    q, k, v, a, beta = cp.to_heads([q.flatten(-2), k.flatten(-2), v.flatten(-2), a.contiguous(), b])
    beta = beta_from_logits(beta)
    heads, v_heads = cp.head_slice(H), cp.head_slice(HV)

    conv = cp.conv_context(q.shape[1], cu_seqlens)
    # One depthwise Conv1d over q|k|v in the model: channels [0, key_dim) q, [key_dim, 2 key_dim) k, then v.
    kd = module.key_dim
    channels = [slice(heads.start * K, heads.stop * K), slice(kd + heads.start * K, kd + heads.stop * K),
                slice(2 * kd + v_heads.start * V, 2 * kd + v_heads.stop * V)]
    q, k, v = fused_short_conv(conv, [q, k, v], module.conv1d, channels, fused)
    q, k, v = q.unflatten(-1, (-1, K)), k.unflatten(-1, (-1, K)), v.unflatten(-1, (-1, V))

    # The model's gate, -exp(A_log) * softplus(a + dt_bias), computed inside the kernel (kdacp's GDN arguments).
    gate = gdn_as_kda_arguments(q, v, a, True, module.A_log[v_heads], module.dt_bias[v_heads])
    o, _ = cp.chunk_kda(q, k, v, beta=beta, cu_seqlens=cu_seqlens, backend=backend, use_qk_l2norm_in_kernel=True,
                        **gate)
    o, _ = cp.to_sequence(o, None)
    o = norm(o, z, fused=fused)
    return module.out_proj(o.flatten(-2))


def parallelize(model: nn.Module, cp: KDAContextParallel) -> nn.Module:
    """Apply context parallelism to a Hugging Face ``Qwen3NextForCausalLM`` (or ``Qwen3NextModel``) in place.

    Gated DeltaNet layers run kdacp's halo'd short convolution and context-parallel GDN on the module's own
    parameters; attention layers run Ulysses over ``cp.group`` around the model's attention implementation.
    Same contract as :func:`kdacp.models.kimi_linear.parallelize` (call on every rank after moving the model
    to its device; feed :func:`kdacp.shard_batch`'s ``batch.model_kwargs()``; loss by
    :func:`kdacp.models.global_token_mean_loss`; all-reduce (SUM) the gradients).

    Raises:
        ImportError: transformers without Qwen3-Next.
        ValueError: a model without Qwen3-Next token mixers, one already parallelised, heads that do not
            split over the ranks (naming the config field), an unsupported attention implementation or
            convolution / norm activation.
    """
    qn = load_qwen3_next()
    gdn, attn, P = token_mixers(model, cp, qn.Qwen3NextGatedDeltaNet, qn.Qwen3NextAttention, "Qwen3-Next")
    for m in gdn:
        for name in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "conv1d", "norm", "out_proj"):
            if not hasattr(m, name):
                raise ValueError(f"GDN layer {m.layer_idx}: this transformers version's Qwen3NextGatedDeltaNet has "
                                 f"no {name!r}; kdacp's adapter follows transformers 5.x's layout")
        try:
            cp.validate_heads(m.num_k_heads, m.num_v_heads)
        except ValueError as e:
            raise ValueError(f"GDN layer {m.layer_idx} (linear_num_key_heads={m.num_k_heads}, "
                             f"linear_num_value_heads={m.num_v_heads}): {e}") from None
        if m.activation not in SILU_NAMES or m.norm.activation not in SILU_NAMES:
            raise ValueError(f"GDN layer {m.layer_idx}: kdacp's short convolution and gated norm apply SiLU, "
                             f"the model's use {m.activation!r} and {m.norm.activation!r}")
    if attn:
        config = model.config
        check_attention(config, P, {"num_attention_heads": {config.num_attention_heads},
                                    "num_key_value_heads": {config.num_key_value_heads}})

    return install(model, cp, gdn, _gdn_forward, lambda m: gated_norm(m.norm.weight, m.norm.variance_epsilon, "swish"),
                   attn, qn.eager_attention_forward)
