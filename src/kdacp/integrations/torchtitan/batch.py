"""Each ``cp`` rank's share of a torchtitan batch (:func:`shard_batch`) and its attention layers' document mask
(:func:`local_document_mask`), under the model's layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask

from torchtitan.distributed.utils import is_in_batch_invariant_mode
from torchtitan.models.common.attention import (FlexAttention, create_attention_mask,
                                                 create_varlen_metadata_for_document)

from ...cp.layout import TokenLayout
from ...cp.sharding import shard_tokens
from .gated_delta import GatedDeltaParallel, KdacpGatedDeltaKernel
from .layout import document_mask_mod

# Batch keys of torchtitan's multimodal loader: their tokens must be scattered before any cut.
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "grid_thw", "grid_thw_videos", "mrope_positions")


def local_document_mask(model: nn.Module, positions: torch.Tensor, layout: TokenLayout, rank: int) -> BlockMask:
    """The FlexAttention mask of rank ``rank``'s queries (its tokens under ``layout``, in their local order) against
    every rank's keys as torchtitan's FlexAttention CP all-gathers them (rank 0's tokens, then rank 1's, ...):
    causal within each document of the global ``positions [1, T]`` (0 at each document start), in the model's
    block size. Built directly rather than cut from the global mask: torch cuts a ``BlockMask`` over ranks only
    when ``T`` is a multiple of ``P x 128``."""
    keys = torch.cat([layout.local_token_index(r) for r in range(layout.world_size)])
    keys = keys.to(device=positions.device, dtype=torch.int32)
    offset = sum(layout.local_lengths[:rank])
    queries = keys[offset:offset + layout.local_lengths[rank]]
    return create_attention_mask(document_mask_mod(positions, queries, keys), 1, None, queries.numel(), keys.numel(),
                                 device=positions.device,
                                 BLOCK_SIZE=model.config.first_attention.inner_attention.block_size,
                                 separate_full_blocks=not is_in_batch_invariant_mode())


def _gated_delta_parallel(model: nn.Module) -> GatedDeltaParallel:
    for module in model.modules():
        if isinstance(module, KdacpGatedDeltaKernel):
            return module.parallel
    raise ValueError("context parallelism with kdacp needs the model's GatedDeltaNet modules swapped first "
                     "(apply_kdacp_to_gated_deltanet, or the qwen3_5_kdacp spec)")


def shard_batch(model: nn.Module, input_dict: dict, labels: torch.Tensor, cp_mesh: DeviceMesh):
    """This rank's shard of one packed batch under torchtitan's load balancer, and the model's keyword arguments.

    The tokens are dealt out by the layout the model's GDN layers follow (:class:`BalancedLayout`, set by
    :func:`apply_kdacp_to_gated_deltanet`), so the attention layers and the GDN layers see one token order,
    with no relayout between them; the cut itself is :func:`kdacp.cp.sharding.shard_tokens`'s.

    Args:
        model: the torchtitan Qwen3.5 with kdacp's GDN modules (its config gives the attention kind and
            block size).
        input_dict: ``{"input": [1, T] token ids, "positions": [1, T] (0 at each document start)}``;
            without ``positions`` the row is one document.
        labels: ``[1, T]``, each token's own target (torchtitan's loader shifts them): dealt out as they are.
        cp_mesh: the 1-D ``cp`` mesh axis; ``T`` must suit the balancer (see :class:`BalancedLayout`).

    Returns:
        ``(inputs [1, T/P], labels [1, T/P], kwargs)``: ``kwargs`` holds this rank's ``positions`` and
        ``attention_masks``: :func:`local_document_mask` for the attention layers, the global document
        offsets (host copy included) for the GDN layers.

    Raises:
        ValueError: batch rows other than 1, vision inputs, a ``T`` the balancer does not split evenly, attention
            other than FlexAttention, a model without kdacp's GDN modules.
    """
    inputs = input_dict["input"]
    P, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if inputs.dim() != 2 or inputs.shape[0] != 1:
        raise ValueError(f"context parallelism with kdacp needs one packed row per rank (training.local_batch_size=1), "
                         f"got input of shape {tuple(inputs.shape)}")
    vision = [key for key in VISION_INPUTS if input_dict.get(key) is not None]
    if vision:
        raise ValueError(f"context parallelism with kdacp runs text batches only; got vision inputs {vision}")
    attention = model.config.first_attention
    if attention is not None and not isinstance(attention.inner_attention, FlexAttention.Config):
        raise ValueError(f"context parallelism with kdacp needs attn_backend='flex', "
                         f"got {type(attention.inner_attention).__name__}")
    positions = input_dict.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
    deltanet = create_varlen_metadata_for_document(positions, include_host_offsets=True)
    batch = shard_tokens(inputs, labels, positions, torch.tensor(deltanet.cu_seq_q_host), rank=rank, world_size=P,
                         layout=_gated_delta_parallel(model).layout, labels_shifted=True)
    kwargs = {key: value for key, value in input_dict.items() if key != "input"}
    kwargs["positions"] = batch.position_ids
    kwargs["attention_masks"] = {
        "quadratic_attention": None if attention is None else local_document_mask(model, positions, batch.layout, rank),
        "deltanet": deltanet}
    return batch.input_ids, batch.labels, kwargs
