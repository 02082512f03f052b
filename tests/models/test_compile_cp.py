"""``torch.compile`` of a ``kdacp.parallelize``d Hugging Face model (Kimi Linear, Qwen3-Next; the tiny models of
tests/models/test_kimi_linear_cp.py and test_qwen3_next_cp.py) on 2 gloo ranks: the whole forward in one graph
(``fullgraph=True``: no graph break in any block; the token mixers' convolutions and recurrence run as one opaque
custom op, the softmax attention's exchanges and inner attention as another), the logits, the loss and every
parameter's all-reduced gradient within ``TOL`` of the same model in eager mode, and batches with other document
boundaries replaying that graph (with ``cu_seqlens`` marked dynamic in size, other document counts too): one
compilation for all of them. Default: the ``aot_eager`` backend; inductor (C++ on the CPU: minutes here) in the
slow test.
"""
from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.helpers import rel_err
from tests.models.cp_common import TOL, VOCAB, averaged_gradients
from tests.multiprocess import run_ranks

# Global boundaries of the batches (192 tokens, 96 a rank): one document crosses the rank edge in each, at
# another place; the third batch's documents end exactly at the edge; the last has fewer documents (its
# boundaries, like all, marked dynamic in size).
BATCHES = ([0, 60, 67, 144, 192], [0, 30, 101, 150, 192], [0, 5, 96, 120, 192], [0, 100, 192])


def _step(model, call, ids, cu, world_size):
    """``call`` (the model, compiled or not) on this rank's shard: its logits, loss and the gradients of
    ``model``'s parameters averaged over the ranks."""
    import kdacp
    batch = kdacp.shard_batch(ids, cu_seqlens=torch.tensor(cu))
    torch._dynamo.mark_dynamic(batch.cu_seqlens, 0)  # the document count: a new one compiles nothing
    model.zero_grad()
    out = call(**batch.model_kwargs())
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), **averaged_gradients(model, world_size)}


def _models(name):
    if name == "kimi_linear":
        from tests.models.test_kimi_linear_cp import _model
    else:
        from tests.models.test_qwen3_next_cp import _model
    return _model


def _worker(rank, world_size, cases, backend, results):
    import torch._dynamo.testing

    import kdacp
    for name, mode, overrides in cases:
        torch._dynamo.reset()  # the models share transformers' wrapper code: each starts from no compiled code
        make_model = _models(name)
        cp = kdacp.ContextParallel(mode)
        eager, model = (kdacp.parallelize(make_model(**overrides), cp) for _ in range(2))
        counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        worst = ("", 0.0)
        for seed, cu in enumerate(BATCHES):
            ids = torch.randint(3, VOCAB, (1, cu[-1]), generator=torch.Generator().manual_seed(seed))
            want = _step(eager, eager, ids, cu, world_size)
            got = _step(model, compiled, ids, cu, world_size)
            errs = {k: rel_err(got[k], v) for k, v in want.items()}
            worst = max([worst, *errs.items()], key=lambda kv: kv[1])
            assert worst[1] < TOL, f"{name}/{mode} batch {cu}: {worst[0]} off by {worst[1]:.2e} (rank {rank})"
        assert counter.frame_count == 1, f"{name}/{mode}: {counter.frame_count} compilations for {len(BATCHES)} batches"
        if rank == 0:
            results[f"{name}/{mode}" + ("/K-V gather" if overrides else "")] = worst


def _run(cases, backend):
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_worker, 2, cases, backend, results, timeout_s=900)
    assert len(results) == len(cases)
    print(dict(results))


@pytest.mark.parametrize("name", ["kimi_linear", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_compiled_models_match_eager_without_recompiling(name):
    _run([(name, "state", {})], "aot_eager")


@pytest.mark.slow
def test_compiled_models_match_eager_ulysses_and_gather():
    # 3 MLA heads do not split over 2 ranks: the softmax attention gathers K/V instead of Ulysses
    _run([("kimi_linear", "ulysses", {}), ("qwen3_next", "ulysses", {}),
          ("kimi_linear", "state", dict(num_attention_heads=3, num_key_value_heads=3))], "aot_eager")


@pytest.mark.slow
def test_compiled_models_match_eager_inductor():
    _run([("kimi_linear", "state", {}), ("qwen3_next", "state", {})], "inductor")
