"""``chunk_kda`` with the ``fla`` and ``attn_gym`` backends over NCCL, bf16, against single-GPU FLA ``chunk_kda``.

Launch on a machine with >= 2 GPUs::

    torchrun --nproc_per_node=2 -m pytest -m gpu tests/cp/test_cp_gpu.py

Both runs are measured against a float64 reference of the whole global batch: the CP run's
relative RMS error (output, final states, every gradient) may be at most 10% above the single-GPU run's
(``attn_gym``, whose kernels round otherwise than FLA's: at most three times; Kimi Linear's safe gate, the
only KDA gate that backend takes; skipped where it is not usable).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from kdacp import reference
from kdacp.cp import build_cp_plan
from kdacp.ops.kda import chunk_kda
from tests.helpers import make_kda_inputs, rel_err

pytestmark = pytest.mark.gpu

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


@pytest.fixture(scope="module")
def group():
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        pytest.skip("launch with torchrun --nproc_per_node=2")
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    yield dist.group.WORLD
    dist.barrier()


def _gather_tokens(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``[B, T_local, ...]`` along T (padded to one size for the all-gather)."""
    padded = x.new_zeros(x.shape[0], max(lengths), *x.shape[2:])
    padded[:, :x.shape[1]] = x
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    return torch.cat([p[:, :L] for p, L in zip(parts, lengths)], 1)


def _grads(loss, leaves: dict) -> dict:
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


# H = HV = 32, K = V = 128 as in kdacp.bench.cp, so that FLA autotunes each kernel once.
CASES = [
    dict(name="one-sequence", B=1, cu=None, T=2048, init=False),
    dict(name="packed-uneven", B=1, cu=[0, 300, 301, 1500, 1900, 2048], lengths=[1100, 948], init=True),
    dict(name="batch-rows", B=2, cu=None, T=1024, init=True),
]


@pytest.mark.parametrize("backend", ["fla", "attn_gym"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cp_bf16_matches_single_gpu_accuracy(group, case, backend):
    from kdacp.backends import backend_usable
    from kdacp.backends.fla_adapter import load_fla
    fla = load_fla()
    if not backend_usable(backend, torch.device("cuda")):
        pytest.skip(f"backend={backend!r} is not usable here")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cu = None if case["cu"] is None else torch.tensor(case["cu"], device="cuda")
    T = case.get("T") or case["cu"][-1]
    H, HV, K, V = 32, 32, 128, 128
    args = make_kda_inputs(case["B"], T, H, HV, K, V, gate="default" if backend == "fla" else "safe",
                           dtype=torch.bfloat16, initial_state=case["init"], cu_seqlens=cu, device="cuda", seed=7)
    args.pop("cu_seqlens", None)
    # float32, as FLA's and Kimi Linear's layers keep them: with bf16 parameters each rank's gradient
    # share is rounded to bf16 before the sum, which alone costs about 1.22x the single-GPU error
    for name in ("A_log", "dt_bias"):
        args[name] = args[name].detach().float().requires_grad_()
    if case["init"]:
        args["initial_state"] = args["initial_state"].detach().float().requires_grad_()
    N = case["B"] if cu is None else len(cu) - 1
    gen = torch.Generator(device="cuda").manual_seed(8)
    do = torch.randn(case["B"], T, HV, V, device="cuda", generator=gen).bfloat16()
    dfinal = torch.randn(world_size, N, HV, K, V, device="cuda", generator=gen)
    leaves = {n: x for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad}

    def loss_of(o, final, dht):
        return (o.double() * do.double()).sum() + (final.double() * dht.double()).sum()

    # float64 reference and single-GPU FLA, on the whole global batch
    ref_leaves = {n: x.detach().double().requires_grad_() for n, x in leaves.items()}
    ref_args = {**args, **ref_leaves}
    ref_o, ref_final = reference.chunk_kda(**ref_args, cu_seqlens=cu, output_final_state=True)
    ref = dict(o=ref_o.detach(), final=ref_final.detach(),
               **_grads(loss_of(ref_o, ref_final, dfinal.sum(0)), ref_leaves))
    one_o, one_final = fla.chunk_kda(**args, cu_seqlens=cu, output_final_state=True)
    one = dict(o=one_o.detach(), final=one_final.detach(), **_grads(loss_of(one_o, one_final, dfinal.sum(0)), leaves))

    # context parallel: each rank its own tokens
    lengths = case.get("lengths") or [T // world_size] * world_size
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    local = {n: (x[:, lo:hi].detach().clone().requires_grad_() if n in TOKEN_INPUTS else
                 x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
    plan = build_cp_plan(cu, local_lengths=case.get("lengths"), batch_size=None if cu is not None else case["B"])
    local_leaves = {n: local[n] for n in leaves}
    o, final = chunk_kda(**local, output_final_state=True, backend=backend, cp=plan)
    grads = _grads((o.double() * do[:, lo:hi].double()).sum() + (final.double() * dfinal[rank].double()).sum(),
                   local_leaves)
    cp = dict(o=o.detach(), final=final.detach(), **grads)
    for n in ["o", *leaves]:  # token tensors: gather the slices; parameter/state gradients: add the shares
        if n == "o" or n in TOKEN_INPUTS:
            cp[n] = _gather_tokens(cp[n], lengths)
        else:
            dist.all_reduce(cp[n])

    errors = {key: (rel_err(one[key], ref[key]), rel_err(cp[key], ref[key])) for key in ref}
    if rank == 0:
        print(f"\n[{case['name']}, {backend}] relative RMS error vs float64, single GPU FLA / CP: "
              + "; ".join(f"{key} {a:.3e} / {b:.3e}" for key, (a, b) in errors.items()))
    factor = 1.1 if backend == "fla" else 3.0
    for key, (e_one, e_cp) in errors.items():
        assert e_cp <= factor * e_one + 1e-6, \
            f"[{case['name']}, {backend}] {key}: CP {e_cp:.3e} vs single GPU {e_one:.3e}"
