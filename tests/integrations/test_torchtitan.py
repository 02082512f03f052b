"""torchtitan 0.3.0's Qwen3.5 debug model under kdacp's context parallelism (gloo, real ranks) against the
one-process model: loss and every gradient, float32, on a packed batch cut by torchtitan's load balancer
(head-tail, PTRR, none), whose documents cross rank edges.

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

pytestmark = pytest.mark.integration  # not in the default run: .ci/run runs it in its own environment
pytest.importorskip("torchtitan", reason="needs the torchtitan extra: pip install -e '.[torchtitan]'")
pytest.importorskip("fla", reason="torchtitan's Qwen3.5 imports FLA: pip install -e '.[torchtitan]'")

from tests.helpers import rel_err, zeroed_outputs  # noqa: E402
from tests.multiprocess import run_ranks  # noqa: E402

TOL = 2e-5
# Documents of 40, 7, 51 and 30 tokens. Head-tail on 2 ranks (rank 0: [0, 32) and [96, 128), rank 1: [32, 96)):
# the first runs from rank 0 into rank 1, the third from rank 1 back into rank 0. On 4 ranks (chunks of 16) the
# first runs through ranks 0, 1, 2 and the third through ranks 2, 3, 2, 1. PTRR deals out blocks of 16.
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
    # split inside the device: the schedule sees it, and the kernel's output stays the oracle's
    import kdacp.cp.schedule
    seen, real = [], kdacp.cp.schedule.chunks_per_piece
    net.kernel.parallel.split = 3
    kdacp.cp.schedule.chunks_per_piece = lambda split, *a: seen.append(split) or real(split, *a)
    try:
        o_split = net.kernel(q, k, v, decay, beta, cu_seqlens=cu_cpu.clone(), cu_seqlens_cpu=cu_cpu)
    finally:
        kdacp.cp.schedule.chunks_per_piece = real
    assert set(seen) == {3} and rel_err(o_split, oracle) < 1e-10
    with pytest.raises(ValueError, match="split must be"):
        kt.GatedDeltaParallel(split=-1)


def test_the_old_name_of_gated_delta_parallel_warns_and_gives_it():
    import kdacp.integrations.torchtitan as kt
    with pytest.warns(DeprecationWarning, match="GatedDeltaParallel"):
        assert kt.GatedDeltaContext is kt.GatedDeltaParallel
    with pytest.raises(AttributeError):
        kt.no_such_name


def test_refusals_name_the_setting():
    """What kdacp's spec does not run is refused before any collective, naming the setting."""
    from types import SimpleNamespace

    from kdacp.integrations.torchtitan.parallelize import _check_supported
    dims = SimpleNamespace(tp=1, pp=1, ep=1, cp_enabled=True)
    training = SimpleNamespace(disable_cuda_graphs=True)
    parallelism = SimpleNamespace(spmd_backend="partial_dtensor")
    _check_supported(dims, training, parallelism)
    cases = [(dict(dims=SimpleNamespace(tp=2, pp=1, ep=1, cp_enabled=True)), "tensor_parallel_degree=2"),
             (dict(dims=SimpleNamespace(tp=1, pp=1, ep=4, cp_enabled=True)), "expert_parallel_degree=4"),
             (dict(training=SimpleNamespace(disable_cuda_graphs=False)), "disable_cuda_graphs"),
             (dict(parallelism=SimpleNamespace(spmd_backend="spmd_types")), "spmd_backend='spmd_types'")]
    for change, message in cases:
        args = {**dict(dims=dims, training=training, parallelism=parallelism), **change}
        with pytest.raises(NotImplementedError, match=message):
            _check_supported(args["dims"], args["training"], args["parallelism"])


class _Mesh:
    """The two calls :func:`shard_batch` makes on a ``cp`` mesh, for ``rank`` of ``size`` (no process group)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.world = rank, size

    def size(self):
        return self.world

    def get_local_rank(self):
        return self.rank


def test_shard_batch_refuses_rows_vision_and_uneven_lengths():
    import kdacp.integrations.torchtitan as kt
    model = build_model()
    kt.apply_kdacp_to_gated_deltanet(model, None, layout=kt.BalancedLayout("headtail"))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="local_batch_size=1"):
        kt.shard_batch(model, {"input": tokens}, tokens, _Mesh(0, 2))
    with pytest.raises(ValueError, match="vision inputs"):
        kt.shard_batch(model, {"input": tokens[:1], "pixel_values": torch.zeros(1)}, tokens[:1], _Mesh(0, 2))
    with pytest.raises(ValueError, match="must split evenly over cp=2 ranks under the 'headtail' load balancer"):
        kt.shard_batch(model, {"input": tokens[:1, :6]}, tokens[:1, :6], _Mesh(0, 2))
    with pytest.raises(ValueError, match="GatedDeltaNet modules swapped first"):
        kt.shard_batch(build_model(), {"input": tokens[:1]}, tokens[:1], _Mesh(0, 2))
    with pytest.raises(ValueError, match="context_parallel_load_balancer must be one of"):
        kt.BalancedLayout("roundrobin")


def test_trainer_settings_pick_the_layout():
    """torchtitan's balancer setting becomes the GDN layers' layout, PTRR in the attention's blocks; a PTRR mask key
    other than the attention layers' is refused by name."""
    from types import SimpleNamespace

    import kdacp.integrations.torchtitan as kt
    from kdacp.integrations.torchtitan.parallelize import _balanced_layout
    model = build_model()
    block = model.config.first_attention.inner_attention.block_size
    for balancer in kt.LOAD_BALANCERS:
        parallelism = SimpleNamespace(context_parallel_load_balancer=balancer, context_parallel_ptrr_mask_key=None)
        assert _balanced_layout(model, parallelism) == kt.BalancedLayout(balancer, block)
    parallelism = SimpleNamespace(context_parallel_load_balancer="ptrr", context_parallel_ptrr_mask_key="deltanet")
    with pytest.raises(ValueError, match="context_parallel_ptrr_mask_key='deltanet'"):
        _balanced_layout(model, parallelism)


def test_balanced_layouts_are_torchs_balancers():
    """The layouts kdacp follows are the rearrangements of torch's balancers that torchtitan 0.3.0 picks by
    name: head-tail is kdacp's zigzag; PTRR reproduces the example of torch's ``_PTRRLoadBalancer`` docstring
    (blocks of a document-causal mask over documents of 4, 8 and 4 blocks: rank 0 gets blocks 2, 3, 5, 6, 8,
    11, 12, 13); None is the contiguous split."""
    import kdacp.integrations.torchtitan as kt
    from kdacp.cp.layout import contiguous_layout, zigzag_layout
    for P in (2, 3):
        cu = (0, 40, 47, 98, 144)
        assert kt.BalancedLayout("headtail")(cu, P) == zigzag_layout(144, P)
        assert kt.BalancedLayout(None)(cu, P) == contiguous_layout(144, P)
    B = 16
    ptrr = kt.BalancedLayout("ptrr", block_size=B)((0, 4 * B, 12 * B, 16 * B), 2)
    blocks = [sorted({t // B for t in ptrr.local_token_index(r).tolist()}) for r in range(2)]
    assert blocks == [[2, 3, 5, 6, 8, 11, 12, 13], [0, 1, 4, 7, 9, 10, 14, 15]]
    assert ptrr.local_lengths == (8 * B, 8 * B)


def _dense(mask) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_mask
    Q, KV = mask.seq_lengths
    return create_mask(mask.mask_mod, None, None, Q, KV, device="cpu")[0, 0]


@pytest.mark.parametrize("balancer", [None, "headtail", "ptrr"])
def test_shard_batch_follows_the_balancer(balancer):
    """Each rank's tokens, labels (not shifted again: torchtitan's loader shifts them) and positions are the
    balancer's, the GDN layers get the global document offsets, and the attention mask of a rank's queries is
    the rows of torchtitan's own global mask at its tokens, its columns at every rank's tokens in all-gather order."""
    import kdacp.integrations.torchtitan as kt
    model = build_model()
    layout_rule = kt.BalancedLayout(balancer, block_size=16)
    kt.apply_kdacp_to_gated_deltanet(model, None, layout=layout_rule)
    input_dict, labels = batch()
    cu = (0, *torch.tensor(DOCUMENTS).cumsum(0).tolist())
    layout = layout_rule(cu, 2)
    gathered = torch.cat([layout.local_token_index(r) for r in range(2)])
    whole = _dense(model.get_attention_masks(positions=input_dict["positions"])["quadratic_attention"])
    for rank in range(2):
        own = layout.local_token_index(rank)
        inputs, shard_labels, kwargs = kt.shard_batch(model, input_dict, labels, _Mesh(rank, 2))
        assert torch.equal(inputs, input_dict["input"][:, own]) and torch.equal(shard_labels, labels[:, own])
        assert torch.equal(kwargs["positions"], input_dict["positions"][:, own])
        assert kwargs["attention_masks"]["deltanet"].cu_seq_q_host == cu
        assert torch.equal(_dense(kwargs["attention_masks"]["quadratic_attention"]), whole[own][:, gathered])


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


def _parallel_step(model, cp_mesh, gdn_layout=None):
    """One step on this rank's shard: the global loss and the summed gradients. ``gdn_layout``: the GDN layers
    are made to assume this layout rule after the batch was cut (a mechanism removed)."""
    import kdacp.integrations.torchtitan as kt
    input_dict, labels = batch()
    total = labels.numel()
    inputs, labels, kwargs = kt.shard_batch(model, input_dict, labels, cp_mesh)
    assert inputs.shape == (1, total // cp_mesh.size())
    kernels = [m for m in model.modules() if isinstance(m, kt.KdacpGatedDeltaKernel)]
    real = kernels[0].parallel
    if gdn_layout is not None:
        for kernel in kernels:
            kernel.parallel = kt.GatedDeltaParallel(real.group, layout=gdn_layout, backend=real.backend)
    try:
        loss, grads = loss_and_grads(model, inputs, labels, kwargs, total)
    finally:
        for kernel in kernels:
            kernel.parallel = real
    dist.all_reduce(loss)
    for grad in grads.values():
        dist.all_reduce(grad)
    return loss, grads


def _errors(model, cp_mesh, ref, gdn_layout=None) -> dict:
    loss, grads = _parallel_step(model, cp_mesh, gdn_layout)
    return {"loss": rel_err(loss, ref["loss"]), **{n: rel_err(g, ref["grads"][n]) for n, g in grads.items()}}


def _torchtitan_cut(cp_mesh, balancer, block_size: int) -> torch.Tensor:
    """The global tokens torchtitan gives this rank under ``balancer``: its ``cp_shard`` for head-tail and none;
    for PTRR (whose ``cp_shard`` also cuts the mask, which torch refuses below ``P x 128`` tokens) the balancer
    ``cp_shard`` builds, from the batch's document mask in blocks of ``block_size``, through torch's shard call."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _PTRRLoadBalancer
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.distributed.context_parallel import cp_shard
    from torchtitan.models.common.attention import (create_attention_mask, get_causal_mask_mod,
                                                     get_efficient_causal_mask_mod_for_packed_document)
    positions = batch()[0]["positions"]
    T = positions.shape[1]
    tokens = torch.arange(T)[None]
    if balancer != "ptrr":
        return cp_shard(cp_mesh, (tokens,), None, balancer)[0][0][0]
    mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    mask = create_attention_mask(mod, 1, None, T, T, device="cpu", BLOCK_SIZE=block_size)
    return _context_parallel_shard(cp_mesh, [tokens], [1], _PTRRLoadBalancer(mask, cp_mesh.size(0)))[0][0]


def _parallel_model(ref, world_size: int, balancer):
    """The reference's model on this rank under context parallelism over a ``cp`` mesh of ``world_size``, the
    batch cut by torchtitan's ``balancer``, as ``parallelize_qwen3_5_kdacp`` sets it up before torchtitan's own
    parallelize: ``(model, cp_mesh, layout)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    import kdacp.integrations.torchtitan as kt
    model = build_model()
    model.load_state_dict(ref["state"])
    cp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    layout = kt.BalancedLayout(balancer, block_size=16)  # PTRR: 8 blocks of 16 on the 128-token batch
    kt.apply_kdacp_to_gated_deltanet(model, cp_mesh, layout=layout)
    kt.apply_dense_attention(model)
    apply_cp_to_forward([layer.attn.inner_attention for layer in model.layers.values() if layer.full_attn], cp_mesh)
    return model, cp_mesh, layout


def _cp_worker(rank, world_size, balancer, ref, check_removal, results):
    import kdacp.integrations.torchtitan as kt
    from kdacp.cp.exchanges import P2PExchange
    from kdacp.cp import batch_context
    model, cp_mesh, layout = _parallel_model(ref, world_size, balancer)
    # kdacp deals out the tokens torchtitan's own cut would give this rank
    cu = (0, *torch.tensor(DOCUMENTS).cumsum(0).tolist())
    assert torch.equal(layout(cu, world_size).local_token_index(rank), _torchtitan_cut(cp_mesh, balancer, 16))
    errs = _errors(model, cp_mesh, ref)
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst < TOL, f"{world_size} ranks, {balancer}: {name} off by {worst:.2e} (rank {rank})"
    if rank == 0:
        results.append(("kdacp CP", name, worst))
    if not check_removal:
        return
    # Each mechanism removed in turn: the GDN layers assuming the contiguous layout while the batch is cut by the
    # balancer, then the state exchange and the halo (messages still flow, their content zeroed).
    errs = _errors(model, cp_mesh, ref, gdn_layout=kt.BalancedLayout(None))
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst > 100 * TOL, f"the GDN layers ignoring the layout went unnoticed on {world_size} ranks"
    if rank == 0:
        results.append(("GDN assuming contiguous", name, worst))
    for what, owner, attr in (("state exchange", P2PExchange, "receive"), ("halo", batch_context, "exchange_rows")):
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


@pytest.mark.parametrize("world_size, balancer", [(2, "headtail"), (2, "ptrr"),
                                                  pytest.param(4, "headtail", marks=pytest.mark.slow),
                                                  pytest.param(4, None, marks=pytest.mark.slow)])
def test_debug_model_cp_matches_one_process(reference, world_size, balancer):
    """Loss and every gradient at 2 (and 4) ranks against one process, the batch cut by torchtitan's load
    balancer; at 2 ranks under head-tail each mechanism removed in turn leaves the tolerance."""
    check_removal = (world_size, balancer) == (2, "headtail")
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_cp_worker, world_size, balancer, reference, check_removal, results, timeout_s=300)
    print(list(results))
    assert results[0][0] == "kdacp CP" and len(results) == (4 if check_removal else 1)


def _compiled_cp_worker(rank, world_size, ref, backend, results):
    """torchtitan's per-block compile (``apply_compile``: each block under ``torch.compile(fullgraph=True)``) of
    the parallel model under torchtitan's default head-tail balancer: the step within ``TOL`` of the one-process
    eager model, every block compiled."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    import kdacp.integrations.torchtitan as kt
    model, cp_mesh, _ = _parallel_model(ref, world_size, "headtail")
    apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"], backend=backend),
                  parallel_dims=SimpleNamespace(tp_enabled=False))
    kt.shard_batch(model, *batch(), cp_mesh)  # torchtitan compiles its mask builder: counted before, not with the blocks
    counters.clear()
    name, worst = max(_errors(model, cp_mesh, ref).items(), key=lambda kv: kv[1])
    assert worst < TOL, f"compiled, {world_size} ranks: {name} off by {worst:.2e} (rank {rank})"
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(LAYERS), f"{graphs} graphs for {len(LAYERS)} blocks (a graph break or a block not compiled)"
    if rank == 0:
        results.append((f"kdacp CP compiled ({backend})", name, worst))


@pytest.mark.slow  # 3 minutes on 2 shared cores (aot_eager), more under inductor
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_debug_model_cp_compiled_per_block_matches_one_process(reference, backend):
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_compiled_cp_worker, 2, reference, backend, results, timeout_s=600)
    print(list(results))
    assert len(results) == 1
