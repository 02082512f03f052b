"""Context-parallel KDA layer on 2 and 4 gloo ranks against the single-process layer on the same
global batch: outputs, final states, input gradients and all-reduced parameter gradients (float64)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from kdacp.layers import KDAContextParallel, KimiDeltaAttention
from tests.helpers import rel_err
from tests.layers.multiprocess import run_ranks

TOL = 1e-9

# (mode, ulysses_size, H, HV, B, T per rank, cu_seqlens or None). Sequence starts at and just
# after the shard boundaries exercise the convolution halo's masking.
CASES_2 = [
    ("state", None, 2, 4, 2, 40, None),
    ("state", None, 2, 4, 1, 48, [0, 3, 47, 48, 50, 70, 96]),
    ("ulysses", None, 2, 4, 2, 40, None),
    ("ulysses", None, 2, 4, 1, 48, [0, 3, 47, 48, 50, 70, 96]),
]
CASES_4 = [
    ("state", None, 2, 2, 1, 30, [0, 29, 31, 61, 62, 100, 120]),
    ("ulysses", None, 4, 4, 1, 30, [0, 29, 31, 61, 62, 100, 120]),
    ("hybrid", 2, 2, 4, 2, 24, None),
    ("hybrid", 2, 2, 4, 1, 30, [0, 29, 31, 61, 62, 100, 120]),
]


def _layer(H, HV, seed=0):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(32, H, HV, head_k_dim=16, head_v_dim=16, conv_bias=True, backend="torch").double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _check_case(rank, world_size, case):
    mode, ulysses_size, H, HV, B, T_local, cu = case
    T = T_local * world_size
    cu = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    ref = _layer(H, HV)
    layer = copy.deepcopy(ref)
    layer.cp = KDAContextParallel(mode, ulysses_size=ulysses_size)
    torch.manual_seed(1)  # the same global batch and loss weights on every rank
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(N, HV, 16, 16, dtype=torch.float64)).requires_grad_()
    w, w_state = torch.randn(B, T, 32, dtype=torch.float64), torch.randn(N, HV, 16, 16, dtype=torch.float64)

    y, S = ref(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    ((y * w).sum() + (S * w_state).sum()).backward()

    own = slice(rank * T_local, (rank + 1) * T_local)
    x_local = x.detach()[:, own].clone().requires_grad_()
    h0_local = h0.detach().clone().requires_grad_()
    y_local, S_local = layer(x_local, cu_seqlens=cu, initial_state=h0_local, output_final_state=True)
    # Every rank holds the final state; its gradients add up over ranks, so one rank carries its loss.
    loss_state = (S_local * w_state).sum() if rank == world_size - 1 else 0.0
    ((y_local * w[:, own]).sum() + loss_state).backward()

    where = f"{mode} (U={ulysses_size}, B={B}, packed={cu is not None}) rank {rank}"
    assert rel_err(y_local, y.detach()[:, own]) < TOL, f"output, {where}"
    assert rel_err(S_local, S.detach()) < TOL, f"final state, {where}"
    assert rel_err(x_local.grad, x.grad[:, own]) < TOL, f"dx, {where}"
    dist.all_reduce(h0_local.grad)
    assert rel_err(h0_local.grad, h0.grad) < TOL, f"d initial_state, {where}"
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        dist.all_reduce(p.grad)
        assert rel_err(p.grad, p_ref.grad) < TOL, f"d {name}, {where}"


def _check_cases(rank, world_size, cases):
    for case in cases:
        _check_case(rank, world_size, case)
    if world_size == 2:
        _check_bad_arguments()


def _check_bad_arguments():
    with pytest.raises(ValueError, match="num_heads % 2 == 0"):
        KimiDeltaAttention(32, 1, 2, head_k_dim=16, head_v_dim=16, cp=KDAContextParallel("ulysses"))
    with pytest.raises(ValueError, match="ulysses_size"):
        KDAContextParallel("hybrid", ulysses_size=2)


def test_layer_cp_2_ranks():
    run_ranks(_check_cases, 2, CASES_2)


def test_layer_cp_4_ranks():
    run_ranks(_check_cases, 4, CASES_4)
