"""``parallelize_qwen3_5_kdacp``: torchtitan's ``parallelize_qwen3_5`` with kdacp's context parallelism over the ``cp``
mesh axis, and the settings it refuses before any rank blocks.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from torchtitan.distributed.context_parallel import apply_cp_to_forward
from torchtitan.models import qwen3_5
from torchtitan.models.common.attention import FlexAttention
from torchtitan.tools.utils import device_type

from .attention import apply_dense_attention
from .gated_delta import apply_kdacp_to_gated_deltanet
from .layout import BalancedLayout

SPEC_NAME = "qwen3_5_kdacp"


class _ContextParallelApplied:
    """``parallel_dims`` as torchtitan's ``parallelize_qwen3_5`` must see it once kdacp has applied
    context parallelism: ``cp_enabled`` False, everything else (meshes, degrees) unchanged."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def _check_supported(parallel_dims, training, parallelism) -> None:
    """Raise before any rank blocks on what kdacp's spec does not run."""
    if not training.disable_cuda_graphs:
        raise NotImplementedError("training.disable_cuda_graphs=False: kdacp's Gated DeltaNet reads each batch's "
                                  "document offsets on the host, which a CUDA graph cannot replay; set it to True")
    refused = {"tensor_parallel_degree": parallel_dims.tp, "pipeline_parallel_degree": parallel_dims.pp,
               "expert_parallel_degree": parallel_dims.ep}
    for name, degree in refused.items():
        if degree > 1:
            raise NotImplementedError(f"parallelism.{name}={degree}: kdacp's Qwen3.5 spec ({SPEC_NAME}) runs data "
                                      f"(FSDP2, replicate) and context parallelism only; set it to 1")
    if parallel_dims.cp_enabled and parallelism.spmd_backend != "partial_dtensor":
        raise NotImplementedError(f"parallelism.spmd_backend={parallelism.spmd_backend!r} with context parallelism: "
                                  "kdacp's spec runs torchtitan's FlexAttention CP, which is written for "
                                  "'partial_dtensor'; set parallelism.spmd_backend='partial_dtensor'")


def _balanced_layout(model: nn.Module, parallelism) -> BalancedLayout:
    """The :class:`BalancedLayout` of torchtitan's ``parallelism.context_parallel_load_balancer`` for ``model``
    (a torchtitan Qwen3.5): ``"ptrr"`` deals out the blocks of the attention layers' mask (their FlexAttention
    block size; torchtitan's 128 for a model without attention layers).

    Raises:
        ValueError: an unknown balancer, or ``"ptrr"`` with ``parallelism.context_parallel_ptrr_mask_key`` naming
            another mask than the attention layers' (``"quadratic_attention"``).
    """
    balancer, key = parallelism.context_parallel_load_balancer, parallelism.context_parallel_ptrr_mask_key
    if balancer == "ptrr" and key not in (None, "quadratic_attention"):
        raise ValueError(f"parallelism.context_parallel_ptrr_mask_key={key!r}: kdacp's spec balances by the attention "
                         "layers' mask; set it to 'quadratic_attention' or leave it unset")
    attention = model.config.first_attention
    inner = None if attention is None else attention.inner_attention
    return BalancedLayout(balancer, inner.block_size if isinstance(inner, FlexAttention.Config) else 128)


def parallelize_qwen3_5_kdacp(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                              dump_folder: str):
    """torchtitan's ``parallelize_qwen3_5`` with context parallelism over the ``cp`` mesh axis.

    Same arguments as torchtitan's parallelize functions. Order: kdacp's GDN modules (and, on CPU,
    :func:`apply_dense_attention`), torchtitan's FlexAttention CP on the attention layers (before any
    wrapping, as torchtitan requires), then torchtitan's own parallelize (activation checkpointing, FSDP2;
    on CPU with plain SUM gradient reductions, as gloo has no PREMUL_SUM).

    Raises:
        NotImplementedError: see :func:`_check_supported`.
        ValueError: attention other than FlexAttention under context parallelism.
    """
    _check_supported(parallel_dims, training, parallelism)
    cp_mesh = parallel_dims.get_mesh("cp") if parallel_dims.cp_enabled else None
    apply_kdacp_to_gated_deltanet(model, cp_mesh, layout=_balanced_layout(model, parallelism))
    if device_type == "cpu":
        apply_dense_attention(model)
    if cp_mesh is not None:
        inner = [layer.attn.inner_attention for layer in model.layers.values() if layer.full_attn]
        if inner and not isinstance(inner[0], FlexAttention):
            raise ValueError(f"context parallelism needs the attention layers on FlexAttention (attn_backend='flex'), "
                             f"got {type(inner[0]).__name__}")
        if inner:
            apply_cp_to_forward(inner, cp_mesh)
    model = qwen3_5.parallelize_qwen3_5(
        model, parallel_dims=_ContextParallelApplied(parallel_dims), training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    if device_type == "cpu":
        # gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor of 1; a plain SUM is the same.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model
