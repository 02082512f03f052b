"""Context parallelism for Hugging Face transformers' ``Qwen3NextForCausalLM``, applied from outside.

As for Kimi Linear (:mod:`kdacp.integrations.transformers.kimi_linear`): the model's own parameters are used in place
(``model.state_dict()`` keeps its keys and tensors), the model code is not forked, and every rank holds
the whole model and its share of the global batch under the context's token layout (:func:`kdacp.shard_batch`).

* Gated DeltaNet layers (``Qwen3NextGatedDeltaNet``): their ``forward`` is replaced, on the instance, by
  :func:`kdacp.integrations.transformers.install.mixer_forward`: :func:`kdacp.layers.delta_rule.mix_tokens` on the module's
  parts (:class:`GatedDeltaNetParts`, parameters looked up at each call): the projections ``in_proj_qkvz`` /
  ``in_proj_ba`` (split per key-head group by the module's own ``fix_query_key_value_ordering``), the fused
  q|k|v depthwise convolution sliced per part with the left halo from the previous rank, the gate
  ``-exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` into kdacp's GDN recurrence through
  ``cp.chunk_kda`` (the scalar gate broadcast over ``K``; state exchange, Ulysses or both, as ``cp`` says;
  grouped value heads), the gated RMSNorm on ``z`` and ``out_proj``. ``del module.forward`` restores the
  model's own.
* Gated softmax attention layers (``Qwen3NextAttention``): kdacp's attention through transformers' attention
  registry, the function shared with Kimi Linear (:mod:`kdacp.integrations.transformers.attention`). The module's own forward
  computes q (with its output gate), k, v, the q/k norms and the partial rotary embedding on the local
  tokens from the global positions of :func:`kdacp.shard_batch`'s ``position_ids`` slice, so the rotary
  embedding stays the one-process one. Any ``P``: Ulysses where the key/value heads split too, else Ulysses
  with each key/value head sent to every rank whose query heads use it or a K/V all-gather, whichever moves
  fewer bytes (Qwen3-Next's 2 key/value heads: the gather at ``P = 4`` and ``8``); flash attention needs
  ``num_attention_heads % P == 0`` (checked, ``ValueError``).

Documents: transformers' ``Qwen3NextDecoderLayer`` forwards its keyword arguments (``cu_seq_lens_q`` ...,
from the model's ``forward``) to the linear-attention module as well as to the attention module, so
``batch.model_kwargs()``'s global boundaries reach both without a hook (checked by the tests on the
installed version: a packed batch would fail its tolerance otherwise).

Not supported under ``parallelize``: caches (``use_cache`` defaults to False; an explicit request raises
``ValueError``; decode with :func:`kdacp.integrations.transformers.generate` or inside :func:`kdacp.integrations.transformers.own_forwards`), padding
masks, returned attention weights, ``flex_attention``, and any keyword argument the forward would drop (refused
by name; ``cu_seqlens=`` is taken as ``cu_seq_lens_q/k``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ...cp.context import ContextParallel
from ...layers.delta_rule import Projected, head_rows
from ...ops.gdn import chunk_gated_delta_rule
from .attention import check_attention
from .checks import SILU_NAMES, token_mixers
from .install import install
from .loading import kernel_fallbacks, load_model_module

__all__ = ["GatedDeltaNetParts", "load_qwen3_next", "parallelize", "torch_fallbacks"]

# transformers' functions that bind a kernel package (FLA; causal-conv1d) where it imports, at import time.
_KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                     "causal_conv1d_update")


def load_qwen3_next():
    """transformers' ``modeling_qwen3_next`` module (``Qwen3NextForCausalLM``, ...), with FLA loaded first by
    kdacp (see :func:`kdacp.integrations.transformers.load_kimi_linear`: the same reason).

    Raises:
        ImportError: transformers missing or without Qwen3-Next (the ``models`` extra).
    """
    return load_model_module("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3-Next")


def torch_fallbacks():
    """Inside the block, transformers' unmodified Qwen3-Next models run its own PyTorch code (GDN and the
    short convolution) instead of FLA's GPU-only kernels, as :func:`kdacp.integrations.transformers.kimi_linear.torch_fallbacks`.
    That code ignores packed-sequence boundaries: one sequence per row."""
    return kernel_fallbacks(load_qwen3_next(), _KERNEL_FUNCTIONS)


class GatedDeltaNetParts:
    """The :class:`kdacp.layers.delta_rule.MixerParts` of a transformers ``Qwen3NextGatedDeltaNet``: its own
    modules, looked up at each call (value head ``j`` uses key head ``j // (HV/H)``; one depthwise Conv1d over
    q|k|v: channels ``[0, key_dim)`` q, ``[key_dim, 2 key_dim)`` k, then v)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.num_heads, self.num_v_heads = module.num_k_heads, module.num_v_heads
        self.head_k_dim, self.head_v_dim = module.head_k_dim, module.head_v_dim

    def project(self, x: torch.Tensor) -> Projected:
        m = self.module
        # q, k [B, T, H, K]; v, z [B, T, HV, V]; b, a [B, T, HV]
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
        return Projected(q.flatten(-2), k.flatten(-2), v.flatten(-2), a.contiguous(), b, z.flatten(-2))

    def conv_weights(self, heads: slice, v_heads: slice) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        conv, kd, K, V = self.module.conv1d, self.module.key_dim, self.head_k_dim, self.head_v_dim
        weight, bias = conv.weight.squeeze(1), conv.bias
        channels = [slice(heads.start * K, heads.stop * K), slice(kd + heads.start * K, kd + heads.stop * K),
                    slice(2 * kd + v_heads.start * V, 2 * kd + v_heads.stop * V)]
        return [(weight[c], None if bias is None else bias[c]) for c in channels]

    op = staticmethod(chunk_gated_delta_rule)

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        # The model's gate, -exp(A_log) * softplus(a + dt_bias), computed inside the kernel.
        m = self.module
        return dict(g=gate, A_log=head_rows(m.A_log, v_heads), dt_bias=head_rows(m.dt_bias, v_heads))

    def norm_arguments(self) -> tuple[torch.Tensor, float, str]:
        return self.module.norm.weight, self.module.norm.variance_epsilon, "swish"

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.module.out_proj(o)


def parallelize(model: nn.Module, cp: ContextParallel, loss_group=None) -> nn.Module:
    """Apply context parallelism to a Hugging Face ``Qwen3NextForCausalLM`` (or ``Qwen3NextModel``) in place.

    Gated DeltaNet layers run :func:`kdacp.layers.delta_rule.mix_tokens` (halo'd short convolution and
    context-parallel GDN) on the module's own parameters; attention layers run kdacp's attention over
    ``cp.group`` around the model's attention implementation (:mod:`kdacp.integrations.transformers.attention`: Ulysses, with
    key/value heads replicated where they do not split, or a K/V all-gather). Same contract as
    :func:`kdacp.integrations.transformers.kimi_linear.parallelize` (call on every rank after moving the model to its device;
    feed :func:`kdacp.shard_batch`'s ``batch.model_kwargs()``; ``.loss`` over ``loss_group``).

    Raises:
        ImportError: transformers without Qwen3-Next.
        ValueError: a model without Qwen3-Next token mixers, one already parallelised, GDN heads that do not
            split over the Ulysses ranks (naming the config field), flash attention with query heads that do
            not split over the ranks, an unsupported attention implementation or convolution / norm activation.
    """
    qn = load_qwen3_next()
    gdn, attn = token_mixers(model, cp, qn.Qwen3NextGatedDeltaNet, qn.Qwen3NextAttention, "Qwen3-Next")
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
        check_attention(model.config, torch.distributed.get_world_size(cp.group),
                        {"num_attention_heads": {model.config.num_attention_heads}})
    return install(model, cp, gdn, GatedDeltaNetParts, attn, qn.eager_attention_forward, loss_group)
