"""torchtitan 0.3.0's Qwen3.5 debug model under kdacp's context parallelism (gloo, real ranks) against the
one-process model: loss and every gradient, float32, on a packed batch whose documents cross rank edges.

Where torchtitan's model needs GPU kernels, CPU paths stand in on both sides: kdacp's GDN op and short
convolution on its ``torch`` backend (the one-process model has kdacp's modules without a plan, on the
same backend) and :class:`~kdacp.integrations.torchtitan.DenseFlexAttention` for FlexAttention, which has no
backward on CPU. Skipped without torchtitan (``pip install -e '.[torchtitan]'``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="needs the torchtitan extra: pip install -e '.[torchtitan]'")

from tests.helpers import rel_err  # noqa: E402
from tests.multiprocess import run_ranks  # noqa: E402

TOL = 2e-5
# Documents of 40, 7, 51 and 30 tokens: on 2 ranks the third crosses the edge at 64; on 4 ranks the first
# crosses 32 and the third runs from rank 1 through rank 2 (all of whose tokens it holds) into rank 3.
DOCUMENTS = (40, 7, 51, 30)
# Shrunk from the debug model to keep CI fast (kdacp's torch backend is the slow part), its layers unchanged:
# its layers 0 (GDN) and 3 (attention) of 8, and 512 of its 248320 vocabulary entries.
LAYERS, VOCAB = (0, 3), 512


def build_model():
    """torchtitan's Qwen3.5 debug model, shrunk as above, in float32, seeded."""
    from torchtitan.distributed import utils as dist_utils

    import kdacp.integrations.torchtitan as kt
    dist_utils.set_spmd_backend("partial_dtensor")
    config = kt.model_registry("debugmodel").model
    config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = VOCAB
    config.layers = [config.layers[i] for i in LAYERS]
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    T = sum(DOCUMENTS)
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    return {"input": torch.randint(0, VOCAB, (1, T), generator=g), "positions": positions}, \
        torch.randint(0, VOCAB, (1, T), generator=g)


def loss_and_grads(model, inputs, labels, kwargs, total: int):
    """The summed token loss over ``total`` tokens (torchtitan's contract) and the parameter gradients."""
    import kdacp.integrations.torchtitan as kt
    model.zero_grad()
    logits = model(inputs, special_tokens=kt.TEXT_ONLY_TOKENS, **kwargs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / total
    loss.backward()
    return loss.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    """The one-process model: kdacp's modules without context parallelism, the whole packed batch."""
    import kdacp.integrations.torchtitan as kt
    model = build_model()
    kt.apply_kdacp_to_gated_deltanet(model, None)
    kt.apply_dense_attention(model)
    input_dict, labels = batch()
    masks = model.get_attention_masks(positions=input_dict["positions"])
    loss, grads = loss_and_grads(model, input_dict["input"], labels,
                                 {"positions": input_dict["positions"], "attention_masks": masks}, labels.numel())
    return {"state": model.state_dict(), "loss": loss, "grads": grads}


def _parallel_step(model, cp_mesh):
    """One step on this rank's shard: the global loss and the summed gradients."""
    import kdacp.integrations.torchtitan as kt
    input_dict, labels = batch()
    total = labels.numel()
    inputs, labels, kwargs = kt.shard_batch(model, input_dict, labels, cp_mesh)
    assert inputs.shape == (1, total // cp_mesh.size())
    loss, grads = loss_and_grads(model, inputs, labels, kwargs, total)
    dist.all_reduce(loss)
    for grad in grads.values():
        dist.all_reduce(grad)
    return loss, grads


def _errors(model, cp_mesh, ref) -> dict:
    loss, grads = _parallel_step(model, cp_mesh)
    return {"loss": rel_err(loss, ref["loss"]), **{n: rel_err(g, ref["grads"][n]) for n, g in grads.items()}}


def _zeros_of(fn):
    return lambda *args, **kwargs: (lambda out: None if out is None else torch.zeros_like(out))(fn(*args, **kwargs))


def _cp_worker(rank, world_size, ref, check_removal, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    import kdacp.integrations.torchtitan as kt
    from kdacp.distributed.strategies import P2PExchange
    from kdacp.layers import context_parallel
    model = build_model()
    model.load_state_dict(ref["state"])
    cp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    kt.apply_kdacp_to_gated_deltanet(model, cp_mesh)
    kt.apply_dense_attention(model)
    apply_cp_to_forward([layer.attn.inner_attention for layer in model.layers.values() if layer.full_attn], cp_mesh)
    errs = _errors(model, cp_mesh, ref)
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst < TOL, f"{world_size} ranks: {name} off by {worst:.2e} (rank {rank})"
    if rank == 0:
        results.append(("kdacp CP", name, worst))
    if not check_removal:
        return
    # Each exchange removed in turn (messages still flow, their content zeroed): the step leaves the tolerance.
    for what, owner, attr in (("state exchange", P2PExchange, "receive"), ("halo", context_parallel, "shift_right")):
        real = getattr(owner, attr)
        setattr(owner, attr, _zeros_of(real))
        try:
            errs = _errors(model, cp_mesh, ref)
        finally:
            setattr(owner, attr, real)
        name, worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst > 100 * TOL, f"removing the {what} went unnoticed on {world_size} ranks"
        if rank == 0:
            results.append((f"without {what}", name, worst))


@pytest.mark.parametrize("world_size", [2, 4])
def test_debug_model_cp_matches_one_process(reference, world_size):
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_cp_worker, world_size, reference, world_size == 2, results, timeout_s=300)
    print(list(results))
    assert results[0][0] == "kdacp CP" and len(results) == (3 if world_size == 2 else 1)
