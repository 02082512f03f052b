"""FlexAttention for CPU runs (:class:`DenseFlexAttention`: FlexAttention has no backward on CPU).
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask

from torchtitan.models.common.attention import FlexAttention


class DenseFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` for CPU runs: FlexAttention has no backward on CPU, so the
    ``BlockMask`` (also one cut along queries by context parallelism) is materialised and handed to
    ``scaled_dot_product_attention``; O(Tq x Tkv) memory, for small CPU models and tests only."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: BlockMask, score_mod=None, scale=None,
                enable_gqa: bool = False, out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("DenseFlexAttention runs mask-only attention (score_mod and out_transform None)")
        Q, KV = attention_masks.seq_lengths
        mask = create_mask(attention_masks.mask_mod, None, None, Q, KV, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def apply_dense_attention(model: nn.Module) -> None:
    """Run every FlexAttention of ``model`` as :class:`DenseFlexAttention` (CPU); no parameters change."""
    for module in model.modules():
        if type(module) is FlexAttention:
            module.__class__ = DenseFlexAttention
