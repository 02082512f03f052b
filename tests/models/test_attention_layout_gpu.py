"""The GPU's attention path under token layouts (:func:`kdacp.models.attention.gathered_attention` over cuDNN
attention, no mask tensor) on a CUDA device in bf16, against the float64 masked softmax of the whole sequence:
zigzag and random uneven ranges, packed documents, 2 and 3 ranks (gloo processes sharing one GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kdacp.layers import build_cp_context
from kdacp.models.attention import cudnn_attend, document_causal_mask, gathered_attention
from tests.helpers import rel_err
from tests.models.test_attention_layout import CASES, SCALE
from tests.multiprocess import run_ranks

D = 64     # cuDNN attention's head dims are multiples of 8
TOL = 2e-2  # bf16 inputs and outputs


def _check(rank, world_size, cases):
    for seed, (name, layout, cu, rows, H, H_kv) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed)  # the same tensors on every rank
        T = layout.num_tokens
        q = torch.randn(rows, H, T, D, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(rows, H_kv, T, D, generator=gen, dtype=torch.float64).repeat_interleave(H // H_kv, 1)
                for _ in range(2))
        mask = document_causal_mask(None if cu is None else torch.tensor(cu), T, torch.device("cpu"))
        scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
        want = scores.softmax(-1) @ v
        own = layout.local_token_index(rank)
        context = build_cp_context(None if cu is None else torch.tensor(cu), local_length=len(own), batch_size=rows,
                                   layout=layout, group=dist.group.WORLD, with_plan=False)
        bf16 = [x.to("cuda", torch.bfloat16) for x in (q[:, :, own], k, v)]
        got = gathered_attention(cudnn_attend(SCALE), *bf16, context)
        err = rel_err(got.float().cpu(), want[:, :, own])
        assert err < TOL, f"{name}, P={world_size}, rank {rank}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_split_cudnn_attention_under_layouts_matches_the_masked_softmax(world_size):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    run_ranks(_check, world_size, CASES[world_size])
