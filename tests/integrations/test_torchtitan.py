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
pytest.importorskip("fla", reason="torchtitan's Qwen3.5 imports FLA: pip install -e '.[torchtitan]'")

from tests.helpers import rel_err, zeroed_outputs  # noqa: E402
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


def _gated_deltanet():
    """Layer 0's torchtitan ``GatedDeltaNet`` of the debug model (2 key heads, 4 value heads of 64), float64."""
    from torchtitan.distributed import utils as dist_utils

    import kdacp.integrations.torchtitan as kt
    dist_utils.set_spmd_backend("partial_dtensor")
    torch.manual_seed(0)
    net = kt.model_registry("debugmodel").model.layers[0].delta_net.build()
    net.init_states()
    return net.double()


def test_swapped_modules_match_torchtitan_per_document():
    """One device: the swapped convolution equals torchtitan's own fixed-length convolution (plain PyTorch) run
    on each document, and the swapped kernel equals the GDN oracle on each document with q, k expanded to the
    value heads by ``repeat_interleave`` and L2-normalised as FLA does, as torchtitan's ``GatedDeltaKernel`` asks."""
    from torchtitan.models.qwen3_5.model import GatedDeltaNet

    import kdacp.integrations.torchtitan as kt
    from kdacp.reference.gdn import recurrent_gated_delta_rule
    net = _gated_deltanet()
    kt.apply_kdacp_to_gated_deltanet(net, None)
    cu = [0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()]
    cu_cpu = torch.tensor(cu, dtype=torch.int32)
    T, g = cu[-1], torch.Generator().manual_seed(2)
    x = torch.randn(1, T, net.conv_q.weight.shape[0], generator=g, dtype=torch.float64)
    conv = net._causal_conv(x, net.conv_q, cu_cpu.clone(), cu_cpu)
    own = torch.cat([GatedDeltaNet._causal_conv(net, x[:, s:e], net.conv_q) for s, e in zip(cu, cu[1:])], dim=1)
    assert rel_err(conv, own) < 1e-12

    H, HV, K = 2, 4, 64
    q, k = (torch.randn(1, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, HV, K, generator=g, dtype=torch.float64)
    decay = -torch.rand(1, T, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=g, dtype=torch.float64)
    o = net.kernel(q, k, v, decay, beta, cu_seqlens=cu_cpu.clone(), cu_seqlens_cpu=cu_cpu)
    # FLA's in-kernel L2 norm, which torchtitan asks for: x / sqrt(sum x^2 + 1e-6)
    expand = [(lambda t: t * (t.square().sum(-1, keepdim=True) + 1e-6).rsqrt())(t.repeat_interleave(HV // H, dim=2))
              for t in (q, k)]
    oracle = torch.cat([recurrent_gated_delta_rule(expand[0][:, s:e], expand[1][:, s:e], v[:, s:e], decay[:, s:e],
                                                   beta[:, s:e])[0] for s, e in zip(cu, cu[1:])], dim=1)
    assert rel_err(o, oracle) < 1e-10


def test_refusals_name_the_setting():
    """What kdacp's spec does not run is refused before any collective, naming the setting."""
    from types import SimpleNamespace

    import kdacp.integrations.torchtitan as kt
    dims = SimpleNamespace(tp=1, pp=1, ep=1, cp_enabled=True)
    training = SimpleNamespace(disable_cuda_graphs=True)
    parallelism = SimpleNamespace(spmd_backend="partial_dtensor")
    no_compile = SimpleNamespace(enable=False, components=[])
    kt._check_supported(dims, training, parallelism, no_compile)
    cases = [(dict(dims=SimpleNamespace(tp=2, pp=1, ep=1, cp_enabled=True)), "tensor_parallel_degree=2"),
             (dict(dims=SimpleNamespace(tp=1, pp=1, ep=4, cp_enabled=True)), "expert_parallel_degree=4"),
             (dict(training=SimpleNamespace(disable_cuda_graphs=False)), "disable_cuda_graphs"),
             (dict(parallelism=SimpleNamespace(spmd_backend="spmd_types")), "spmd_backend='spmd_types'"),
             (dict(compile_config=SimpleNamespace(enable=True, components=["model"])), "compile.components")]
    for change, message in cases:
        args = {**dict(dims=dims, training=training, parallelism=parallelism, compile_config=no_compile), **change}
        with pytest.raises(NotImplementedError, match=message):
            kt._check_supported(args["dims"], args["training"], args["parallelism"], args["compile_config"])


class _TwoRankMesh:
    """The two calls :func:`shard_batch` makes on a ``cp`` mesh, for rank 0 of 2 (it refuses before any other)."""

    def size(self):
        return 2

    def get_local_rank(self):
        return 0


def test_shard_batch_refuses_rows_vision_and_uneven_lengths():
    import kdacp.integrations.torchtitan as kt
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="local_batch_size=1"):
        kt.shard_batch(None, {"input": tokens}, tokens, _TwoRankMesh())
    with pytest.raises(ValueError, match="vision inputs"):
        kt.shard_batch(None, {"input": tokens[:1], "pixel_values": torch.zeros(1)}, tokens[:1], _TwoRankMesh())
    with pytest.raises(ValueError, match="split evenly"):
        kt.shard_batch(None, {"input": tokens[:1, :7]}, tokens[:1, :7], _TwoRankMesh())


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


def _cp_worker(rank, world_size, ref, check_removal, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    import kdacp.integrations.torchtitan as kt
    from kdacp.distributed.strategies import P2PExchange
    from kdacp.layers import cp_context
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
    for what, owner, attr in (("state exchange", P2PExchange, "receive"), ("halo", cp_context, "exchange_rows")):
        real = getattr(owner, attr)
        setattr(owner, attr, zeroed_outputs(real))
        try:
            errs = _errors(model, cp_mesh, ref)
        finally:
            setattr(owner, attr, real)
        name, worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst > 100 * TOL, f"removing the {what} went unnoticed on {world_size} ranks"
        if rank == 0:
            results.append((f"without {what}", name, worst))


@pytest.mark.slow  # 2-3 minutes on 2 shared cores: kdacp's torch backend on CPU
@pytest.mark.parametrize("world_size", [2, 4])
def test_debug_model_cp_matches_one_process(reference, world_size):
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_cp_worker, world_size, reference, world_size == 2, results, timeout_s=300)
    print(list(results))
    assert results[0][0] == "kdacp CP" and len(results) == (3 if world_size == 2 else 1)
