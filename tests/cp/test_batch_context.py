"""The per-batch context's short-convolution halo under token layouts: each rank's convolution of its ranges,
with the halos :meth:`CPContext.left_halos` fetches, against the one-process convolution of the whole batch
(outputs, input and parameter gradients, float64 at 1e-12), on 2 and 3 gloo ranks; and the per-range halo
contract of :func:`causal_conv1d` on one process (its PyTorch path in float64, its Triton kernels in float32)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kdacp.cp.layout import document_zigzag_layout, ranges_layout, zigzag_layout
from kdacp.cp import build_cp_context
from kdacp.layers import causal_conv1d
from tests.helpers import rel_err
from tests.multiprocess import run_ranks

TOL = 1e-12
W, D = 4, 6

# (name, layout, cu_seqlens or None, rows). The random ranges hold a range of one token (shorter than W-1), whose
# successor's halo comes from three ranks (P=3) or from this rank and another (P=2); documents of one and two
# tokens (shorter than W-1) and document edges next to range edges.
CASES = {
    2: [
        ("zigzag rows", zigzag_layout(22, 2), None, 2),
        ("zigzag packed", zigzag_layout(22, 2), [0, 2, 9, 10, 22], 1),
        ("document zigzag", document_zigzag_layout([0, 1, 3, 12, 25], 2), [0, 1, 3, 12, 25], 1),
        ("random ranges", ranges_layout([[(0, 3), (4, 5), (9, 16)], [(3, 4), (5, 9), (16, 21)]]), [0, 4, 6, 21], 1),
        ("random ranges rows", ranges_layout([[(0, 3), (4, 5), (9, 16)], [(3, 4), (5, 9), (16, 21)]]), None, 2),
    ],
    3: [
        ("zigzag rows", zigzag_layout(31, 3), None, 2),
        ("document zigzag", document_zigzag_layout([0, 2, 14, 15, 40], 3), [0, 2, 14, 15, 40], 1),
        ("random ranges", ranges_layout([[(0, 5), (11, 12), (20, 24)], [(5, 9), (12, 13), (24, 29)],
                                         [(9, 11), (13, 20)]]), [0, 2, 11, 14, 29], 1),
    ],
}


def _reference(layout, cu, rows, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, layout.num_tokens, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(D, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(rows, layout.num_tokens, D, generator=gen, dtype=torch.float64)
    y = causal_conv1d(x, weight, bias, cu_seqlens=None if cu is None else torch.tensor(cu))
    (y * w).sum().backward()
    return dict(x=x.detach(), weight=weight.detach(), bias=bias.detach(), w=w, y=y.detach(), dx=x.grad,
                dweight=weight.grad, dbias=bias.grad)


def _check(rank, world_size, cases, refs):
    for (name, layout, cu, rows), ref in zip(cases, refs):
        own = layout.local_token_index(rank)
        context = build_cp_context(None if cu is None else torch.tensor(cu), local_length=len(own), batch_size=rows,
                                   layout=layout, group=dist.group.WORLD, with_plan=False)
        x = ref["x"][:, own].clone().requires_grad_()
        weight, bias = (ref[n].clone().requires_grad_() for n in ("weight", "bias"))
        (halo,) = context.left_halos([x], W - 1)
        assert halo.shape == (rows, len(layout.ranges[rank]), W - 1, D)
        y = causal_conv1d(x, weight, bias, halo=halo, cu_seqlens=context.local_cu_seqlens,
                          cu_seqlens_cpu=context.local_cu_seqlens_cpu, range_starts=context.range_starts)
        (y * ref["w"][:, own]).sum().backward()
        where = f"{name}, P={world_size}, rank {rank}"
        assert rel_err(y, ref["y"][:, own]) < TOL, f"output, {where}"
        assert rel_err(x.grad, ref["dx"][:, own]) < TOL, f"dx, {where}"
        for n, p in (("dweight", weight), ("dbias", bias)):
            dist.all_reduce(p.grad)
            assert rel_err(p.grad, ref[n]) < TOL, f"{n}, {where}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_halo_per_range_matches_one_process(world_size):
    cases = CASES[world_size]
    refs = [_reference(layout, cu, rows, seed) for seed, (_, layout, cu, rows) in enumerate(cases)]
    run_ranks(_check, world_size, cases, refs)


@pytest.mark.slow
def test_halo_per_range_4_ranks():
    cases = [("zigzag rows", zigzag_layout(45, 4), None, 2),
             ("document zigzag", document_zigzag_layout([0, 3, 20, 21, 50], 4), [0, 3, 20, 21, 50], 1)]
    refs = [_reference(layout, cu, rows, seed) for seed, (_, layout, cu, rows) in enumerate(cases)]
    run_ranks(_check, 4, cases, refs)


@pytest.mark.parametrize("fused, dtype, tol, device", [
    (False, torch.float64, 1e-13, "cpu"), (True, torch.float32, 1e-5, "cpu"),
    pytest.param(True, torch.float32, 1e-5, "cuda", marks=pytest.mark.gpu)])
def test_conv_with_a_halo_per_range_equals_the_whole_convolution(fused, dtype, tol, device):
    """Three ranges of one rank (the middle one a single token) with halos cut from the whole sequence, the
    PyTorch path and the Triton kernels (under the interpreter on CPU, compiled on a GPU): the ranges' outputs
    and gradients."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    T, rows = 30, 2
    x = torch.randn(rows, T, D, generator=gen, dtype=dtype).to(device).requires_grad_()
    weight, bias = (t.to(device) for t in (torch.randn(D, W, generator=gen, dtype=dtype),
                                           torch.randn(D, generator=gen, dtype=dtype)))
    ranges = [(3, 9), (13, 14), (20, 27)]  # W-1 or more apart: a halo token feeds only its range's outputs
    full = causal_conv1d(x, weight, bias)
    own = torch.cat([torch.arange(s, e) for s, e in ranges]).to(device)
    x_own = x.detach()[:, own].clone().requires_grad_()
    halo = torch.stack([x.detach()[:, s - W + 1:s] for s, _ in ranges], dim=1).requires_grad_()
    cu = torch.tensor([0, 6, 7, 14])
    y = causal_conv1d(x_own, weight, bias, halo=halo, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu, fused=fused,
                      range_starts=(0, 6, 7))
    assert rel_err(y, full[:, own]) < tol
    w = torch.randn(y.shape, generator=gen, dtype=dtype).to(device)
    (dx,) = torch.autograd.grad((full * torch.zeros_like(full).index_copy(1, own, w)).sum(), x)
    (y * w).sum().backward()
    assert rel_err(x_own.grad, dx[:, own]) < tol
    for k, (s, _) in enumerate(ranges):
        assert rel_err(halo.grad[:, k], dx[:, s - W + 1:s]) < tol


def test_halo_arguments_are_checked():
    x, weight = torch.randn(1, 10, D), torch.randn(D, W)
    with pytest.raises(ValueError, match="one range start per range"):
        causal_conv1d(x, weight, halo=torch.zeros(1, 2, W - 1, D), range_starts=(0,))
    with pytest.raises(ValueError, match="needs cu_seqlens_cpu"):
        causal_conv1d(x, weight, halo=torch.zeros(1, 2, W - 1, D), range_starts=(0, 4))
    with pytest.raises(ValueError, match="every range start must be a boundary"):
        causal_conv1d(x, weight, halo=torch.zeros(1, 2, W - 1, D), range_starts=(0, 4),
                      cu_seqlens_cpu=torch.tensor([0, 5, 10]))


def test_context_refuses_a_layout_that_gives_this_rank_other_tokens():
    with pytest.raises(ValueError, match="local_length=5"):
        build_cp_context(torch.tensor([0, 10]), local_length=5, layout=ranges_layout([[(0, 10)]]))


def test_a_token_mixers_context_of_one_sequence_holds_no_device_tensor(monkeypatch):
    """Built for one sequence on one device, the context makes no device tensor (its first use may be inside
    Inductor's CUDA-graph pool, where a tensor it keeps would be left untracked); the token positions softmax
    attention masks with are made at their first use, right."""
    import kdacp.cp.batch_context as batch_context
    made = []
    monkeypatch.setattr(batch_context, "to_device", lambda host, device: made.append(host) or host.clone())
    context = build_cp_context(None, local_length=12, batch_size=2)
    assert made == []
    assert torch.equal(context.token_index, torch.arange(12)) and len(made) == 1
