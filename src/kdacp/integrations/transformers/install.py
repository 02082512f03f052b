"""How ``parallelize`` changes a Hugging Face model in place: the linear-attention modules' forwards, the
softmax attention's routing, its own config (no cache by default) and the model's loss function."""
from __future__ import annotations

import copy
import functools

import torch.nn as nn

import torch

from ...cp.context import ContextParallel
from ...cp.groups import process_group
from ...cp.sharding import causal_lm_loss
from ...layers.delta_rule import mix_tokens
from .attention import ATTENTION_NAME, install_attention
from .checks import CallCheck, check_batch_layout, check_training_call, global_cu_seqlens
from .prefill import PrefillCache


def mixer_forward(parts: type, module: nn.Module, cp: ContextParallel, hidden_states: torch.Tensor, cache=None,
                  attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """A transformers linear-attention module's ``forward`` under ``parallelize``: :func:`mix_tokens` on
    ``parts(module)`` (the adapter's :class:`kdacp.layers.delta_rule.MixerParts`), on this rank's tokens
    ``hidden_states [B, L, hidden]`` (its ranges of ``cp``'s token layout, in global order);
    ``kwargs['cu_seq_lens_q']`` holds the global ``[N+1]`` boundaries of a packed batch (``B == 1``) or is absent,
    ``kwargs['kdacp_layout']`` the layout the batch was sharded by (checked against ``cp``'s). Returns
    ``[B, L, hidden]``.

    Under :func:`kdacp.integrations.transformers.prefill` (``cache`` its :class:`PrefillCache`) the layer runs on the pass's hooks
    (:meth:`PrefillCache.layer`): from the cached states, recording its final ones."""
    cu_seqlens = global_cu_seqlens(kwargs)
    check_batch_layout(cp, kwargs, *hidden_states.shape[:2], cu_seqlens, hidden_states.device)
    layer = None
    if isinstance(cache, PrefillCache):  # the cache refusal below stands for every other cache
        layer, cache = cache.layer(cp, module.layer_idx), None
        kwargs.pop("use_cache", None)
    check_training_call(cache, attention_mask, kwargs)
    initial_state = None if layer is None else layer.initial_state(cu_seqlens)
    y, final_state = mix_tokens(parts(module), cp if layer is None else layer, hidden_states, cu_seqlens=cu_seqlens,
                                backend="auto", initial_state=initial_state, output_final_state=layer is not None)
    if layer is not None:
        layer.record_state(final_state)
    return y


def install(model: nn.Module, cp: ContextParallel, linear: list[nn.Module], parts: type,
            attention: list[nn.Module], eager, loss_group=None) -> nn.Module:
    """Replace each linear-attention module's ``forward`` (on the instance) by :func:`mixer_forward` over
    ``parts`` (its :class:`kdacp.layers.delta_rule.MixerParts` class), route
    the ``attention`` modules through kdacp's attention over ``cp``'s group and layout (``eager``: the model's own eager
    function), give the model its own config with ``use_cache=False``, set its ``loss_function`` to
    :func:`kdacp.cp.sharding.causal_lm_loss` over ``loss_group`` (default ``cp.group``) and check each call's
    keyword arguments (:class:`kdacp.integrations.transformers.checks.CallCheck`, as ``model._kdacp_call_check``).

    Nothing made here holds a module's parameter: the forwards look them up on the module at each call, so
    wrappers applied afterwards (FSDP2's ``fully_shard``, DDP) that replace parameters keep working."""
    for m in linear:
        m.forward = functools.partial(mixer_forward, parts, m, cp)
    config = model.config
    # The config object may be shared with other models (built from the same config, or a reference copy's):
    # this model's modules get their own copy, so that only they look up the registered attention and default
    # to no cache (a training call that leaves use_cache unset builds none).
    own = copy.deepcopy(config)
    own.use_cache = False
    if attention:
        install_attention(attention, cp, config._attn_implementation, eager)
        # The mask code builds no mask for a name it does not know, and the function builds its own.
        own._attn_implementation = ATTENTION_NAME
    for m in model.modules():
        if getattr(m, "config", None) is config:
            m.config = own
    model._kdacp_call_check = CallCheck(model.forward)
    model.register_forward_pre_hook(model._kdacp_call_check, with_kwargs=True)
    model.loss_function = functools.partial(causal_lm_loss, group=process_group(
        cp.group if loss_group is None else loss_group, "loss_group"))
    return model
