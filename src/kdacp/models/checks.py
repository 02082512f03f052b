"""The argument checks of a parallelised model's token mixers: no cache, no padding mask, one set of global
boundaries, and which modules ``parallelize`` takes."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..layers.context_parallel import ContextParallel
from .batch import LAYOUT_KWARG

__all__ = ["SILU_NAMES", "check_batch_layout", "check_training_call", "global_cu_seqlens", "refuse_cache_and_mask", "token_mixers"]

# the activation names of SiLU in transformers' configs: what kdacp's short convolution and gated norm apply
SILU_NAMES = ("silu", "swish")


def global_cu_seqlens(kwargs: dict) -> torch.Tensor | None:
    """The global ``[N+1]`` boundaries a token mixer received (``cu_seq_lens_q``), or None."""
    cu = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu is not None and cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError("under kdacp.parallelize, cu_seq_lens_q and cu_seq_lens_k are the same global boundaries")
    return cu


def check_batch_layout(cp: ContextParallel, kwargs: dict, B: int, T: int, cu_seqlens: torch.Tensor | None,
                       device: torch.device) -> None:
    """Pop the token layout a token mixer received from :meth:`kdacp.ShardedBatch.model_kwargs` and raise
    ``ValueError`` unless it is the layout ``cp`` gives this batch (``B`` rows of ``T`` local tokens, or the
    packed row of global ``cu_seqlens``): a batch sharded by one layout and run by another would be wrong
    everywhere. Absent (keyword arguments made by hand): the batch is taken to follow ``cp``'s layout."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return
    expected = cp.attention_context(B, T, cu_seqlens, device).layout
    if layout != expected:
        def show(x):
            return f"{x.world_size} ranks, rank 0 holding {list(x.ranges[0])} of {x.num_tokens} tokens"
        raise ValueError(f"the batch was sharded under another token layout ({show(layout)}) than the model runs "
                         f"({cp.layout!r}: {show(expected)}); pass shard_batch(layout=...) the model's layout")


def refuse_cache_and_mask(uses_cache: bool, attention_mask) -> None:
    """Raise ``ValueError`` for what ``parallelize`` does not run: a cache or a padding mask."""
    if uses_cache:
        raise ValueError("kdacp.parallelize runs without a cache: leave use_cache unset (the parallelised model's "
                         "default is False) or pass use_cache=False")
    if attention_mask is not None:
        raise ValueError("kdacp.parallelize takes packed batches (cu_seq_lens_q), not padding masks")


def check_training_call(cache, attention_mask, kwargs: dict) -> None:
    """:func:`refuse_cache_and_mask` for a token mixer's arguments. Pops the earlier 5.x cache names
    (``cache_params``, ``past_key_values``) from ``kwargs``."""
    # `cache` (transformers >= 5.24), `cache_params` / `past_key_values` (earlier 5.x)
    caches = (cache, kwargs.pop("cache_params", None), kwargs.pop("past_key_values", None))
    refuse_cache_and_mask(any(c is not None for c in caches) or bool(kwargs.get("use_cache")), attention_mask)


def token_mixers(model: nn.Module, cp: ContextParallel, linear_type: type, attention_type: type, what: str):
    """``(linear, attention)``: the model's linear-attention and attention modules, after checking ``cp`` and
    that the model holds some of them (``what``: the model's name) not yet parallelised."""
    if not isinstance(cp, ContextParallel):
        raise ValueError(f"cp must be a kdacp.ContextParallel or a DeviceMesh, got {type(cp).__name__}")
    linear = [m for m in model.modules() if isinstance(m, linear_type)]
    attention = [m for m in model.modules() if isinstance(m, attention_type)]
    if not linear and not attention:
        raise ValueError(f"{type(model).__name__} holds no {what} token mixers "
                         f"({linear_type.__name__}, {attention_type.__name__})")
    if any("forward" in vars(m) for m in linear) or any(hasattr(m, "_kdacp_ulysses") for m in attention):
        raise ValueError("model is already parallelised by kdacp")
    return linear, attention
