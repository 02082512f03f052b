"""The argument checks of a parallelised model: the keyword arguments its forward honours, no cache, no padding
mask, one set of global boundaries, and which modules ``parallelize`` takes."""
from __future__ import annotations

import inspect
import torch
import torch.nn as nn

from ...cp.context import ContextParallel
from ...cp.sharding import LAYOUT_KWARG
from ...host_copies import host_boundaries

# the activation names of SiLU in transformers' configs: what kdacp's short convolution and gated norm apply
SILU_NAMES = ("silu", "swish")

# The keyword arguments, besides the forward's named parameters, that a parallelised model's forward honours:
# transformers passes everything else on to the layers, where kdacp's token mixers would drop it.
HONOURED_KWARGS = frozenset({
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",  # the global boundaries (model_kwargs())
    "num_items_in_batch",  # the loss counts its labelled tokens over the loss group itself: the same number
    "output_hidden_states", "output_router_logits", "return_dict",  # per token: each rank returns its own
    "past_key_values", "cache_params",  # earlier 5.x cache names: refused as caches by the token mixers
    LAYOUT_KWARG,  # the batch's token layout, checked against the model's (check_batch_layout)
})
# Honoured at these values only: the attention is causal and returns no weights.
_HONOURED_VALUES = {"is_causal": (None, True), "output_attentions": (None, False)}


class CallCheck:
    """A parallelised model's forward pre-hook (``with_kwargs``): refuses, by name and before any layer runs, a
    keyword argument the forward would not honour, and takes ``cu_seqlens`` (kdacp's name for the global
    ``[N+1]`` boundaries) as ``cu_seq_lens_q`` / ``cu_seq_lens_k``. ``enabled`` is False while the model runs
    its own code (:func:`kdacp.integrations.transformers.own_forwards`), which honours them all."""

    def __init__(self, forward):
        parameters = inspect.signature(forward).parameters.values()
        self.named = frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD)
        self.enabled = True

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.enabled:
            return None
        for name, value in kwargs.items():
            if name in self.named or name in HONOURED_KWARGS or name == "cu_seqlens":
                continue
            if name in _HONOURED_VALUES and value in _HONOURED_VALUES[name]:
                continue
            if name in _HONOURED_VALUES:
                raise ValueError(f"a kdacp.parallelize'd model runs with {name} in {_HONOURED_VALUES[name]}, "
                                 f"got {name}={value!r}")
            raise ValueError(f"a kdacp.parallelize'd model does not take {name}=: it would be dropped. Pass "
                             "kdacp.shard_batch(...).model_kwargs() (input_ids, position_ids, labels and the "
                             "global boundaries as cu_seq_lens_q/k)")
        if "cu_seqlens" not in kwargs:
            return None
        kwargs = dict(kwargs)
        cu = kwargs.pop("cu_seqlens")
        if cu is not None:
            for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
                given = kwargs.get(name)  # the same tensor needs no comparison (a device sync)
                if given is not None and given is not cu and not torch.equal(given, cu):
                    raise ValueError(f"cu_seqlens and {name} are the same global boundaries; they differ")
            bounds = host_boundaries(cu)  # once per tensor: the layers' per-batch contexts read the same copy
            longest = max(b - a for a, b in zip(bounds, bounds[1:]))
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return args, kwargs


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
    everywhere. Absent (keyword arguments made by hand): the batch is taken to follow ``cp``'s layout. Under
    ``torch.compile`` the layout is dropped unchecked: the check reads the batch's boundaries on the host, which
    a graph cannot (check a compiled model's batches with one eager call first)."""
    layout = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None or torch.compiler.is_compiling():
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
                         "default is False) or pass use_cache=False. To decode, call kdacp.integrations.transformers.generate (the "
                         "prompt prefilled under context parallelism, then transformers' generate), or run the "
                         "model's own code inside `with kdacp.integrations.transformers.own_forwards(model):`")
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
