"""Context-parallel KDA and GDN layers on 2 and 4 gloo ranks against the single-process layer on the same
global batch: outputs, final states, input gradients and all-reduced parameter gradients (float64)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from kdacp.cp.layout import TokenLayout, contiguous_layout, document_zigzag_layout, ranges_layout, zigzag_layout
from kdacp.cp import ContextParallel
from kdacp.layers import GatedDeltaNet, KimiDeltaAttention
from tests.helpers import count_signature_gathers, rel_err
from tests.multiprocess import run_ranks

TOL = 1e-9

# (mode, ulysses_size, H, HV, B, T per rank, cu_seqlens or None[, layer]). Sequence starts at and
# just after the shard boundaries exercise the convolution halo's masking.
CASES_2 = [
    ("state", None, 2, 4, 2, 40, None),
    ("state", None, 2, 4, 1, 48, [0, 3, 47, 50, 96]),
    ("ulysses", None, 2, 4, 2, 40, None),
    ("ulysses", None, 2, 4, 1, 48, [0, 3, 47, 49, 96]),
    ("state", None, 2, 4, 1, 48, [0, 3, 47, 50, 96], "gdn"),
    ("ulysses", None, 2, 4, 2, 40, None, "gdn"),
]
CASES_4 = [
    ("state", None, 2, 2, 1, 30, [0, 29, 31, 60, 120]),
    ("ulysses", None, 4, 4, 2, 24, None),
    ("hybrid", 2, 2, 4, 2, 24, None),
    ("hybrid", 2, 2, 4, 1, 30, [0, 29, 31, 58, 120]),
    ("hybrid", 2, 2, 4, 1, 30, [0, 29, 31, 58, 120], "gdn"),
]
LAYERS = {"kda": KimiDeltaAttention, "gdn": GatedDeltaNet}


def _layer(H, HV, seed=0, kind="kda"):
    torch.manual_seed(seed)
    layer = LAYERS[kind](32, H, HV, head_k_dim=16, head_v_dim=16, conv_bias=True, backend="torch").double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _single_process(case, world_size, T=None) -> dict:
    """The global batch (``T`` tokens per row, default ``T_local * world_size``), loss weights, and the
    single-process layer's outputs and gradients."""
    mode, ulysses_size, H, HV, B, T_local, cu, *kind = case
    N = B if cu is None else len(cu) - 1
    layer = _layer(H, HV, kind=kind[0] if kind else "kda")
    torch.manual_seed(1)
    x = torch.randn(B, T_local * world_size if T is None else T, 32, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(N, HV, 16, 16, dtype=torch.float64)).requires_grad_()
    w, w_state = torch.randn_like(x), torch.randn_like(h0)
    y, S = layer(x, cu_seqlens=None if cu is None else torch.tensor(cu), initial_state=h0, output_final_state=True)
    ((y * w).sum() + (S * w_state).sum()).backward()
    grads = {"dx": x.grad, "d initial_state": h0.grad, **{f"d {n}": p.grad for n, p in layer.named_parameters()}}
    return dict(x=x.detach(), h0=h0.detach(), w=w, w_state=w_state, y=y.detach(), S=S.detach(), grads=grads)


def _check_case(rank, world_size, case, ref):
    mode, ulysses_size, H, HV, B, T_local, cu, *kind = case
    cu = None if cu is None else torch.tensor(cu)
    layer = _layer(H, HV, kind=kind[0] if kind else "kda")
    layer.cp = ContextParallel(mode, ulysses_size=ulysses_size)
    own = slice(rank * T_local, (rank + 1) * T_local)
    where = f"{kind or 'kda'} {mode} (U={ulysses_size}, B={B}, packed={cu is not None}) rank {rank}"
    _check_rank(layer, ref, own, cu, rank, world_size, where)


def _check_rank(layer, ref, own, cu, rank, world_size, where):
    """This rank's tokens ``own`` of ``ref``'s input through ``layer``: its outputs, the final state, its input
    gradient and (summed over the ranks) the replicated initial state's and parameters' gradients."""
    x = ref["x"][:, own].clone().requires_grad_()
    h0 = ref["h0"].clone().requires_grad_()
    y, S = layer(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    # Every rank holds the final state; its gradients add up over ranks, so one rank carries its loss.
    loss_state = (S * ref["w_state"]).sum() if rank == world_size - 1 else 0.0
    ((y * ref["w"][:, own]).sum() + loss_state).backward()
    assert rel_err(y, ref["y"][:, own]) < TOL, f"output, {where}"
    assert rel_err(S, ref["S"]) < TOL, f"final state, {where}"
    assert rel_err(x.grad, ref["grads"]["dx"][:, own]) < TOL, f"dx, {where}"
    # Replicated inputs and parameters: each rank holds its share of the gradient.
    shared = {"d initial_state": h0.grad, **{f"d {n}": p.grad for n, p in layer.named_parameters()}}
    for name, grad in shared.items():
        dist.all_reduce(grad)
        assert rel_err(grad, ref["grads"][name]) < TOL, f"{name}, {where}"


def _check_checkpointing(rank, world_size, mode, ulysses_size):
    """Two checkpointed (non-reentrant) calls in flight, backwards in reverse order, give the gradients
    of plain calls: the recomputed forwards redo their exchanges in step on every rank."""
    layer = _layer(2, 4)
    layer.cp = ContextParallel(mode, ulysses_size=ulysses_size)
    cu = torch.tensor([0, 5, 24 * world_size - 1, 24 * world_size])
    torch.manual_seed(2 + rank)
    xs = [torch.randn(1, 24, 32, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ws = [torch.randn(1, 24, 32, dtype=torch.float64) for _ in range(2)]

    def loss(x, w, ckpt):
        def f(t):
            y, S = layer(t, cu_seqlens=cu, output_final_state=True)
            return (y * w).sum() + S.sum()
        return checkpoint(f, x, use_reentrant=False) if ckpt else f(x)

    plain = [torch.autograd.grad(loss(x, w, False), [x, *layer.parameters()]) for x, w in zip(xs, ws)]
    losses = [loss(x, w, True) for x, w in zip(xs, ws)]
    for i in (1, 0):
        for a, b in zip(torch.autograd.grad(losses[i], [xs[i], *layer.parameters()]), plain[i]):
            assert rel_err(a, b) < 1e-13, f"checkpointed {mode} call {i}, rank {rank}"


def _check_row_plan_checked_once(rank, world_size):
    """Unpacked rows reuse one plan per shape, so the ranks' agreement is gathered once, not per call."""
    with count_signature_gathers() as gathers:
        layer = _layer(2, 2)
        layer.cp = ContextParallel("state")
        x = torch.randn(2, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        y1, _ = layer(x)
        y2, _ = layer(x)
        assert len(gathers) == 1 and torch.equal(y1, y2)
        layer(x[:, :20])  # another shape: a new plan, checked once
        assert len(gathers) == 2


def _check_cases(rank, world_size, cases, refs, checkpoint_modes):
    for case, ref in zip(cases, refs):
        _check_case(rank, world_size, case, ref)
    for mode, ulysses_size in checkpoint_modes:
        _check_checkpointing(rank, world_size, mode, ulysses_size)
    if world_size == 2:
        _check_bad_arguments()
        _check_row_plan_checked_once(rank, world_size)
        _check_split_setting(rank, world_size, cases[1], refs[1])


def _check_split_setting(rank, world_size, case, ref):
    """``ContextParallel(split=...)`` reaches every layer's recurrence (over the layer's own), exact as uncut."""
    import kdacp.cp.schedule
    mode, ulysses_size, H, HV, B, T_local, cu, *kind = case
    seen, real = [], kdacp.cp.schedule.chunks_per_piece
    kdacp.cp.schedule.chunks_per_piece = lambda split, *a: seen.append(split) or real(split, *a)
    try:
        layer = _layer(H, HV)
        layer.split = 2
        layer.cp = ContextParallel(mode, split=3)
        assert "split=3" in repr(layer.cp)
        _check_rank(layer, ref, slice(rank * T_local, (rank + 1) * T_local), torch.tensor(cu), rank, world_size,
                    f"split=3 rank {rank}")
    finally:
        kdacp.cp.schedule.chunks_per_piece = real
    assert seen and set(seen) == {3}, seen
    with pytest.raises(ValueError, match="split must be"):
        ContextParallel("state", split="fast")


def _check_bad_arguments():
    with pytest.raises(ValueError, match="num_heads % 2 == 0"):
        KimiDeltaAttention(32, 1, 2, head_k_dim=16, head_v_dim=16, cp=ContextParallel("ulysses"))
    with pytest.raises(ValueError, match="ulysses_size"):
        ContextParallel("hybrid", ulysses_size=2)
    with pytest.raises(ValueError, match="needs layout='contiguous'"):
        ContextParallel("ulysses", layout="zigzag")
    with pytest.raises(ValueError, match="layout must be a TokenLayout, one of .* or a layout rule"):
        ContextParallel("state", layout="striped")
    # Raised before any exchange, on every rank: the layout gives each rank 10 tokens.
    layer = KimiDeltaAttention(32, 2, head_k_dim=16, head_v_dim=16,
                               cp=ContextParallel("state", layout=contiguous_layout(20, 2)))
    with pytest.raises(ValueError, match="local_length=12"):
        layer(torch.randn(1, 12, 32), cu_seqlens=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="mode='ulysses'.*needs layout='contiguous'"):
        ContextParallel("ulysses", layout=DocumentZigzagRule())
    layer.cp = ContextParallel("state", layout=lambda cu, world_size, device: "zigzag")
    with pytest.raises(TypeError, match="must return a TokenLayout, got str"):
        layer(torch.randn(1, 10, 32), cu_seqlens=torch.tensor([0, 20]))


@dataclass(frozen=True)
class DocumentZigzagRule:
    """A layout rule, as torchtitan's load balancers are: each batch's layout made from its boundaries."""

    def __call__(self, cu_seqlens, world_size: int, device) -> TokenLayout:
        return document_zigzag_layout(cu_seqlens, world_size)


def _resolved(layout, cu, world_size: int) -> TokenLayout:
    return layout if isinstance(layout, TokenLayout) else layout(tuple(cu), world_size, None)


# Under other layouts, mode "state": (name, layout or layout rule, B, cu_seqlens or None, layer). Per-document zigzag with
# documents shorter than W (1 and 2 tokens) and longer than a rank's range; random uneven ranges with a range of
# one token.
LAYOUT_CASES = {
    2: [("zigzag rows", zigzag_layout(44, 2), 2, None, "kda"),
        ("document zigzag", document_zigzag_layout([0, 1, 3, 30, 48], 2), 1, [0, 1, 3, 30, 48], "gdn"),
        ("random ranges", ranges_layout([[(0, 13), (14, 15), (29, 40)], [(13, 14), (15, 29), (40, 45)]]), 1,
         [0, 14, 16, 45], "kda"),
        ("document zigzag by a rule", DocumentZigzagRule(), 1, [0, 4, 10, 40], "kda")],
    3: [("zigzag packed", zigzag_layout(48, 3), 1, [0, 5, 20, 21, 48], "kda"),
        ("random ranges rows", ranges_layout([[(0, 9), (20, 21), (30, 36)], [(9, 17), (21, 22), (36, 41)],
                                              [(17, 20), (22, 30)]]), 2, None, "gdn")],
}


def _check_layout_cases(rank, world_size, cases, refs):
    for (name, layout, B, cu, kind), ref in zip(cases, refs):
        cu = None if cu is None else torch.tensor(cu)
        layer = _layer(2, 4, kind=kind)
        layer.cp = ContextParallel("state", layout=layout)
        own = _resolved(layout, cu.tolist() if cu is not None else None, world_size).local_token_index(rank)
        _check_rank(layer, ref, own, cu, rank, world_size,
                    f"{kind} {name} rank {rank} of {world_size}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_cp_layouts(world_size):
    cases = LAYOUT_CASES[world_size]
    layouts = [_resolved(layout, cu, world_size) for _, layout, _, cu, _ in cases]
    refs = [_single_process(("state", None, 2, 4, B, layout.num_tokens // world_size, cu, kind), world_size,
                            T=layout.num_tokens) for layout, (_, _, B, cu, kind) in zip(layouts, cases)]
    run_ranks(_check_layout_cases, world_size, cases, refs)


def test_layer_cp_2_ranks():
    refs = [_single_process(case, 2) for case in CASES_2]
    run_ranks(_check_cases, 2, CASES_2, refs, [("state", None), ("ulysses", None)])


@pytest.mark.slow
def test_layer_cp_4_ranks():
    refs = [_single_process(case, 4) for case in CASES_4]
    run_ranks(_check_cases, 4, CASES_4, refs, [("hybrid", 2)])
