"""Context parallelism for torchtitan 0.3.0's Qwen3.5, applied from outside torchtitan's code.

torchtitan's ``parallelize_qwen3_5`` refuses context parallelism (its Gated DeltaNet layers would
need the whole sequence). This module is a torchtitan config module (``--module
kdacp.integrations.torchtitan``): its config functions (``qwen35_kdacp_*``) return torchtitan
``Trainer.Config`` objects whose model spec, named ``qwen3_5_kdacp``, builds torchtitan's own
Qwen3.5 and parallelizes it with :func:`parallelize_qwen3_5_kdacp`:

1. every ``GatedDeltaNet`` of the model gets kdacp's recurrence and short convolution
   (:func:`apply_kdacp_to_gated_deltanet`): its ``kernel`` module becomes a
   :class:`KdacpGatedDeltaKernel` (state exchange between the ranks' ranges by kdacp's GDN op, with one
   plan per batch built from the global ``cu_seqlens`` and the layout) and its ``_causal_conv`` runs
   :meth:`kdacp.cp.CPContext.short_convolution`: a left halo from whichever rank holds the tokens before
   each range;
   parameters and state-dict keys do not change;
2. the attention layers (one in four) run under torchtitan's own context parallelism for
   FlexAttention (``apply_cp_to_forward``: keys and values all-gathered over ``cp``; each rank's
   document mask is built for its queries under the layout, :func:`local_document_mask`). kdacp's Ulysses attention
   would need ``n_kv_heads % cp == 0``, and every dense Qwen3.5 has 2 key/value heads;
3. then torchtitan's ``parallelize_qwen3_5`` for everything it does (activation checkpointing,
   FSDP2 over ``dp_shard x cp``), with context parallelism marked as done.

:class:`KdacpTrainer` cuts each batch over the ``cp`` mesh axis (:func:`shard_batch`) as torchtitan's
context-parallel load balancer (``parallelism.context_parallel_load_balancer``: ``"headtail"``, its default,
``"ptrr"`` or None) rearranges it, and keeps the global document boundaries for the GDN layers. The GDN
layers follow that token order natively (:class:`BalancedLayout`: a rank's ranges are links of kdacp's state
chain and halo routes), so attention and recurrence share one layout with no relayout between them.

Configs: :func:`qwen35_kdacp_debugmodel`, :func:`qwen35_kdacp_0_8b` and the baseline
:func:`qwen35_titan_0_8b` (torchtitan's own spec), on text (:func:`text_config`). On CPU,
:class:`DenseFlexAttention` stands in for FlexAttention (no backward on CPU) and kdacp's ``torch``
backend for FLA's kernels.

Loss contract: torchtitan's loss is the rank's summed token loss over the global count of valid
tokens, and FSDP2 sums gradients over ``dp_shard x cp`` (divide factor 1), so the sums are the
gradients of the global mean; nothing here changes that.

torch.compile (``compile.components`` with ``"model"``: torchtitan compiles each block with ``fullgraph=True``): the
GDN modules' short convolutions and recurrence, which read the batch's offsets on the host and exchange between
ranks, each run as one opaque custom op (:mod:`kdacp.compile`); the rest of the block traces.

Refused with an error before any rank blocks: CUDA graphs, tensor, pipeline and expert parallelism, the
``spmd_types`` / ``full_dtensor`` backends under context parallelism, vision inputs, ``local_batch_size > 1``
and attention other than FlexAttention under context parallelism.

Modules: :mod:`.layout` (the load balancers as kdacp layouts), :mod:`.gated_delta` (the GDN modules),
:mod:`.attention` (FlexAttention on CPU), :mod:`.batch` (a rank's share of a batch), :mod:`.parallelize` and
:mod:`.spec` (the trainer, model spec and configs).
"""
from __future__ import annotations

from .attention import DenseFlexAttention, apply_dense_attention
from .batch import local_document_mask, shard_batch
from .gated_delta import GatedDeltaParallel, KdacpGatedDeltaKernel, KdacpGatedDeltaNet, apply_kdacp_to_gated_deltanet
from .layout import LOAD_BALANCERS, BalancedLayout
from .parallelize import SPEC_NAME, parallelize_qwen3_5_kdacp
from .spec import (TEXT_ONLY_TOKENS, KdacpTrainer, model_registry, qwen35_kdacp_0_8b, qwen35_kdacp_debugmodel,
                   qwen35_titan_0_8b, text_config)

__all__ = ["BalancedLayout", "DenseFlexAttention", "GatedDeltaParallel", "KdacpGatedDeltaKernel", "KdacpGatedDeltaNet",
           "KdacpTrainer", "LOAD_BALANCERS", "SPEC_NAME", "TEXT_ONLY_TOKENS", "apply_dense_attention",
           "apply_kdacp_to_gated_deltanet", "local_document_mask", "model_registry", "parallelize_qwen3_5_kdacp",
           "qwen35_kdacp_0_8b", "qwen35_kdacp_debugmodel", "qwen35_titan_0_8b", "shard_batch", "text_config"]


def __getattr__(name: str):
    # the old name, for one release: "context" is the per-batch CPContext's word
    if name == "GatedDeltaContext":
        import warnings
        warnings.warn("kdacp.integrations.torchtitan.GatedDeltaContext is now GatedDeltaParallel; the old name goes "
                      "in the next release", DeprecationWarning, stacklevel=2)
        return GatedDeltaParallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
