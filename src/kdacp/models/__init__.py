"""Context parallelism for Hugging Face transformers models, applied from outside the model code.

:func:`parallelize` (Kimi Linear, Qwen3-Next; dispatched on ``config.model_type``), :func:`load_kimi_linear`
and :func:`load_qwen3_next` need the ``models`` extra (``transformers``), imported only when called;
:func:`shard_batch` and :func:`global_token_mean_loss` need only ``torch.distributed``.
"""
from .attention import document_causal_mask
from .batch import ShardedBatch, global_token_mean_loss, shard_batch
from .dispatch import SUPPORTED_MODELS, parallelize, torch_fallbacks
from .kimi_linear import load_kimi_linear
from .qwen3_next import load_qwen3_next

__all__ = ["SUPPORTED_MODELS", "ShardedBatch", "document_causal_mask", "global_token_mean_loss", "load_kimi_linear",
           "load_qwen3_next", "parallelize", "shard_batch", "torch_fallbacks"]
