"""``chunk_gated_delta_rule`` on 2 and 3 gloo ranks against the token-by-token GDN recurrence on the
whole batch (float64): packed sequences cut across uneven ranks, grouped value heads, initial states,
the gate in kernel, every strategy."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kdacp.cp import STRATEGIES, build_cp_plan
from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.reference.gdn import recurrent_gated_delta_rule
from tests.helpers import rel_err
from tests.multiprocess import run_ranks
from tests.test_gdn import gdn_inputs

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def _check(rank: int, world_size: int, strategies=None, backend: str = "torch") -> None:
    """Every strategy of ``strategies`` (default :data:`STRATEGIES`) on ``backend`` against the reference."""
    cu = [0, 7, 40 * world_size - 9, 40 * world_size - 1, 40 * world_size]   # the long one spans every rank
    lengths = [40 + 5 * (r - (world_size - 1) / 2) for r in range(world_size)]
    lengths = [int(x) for x in lengths[:-1]] + [40 * world_size - sum(int(x) for x in lengths[:-1])]
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    args = gdn_inputs(1, cu[-1], 1, 2, 16, 8, gate_in_kernel=True, cu=cu, seed=world_size)
    cu_t = args.pop("cu_seqlens")
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    ref_o, ref_S = recurrent_gated_delta_rule(**args, cu_seqlens=cu_t, output_final_state=True)
    gen = torch.Generator().manual_seed(3)
    w, wS = torch.randn(ref_o.shape, generator=gen, dtype=ref_o.dtype), torch.randn(ref_S.shape, generator=gen,
                                                                                     dtype=ref_S.dtype)
    ref = torch.autograd.grad((ref_o * w).sum() + (ref_S * wS).sum(), [args[n] for n in names])
    for strategy in strategies or STRATEGIES:
        local = {n: (x[:, lo:hi].detach().clone().requires_grad_() if n in TOKEN_INPUTS else
                     x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x)
                 for n, x in args.items()}
        plan = build_cp_plan(cu_t, local_lengths=lengths, strategy=strategy)
        o, S = chunk_gated_delta_rule(**local, output_final_state=True, backend=backend, cp=plan)
        # the final states are on every rank; one rank carries their loss
        loss = (o * w[:, lo:hi]).sum() + ((S * wS).sum() if rank == 0 else 0.0)
        grads = torch.autograd.grad(loss, [local[n] for n in names])
        where = f"[{strategy}, {backend}, rank {rank}/{world_size}]"
        assert rel_err(o, ref_o[:, lo:hi]) < 1e-9, f"{where} o"
        assert rel_err(S, ref_S) < 1e-9, f"{where} final state"
        for n, got, want in zip(names, grads, ref):
            if n in TOKEN_INPUTS:
                want = want[:, lo:hi]
            else:
                dist.all_reduce(got)
            assert rel_err(got, want) < 1e-9, f"{where} d{n}: {rel_err(got, want):.2e}"


def test_cp_gdn_2_ranks():
    run_ranks(_check, 2)


def test_cp_gdn_3_ranks():
    run_ranks(_check, 3)
