"""Deprecated: the Hugging Face integration moved to :mod:`kdacp.integrations.transformers`, and the batch
sharding and its loss (``ShardedBatch``, ``shard_batch``, ``shard_tokens``, ``global_token_mean_loss``), which
no framework owns, to :mod:`kdacp.cp.sharding`. This alias re-exports the names this package exported, with a
:class:`DeprecationWarning`, for one release."""
import importlib
import warnings

_SHARDING = ("ShardedBatch", "global_token_mean_loss", "shard_batch", "shard_tokens")
_TRANSFORMERS = ("SUPPORTED_MODELS", "PrefillOutput", "document_causal_mask", "generate", "load_kimi_linear",
                 "load_qwen3_next", "own_forwards", "parallelize", "prefill", "torch_fallbacks")
# each name this package exported -> the module that now defines it
_MOVED = {**dict.fromkeys(_SHARDING, "kdacp.cp.sharding"),
          **dict.fromkeys(_TRANSFORMERS, "kdacp.integrations.transformers")}

__all__ = sorted(_MOVED)

warnings.warn("kdacp.models is deprecated; import from kdacp.integrations.transformers (and kdacp.cp.sharding) "
              "instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    """A name this package exported, from its new module."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"kdacp.models.{name} is deprecated; use {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
