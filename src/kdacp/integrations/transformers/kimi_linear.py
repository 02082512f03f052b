"""Context parallelism for Hugging Face transformers' ``KimiLinearForCausalLM``, applied from outside.

:func:`parallelize` changes how the model's token mixers run, never what they hold: the model's own
parameters are used in place (``model.state_dict()`` keeps its keys and tensors), and the model code is
not forked. Every rank holds the whole model and its share of the global batch under the context's token
layout (:func:`kdacp.shard_batch`: equal time shards in rank order, zigzag, ...); everything but the two token
mixers works per token and needs nothing else.

* KDA layers (``KimiLinearDeltaAttention``): their ``forward`` is replaced, on the instance, by
  :func:`kdacp.integrations.transformers.install.mixer_forward`, which runs the token mixer kdacp's own layers run
  (:func:`kdacp.layers.delta_rule.mix_tokens`) on the module's parts (:class:`KimiDeltaParts`, which looks
  each parameter up on the module at each call, so FSDP2 may replace them): the projections, the fused
  q|k|v short convolution sliced per part with the left halo from the previous rank, the gate inside the
  KDA kernel (``A_log``, ``dt_bias`` of ``forget_gate``), ``cp.chunk_kda`` (state exchange, Ulysses or both,
  as ``cp`` says), the gated RMSNorm and the output projection. ``del module.forward`` restores the model's own.
* MLA layers (``KimiLinearAttention``): kdacp's attention through transformers' attention registry (the
  function shared with Qwen3-Next, :mod:`kdacp.integrations.transformers.attention`). The module's own forward still computes
  q, k, v on the local tokens; the registered function ``"kdacp_ulysses"`` runs Ulysses where
  ``num_attention_heads % P == 0`` (all-to-all to head shards, the model's previous attention implementation,
  ``eager``, ``sdpa`` or ``flash_attention_*``, on the whole global sequence of ``H/P`` heads with a
  per-document causal mask, all-to-all back) and otherwise gathers K/V along the sequence (``eager`` and
  ``sdpa``). Why not gather MLA's compressed latent: it would move less data (``kv_lora_rank +
  qk_rope_head_dim`` per token) but needs a forked forward; the registry is the extension point transformers
  offers.

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

Not supported under ``parallelize``: caches (the parallelised model's ``use_cache`` defaults to False; an
explicit request raises ``ValueError``; decode with :func:`kdacp.integrations.transformers.generate` or inside
:func:`kdacp.integrations.transformers.own_forwards`), padding masks, returned attention weights, ``flex_attention``, and any
keyword argument the forward would drop (refused by name; ``cu_seqlens=`` is taken as ``cu_seq_lens_q/k``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...cp.context import ContextParallel
from ...layers.delta_rule import Projected, head_rows
from ...ops.kda import chunk_kda
from .attention import ATTENTION_NAME, check_attention, document_causal_mask
from .checks import SILU_NAMES, token_mixers
from .install import install
from .loading import kernel_fallbacks, load_model_module

__all__ = ["ATTENTION_NAME", "KimiDeltaParts", "document_causal_mask", "load_kimi_linear", "parallelize",
           "torch_fallbacks"]


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


class KimiDeltaParts:
    """The :class:`kdacp.layers.delta_rule.MixerParts` of a transformers ``KimiLinearDeltaAttention``: its own
    modules, looked up at each call (``H == HV``, ``K == V``; one depthwise Conv1d over q|k|v)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.num_heads = self.num_v_heads = module.num_heads
        self.head_k_dim = self.head_v_dim = module.head_dim

    op = staticmethod(chunk_kda)

    def project(self, x: torch.Tensor) -> Projected:
        m, f = self.module, self.module.forget_gate
        return Projected(m.q_proj(x), m.k_proj(x), m.v_proj(x), f.f_b_proj(f.f_a_proj(x)), m.b_proj(x),
                         m.g_b_proj(m.g_a_proj(x)))

    def conv_weights(self, heads: slice, v_heads: slice) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        conv, H, K = self.module.conv1d, self.num_heads, self.head_k_dim
        weight, bias = conv.weight.squeeze(1), conv.bias
        # part i's channels start at i * H * K
        channels = [slice(part * H * K + heads.start * K, part * H * K + heads.stop * K) for part in range(3)]
        return [(weight[c], None if bias is None else bias[c]) for c in channels]

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        # The model's gate, -exp(A_log) * softplus(f + dt_bias), computed inside the KDA kernel.
        f, K = self.module.forget_gate, self.head_k_dim
        return dict(g=gate.unflatten(-1, (-1, K)), A_log=head_rows(f.A_log.view(-1), v_heads),
                    dt_bias=head_rows(f.dt_bias, slice(v_heads.start * K, v_heads.stop * K)), lower_bound=None,
                    safe_gate=False)

    def norm_arguments(self) -> tuple[torch.Tensor, float, str]:
        return self.module.o_norm.weight, self.module.o_norm.variance_epsilon, "sigmoid"

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.module.o_proj(o)


def parallelize(model: nn.Module, cp: ContextParallel, loss_group=None) -> nn.Module:
    """Apply context parallelism to a Hugging Face ``KimiLinearForCausalLM`` (or ``KimiLinearModel``) in place.

    KDA layers run :func:`kdacp.layers.delta_rule.mix_tokens` (kdacp's halo'd short convolution and
    ``cp.chunk_kda``) on the module's own parameters, looked up at each call; MLA layers run kdacp's attention
    over ``cp.group`` around the model's attention implementation (Ulysses, or a K/V all-gather where the
    heads do not split: :mod:`kdacp.integrations.transformers.attention`). Parameters are used in place: no copies, and
    ``model.state_dict()`` is unchanged. Call it on every rank, after moving the model to its device; FSDP2,
    DDP and activation checkpointing go on afterwards.

    Feed each rank its shard from :func:`kdacp.shard_batch`: ``model(**batch.model_kwargs()).loss`` follows
    the loss-scaling contract of :mod:`kdacp.cp.sharding` over ``loss_group``.

    Args:
        model: a transformers Kimi Linear model; its attention implementation (``eager``, ``sdpa``,
            ``flash_attention_2/3/4``) becomes the inner one of kdacp's attention.
        cp: the :class:`kdacp.ContextParallel` of the KDA layers (``state``, ``ulysses`` or
            ``hybrid``); the MLA layers use its whole ``group``.
        loss_group: the loss group of the model's ``.loss`` (a process group or 1-D mesh: the flattened
            dp x cp mesh under FSDP2/DDP); default ``cp.group``.

    Returns:
        ``model``.

    Raises:
        ImportError: transformers without Kimi Linear.
        ValueError: a model without Kimi Linear token mixers, one already parallelised, KDA heads that do not
            split over the Ulysses ranks, flash attention with MLA heads that do not split over the ranks,
            an unsupported attention implementation or convolution activation.
    """
    kl = load_kimi_linear()
    kda, mla = token_mixers(model, cp, kl.KimiLinearDeltaAttention, kl.KimiLinearAttention, "Kimi Linear")
    for m in kda:
        cp.validate_heads(m.num_heads, m.num_heads)
        if m.activation not in SILU_NAMES:
            raise ValueError(f"KDA layer {m.layer_idx}: kdacp's short convolution applies SiLU, "
                             f"the model's uses {m.activation!r}")
    if mla:
        check_attention(model.config, torch.distributed.get_world_size(cp.group),
                        {"num_attention_heads": {m.num_heads for m in mla}}, "MLA layers")
    return install(model, cp, kda, KimiDeltaParts, mla, kl.eager_attention_forward, loss_group)
