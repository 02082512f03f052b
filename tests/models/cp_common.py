"""What the ``kdacp.parallelize`` tests of the Hugging Face models share: a packed batch whose documents cross
rank edges, the one-process reference (one document at a time), one parallel step, the errors against it,
and the checks of the contract (state dict, shared config, exchanges that matter)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import rel_err
from tests.multiprocess import run_ranks

TOL = 2e-5
# Documents of 60, 7, 77 and 48 tokens: on 2 ranks the third crosses the edge at 96; on 4 ranks the
# first crosses 48, the third crosses 96, and the fourth starts exactly at 144.
CU_SEQLENS = [0, 60, 67, 144, 192]
VOCAB = 96


def tokens():
    return torch.randint(3, VOCAB, (1, CU_SEQLENS[-1]), generator=torch.Generator().manual_seed(1))


def one_document_at_a_time(model, context) -> dict:
    """The unmodified ``model`` inside ``context``, one document at a time (on the model's device): logits,
    the global token-mean loss and the parameter gradients."""
    ids = tokens().to(next(model.parameters()).device)
    total = sum(e - s - 1 for s, e in zip(CU_SEQLENS, CU_SEQLENS[1:]))
    loss, logits = 0.0, []
    with context:
        for s, e in zip(CU_SEQLENS, CU_SEQLENS[1:]):
            doc = model(input_ids=ids[:, s:e]).logits[0]
            logits.append(doc.detach())
            loss = loss + F.cross_entropy(doc[:-1], ids[0, s + 1:e], reduction="sum")
    loss = loss / total
    loss.backward()
    return dict(logits=torch.cat(logits), loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()})


def original_index(batch) -> torch.Tensor:
    """``[layout.num_tokens]`` int64: the token of the unpadded batch (``CU_SEQLENS``) at each global position of
    ``batch``'s (possibly padded) stream, ``-1`` on padding (at a document's end, or a document of its own)."""
    out = torch.full((batch.layout.num_tokens,), -1, dtype=torch.int64)
    padded = batch.cu_seqlens.tolist()
    for (s, e), start in zip(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]), padded):
        out[start:start + e - s] = torch.arange(s, e)
    return out


def step(model, world_size, layout="contiguous"):
    """One parallel step on this rank's shard (``layout``: the token layout it is sharded by, padded with token
    0 where the layout needs it): its logits, the model's own loss, the gradients averaged over the ranks (the
    loss-scaling contract of ``kdacp.cp.sharding``: what DDP or FSDP2 would do) and, for each of its tokens,
    the token of the unpadded batch (``-1`` on padding)."""
    import kdacp
    from kdacp.integrations.transformers import global_token_mean_loss
    device = next(model.parameters()).device
    batch = kdacp.shard_batch(tokens().to(device), cu_seqlens=torch.tensor(CU_SEQLENS, device=device), layout=layout,
                              pad_id=0)
    assert batch.input_ids.shape == (1, batch.layout.num_tokens // world_size)
    out = model(**batch.model_kwargs())  # the config's use_cache (True) left as is: no cache is built
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None  # `cache` from transformers 5.24
    assert rel_err(out.loss.detach(), global_token_mean_loss(out.logits.detach(), batch.labels)) < 1e-6
    model.zero_grad()
    out.loss.backward()
    grads = averaged_gradients(model, world_size)
    return out.logits.detach()[0], out.loss.detach(), grads, original_index(batch)[batch.layout.local_token_index(batch.rank)]


def averaged_gradients(model, world_size: int) -> dict:
    """Every parameter's gradient (zeros where none) averaged over the ``world_size`` ranks, by name."""
    grads = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad / world_size
    return grads


def errors(model, ref, rank, world_size, layout="contiguous") -> dict:
    """Relative errors of one parallel step's logits (this rank's real tokens), loss and gradients against ``ref``."""
    logits, loss, grads, own = step(model, world_size, layout)
    real = own >= 0
    return {"logits": rel_err(logits[real.to(logits.device)], ref["logits"][own[real].to(ref["logits"].device)]),
            "loss": rel_err(loss, ref["loss"]), **{n: rel_err(g, ref["grads"][n]) for n, g in grads.items()}}


def check_matches(model, ref, rank, world_size, what: str, worst: dict, layout="contiguous") -> None:
    """One parallel step within ``TOL`` of ``ref``; records the worst error under ``what``."""
    name, err = max(errors(model, ref, rank, world_size, layout).items(), key=lambda kv: kv[1])
    assert err < TOL, f"{what} on {world_size} ranks: {name} off by {err:.2e} (rank {rank})"
    worst[what] = (name, err)


def check_each_matters(model, ref, rank, world_size, broken: dict, worst: dict, layout="contiguous") -> None:
    """``broken``: what -> ``(owner, attribute, fake)``; with each faked in turn, the step leaves the tolerance."""
    for what, (owner, attr, fake) in broken.items():
        real = getattr(owner, attr)
        setattr(owner, attr, fake)
        try:
            errs = errors(model, ref, rank, world_size, layout)
        finally:
            setattr(owner, attr, real)
        assert max(errs.values()) > 100 * TOL, f"removing the {what} went unnoticed on {world_size} ranks"
        worst[f"without {what}"] = max(errs.items(), key=lambda kv: kv[1])


def check_in_place(model, cp) -> None:
    """``kdacp.parallelize`` keeps the state dict's keys and tensors and the parameters, and refuses a second time."""
    import kdacp
    before = dict(model.state_dict())
    params = dict(model.named_parameters())
    assert kdacp.parallelize(model, cp) is model
    after = model.state_dict()
    assert list(after) == list(before), "parallelize changed the state dict's keys"
    assert all(after[k].data_ptr() == v.data_ptr() and after[k].shape == v.shape for k, v in before.items())
    assert all(p is params[n] for n, p in model.named_parameters()), "parallelize replaced a parameter"
    with pytest.raises(ValueError, match="already parallelised"):
        kdacp.parallelize(model, cp)


def check_shared_config(model_type, config, cp) -> None:
    """A model sharing ``config`` (attention ``sdpa``) with a parallelised one keeps its own attention."""
    import kdacp
    twin = model_type(config)
    parallel = kdacp.parallelize(model_type(config), cp)
    assert config._attn_implementation == "sdpa" and twin.config is config
    assert parallel.config is not config and parallel.config._attn_implementation == "kdacp_ulysses"
    with kdacp.integrations.transformers.torch_fallbacks():  # the unmodified model on CPU
        twin(input_ids=tokens()[:, :16], use_cache=False)  # not routed to the Ulysses function


def check_parallelize_contract(model_type, make_model):
    """:func:`check_in_place` and :func:`check_shared_config` on fresh ``make_model()`` models under a
    ``state``-mode context; returns that context for the caller's further checks."""
    import kdacp
    cp = kdacp.ContextParallel("state")
    model = make_model()
    check_in_place(model, cp)
    check_shared_config(model_type, make_model().config, cp)
    # An explicit cache request is refused before any exchange (the default builds none: see step()).
    batch = kdacp.shard_batch(tokens(), cu_seqlens=torch.tensor(CU_SEQLENS))
    with pytest.raises(ValueError, match="runs without a cache.*kdacp.integrations.transformers.generate"):
        model(**batch.model_kwargs(), use_cache=True)
    return cp


def local_recurrence(self, op, q, k, v, g, beta, **kwargs):
    """``CPContext.recurrence`` without the state exchange: each rank's pieces start from zero."""
    return op(q, k, v, g, beta, cu_seqlens=self.local_cu_seqlens_cpu, **kwargs)


def exchanges() -> dict:
    """For :func:`check_each_matters`: the convolution halo, the recurrence's state exchange and the attention
    all-to-all, each faked away."""
    import kdacp
    from kdacp.cp import autograd_collectives, batch_context
    return {
        "convolution halo": (batch_context.CPContext, "left_halos", lambda self, xs, width: [None] * len(xs)),
        "state exchange": (batch_context.CPContext, "recurrence", local_recurrence),
        "attention all-to-all": (autograd_collectives, "all_to_all", lambda x, group: x),
        "global label shift": (kdacp, "shard_batch", shifted_in_shard(kdacp.shard_batch)),
    }


def shifted_in_shard(shard_batch):
    """``shard_batch`` whose labels are shifted inside each rank's shard (what the model's own loss did before
    ``parallelize`` set its loss): the token before each edge of a rank's ranges learns the wrong target (or
    none, at its last token); document ends stay unlabelled."""
    import dataclasses

    def fake(input_ids, *args, **kwargs):
        batch = shard_batch(input_ids, *args, **kwargs)
        labels = torch.full_like(batch.labels, -100)
        labels[:, :-1] = batch.input_ids[:, 1:]
        if batch.cu_seqlens is not None:
            own = batch.layout.local_token_index(batch.rank).to(labels.device)
            labels[:, torch.isin(own, batch.cu_seqlens[1:].to(own.device) - 1)] = -100
        return dataclasses.replace(batch, labels=labels)
    return fake


def check_modes(rank, world_size, ref, results, modes, make_model, broken: dict, broken_on=(2, 4)) -> None:
    """For each ``(mode, ulysses_size, attention)`` of ``modes``: ``make_model(attn_implementation=attention)``
    parallelised in place matches ``ref``; in ``state`` mode on ``broken_on`` ranks, each of ``broken``
    matters (:func:`check_each_matters`). Rank 0 reports the worst errors in ``results``."""
    import kdacp
    worst = {}
    for mode, ulysses_size, attention in modes:
        if mode == "hybrid":  # the DeviceMesh form: (state, ulysses), Ulysses over consecutive ranks
            mesh = kdacp.init_device_mesh("cpu", (world_size // ulysses_size, ulysses_size),
                                          mesh_dim_names=("state", "ulysses"))
            cp = kdacp.ContextParallel.from_mesh(mesh)
            assert (cp.mode, cp.ulysses_size) == ("hybrid", ulysses_size)
        else:
            cp = kdacp.ContextParallel(mode, ulysses_size=ulysses_size)
        model = make_model(attn_implementation=attention)
        check_in_place(model, cp)  # the model's own parameters, in place: same keys, same tensors
        check_matches(model, ref, rank, world_size, f"{mode}/{attention}", worst)
        if mode == "state" and world_size in broken_on:
            check_each_matters(model, ref, rank, world_size, broken, worst)
    if rank == 0:
        results.update(worst)


def check_layout(rank, world_size, ref, results, make_model, layout, attention="sdpa") -> None:
    """``make_model(attn_implementation=attention)`` parallelised over a 1-D mesh under the token ``layout``
    matches ``ref`` with batches sharded under that layout; the global label shift matters there too, and a
    batch sharded under the contiguous layout is refused. Rank 0 reports the worst errors in ``results``."""
    import kdacp
    mesh = kdacp.init_device_mesh("cpu", (world_size,))
    model = kdacp.parallelize(make_model(attn_implementation=attention), mesh, layout=layout)
    worst = {}
    check_matches(model, ref, rank, world_size, f"{layout}/{attention}", worst, layout)
    check_each_matters(model, ref, rank, world_size, {"global label shift": (
        kdacp, "shard_batch", shifted_in_shard(kdacp.shard_batch))}, worst, layout)
    contiguous = kdacp.shard_batch(tokens(), cu_seqlens=torch.tensor(CU_SEQLENS))
    with pytest.raises(ValueError, match="sharded under another token layout"):
        model(**contiguous.model_kwargs())
    if rank == 0:
        results.update(worst)


def reference_fixture(build):
    """The module-scoped pytest fixture ``reference``: ``build()``, once per test module."""
    return pytest.fixture(scope="module", name="reference")(lambda: build())


def run_and_report(worker, world_size, reference, modes) -> None:
    """Run ``worker(rank, world_size, reference, results)`` on ``world_size`` ranks; every mode reported."""
    results = torch.multiprocessing.Manager().dict()
    run_ranks(worker, world_size, reference, results)
    assert {f"{mode}/{attention}" for mode, _, attention in modes} <= set(results)
    print({mode: f"{name}: {err:.1e}" for mode, (name, err) in results.items()})
