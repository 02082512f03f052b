"""kdacp's Gated DeltaNet in Megatron-Core 0.19.2 (:mod:`kdacp.integrations.megatron`) against Megatron's own
``GatedDeltaNet`` at cp = 1, on real ranks (gloo, float32): outputs, the input gradient and every parameter
gradient, on unpacked rows and on THD-packed documents cut across ranks, each rank holding Megatron's zigzag
shard; and a ``GPTModel`` of two such layers at cp = P against cp = 1.

And Megatron's ``dist_checkpointing``: such a ``GPTModel`` saved at one cp degree and loaded at another.

Megatron's GDN calls FLA's CUDA kernels; on CPU its reference runs with plain-PyTorch stand-ins of the same
contracts (:func:`kdacp.integrations.megatron.fla_stand_ins`). Skipped without megatron-core (see the skip reason
for the install line).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytestmark = pytest.mark.integration  # not in the default run: .ci/run runs it in its own environment
pytest.importorskip("megatron.core", reason="needs megatron-core 0.19.2: pip install -e '.[megatron]' (Python "
                    ">= 3.12) or, on 3.11, pip install --no-deps --ignore-requires-python megatron-core==0.19.2")

from tests.helpers import rel_err, zeroed_outputs  # noqa: E402
from tests.multiprocess import run_command, run_ranks  # noqa: E402

TOL = 1e-5
# float32 on both sides; under TP x CP, A_log's gradient (a sum over every token of its heads) is reduced over
# the CP group in another order than one rank's: 1.16e-5 at tp = cp = 2 (the rest below TOL)
TP_TOL = 3e-5
S = 128                       # global tokens of a row
ROWS = 2                      # unpacked rows
DOCUMENTS = (40, 8, 56, 24)   # THD: each divides by 2 x 4; on 2 ranks 56 crosses, on 4 ranks 40 and 56 do
SHAPE = dict(hidden_size=32, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_conv_kernel_dim=4)  # cp = 4 > 2 key heads


@pytest.fixture(autouse=True, scope="module")
def _no_torch_compile():
    """Megatron's fused functions are torch.compile'd on first call: off for this module's tests in this process
    (restored after it, so that the rest of a run compiles), and in every rank (:func:`_megatron_cpu`)."""
    import torch._dynamo
    with torch._dynamo.config.patch(disable=True):
        yield


def _megatron_cpu():
    """Megatron on CPU in this process: no torch.compile (a rank may start from a server that imported torch)."""
    import torch._dynamo
    torch._dynamo.config.disable = True


def config(P: int, num_layers: int = 1):
    from kdacp.integrations.megatron import KdacpTransformerConfig
    return KdacpTransformerConfig(
        num_layers=num_layers, num_attention_heads=2, ffn_hidden_size=64, use_cpu_initialization=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1] * num_layers,
        normalization="RMSNorm", activation_func=F.silu, gated_linear_unit=True, params_dtype=torch.float32,
        context_parallel_size=P, hidden_dropout=0.0, attention_dropout=0.0, **SHAPE)


_RANK_LIFETIME = contextlib.ExitStack()  # what a rank enters for the rest of its life (never closed)


def megatron_reference_kernels():
    """Megatron's GDN on plain-PyTorch stand-ins of its FLA calls, for the rest of this rank's life."""
    from kdacp.integrations import megatron as km
    _RANK_LIFETIME.enter_context(km.fla_stand_ins())


def long_memory_gates(module, generator):
    """Decays near 1 (``-exp(A_log) softplus(.)`` about -0.01 a token), so that state crosses rank edges."""
    with torch.no_grad():
        module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.05, 0.3, generator=generator).log())
        module.dt_bias.copy_(torch.empty_like(module.dt_bias).uniform_(-3, -1, generator=generator))


def zigzag_index(P: int, rank: int, cu_seqlens) -> torch.Tensor:
    """Global token indices of ``rank``'s zigzag shard: per document ``2P`` chunks, chunks ``rank`` and
    ``2P-1-rank`` (Megatron's THD layout; for one document, its per-sequence one)."""
    parts = []
    for s, e in zip(cu_seqlens, cu_seqlens[1:]):
        c = (e - s) // (2 * P)
        parts += [torch.arange(s + rank * c, s + (rank + 1) * c),
                  torch.arange(s + (2 * P - 1 - rank) * c, s + (2 * P - rank) * c)]
    return torch.cat(parts)


def single_rank_groups():
    """This rank's one-rank group (every rank creates all of them, in one order)."""
    own = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        if r == dist.get_rank():
            own = group
    return own


def build_gdn(module_class, cfg, tp, cp):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from kdacp.integrations import megatron as km
    spec = km.get_gated_delta_net_module_spec(cfg, LocalSpecProvider())
    spec.module = module_class
    if module_class is not km.KdacpGatedDeltaNet:
        spec.params = {}
    with km.cpu_stand_ins():
        return build_module(spec, config=cfg, layer_number=1, pg_collection=ProcessGroupCollection(tp=tp, cp=cp))


def _packed_params(cu):
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(DOCUMENTS),
                           max_seqlen_kv=max(DOCUMENTS))


def _run(module, x, weight, packed_seq_params):
    """Output and the gradients of ``sum(out * weight)``: input and parameters."""
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    out, bias = module(x, None, packed_seq_params=packed_seq_params)
    assert bias is None
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _errors(module, ref, index, x, weight, psp):
    out, dx, grads = _run(module, x[index], weight[index], psp)
    for g in grads.values():
        dist.all_reduce(g)
    return {"output": rel_err(out, ref[0][index]), "input grad": rel_err(dx, ref[1][index]),
            **{n: rel_err(g, ref[2][n]) for n, g in grads.items()}}


def _layer_worker(rank, P, check_removal, results):
    _megatron_cpu()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from kdacp.cp.exchanges import P2PExchange
    from kdacp.integrations import megatron as km
    from kdacp.cp import batch_context
    megatron_reference_kernels()
    own = single_rank_groups()
    torch.manual_seed(0)
    reference = build_gdn(GatedDeltaNet, config(1), own, own)
    long_memory_gates(reference, torch.Generator().manual_seed(1))
    ours = build_gdn(km.KdacpGatedDeltaNet, config(P), own, dist.group.WORLD)
    ours.load_state_dict(reference.state_dict())  # same keys and shapes, strictly
    g = torch.Generator().manual_seed(2)
    cases = {"rows": (torch.randn(S, ROWS, 32, generator=g), torch.randn(S, ROWS, 32, generator=g), None,
                      (0, S)),
             "thd": (torch.randn(S, 1, 32, generator=g), torch.randn(S, 1, 32, generator=g),
                     _packed_params([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()]), None)}
    for case, (x, weight, psp, cu) in cases.items():
        cu = cu if psp is None else tuple(psp.cu_seqlens_q.tolist())
        ref = _run(reference, x, weight, psp)
        index = zigzag_index(P, rank, cu)
        errs = _errors(ours, ref, index, x, weight, psp)
        name, worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst < TOL, f"{case}, cp={P}: {name} off by {worst:.2e} (rank {rank})"
        if rank == 0:
            results.append((case, "kdacp", name, worst))
        if P == 1 and case == "thd":
            _check_split(ours, ref, index, x, weight, psp)
        if not check_removal:
            continue
        # Each mechanism removed in turn: the state exchange through the zigzag chain and the halo from whichever
        # rank holds the tokens before a chunk (messages still flow, their content zeroed). Each leaves the tolerance.
        removals = (("state exchange", P2PExchange, "receive", zeroed_outputs),
                    ("halo", batch_context, "exchange_rows", zeroed_outputs))
        for what, owner, attr, broken in removals:
            real = getattr(owner, attr)
            setattr(owner, attr, broken(real))
            try:
                errs = _errors(ours, ref, index, x, weight, psp)
            finally:
                setattr(owner, attr, real)
            name, worst = max(errs.items(), key=lambda kv: kv[1])
            assert worst > 100 * TOL, f"{case}: removing the {what} went unnoticed at cp={P}"
            if rank == 0:
                results.append((case, f"without {what}", name, worst))


def _check_split(ours, ref, index, x, weight, psp):
    """``split=`` reaches the recurrence (the schedule sees it) and the layer stays within tolerance, cut."""
    import kdacp.cp.schedule
    seen, real = [], kdacp.cp.schedule.chunks_per_piece
    kdacp.cp.schedule.chunks_per_piece = lambda split, *a: seen.append(split) or real(split, *a)
    ours.split = 3
    try:
        errs = _errors(ours, ref, index, x, weight, psp)
    finally:
        kdacp.cp.schedule.chunks_per_piece, ours.split = real, None
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst < TOL and set(seen) == {3}, (name, worst, seen)


@pytest.mark.parametrize("P", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_layer_matches_megatron_gdn(P):
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_layer_worker, P, P == 2, results, timeout_s=600)
    print(list(results))
    assert len(results) == (6 if P == 2 else 2)


VOCAB, STEPS, LR = 64, 3, 0.5


def _gpt(cfg, pg, state=None):
    """A ``GPTModel`` of kdacp GDN layers (Megatron's hybrid spec, MLPs dense), seeded, or loading ``state``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel

    from kdacp.integrations import megatron as km
    torch.manual_seed(0)
    with km.cpu_stand_ins():
        model = GPTModel(config=cfg, transformer_layer_spec=km.get_hybrid_block_spec(cfg, LocalSpecProvider()),
                         vocab_size=VOCAB, max_sequence_length=S, position_embedding_type="none", pg_collection=pg)
    if state is None:
        g = torch.Generator().manual_seed(1)
        for module in model.modules():
            if isinstance(module, km.KdacpGatedDeltaNet):
                long_memory_gates(module, g)
    else:
        model.load_state_dict(state)
    return model


def _train(model, tokens, labels, psp, total, group):
    """``STEPS`` SGD steps on the mean token loss over ``total`` tokens (gradients summed over ``group``, as
    Megatron's DDP does over dp x cp); the losses and the first step's gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(tokens, None, None, labels=labels, packed_seq_params=psp).sum() / total
        loss.backward()
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        losses.append(loss)
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return torch.stack(losses), first


def _gpt_worker(rank, P, results):
    _megatron_cpu()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    own = single_rank_groups()
    parallel_state.initialize_model_parallel(context_parallel_size=P)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    one = ProcessGroupCollection.use_mpu_process_groups()
    one.cp = own
    reference = _gpt(config(1, num_layers=2), one)
    ours = _gpt(config(P, num_layers=2), pg, reference.state_dict())
    g = torch.Generator().manual_seed(3)
    cu = (0, *torch.tensor(DOCUMENTS).cumsum(0).tolist())
    for case, rows, psp in (("rows", ROWS, None), ("thd", 1, _packed_params(cu))):
        tokens, labels = (torch.randint(0, VOCAB, (rows, S), generator=g) for _ in range(2))
        state = reference.state_dict()
        ref_losses, ref_grads = _train(reference, tokens, labels, psp, labels.numel(), None)
        reference.load_state_dict(state)
        index = zigzag_index(P, rank, cu if psp is not None else (0, S))
        losses, grads = _train(ours, tokens[:, index], labels[:, index], psp, labels.numel(), pg.cp)
        ours.load_state_dict(state)
        errs = {"losses": rel_err(losses, ref_losses), **{n: rel_err(g, ref_grads[n]) for n, g in grads.items()}}
        name, worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst < TOL, f"GPTModel {case}, cp={P}: {name} off by {worst:.2e} (rank {rank})"
        if rank == 0:
            results.append((case, name, worst))


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gpt_model_matches_one_rank(P):
    """Two kdacp GDN layers in a GPTModel: three SGD steps at cp = P equal cp = 1 (losses, first gradients)."""
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_gpt_worker, P, results, timeout_s=600)
    print(list(results))
    assert len(results) == 2


def test_config_allows_cp_past_the_head_count():
    from megatron.core.transformer import TransformerConfig

    from kdacp.integrations.megatron import KdacpTransformerConfig
    cfg = config(4)  # 2 key heads, cp = 4
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.context_parallel_size) == (2, 4, 4)
    fields = {f: getattr(cfg, f) for f in ("num_layers", "hidden_size", "num_attention_heads", "linear_attention_freq",
                                           "experimental_attention_variant", *SHAPE)}
    with pytest.raises(AssertionError, match="linear_num_key_heads"):
        TransformerConfig(context_parallel_size=4, **fields)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4"):
        KdacpTransformerConfig(tensor_model_parallel_size=4, **fields)


def test_refusals_name_the_setting():
    """What kdacp's GDN does not run is refused at construction or before any exchange, naming the setting."""
    from types import SimpleNamespace

    from kdacp.integrations import megatron as km

    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

    good = dict(sequence_parallel=False, activation_func=F.silu, recompute_granularity=None, recompute_modules=[],
                fp8=None, linear_num_key_heads=2, linear_num_value_heads=4)
    pg = SimpleNamespace(tp=Group(2), cp=Group(8))
    km._check_supported(SimpleNamespace(**good), pg)
    cases = [(dict(sequence_parallel=True), "sequence_parallel=True"),
             (dict(activation_func=F.gelu), "activation_func"),
             (dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"]), "gdn_norm_out"),
             (dict(fp8="hybrid"), "fp8")]
    for change, message in cases:
        with pytest.raises(NotImplementedError, match=message):
            km._check_supported(SimpleNamespace(**{**good, **change}), pg)
    with pytest.raises(ValueError, match="pg_collection"):
        km._check_supported(SimpleNamespace(**good), None)

    from megatron.core.packed_seq_params import PackedSeqParams
    module = SimpleNamespace(cp_size=2)
    cu = torch.tensor([0, 8, 14, 32], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match=r"lengths \[6, 18\] do not divide by 4"):
        km.KdacpGatedDeltaNet._global_cu_seqlens(module, psp, 1, 32)
    with pytest.raises(ValueError, match="b == 1"):
        km.KdacpGatedDeltaNet._global_cu_seqlens(module, psp, 2, 32)
    with pytest.raises(ValueError, match="global token count 64"):
        km.KdacpGatedDeltaNet._global_cu_seqlens(module, psp, 1, 64)


def test_thd_boundaries_are_read_once_per_tensor(monkeypatch):
    """Every layer of a step gets one boundaries tensor: its values are read on the host (a device sync on a GPU)
    by the first layer's check only; a new tensor, or the same one changed in place, is read again, and a bad one
    is refused on every call."""
    from types import SimpleNamespace

    from megatron.core.packed_seq_params import PackedSeqParams

    from kdacp.integrations import megatron as km
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t) or tolist(t))
    module = SimpleNamespace(cp_size=2)

    def check(cu):
        return km.KdacpGatedDeltaNet._global_cu_seqlens(
            module, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), 1, 32)

    cu = torch.tensor([0, 8, 32], dtype=torch.int32)
    for _ in range(3):
        assert check(cu) is cu
    assert len(reads) == 1
    cu[1] = 12
    check(cu)
    check(torch.tensor([0, 8, 32], dtype=torch.int32))
    assert len(reads) == 3
    bad = torch.tensor([0, 6, 32], dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match="do not divide by 4"):
            check(bad)


def test_hybrid_specs_swap_the_gdn_mixers():
    """Megatron's hybrid layer specs with kdacp's GDN mixers, with an input norm where the backend fuses none
    (Megatron's local one). With attention layers (Qwen3-Next: one in four) Megatron's hybrid stack needs
    Transformer Engine's spec, which the local backend has not: refused by name."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.identity_op import IdentityOp

    from kdacp.integrations import megatron as km
    cfg = config(2, num_layers=4)
    specs = km.get_hybrid_layer_specs(cfg, LocalSpecProvider(), strategy="scan", split="auto")
    assert len(specs) == 4
    for spec in specs:
        mixer = spec.submodules.self_attention
        assert mixer.module is km.KdacpGatedDeltaNet and mixer.params["strategy"] == "scan"
        assert mixer.params["split"] == "auto"
        assert mixer.submodules.in_proj is not None and spec.submodules.input_layernorm is not IdentityOp
    assert len(km.get_hybrid_block_spec(cfg, LocalSpecProvider(), pp_rank=0).layer_specs) == 4
    cfg.linear_attention_freq = 4
    with pytest.raises(NotImplementedError, match="Transformer Engine"):
        km.get_hybrid_layer_specs(cfg, LocalSpecProvider())
    cfg.experimental_attention_variant = None
    with pytest.raises(ValueError, match="experimental_attention_variant"):
        km.get_hybrid_layer_specs(cfg, LocalSpecProvider())


def tp_shard(name: str, full: torch.Tensor, module, t: int, tp: int) -> torch.Tensor:
    """TP rank ``t``'s part of the one-rank parameter (or gradient) ``name`` of a GDN: ``in_proj`` and ``conv1d``
    split per section (q, k, v, z, beta, alpha / q, k, v), ``A_log``, ``dt_bias`` and ``out_proj`` by heads."""
    qk, v, hv = module.qk_dim, module.v_dim, module.num_value_heads
    sections = {"in_proj.weight": [qk, qk, v, v, hv, hv], "conv1d.weight": [qk, qk, v]}.get(name)
    if sections is not None:
        return torch.cat([part.chunk(tp)[t] for part in full.split(sections)])
    if name in ("A_log", "dt_bias"):
        return full.chunk(tp)[t]
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[t]
    return full  # out_norm.weight: replicated


def _tp_worker(rank, world_size, tp, results):
    """Ranks ``c*tp ... c*tp+tp-1`` form TP group ``c``; ranks with one TP index form a CP group."""
    _megatron_cpu()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from kdacp.integrations import megatron as km
    megatron_reference_kernels()
    P = world_size // tp
    own = single_rank_groups()
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp))) for c in range(P)]
    cp_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    t, c = rank % tp, rank // tp
    torch.manual_seed(0)
    reference = build_gdn(GatedDeltaNet, config(1), own, own)
    long_memory_gates(reference, torch.Generator().manual_seed(1))
    cfg = config(P)
    cfg.tensor_model_parallel_size = tp
    ours = build_gdn(km.KdacpGatedDeltaNet, cfg, tp_groups[c], cp_groups[t])
    ours.load_state_dict({n: tp_shard(n, p, reference, t, tp) for n, p in reference.state_dict().items()})
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(S, 1, 32, generator=g), torch.randn(S, 1, 32, generator=g)
    cu = (0, *torch.tensor(DOCUMENTS).cumsum(0).tolist())
    psp = _packed_params(list(cu))
    ref = _run(reference, x, weight, psp)
    index = zigzag_index(P, c, cu)
    out, dx, grads = _run(ours, x[index], weight[index], psp)
    errs = {"output": rel_err(out, ref[0][index]), "input grad": rel_err(dx, ref[1][index])}
    for n, grad in grads.items():
        dist.all_reduce(grad, group=cp_groups[t])
        if n == "out_norm.weight":  # shared by all heads: each TP rank holds its own heads' share (as Megatron's)
            dist.all_reduce(grad, group=tp_groups[c])
        errs[n] = rel_err(grad, tp_shard(n, ref[2][n], reference, t, tp))
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    assert worst < TP_TOL, f"tp={tp}, cp={P}: {name} off by {worst:.2e} (rank {rank})"
    if rank == 0:
        results.append((name, worst))


@pytest.mark.slow  # four ranks
def test_tensor_parallel_heads_match_megatron_gdn():
    """tp = 2 x cp = 2 on THD-packed documents: each TP rank's heads, outputs and gradients, equal the one-rank
    Megatron GDN's."""
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_tp_worker, 4, 2, results, timeout_s=600)
    print(list(results))
    assert len(results) == 1


def _sharded_specs(sharded_state_dict) -> dict:
    """What Megatron's ``dist_checkpointing`` writes and reads for each entry of a sharded state dict: after its
    factories (the per-section split of ``in_proj`` and ``conv1d``), each ``ShardedTensor``'s key, global shape,
    offset, fragmentation, replica id, dtype and local shape."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    apply_factories(sharded_state_dict)
    return {(t.key, t.global_offset): (t.global_shape, t.axis_fragmentations, t.replica_id, t.dtype,
                                       tuple(t.data.shape))
            for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)}


def _checkpoint_worker(rank, P, directory, load, results):
    """At cp = P, a kdacp-GDN ``GPTModel`` either trains a step and saves itself with Megatron's
    ``dist_checkpointing`` (``load=False``), or loads what was saved (``load=True``, its own parameters first
    scrambled); then it trains ``STEPS`` more. Rank 0 reports the parameters after save or load and the losses."""
    _megatron_cpu()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from kdacp.integrations import megatron as km
    parallel_state.initialize_model_parallel(context_parallel_size=P)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    model = _gpt(config(P, num_layers=2), pg)
    g = torch.Generator().manual_seed(4)
    cu = (0, *torch.tensor(DOCUMENTS).cumsum(0).tolist())
    index = zigzag_index(P, rank, cu)
    first, after = ([torch.randint(0, VOCAB, (1, S), generator=g) for _ in range(2)] for _ in range(2))
    psp = _packed_params(list(cu))
    if load:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        with km.cpu_stand_ins():
            loaded = dist_checkpointing.load(model.sharded_state_dict(), directory)
        model.load_state_dict(loaded)
    else:
        tokens, labels = first
        _train(model, tokens[:, index], labels[:, index], psp, labels.numel(), pg.cp)
        with km.cpu_stand_ins():
            dist_checkpointing.save(model.sharded_state_dict(), directory)
        # save leaves a multiprocessing Manager (its write-results queue) running, which a rank ending without
        # interpreter shutdown would leave behind
        for child in multiprocessing.active_children():
            child.terminate()
            child.join()
        # The kdacp GDN's checkpoint entries are Megatron's GDN's, entry by entry (here at a cp Megatron runs).
        tp = pg.tp
        with km.fla_stand_ins():  # Megatron's GDN refuses to be built where FLA is not installed
            specs = [_sharded_specs(build_gdn(cls, config(P), tp, pg.cp).sharded_state_dict(
                         prefix="mixer.", metadata={"dp_cp_group": pg.dp_cp}))
                     for cls in (GatedDeltaNet, km.KdacpGatedDeltaNet)]
        assert specs[0] == specs[1] and len(specs[0]) >= 9, (specs[0].keys(), specs[1].keys())
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels = after
    losses, _ = _train(model, tokens[:, index], labels[:, index], psp, labels.numel(), pg.cp)
    if rank == 0:
        results.append((state, losses))


@pytest.mark.parametrize("saved, loaded", [(1, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_dist_checkpoint_reshards_across_cp(tmp_path, saved, loaded):
    """A kdacp-GDN ``GPTModel`` saved with Megatron's ``dist_checkpointing`` at cp = ``saved`` (after a step) and
    loaded at cp = ``loaded``: the same parameters, bit for bit, and the same losses over the next steps."""
    pytest.importorskip("psutil", reason="Megatron-Core 0.19.2's dist_checkpointing.save imports psutil (not among "
                        "its declared dependencies): pip install psutil")
    results = torch.multiprocessing.get_context("spawn").Manager().list()
    run_ranks(_checkpoint_worker, saved, str(tmp_path), False, results, timeout_s=600)
    run_ranks(_checkpoint_worker, loaded, str(tmp_path), True, results, timeout_s=600)
    (state, losses), (state_loaded, losses_loaded) = results
    assert state.keys() == state_loaded.keys()
    different = [n for n in state if not torch.equal(state[n], state_loaded[n])]
    assert not different, f"parameters differ after loading at cp={loaded}: {different}"
    err = rel_err(losses_loaded, losses)
    print(losses.tolist(), losses_loaded.tolist(), err)
    assert err < TOL, f"losses after loading at cp={loaded} off by {err:.2e}"


@pytest.mark.parametrize("nproc, extra", [(2, ()), pytest.param(4, ("--packed",), marks=pytest.mark.slow)])
def test_the_example_trains_under_torchrun(nproc, extra):
    """``examples/megatron_gdn_cp.py`` under ``torchrun`` on CPU (gloo): cp = 2, and cp = 4 (past the example
    model's 2 key heads) on THD-packed documents; every step's loss printed and finite, and the task learnt
    (the loss more than halved over 4 steps)."""
    from kdacp.workers import free_port
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    run = run_command([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                       f"--master-port={free_port()}", str(root / "examples" / "megatron_gdn_cp.py"), "--steps", "4",
                       *extra], timeout_s=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+  loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses), run.stdout
    assert losses[-1] < 0.5 * losses[0], run.stdout
