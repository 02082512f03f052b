"""``kdacp.parallelize`` on a tiny random Hugging Face ``Qwen3NextForCausalLM`` (Gated DeltaNet and gated
softmax attention with grouped-query heads and partial rotary embeddings; a dense and two MoE MLPs) over
2 and 4 gloo ranks against the unmodified one-process model, on a packed batch whose documents cross rank
edges.

As in tests/models/test_kimi_linear_cp.py, the one-process reference runs transformers' own model on each
document alone (its PyTorch GDN and short convolution ignore packed-sequence boundaries; its kernel wrapper
refuses ``cu_seqlens`` without FLA) and sums the token losses. Its GDN runs as transformers' own
token-by-token recurrence (``torch_recurrent_gated_delta_rule``, the same math) rather than its chunked form:
in float32 the chunked form exponentiates log decays summed over up to 64 tokens, which underflow for strong
decays (``A`` near 16, as the model's initialisation draws), and loses the gate's gradient to about 3e-5
against float64 on such gates where the recurrence keeps 2e-7 (kdacp's GDN: 5e-8); with the chunked reference
the ``A_log``/``dt_bias`` gradients here differ by 2.6e-4, everything else by under 5e-6.
Float32 throughout; tolerance ``TOL`` (tests/models/cp_common.py) relative (2-norm) on the logits, the loss
and every parameter's all-reduced gradient. The same workers
check that removing an exchange (the convolution halo, the recurrence's state exchange, the attention
all-to-all) or the documents (the global boundaries reaching the GDN layers) breaks that tolerance.
"""
from __future__ import annotations

import contextlib
import inspect
from unittest import mock

import pytest
import torch
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.models.cp_common import (VOCAB, check_layout, check_modes, check_parallelize_contract, exchanges,
                                    one_document_at_a_time, reference_fixture, run_and_report)
from tests.multiprocess import run_ranks

# (GDN mode, Ulysses size, the model's attention implementation, which becomes the Ulysses one's inner)
# The attention's 8 query and 2 key/value heads: Ulysses on 2 ranks, the K/V all-gather on 4 (fewer bytes than
# replicating), Ulysses with each key/value head sent 4 times on 8 (as many bytes as the gather).
MODES = {2: [("state", None, "sdpa"), ("ulysses", None, "eager")],
         4: [("state", None, "eager"), ("hybrid", 2, "sdpa")],
         8: [("state", None, "sdpa")]}


def _config(**overrides):
    from transformers import Qwen3NextConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0],
              pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")  # use_cache: default
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def _model(**overrides):
    from transformers import Qwen3NextForCausalLM
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(_config(**overrides))
    with torch.no_grad():  # norms away from their initialisation, so their gradients mean something
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@contextlib.contextmanager
def _transformers_recurrent_gdn():
    """transformers' PyTorch code (torch_fallbacks: where FLA imports, transformers would call its GPU-only
    kernels on these CPU tensors), its GDN in the recurrent form (see the module docstring)."""
    from kdacp.integrations.transformers import load_qwen3_next, torch_fallbacks
    qn = load_qwen3_next()
    recurrent = inspect.unwrap(qn.torch_recurrent_gated_delta_rule)
    with torch_fallbacks(), mock.patch.object(qn, "torch_chunk_gated_delta_rule", recurrent):
        yield


def _reference() -> dict:
    """The unmodified model, one document at a time."""
    return one_document_at_a_time(_model(), _transformers_recurrent_gdn())


def _worker(rank, world_size, ref, results):
    from kdacp.integrations.transformers import attention, install

    if world_size == 2:
        _check_contract()
    # Each exchange matters, and so do the documents reaching the GDN layers: without one the result
    # leaves the tolerance (checked on 2 ranks, to keep the test short); on 8 ranks, the order of the
    # replicated key/value heads (each query head's group) and on 4 the K/V all-gather.
    broken = {**exchanges(), "GDN documents": (install, "global_cu_seqlens", lambda kwargs: None)}
    if world_size == 4:
        broken = {"K/V all-gather": (attention, "all_gather_along",
                                     lambda x, dim, group: torch.cat([x] * world_size, dim))}
    if world_size == 8:
        broken = {"K/V replication order": (attention, "replicate_kv_heads", lambda x, r: x.repeat(1, r, 1, 1))}
    check_modes(rank, world_size, ref, results, MODES[world_size], _model, broken, broken_on=(2, 4, 8))


def _check_contract():
    """What parallelize promises besides the numbers: the state dict, the shared config, and clear errors."""
    import kdacp
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3NextForCausalLM
    cp = check_parallelize_contract(Qwen3NextForCausalLM, _model)
    flash = _model(num_attention_heads=3, num_key_value_heads=1)
    flash.config._attn_implementation = "flash_attention_2"  # Ulysses only: its query heads must split
    with pytest.raises(ValueError, match="num_attention_heads % 2 == 0"):
        kdacp.parallelize(flash, cp)
    with pytest.raises(ValueError, match="linear_num_key_heads=1.*num_heads % 2 == 0"):
        kdacp.parallelize(_model(linear_num_key_heads=1), kdacp.ContextParallel("ulysses"))
    flex = _model()
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="Ulysses attention wraps one of"):
        kdacp.parallelize(flex, cp)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="supports transformers' KimiLinearForCausalLM, Qwen3NextForCausalLM"):
        kdacp.parallelize(llama, cp)


reference = reference_fixture(_reference)


# 4 ranks (beyond the 2 key/value heads) in the default run; 2 and 8 with -m slow
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 4,
                                        pytest.param(8, marks=pytest.mark.slow)])
def test_parallelize_matches_one_process(world_size, reference):
    run_and_report(_worker, world_size, reference, MODES[world_size])


def _layout_worker(rank, world_size, ref, results, layout):
    check_layout(rank, world_size, ref, results, _model, layout)


@pytest.mark.parametrize("world_size,layout", [(2, "zigzag"), pytest.param(4, "zigzag", marks=pytest.mark.slow),
                                               pytest.param(2, "document_zigzag", marks=pytest.mark.slow),
                                               (2, "balanced_documents")])
def test_parallelize_under_zigzag_matches_one_process(world_size, layout, reference):
    """Batches sharded under zigzag (rank r holds chunks r and 2P-1-r), or per-document zigzag (every document
    padded to a multiple of 2P after its last token), the model parallelised for it: logits of the real tokens,
    loss and every gradient as one process's within TOL."""
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_layout_worker, world_size, reference, results, layout)
    assert f"{layout}/sdpa" in results and "without global label shift" in results
    print(dict(results))
