"""The Ulysses path with a varlen flash inner (``flash_attention_2``'s keywords, which only run on GPUs): over 2
gloo ranks, a stand-in of that contract (per-document causal attention from ``cu_seq_lens_q`` and
``max_length_q``) gets the global boundaries as int32 and the longest document, and the ranks' outputs are the
whole sequence's attention at their tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.multiprocess import run_ranks

CU = (0, 5, 37, 40, 64)  # the longest document (32 tokens) crosses the ranks' edge
H, D = 4, 8


def _documents_attention(q, k, v, cu):
    """``[B, H, T, D]`` each -> ``[B, T, H, D]``: causal attention within each document of ``cu``."""
    parts = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
             for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(parts, 2).transpose(1, 2)


def _flash_stand_in(module, q, k, v, mask, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                    position_ids, **kwargs):
    assert mask is None and cu_seq_lens_q.dtype == torch.int32 and cu_seq_lens_k is cu_seq_lens_q
    cu = tuple(cu_seq_lens_q.tolist())
    assert cu == CU and max_length_q == max_length_k == max(b - a for a, b in zip(cu, cu[1:]))
    assert position_ids.shape == (1, CU[-1])
    return _documents_attention(q, k, v, cu), None


def _worker(rank, world_size):
    from kdacp.cp import ContextParallel
    from kdacp.integrations.transformers.attention import _ContextParallelAttention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, CU[-1], D, generator=g, dtype=torch.float64) for _ in range(3))
    T = CU[-1] // world_size
    mine = slice(rank * T, (rank + 1) * T)
    attention = _ContextParallelAttention(ContextParallel("ulysses"), "flash_attention_2", _flash_stand_in)
    out = attention.attend(object(), q[:, :, mine], k[:, :, mine], v[:, :, mine], torch.tensor(CU), {})
    torch.testing.assert_close(out, _documents_attention(q, k, v, CU)[:, mine], rtol=1e-12, atol=1e-12)


def test_ulysses_hands_a_varlen_inner_the_global_boundaries_and_longest_document():
    run_ranks(_worker, 2)
