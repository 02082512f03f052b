"""Context parallelism for Hugging Face transformers' ``KimiLinearForCausalLM``, applied from outside.

:func:`parallelize` changes how the model's token mixers run, never what they hold: the model's own
parameters are used in place (``model.state_dict()`` keeps its keys and tensors), and the model code is
not forked. Every rank holds the whole model and one equal time shard of the global batch, in rank order
(:func:`kdacp.shard_batch`); everything but the two token mixers works per token and needs nothing else.

* KDA layers (``KimiLinearDeltaAttention``): their ``forward`` is replaced, on the instance, by
  :func:`_kda_forward`, which runs kdacp's context-parallel composition (the one of
  :class:`kdacp.layers.DeltaRuleLayer`) on the module's parameters: the projections, the fused q|k|v
  short convolution sliced per part with the left halo from the previous rank
  (:meth:`ConvContext.left_halos`), the gate inside the KDA kernel (``A_log``, ``dt_bias`` of
  ``forget_gate``), ``cp.chunk_kda`` (state exchange, Ulysses or both, as ``cp`` says), the gated
  RMSNorm and the output projection. ``del module.forward`` restores the model's own.
* MLA layers (``KimiLinearAttention``): Ulysses sequence parallelism through transformers' attention
  registry (the function shared with Qwen3-Next, :mod:`kdacp.models.common`). The module's own forward
  still computes q, k, v on the local tokens; the registered function ``"kdacp_ulysses"`` all-to-alls them from time shards to head shards (every rank then holds
  the whole global sequence of ``H/P`` heads), calls the model's previous attention implementation
  (``eager``, ``sdpa`` or ``flash_attention_*``) on it with a per-document causal mask, and
  all-to-alls the output back. Why Ulysses rather than gathering K/V: it keeps the model's forward and
  its attention kernel unchanged (the registry is the extension point transformers offers; gathering
  MLA's compressed latent would need a forked forward), it balances the causal work over ranks (with
  gathered K/V the last rank does most of it), and the mask is the plain global one. Its condition:
  ``num_attention_heads % P == 0`` (checked, ``ValueError``). Gathering the latent would move less data
  (``kv_lora_rank + qk_rope_head_dim`` per token instead of q, k, v and the output of ``H/P`` heads);
  worth it if the all-to-all shows up in profiles.

Positions and documents. Kimi Linear's MLA uses no rotary embedding (NoPE; the ``k_rot`` part is not
rotated), so ``position_ids`` only tell transformers' mask code where documents restart. Under
:func:`parallelize` the masks are built here from the global ``cu_seqlens`` instead: pass
``batch.model_kwargs()`` from :func:`kdacp.shard_batch`, which gives every rank its slice of the global
``position_ids`` (restarting at each document) and the *global* boundaries as ``cu_seq_lens_q`` /
``cu_seq_lens_k`` (flash-attention's names). Transformers forwards these keyword arguments from the
model's ``forward`` to every decoder layer and from there to both token mixers: the KDA layers build
their convolution context and recurrence plan from them (once per tensor object), and the attention
function, after the all-to-all, holds exactly the global sequence they describe: it builds the
block-diagonal causal mask (``eager``/``sdpa``) or hands them to flash attention's varlen path, with
global positions derived from them. Without ``cu_seq_lens_q`` the batch is ``B`` unpacked sequences.

Not supported under ``parallelize``: caches (``use_cache`` must be False: training and scoring, not
generation), padding masks, returned attention weights, ``flex_attention``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..backends import resolve_backend
from ..layers.context_parallel import KDAContextParallel
from ..layers.delta_rule import beta_from_logits
from ..layers.norm import RMSNormGated
from .common import (ATTENTION_NAME, SILU_NAMES, check_attention, check_training_call, document_causal_mask,
                     fused_short_conv, gated_norm, global_cu_seqlens, install, kernel_fallbacks, load_model_module,
                     token_mixers)
from .prefill import layer_prefill

__all__ = ["ATTENTION_NAME", "document_causal_mask", "load_kimi_linear", "parallelize", "torch_fallbacks"]


def load_kimi_linear():
    """transformers' ``modeling_kimi_linear`` module (``KimiLinearConfig``, ``KimiLinearForCausalLM``, ...).

    Importing it imports FLA where installed (transformers' kernel fallback), and FLA reads
    ``FLA_CACHE_MODE`` once, at import: so kdacp's adapter loads FLA first, pointed at kdacp's tuned
    configurations (:func:`kdacp.tuning.use_shipped_configs`). Build models through this module, or
    call it before transformers imports its Kimi Linear code, to have them.

    Raises:
        ImportError: transformers missing or without Kimi Linear (the ``models`` extra).
    """
    return load_model_module("transformers.models.kimi_linear.modeling_kimi_linear", "Kimi Linear")


# transformers' functions that bind a kernel package (FLA; causal-conv1d) where it imports, at import time.
_KERNEL_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                     "causal_conv1d_update")


def torch_fallbacks():
    """Inside the block, transformers' unmodified Kimi Linear models run its own PyTorch code.

    transformers binds FLA's Triton kernels for KDA when it imports its Kimi Linear code, wherever FLA
    imports, and calls them whatever the tensors' device: on a machine without a GPU they fail in Triton
    ("0 active drivers"). The block swaps those module functions for the PyTorch code they wrap, and
    restores them on exit. That code ignores packed-sequence boundaries: one sequence per row.
    """
    return kernel_fallbacks(load_kimi_linear(), _KERNEL_FUNCTIONS)


def _kda_forward(module: nn.Module, cp: KDAContextParallel, o_norm: RMSNormGated, hidden_states: torch.Tensor,
                 cache=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``KimiLinearDeltaAttention.forward`` on this rank's time shard ``hidden_states [B, T/P, hidden]``,
    with kdacp's halo'd convolution and context-parallel recurrence; ``kwargs['cu_seq_lens_q']`` holds the
    global ``[N+1]`` boundaries of a packed batch (``B == 1``) or is absent. Returns ``[B, T/P, hidden]``."""
    cp, cache = layer_prefill(cp, cache, module.layer_idx, kwargs)  # under kdacp.models.prefill: its hooks
    check_training_call(cache, attention_mask, kwargs)
    cu_seqlens = global_cu_seqlens(kwargs)
    x = hidden_states
    H, K = module.num_heads, module.head_dim  # Kimi Linear: HV == H, V == K
    gate_module = module.forget_gate
    backend = cp.backend or "auto"
    fused = resolve_backend(backend, x.device) == "fla"
    # Ulysses moves the convolution's inputs, so it then sees whole sequences of its head shard.
    q, k, v, gate, beta = cp.to_heads([module.q_proj(x), module.k_proj(x), module.v_proj(x),
                                       gate_module.f_b_proj(gate_module.f_a_proj(x)), module.b_proj(x)])
    beta = beta_from_logits(beta)
    heads = cp.head_slice(H)

    conv = cp.conv_context(q.shape[1], cu_seqlens)
    # One depthwise Conv1d over q|k|v in the model: part i's channels start at i * H * K.
    channels = [slice(part * H * K + heads.start * K, part * H * K + heads.stop * K) for part in range(3)]
    q, k, v = (y.unflatten(-1, (-1, K)) for y in fused_short_conv(conv, [q, k, v], module.conv1d, channels, fused))

    # The model's gate, -exp(A_log) * softplus(f + dt_bias), computed inside the KDA kernel.
    o, _ = cp.chunk_kda(q, k, v, beta=beta, cu_seqlens=cu_seqlens, backend=backend, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, g=gate.unflatten(-1, (-1, K)), A_log=gate_module.A_log.view(-1)[heads],
                        dt_bias=gate_module.dt_bias[heads.start * K:heads.stop * K], lower_bound=None,
                        safe_gate=False)
    o, _ = cp.to_sequence(o, None)
    o = o_norm(o, module.g_b_proj(module.g_a_proj(x)).unflatten(-1, (-1, K)), fused=fused)
    return module.o_proj(o.flatten(-2))


def parallelize(model: nn.Module, cp: KDAContextParallel) -> nn.Module:
    """Apply context parallelism to a Hugging Face ``KimiLinearForCausalLM`` (or ``KimiLinearModel``) in place.

    KDA layers run kdacp's halo'd short convolution and ``cp.chunk_kda`` on the module's own parameters;
    MLA layers run Ulysses sequence parallelism over ``cp.group`` around the model's attention
    implementation (see the module docstring for the why). Parameters are used in place: no copies, and
    ``model.state_dict()`` is unchanged. Call it on every rank, after moving the model to its device.

    Feed each rank its shard from :func:`kdacp.shard_batch`: ``model(**batch.model_kwargs())``, then
    :func:`kdacp.models.global_token_mean_loss` on the logits (not the model's ``labels`` loss, which would
    shift labels within the shard).

    Args:
        model: a transformers Kimi Linear model; its attention implementation (``eager``, ``sdpa``,
            ``flash_attention_2/3/4``) becomes the inner one of the Ulysses attention.
        cp: the :class:`kdacp.KDAContextParallel` of the KDA layers (``state``, ``ulysses`` or
            ``hybrid``); the MLA layers use its whole ``group``.

    Returns:
        ``model``.

    Raises:
        ImportError: transformers without Kimi Linear.
        ValueError: a model without Kimi Linear token mixers, one already parallelised, heads that do not
            split over the ranks, an unsupported attention implementation or convolution activation.
    """
    kl = load_kimi_linear()
    kda, mla, P = token_mixers(model, cp, kl.KimiLinearDeltaAttention, kl.KimiLinearAttention, "Kimi Linear")
    for m in kda:
        cp.validate_heads(m.num_heads, m.num_heads)
        if m.activation not in SILU_NAMES:
            raise ValueError(f"KDA layer {m.layer_idx}: kdacp's short convolution applies SiLU, "
                             f"the model's uses {m.activation!r}")
    if mla:
        check_attention(model.config, P, {"num_attention_heads": {m.num_heads for m in mla}}, "MLA layers")

    return install(model, cp, kda, _kda_forward,
                   lambda m: gated_norm(m.o_norm.weight, m.o_norm.variance_epsilon, "sigmoid"),
                   mla, kl.eager_attention_forward)
