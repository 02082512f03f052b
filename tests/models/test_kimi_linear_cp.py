"""``kdacp.parallelize`` on a tiny random Hugging Face ``KimiLinearForCausalLM`` (KDA, MLA and MoE layers) over
2 and 4 gloo ranks against the unmodified one-process model, on a packed batch whose documents cross rank edges.

The one-process reference runs transformers' own model on each document alone and sums the token losses:
transformers' CPU fallbacks of the short convolution and of KDA ignore packed-sequence boundaries, so the
packed batch cannot be its reference directly, while one document at a time is exactly the model's meaning.
Float32 throughout (the MoE router keeps float32 weights); tolerance ``TOL`` relative (2-norm) on the loss
and on every parameter's all-reduced gradient. The same workers check that removing any exchange (the
convolution halo, the recurrence's state exchange, the MLA all-to-all) breaks that tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.helpers import rel_err
from tests.multiprocess import run_ranks


TOL = 2e-5
# Documents of 60, 7, 77 and 48 tokens: on 2 ranks the third crosses the edge at 96; on 4 ranks the
# first crosses 48, the third crosses 96, and the fourth starts exactly at 144.
CU_SEQLENS = [0, 60, 67, 144, 192]
VOCAB = 96
# (KDA mode, Ulysses size, the model's attention implementation, which becomes the Ulysses one's inner)
MODES = {2: [("state", None, "sdpa"), ("ulysses", None, "eager")],
         4: [("state", None, "sdpa"), ("hybrid", 2, "eager")]}


def _config(**overrides):
    from transformers import KimiLinearConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              n_group=1, topk_group=1, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
              use_cache=False, attn_implementation="sdpa")
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


def _tokens():
    return torch.randint(3, VOCAB, (1, CU_SEQLENS[-1]), generator=torch.Generator().manual_seed(1))


def _reference() -> dict:
    """The unmodified model, one document at a time: global token-mean loss and parameter gradients."""
    from kdacp.models import torch_fallbacks
    model, ids = _model(), _tokens()
    total = sum(e - s - 1 for s, e in zip(CU_SEQLENS, CU_SEQLENS[1:]))
    loss = 0.0
    with torch_fallbacks():  # where FLA imports, transformers would call its GPU-only kernels on these CPU tensors
        for s, e in zip(CU_SEQLENS, CU_SEQLENS[1:]):
            logits = model(input_ids=ids[:, s:e]).logits[0]
            loss = loss + F.cross_entropy(logits[:-1], ids[0, s + 1:e], reduction="sum")
    loss = loss / total
    loss.backward()
    return dict(loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()})


def _step(model, rank, world_size):
    """One parallel step on this rank's shard: the global loss and the all-reduced parameter gradients."""
    import kdacp
    from kdacp.models import global_token_mean_loss
    batch = kdacp.shard_batch(_tokens(), cu_seqlens=torch.tensor(CU_SEQLENS))
    assert batch.input_ids.shape == (1, CU_SEQLENS[-1] // world_size)
    loss = global_token_mean_loss(model(**batch.model_kwargs()).logits, batch.labels)
    model.zero_grad()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad)  # each rank holds its share: they add up
        grads[name] = grad
    return loss.detach(), grads


def _errors(loss, grads, ref):
    return {"loss": rel_err(loss, ref["loss"]), **{n: rel_err(g, ref["grads"][n]) for n, g in grads.items()}}


def _worker(rank, world_size, ref, results):
    import kdacp
    from kdacp.layers import context_parallel
    from kdacp.models import kimi_linear

    if world_size == 2:
        _check_contract(rank, world_size)
    worst = {}
    for mode, ulysses_size, attention in MODES[world_size]:
        cp = kdacp.KDAContextParallel(mode, ulysses_size=ulysses_size)
        model = _model(attn_implementation=attention)
        before = model.state_dict()
        assert kdacp.parallelize(model, cp) is model
        after = model.state_dict()
        # The model's own parameters, in place: same keys, same tensors.
        assert list(after) == list(before)
        assert all(after[k] is before[k] or after[k].data_ptr() == before[k].data_ptr() for k in before)

        errors = _errors(*_step(model, rank, world_size), ref)
        name, err = max(errors.items(), key=lambda kv: kv[1])
        assert err < TOL, f"{mode} on {world_size} ranks: {name} off by {err:.2e} (rank {rank})"
        worst[f"{mode}/{attention}"] = (name, err)

        if mode != "state":
            continue
        # Each exchange matters: without it the result leaves the tolerance.
        broken = {
            "convolution halo": (context_parallel.ConvContext, "left_halos", lambda self, xs, width: [None] * len(xs)),
            "state exchange": (context_parallel.KDAContextParallel, "chunk_kda", _local_chunk_kda),
            "MLA all-to-all": (kimi_linear, "all_to_all", lambda x, group: x),
            "MLA documents": (kimi_linear, "document_causal_mask",
                              lambda cu, T, device, real=kimi_linear.document_causal_mask: real(None, T, device)),
        }
        for what, (owner, attr, fake) in broken.items():
            real = getattr(owner, attr)
            setattr(owner, attr, fake)
            try:
                errors = _errors(*_step(model, rank, world_size), ref)
            finally:
                setattr(owner, attr, real)
            assert max(errors.values()) > 100 * TOL, f"removing the {what} went unnoticed on {world_size} ranks"
            worst[f"without {what}"] = max(errors.items(), key=lambda kv: kv[1])
    if rank == 0:
        results.update(worst)


def _check_contract(rank, world_size):
    """What parallelize and shard_batch promise besides the numbers: the state dict, and clear errors."""
    import kdacp
    cp = kdacp.KDAContextParallel("state")
    model = _model()
    before = {k: v for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    kdacp.parallelize(model, cp)
    after = model.state_dict()
    assert list(after) == list(before), "parallelize changed the state dict's keys"
    assert all(after[k].data_ptr() == v.data_ptr() and after[k].shape == v.shape for k, v in before.items())
    assert all(p is params[n] for n, p in model.named_parameters()), "parallelize replaced a parameter"
    with pytest.raises(ValueError, match="already parallelised"):
        kdacp.parallelize(model, cp)
    # A model sharing the config object keeps its own attention: parallelize gives its model a copy.
    from transformers import KimiLinearForCausalLM
    shared = _model().config
    twin = KimiLinearForCausalLM(shared)
    parallel = kdacp.parallelize(KimiLinearForCausalLM(shared), cp)
    assert shared._attn_implementation == "sdpa" and twin.config is shared
    assert parallel.config is not shared and parallel.config._attn_implementation == "kdacp_ulysses"
    with kdacp.models.torch_fallbacks():  # the unmodified model on CPU (see _reference)
        twin(input_ids=_tokens()[:, :16], use_cache=False)  # not routed to the Ulysses function
    with pytest.raises(ValueError, match="num_attention_heads % 2 == 0"):
        kdacp.parallelize(_model(num_attention_heads=3, num_key_value_heads=3), cp)
    with pytest.raises(ValueError, match="num_heads % 2 == 0"):
        kdacp.parallelize(_model(linear_num_heads=3), kdacp.KDAContextParallel("ulysses"))
    paged = _model()
    paged.config._attn_implementation = "paged|eager"  # (Kimi Linear refuses flex_attention itself)
    with pytest.raises(ValueError, match="Ulysses attention wraps one of"):
        kdacp.parallelize(paged, cp)
    with pytest.raises(ValueError, match="split evenly over 2 ranks"):
        kdacp.shard_batch(_tokens()[:, :-1])
    # Documents from position_ids that restart at 0, as transformers' flattening collator marks them.
    cu = torch.tensor(CU_SEQLENS)
    explicit = kdacp.shard_batch(_tokens(), cu_seqlens=cu)
    derived = kdacp.shard_batch(_tokens(), position_ids=kdacp.layers.sequence_positions(cu, 0, CU_SEQLENS[-1])[None])
    assert torch.equal(derived.cu_seqlens, cu) and torch.equal(derived.labels, explicit.labels)
    assert torch.equal(derived.position_ids, explicit.position_ids)
    # Labels shifted over the whole batch: the last token of rank 0 learns rank 1's first token.
    T = CU_SEQLENS[-1] // world_size
    if rank == 0:
        assert explicit.labels[0, -1] == _tokens()[0, T]
    ends = [e - 1 - rank * T for e in CU_SEQLENS[1:] if rank * T < e <= (rank + 1) * T]
    assert (explicit.labels[0, ends] == -100).all() and (explicit.labels != -100).sum() == T - len(ends)


def _local_chunk_kda(self, q, k, v, g, beta, *, cu_seqlens, backend, **kwargs):
    """``KDAContextParallel.chunk_kda`` without the state exchange: each rank's pieces start from zero."""
    from kdacp.kda import chunk_kda
    return chunk_kda(q, k, v, g, beta, cu_seqlens=self.conv_context(q.shape[1], cu_seqlens).cu_seqlens_cpu,
                     backend=backend, **kwargs)


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("world_size", [2, 4])
def test_parallelize_matches_one_process(world_size, reference):
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_worker, world_size, reference, results)
    assert {f"{mode}/{attention}" for mode, _, attention in MODES[world_size]} <= set(results)
    print({mode: f"{name}: {err:.1e}" for mode, (name, err) in results.items()})
