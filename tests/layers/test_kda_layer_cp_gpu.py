"""Context-parallel KDA layer on 2 GPUs (NCCL, fla backend, bf16) against the one-GPU layer.

bf16 rounds differently on each path, so both the CP layer and the one-GPU bf16 layer are measured
against a float32 one-GPU run (torch backend) of the same batch; CP must be about as close as one GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from kdacp.cp import ContextParallel
from kdacp.layers import KimiDeltaAttention
from tests.helpers import rel_err
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.gpu

# H = HV = 32 and K = V = 128 as in kdacp.bench.layer (and kdacp.bench.cp): FLA autotunes per
# head count and head dims, so sharing them saves minutes on a cold machine.
H, K = 32, 128
# (mode, B, T per rank, cu_seqlens or None)
CASES = [
    ("state", 2, 512, None),
    ("state", 1, 512, [0, 100, 511, 513, 900, 1024]),
    ("ulysses", 2, 512, None),
    ("ulysses", 1, 512, [0, 100, 511, 513, 900, 1024]),
]


def _run(layer, x, h0, cu, w, w_state, with_state_loss, group_sum):
    """Outputs, final state and gradients (float32); ``group_sum``: all-reduce the gradients of
    replicated inputs and parameters (CP runs)."""
    x, h0 = x.clone().requires_grad_(), h0.clone().requires_grad_()
    y, S = layer(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    loss_state = (S.float() * w_state).sum() if with_state_loss else 0.0
    ((y.float() * w).sum() + loss_state).backward()
    grads = {"dx": x.grad.float(), "dh0": h0.grad.float(),
             **{name: p.grad.float() for name, p in layer.named_parameters()}}
    if group_sum:
        for name, g in grads.items():
            if name != "dx":
                dist.all_reduce(g)
    return y.float(), S.float(), grads


def _check(rank, world_size, device_type="cuda", backend="fla"):
    dev = torch.device(device_type, rank if device_type == "cuda" else None)
    for mode, B, T_local, cu in CASES:
        T = T_local * world_size
        cu = None if cu is None else torch.tensor(cu, device=dev)
        N = B if cu is None else len(cu) - 1
        torch.manual_seed(0)  # the same parameters and global batch on both ranks
        ref32 = KimiDeltaAttention(256, H, head_k_dim=K, head_v_dim=K, conv_bias=True, backend="torch").to(dev)
        one = copy.deepcopy(ref32).to(torch.bfloat16)
        one.backend = backend
        cp = copy.deepcopy(one)
        cp.cp = ContextParallel(mode)
        x = torch.randn(B, T, 256, device=dev)
        h0 = 0.5 * torch.randn(N, H, K, K, device=dev)
        w, w_state = torch.randn(B, T, 256, device=dev), torch.randn_like(h0)
        own = slice(rank * T_local, (rank + 1) * T_local)

        y32, S32, g32 = _run(ref32, x, h0, cu, w, w_state, True, False)
        y1, S1, g1 = _run(one, x.bfloat16(), h0, cu, w, w_state, True, False)
        # The final state's gradients add up over ranks, so one rank carries its loss.
        ycp, Scp, gcp = _run(cp, x[:, own].bfloat16(), h0, cu, w[:, own], w_state, rank == world_size - 1, True)
        g32["dx"], g1["dx"] = g32["dx"][:, own], g1["dx"][:, own]
        pairs = {"y": (ycp, y1[:, own], y32[:, own]), "final_state": (Scp, S1, S32),
                 **{n: (gcp[n], g1[n], g32[n]) for n in g32}}
        for name, (a_cp, a_one, a_ref) in pairs.items():
            e_cp, e_one = rel_err(a_cp, a_ref), rel_err(a_one, a_ref)
            if rank == 0:
                print(f"{mode} B={B} packed={cu is not None} {name}: cp {e_cp:.2e} one-GPU {e_one:.2e}", flush=True)
            assert e_cp <= 1.5 * e_one + 2e-3, f"{mode} {name} rank {rank}: cp {e_cp:.3e}, one GPU {e_one:.3e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layer_cp_2_gpus_bf16():
    pytest.importorskip("fla", reason="needs fla-core")
    run_ranks(_check, 2, backend="nccl", timeout_s=240)
