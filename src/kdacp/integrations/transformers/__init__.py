"""Context parallelism for Hugging Face transformers models, applied from outside the model code.

:func:`parallelize` (Kimi Linear, Qwen3-Next; dispatched on ``config.model_type``), :func:`load_kimi_linear`
and :func:`load_qwen3_next` need the ``models`` extra (``transformers``), imported only when called;
:func:`shard_batch` (any token layout; :func:`shard_tokens` without a process group) and
:func:`global_token_mean_loss` need only ``torch.distributed``. :func:`prefill` and
:func:`generate` run a long prompt under context parallelism into the model's own cache, then decode from it.
"""
from ...cp.sharding import ShardedBatch, global_token_mean_loss, shard_batch, shard_tokens
from .attention import document_causal_mask
from .dispatch import SUPPORTED_MODELS, parallelize, torch_fallbacks
from .kimi_linear import load_kimi_linear
from .prefill import PrefillOutput, generate, own_forwards, prefill
from .qwen3_next import load_qwen3_next

__all__ = ["SUPPORTED_MODELS", "PrefillOutput", "ShardedBatch", "document_causal_mask", "generate",
           "global_token_mean_loss", "load_kimi_linear", "load_qwen3_next", "own_forwards", "parallelize", "prefill",
           "shard_batch", "shard_tokens", "torch_fallbacks"]
