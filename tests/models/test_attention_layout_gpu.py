"""The GPU's attention path under token layouts (:func:`kdacp.integrations.transformers.attention.gathered_attention` over SDPA with a
lower-right causal bias, no mask tensor) on a CUDA device in bf16, against the float64 masked softmax of the whole
sequence, outputs and query gradients: zigzag and random uneven ranges, packed documents, every rank of 2 and 3
(one process: the path reads only the rank's attention pieces)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdacp.cp.batch_context import _attention_pieces
from kdacp.integrations.transformers.attention import document_causal_mask, gathered_attention, sdpa_lower_right
from tests.helpers import rel_err
from tests.models.test_attention_layout import CASES, SCALE

D = 64
TOL = 2e-2  # bf16 inputs and outputs


def _check(world_size, cases):
    for seed, (name, layout, cu, rows, H, H_kv) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed)
        T = layout.num_tokens
        q = torch.randn(rows, H, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(rows, H_kv, T, D, generator=gen, dtype=torch.float64).repeat_interleave(H // H_kv, 1)
                for _ in range(2))
        w = torch.randn(rows, H, T, D, generator=gen, dtype=torch.float64)
        mask = document_causal_mask(None if cu is None else torch.tensor(cu), T, torch.device("cpu"))
        scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
        want = scores.softmax(-1) @ v
        (want * w).sum().backward()
        for rank in range(world_size):
            _check_rank(rank, world_size, name, layout, cu, q, k, v, w, want)


def _check_rank(rank, world_size, name, layout, cu, q, k, v, w, want):
    own = layout.local_token_index(rank)
    context = SimpleNamespace(attention_pieces=_attention_pieces(layout, cu, rank))
    q_own = q.detach()[:, :, own].to("cuda", torch.bfloat16).requires_grad_()
    got = gathered_attention(sdpa_lower_right(SCALE), q_own, *(x.to("cuda", torch.bfloat16) for x in (k, v)),
                             context)
    (got.float() * w[:, :, own].cuda()).sum().backward()
    for what, x, ref in (("output", got, want.detach()), ("dq", q_own.grad, q.grad)):
        err = rel_err(x.float().cpu(), ref[:, :, own])
        assert err < TOL, f"{what}, {name}, P={world_size}, rank {rank}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_split_attention_under_layouts_matches_the_masked_softmax(world_size):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check(world_size, CASES[world_size])
