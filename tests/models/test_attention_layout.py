"""Softmax attention over the context-parallel group under token layouts (zigzag, random uneven ranges, packed
documents) against one-process attention with the global causal per-document mask: outputs and q/k/v
gradients in float64 at 1e-12, on 2 and 3 gloo ranks, through the registered function (Ulysses or the K/V
gather, as it chooses) and through the GPU's no-mask path (:func:`gathered_attention`) called directly."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kdacp.cp.layout import ranges_layout, zigzag_layout
from kdacp.cp import ContextParallel, build_cp_context
from kdacp.integrations.transformers.attention import (_ContextParallelAttention, document_causal_mask, gathered_attention, kv_replication,
                                    sdpa_lower_right)
from tests.helpers import rel_err
from tests.multiprocess import run_ranks

TOL = 1e-12
D = 8
SCALE = 0.3


def _math_attention(q, k, v, mask):
    """``q [B, H, Tq, D]``, ``k, v [B, H, Tk, D]``, bool ``mask [.., Tq, Tk]`` -> ``(out [B, H, Tq, D], lse)``."""
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v, lse


def _inner(module, q, k, v, mask, scaling=None, **kwargs):
    """An eager inner implementation as transformers calls it: additive mask, grouped key/value heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    return _math_attention(q, k, v, mask == 0)[0].transpose(1, 2), None


def _math_attend(q, k, v, causal):
    n, Tk = q.shape[-2], k.shape[-2]
    mask = torch.ones(n, Tk, dtype=torch.bool).tril() if causal else torch.ones(n, Tk, dtype=torch.bool)
    return _math_attention(q, k, v, mask)


# (name, layout, cu_seqlens or None, rows, H, H_kv). The exchange each runs (kv_replication): Ulysses for MHA
# heads that split (fewer bytes) and for packed zigzag, whose documents leave the gather's work unbalanced; the
# gather where heads do not split (P=3, H=2) and for uneven random ranges. Every case also runs the split path.
CASES = {
    2: [("zigzag rows, MHA", zigzag_layout(20, 2), None, 2, 2, 2),
        ("zigzag packed, GQA", zigzag_layout(24, 2), [0, 5, 13, 24], 1, 4, 2),
        ("random ranges packed", ranges_layout([[(0, 3), (4, 5), (9, 16)], [(3, 4), (5, 9), (16, 21)]]),
         [0, 4, 6, 21], 1, 2, 1)],
    3: [("zigzag packed, MHA", zigzag_layout(36, 3), [0, 7, 8, 36], 1, 3, 3),
        ("zigzag rows, GQA", zigzag_layout(30, 3), None, 2, 2, 1),
        ("random ranges rows", ranges_layout([[(0, 5), (11, 12), (20, 24)], [(5, 9), (12, 13), (24, 29)],
                                              [(9, 11), (13, 20)]]), None, 1, 3, 3)],
}


def _reference(layout, cu, rows, H, H_kv, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = layout.num_tokens
    q = torch.randn(rows, H, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(rows, H_kv, T, D, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(rows, T, H, D, generator=gen, dtype=torch.float64)
    mask = document_causal_mask(None if cu is None else torch.tensor(cu), T, torch.device("cpu"))
    out = _inner(None, q, k, v, torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -1e300))[0]
    (out * w).sum().backward()
    return dict(q=q.detach(), k=k.detach(), v=v.detach(), w=w, out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _check(rank, world_size, cases, refs):
    module = type("Attention", (), {"training": False})()
    for (name, layout, cu, rows, H, H_kv), ref in zip(cases, refs):
        where = f"{name}, P={world_size}, rank {rank}"
        cp = ContextParallel("state", layout=layout)
        attention = _ContextParallelAttention(cp, "eager", _inner)
        own = layout.local_token_index(rank)
        q, k, v = (ref[n][:, :, own].clone().requires_grad_() for n in ("q", "k", "v"))
        kwargs = {} if cu is None else dict(cu_seq_lens_q=torch.tensor(cu), cu_seq_lens_k=torch.tensor(cu))
        out, _ = attention(module, q, k, v, None, scaling=SCALE, **kwargs)
        (out * ref["w"][:, own]).sum().backward()
        assert rel_err(out, ref["out"][:, own]) < TOL, f"output, {where}"
        for n, x in (("dq", q), ("dk", k), ("dv", v)):
            assert rel_err(x.grad, ref[n][:, :, own]) < TOL, f"{n}, {where}"
        # the GPU's path without a mask tensor (SDPA with a lower-right causal bias per piece), on the whole keys
        # in global order: outputs and gradients
        context = build_cp_context(None if cu is None else torch.tensor(cu), local_length=len(own), batch_size=rows,
                                   layout=layout, group=dist.group.WORLD, with_plan=False)
        groups = H // H_kv
        q = ref["q"][:, :, own].clone().requires_grad_()
        k, v = (ref[n].clone().requires_grad_() for n in ("k", "v"))
        split = gathered_attention(sdpa_lower_right(SCALE), q, *(x.repeat_interleave(groups, dim=1) for x in (k, v)),
                                   context)
        assert rel_err(split.transpose(1, 2), ref["out"][:, own]) < TOL, f"split path, {where}"
        # the other ranks' queries' gradients reach k and v too: compare this rank's share through its own queries
        (split.transpose(1, 2) * ref["w"][:, own]).sum().backward()
        assert rel_err(q.grad, ref["dq"][:, :, own]) < TOL, f"split path dq, {where}"


def test_exchange_choice_follows_bytes_under_a_balanced_layout():
    # zigzag (balanced): MHA moves fewer bytes by Ulysses, GQA by the gather; contiguous (imbalanced): Ulysses
    # whenever heads divide
    assert kv_replication(2, 2, (D, D, D), 2, False, imbalance=1.0) == 1
    assert kv_replication(4, 2, (D, D, D), 2, False, imbalance=1.0) is None
    assert kv_replication(4, 2, (D, D, D), 2, False) == 1
    assert kv_replication(4, 2, (D, D, D), 2, False, imbalance=1.0, equal_lengths=False) is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_attention_under_layouts_matches_one_process(world_size):
    cases = CASES[world_size]
    refs = [_reference(*case[1:], seed) for seed, case in enumerate(cases)]
    run_ranks(_check, world_size, cases, refs)
