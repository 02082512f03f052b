"""How ``parallelize`` changes a Hugging Face model in place: the linear-attention modules' forwards, the
softmax attention's routing, its own config (no cache by default) and the model's loss function."""
from __future__ import annotations

import copy
import functools

import torch.nn as nn

from ..distributed.comm import process_group
from ..layers.context_parallel import KDAContextParallel
from .attention import ATTENTION_NAME, install_attention
from .batch import causal_lm_loss

__all__ = ["install"]


def install(model: nn.Module, cp: KDAContextParallel, linear: list[nn.Module], forward, attention: list[nn.Module],
            eager, loss_group=None) -> nn.Module:
    """Replace each linear-attention module's ``forward`` (on the instance) by ``forward(module, cp, ...)``, route
    the ``attention`` modules through kdacp's attention over ``cp.group`` (``eager``: the model's own eager
    function), give the model its own config with ``use_cache=False`` and set its ``loss_function`` to
    :func:`kdacp.models.batch.causal_lm_loss` over ``loss_group`` (default ``cp.group``).

    Nothing made here holds a module's parameter: the forwards look them up on the module at each call, so
    wrappers applied afterwards (FSDP2's ``fully_shard``, DDP) that replace parameters keep working."""
    for m in linear:
        m.forward = functools.partial(forward, m, cp)
    config = model.config
    # The config object may be shared with other models (built from the same config, or a reference copy's):
    # this model's modules get their own copy, so that only they look up the registered attention and default
    # to no cache (a training call that leaves use_cache unset builds none).
    own = copy.deepcopy(config)
    own.use_cache = False
    if attention:
        install_attention(attention, cp.group, config._attn_implementation, eager)
        # The mask code builds no mask for a name it does not know, and the function builds its own.
        own._attn_implementation = ATTENTION_NAME
    for m in model.modules():
        if getattr(m, "config", None) is config:
            m.config = own
    model.loss_function = functools.partial(causal_lm_loss, group=process_group(
        cp.group if loss_group is None else loss_group, "loss_group"))
    return model
