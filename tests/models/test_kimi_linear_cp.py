"""``kdacp.parallelize`` on a tiny random Hugging Face ``KimiLinearForCausalLM`` (KDA, MLA and MoE layers) over
2 and 4 gloo ranks against the unmodified one-process model, on a packed batch whose documents cross rank edges.

The one-process reference runs transformers' own model on each document alone and sums the token losses:
transformers' CPU fallbacks of the short convolution and of KDA ignore packed-sequence boundaries, so the
packed batch cannot be its reference directly, while one document at a time is exactly the model's meaning.
Float32 throughout (the MoE router keeps float32 weights); tolerance ``TOL`` relative (2-norm) on the logits,
the loss and every parameter's all-reduced gradient. The same workers check that removing any exchange (the
convolution halo, the recurrence's state exchange, the MLA all-to-all) breaks that tolerance.
"""
from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.models.cp_common import (CU_SEQLENS, VOCAB, check_layout, check_modes, check_parallelize_contract,
                                    exchanges, one_document_at_a_time, reference_fixture, run_and_report, tokens)
from tests.multiprocess import run_ranks

# (KDA mode, Ulysses size, the model's attention implementation, which becomes the Ulysses one's inner)
# MLA's 4 heads: Ulysses on 2 and 4 ranks, the K/V all-gather on 8 (fewer heads than ranks).
MODES = {2: [("state", None, "sdpa"), ("ulysses", None, "eager")],
         4: [("state", None, "sdpa"), ("hybrid", 2, "eager")],
         8: [("state", None, "eager")]}


def _config(**overrides):
    from transformers import KimiLinearConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              n_group=1, topk_group=1, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
              attn_implementation="sdpa")  # use_cache: the config's default (True)
    kw.update(overrides)
    return KimiLinearConfig(**kw)


def _model(**overrides):
    from transformers import KimiLinearForCausalLM
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(_config(**overrides))
    with torch.no_grad():  # norms away from their all-ones initialisation, so their gradients mean something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model


def _reference() -> dict:
    """The unmodified model, one document at a time."""
    from kdacp.integrations.transformers import torch_fallbacks
    # torch_fallbacks: where FLA imports, transformers would call its GPU-only kernels on these CPU tensors
    return one_document_at_a_time(_model(), torch_fallbacks())


def _worker(rank, world_size, ref, results):
    from kdacp.integrations.transformers import attention

    if world_size == 2:
        _check_contract(rank, world_size)
    # Each exchange matters: without it the result leaves the tolerance (the MLA all-gather on 8 ranks).
    broken = {**exchanges(), "MLA documents": (attention, "document_causal_mask",
                                               lambda cu, T, device, queries=None, real=attention.document_causal_mask:
                                               real(None, T, device, queries))}
    if world_size == 8:
        broken = {"MLA K/V all-gather": (attention, "all_gather_along",
                                         lambda x, dim, group: torch.cat([x] * world_size, dim))}
    check_modes(rank, world_size, ref, results, MODES[world_size], _model, broken, broken_on=(2, 4, 8))


def _check_contract(rank, world_size):
    """What parallelize and shard_batch promise besides the numbers: the state dict, and clear errors."""
    import kdacp
    from transformers import KimiLinearForCausalLM
    cp = check_parallelize_contract(KimiLinearForCausalLM, _model)
    flash = _model(num_attention_heads=3, num_key_value_heads=3)
    flash.config._attn_implementation = "flash_attention_2"  # Ulysses only: its heads must split
    with pytest.raises(ValueError, match="num_attention_heads % 2 == 0"):
        kdacp.parallelize(flash, cp)
    with pytest.raises(ValueError, match="num_heads % 2 == 0"):
        kdacp.parallelize(_model(linear_num_heads=3), kdacp.ContextParallel("ulysses"))
    paged = _model()
    paged.config._attn_implementation = "paged|eager"  # (Kimi Linear refuses flex_attention itself)
    with pytest.raises(ValueError, match="Ulysses attention wraps one of"):
        kdacp.parallelize(paged, cp)
    with pytest.raises(ValueError, match="split evenly over 2 ranks"):
        kdacp.shard_batch(tokens()[:, :-1])
    # Documents from position_ids that restart at 0, as transformers' flattening collator marks them.
    cu = torch.tensor(CU_SEQLENS)
    explicit = kdacp.shard_batch(tokens(), cu_seqlens=cu)
    derived = kdacp.shard_batch(tokens(), position_ids=kdacp.layers.sequence_positions(cu, 0, CU_SEQLENS[-1])[None])
    assert torch.equal(derived.cu_seqlens, cu) and torch.equal(derived.labels, explicit.labels)
    assert torch.equal(derived.position_ids, explicit.position_ids)
    # Labels shifted over the whole batch: the last token of rank 0 learns rank 1's first token.
    T = CU_SEQLENS[-1] // world_size
    if rank == 0:
        assert explicit.labels[0, -1] == tokens()[0, T]
    ends = [e - 1 - rank * T for e in CU_SEQLENS[1:] if rank * T < e <= (rank + 1) * T]
    assert (explicit.labels[0, ends] == -100).all() and (explicit.labels != -100).sum() == T - len(ends)


reference = reference_fixture(_reference)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_parallelize_matches_one_process(world_size, reference):
    run_and_report(_worker, world_size, reference, MODES[world_size])


def _layout_worker(rank, world_size, ref, results, layout):
    check_layout(rank, world_size, ref, results, _model, layout)


@pytest.mark.parametrize("world_size,layout", [(2, "zigzag"), pytest.param(4, "zigzag", marks=pytest.mark.slow),
                                               pytest.param(2, "document_zigzag", marks=pytest.mark.slow),
                                               (2, "balanced_documents")])
def test_parallelize_under_zigzag_matches_one_process(world_size, layout, reference):
    """Batches sharded under zigzag (rank r holds chunks r and 2P-1-r), per-document zigzag (every document
    padded to a multiple of 2P after its last token) or the balanced placement (long documents cut per document,
    the short one whole), the model parallelised for it: logits of the real tokens,
    loss and every gradient as one process's within TOL."""
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_layout_worker, world_size, reference, results, layout)
    assert f"{layout}/sdpa" in results and "without global label shift" in results
    print(dict(results))
