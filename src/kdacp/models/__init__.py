"""Context parallelism for Hugging Face transformers models, applied from outside the model code.

:func:`parallelize` and :func:`load_kimi_linear` (Kimi Linear) need the ``models`` extra
(``transformers``), imported only when called; :func:`shard_batch` and :func:`global_token_mean_loss`
need only ``torch.distributed``.
"""
from .batch import ShardedBatch, global_token_mean_loss, shard_batch
from .kimi_linear import document_causal_mask, load_kimi_linear, parallelize, torch_fallbacks

__all__ = ["ShardedBatch", "document_causal_mask", "global_token_mean_loss", "load_kimi_linear", "parallelize",
           "shard_batch", "torch_fallbacks"]
