"""Multi-process (gloo, CPU) tests of ``chunk_kda`` against the single-process reference.

Every rank builds the same global batch, runs its share through ``chunk_kda`` and the whole
batch through ``kdacp.reference.chunk_kda``, and compares outputs, final states and all gradients.
Many cases run per spawn to keep the suite fast on a 2-core machine.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kdacp import reference
from kdacp.cp import build_cp_plan, new_cp_group
from kdacp.ops.kda import chunk_kda
from tests.multiprocess import run_ranks
from tests.helpers import count_signature_gathers, make_kda_inputs, rel_err

TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def _split(total: int, world_size: int, uneven: bool) -> list[int]:
    """Tokens per rank: equal, or deliberately uneven and not multiples of 64."""
    if not uneven:
        return [total // world_size] * world_size
    weights = [1 + 2 * r for r in range(world_size)]
    lengths = [max(1, total * w // sum(weights)) for w in weights]
    lengths[-1] = total - sum(lengths[:-1])
    return lengths


def _cases(world_size: int) -> list[dict]:
    """Case dicts: global layout, sizes, gate, dtype, states. Sizes stay small for CI."""
    P = world_size
    long_middle = [0, 5, 40 * P - 7, 40 * P]         # the middle sequence spans every rank
    many_short = list(range(0, 30 * P, 7)) + [30 * P]  # several whole sequences per rank
    return [
        dict(name="one-sequence", B=1, cu=None, T=50 * P, uneven=False, gate="plain"),
        # three chunks per rank and batch row: a through rank's state pass runs over its summary's pieces at
        # once (two per segment), each from the state entering it; each row's final state is its last piece's
        dict(name="batch-rows-pieces", B=2, cu=None, T=150 * P, uneven=False, gate="default", init=True,
             final=True, gate_shift=-4.0),
        dict(name="batch-rows-uneven", B=2, cu=None, T=45 * P + 3, uneven=True, gate="default", init=True, final=True),
        # a slowly fading gate: the through ranks' transitions weigh on the result
        dict(name="packed-long-middle-uneven", B=1, cu=long_middle, uneven=True, gate="default", init=True, final=True,
             gate_shift=-4.0),
        dict(name="packed-many-short", B=1, cu=many_short, uneven=False, gate="safe", init=True, final=True, HV=2,
             scale=0.3),
        # no initial or final states (a training step): the whole sequences before a tail get zero gradients
        dict(name="packed-many-short-no-states", B=1, cu=many_short, uneven=True, gate="safe"),
        dict(name="packed-random-cuts-fp32", B=1, cu=[0, 33, 34, 70 * P - 50, 70 * P - 3, 70 * P], uneven=True,
             gate="plain", init=True, final=True, dtype=torch.float32),
    ]


def _global_inputs(case: dict, seed: int) -> dict:
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.long)
    T = case["T"] if cu is None else case["cu"][-1]
    H, HV = 1, case.get("HV", 1)
    return make_kda_inputs(case["B"], T, H, HV, 16, 16, dtype=case.get("dtype", torch.float64), gate=case["gate"],
                           initial_state=case.get("init", False), cu_seqlens=cu, seed=seed,
                           gate_shift=case.get("gate_shift", 0.0))


def _check_case(rank: int, world_size: int, case: dict, strategy: str, seed: int, backend: str = "torch") -> None:
    args = _global_inputs(case, seed)
    cu = args.pop("cu_seqlens", None)
    if "scale" in case:
        args["scale"] = case["scale"]
    total = args["q"].shape[1]
    lengths = _split(total, world_size, case["uneven"])
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    tol = 1e-9 if args["q"].dtype == torch.float64 else 1e-5
    final = case.get("final", False)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64).to(args["v"].dtype)
    N = case["B"] if cu is None else len(cu) - 1
    HV, K, V = args["v"].shape[2], args["q"].shape[3], args["v"].shape[3]
    # Each rank puts its own gradient on the replicated final states; the reference sees their sum.
    dfinal = [torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64) for _ in range(world_size)]

    ref_o, ref_final = reference.chunk_kda(**args, cu_seqlens=cu, output_final_state=True)
    ref_loss = (ref_o * do).sum() + (final and (ref_final * sum(dfinal).to(ref_final)).sum())
    names = [n for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    ref_grads = dict(zip(names, torch.autograd.grad(ref_loss, [args[n] for n in names])))

    local = {n: (x[:, lo:hi].detach().clone().requires_grad_() if n in TOKEN_INPUTS else
                 x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x)
             for n, x in args.items()}
    plan = build_cp_plan(cu, local_lengths=None if not case["uneven"] else lengths,
                         batch_size=None if cu is not None else case["B"], strategy=strategy)
    o, final_state = chunk_kda(**local, output_final_state=final, backend=backend, cp=plan)
    loss = (o * do[:, lo:hi]).sum() + (final and (final_state * dfinal[rank].to(final_state)).sum())
    grads = dict(zip(names, torch.autograd.grad(loss, [local[n] for n in names])))

    where = f"[{case['name']}, {strategy}, {backend}, rank {rank}/{world_size}]"
    assert rel_err(o, ref_o[:, lo:hi]) < tol, f"{where} o: {rel_err(o, ref_o[:, lo:hi]):.2e}"
    if final:
        assert rel_err(final_state, ref_final) < tol, f"{where} final_state: {rel_err(final_state, ref_final):.2e}"
    for n in names:
        got, want = grads[n], ref_grads[n]
        if n in TOKEN_INPUTS:
            want = want[:, lo:hi]
        else:  # parameter and initial-state gradients are per-rank shares that add up
            dist.all_reduce(got)
        assert rel_err(got, want) < tol, f"{where} d{n}: {rel_err(got, want):.2e}"


def _all_cases(rank: int, world_size: int) -> None:
    for i, case in enumerate(_cases(world_size)):
        for strategy in ("p2p", "allgather"):
            _check_case(rank, world_size, case, strategy, seed=100 * world_size + i)


def _expect_value_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _bad_inputs(rank: int, world_size: int) -> None:
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=0)
    plan = build_cp_plan(batch_size=1)
    # One rank passes a different value dim: every rank must raise, none may hang.
    bad = dict(args, v=args["v"][..., :8] if rank == world_size - 1 else args["v"])
    _expect_value_error(lambda: chunk_kda(**bad, backend="torch", cp=plan), "disagree on V|rejected")
    # A dtype mismatch on one rank.
    mixed = dict(args, q=args["q"].float() if rank == 0 else args["q"], k=args["k"].float() if rank == 0 else args["k"])
    _expect_value_error(lambda: chunk_kda(**mixed, backend="torch", cp=plan), "disagree on q/k dtype")
    # Ranks built different plans.
    other = build_cp_plan(batch_size=1, strategy="allgather" if rank == 1 else "p2p")
    _expect_value_error(lambda: chunk_kda(**args, backend="torch", cp=other), "disagree on plan")
    # A shape error on a single rank is raised there and reported on the others.
    broken = dict(args, beta=args["beta"][..., None] if rank == 0 else args["beta"])
    _expect_value_error(lambda: chunk_kda(**broken, backend="torch", cp=plan), "beta|rejected")
    _expect_value_error(lambda: chunk_kda(**args, backend="nope", cp=plan), "backend")
    # The plan holds the boundaries: a rank that also passes cu_seqlens fails, and every rank with it.
    local_cu = dict(cu_seqlens=torch.tensor([0, 20])) if rank == 0 else {}
    _expect_value_error(lambda: chunk_kda(**args, **local_cu, backend="torch", cp=plan), "cu_seqlens|rejected")
    _expect_value_error(lambda: build_cp_plan(strategy="ring"), "strategy")
    _expect_value_error(lambda: build_cp_plan(torch.tensor([0, 5, 5, 12])), "strictly increasing")
    _expect_value_error(lambda: build_cp_plan(torch.tensor([0, 7]), local_lengths=[1] * world_size), "add up")
    # The plan gives rank 0 one token more than it passes.
    lengths = [21, 19] + [20] * (world_size - 2)
    shifted = build_cp_plan(torch.tensor([0, 20 * world_size]), local_lengths=lengths)
    _expect_value_error(lambda: chunk_kda(**args, backend="torch", cp=shifted), r"holds \d+ tokens|rejected")
    dist.barrier()


def _calls_in_flight(rank: int, world_size: int) -> None:
    """Two calls share one plan before either backward runs; their gradients add up."""
    args = make_kda_inputs(1, 40 * world_size, 1, 1, 16, 16, gate="default", seed=11)
    lo, hi = 40 * rank, 40 * (rank + 1)
    local = {n: (x[:, lo:hi].detach().clone().requires_grad_() if n in TOKEN_INPUTS else
                 x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x) for n, x in args.items()}
    plan = build_cp_plan(batch_size=1, strategy="p2p")
    o1, _ = chunk_kda(**local, backend="torch", cp=plan)
    o2, _ = chunk_kda(**dict(local, v=2 * local["v"]), backend="torch", cp=plan)
    (dq,) = torch.autograd.grad(o1.sum() + o2.sum(), [local["q"]])
    ref_o, _ = reference.chunk_kda(**args)
    (ref_dq,) = torch.autograd.grad(3 * ref_o.sum(), [args["q"]])  # the output is linear in v
    assert rel_err(dq, ref_dq[:, lo:hi]) < 1e-9, f"rank {rank}: {rel_err(dq, ref_dq[:, lo:hi]):.2e}"


def _checks_once_per_signature(rank: int, world_size: int) -> None:
    """The cross-rank check's all-gather runs once per plan and call signature, or on every call
    with ``check_every_call``; ranks that disagree on that option are told at the first call."""
    with count_signature_gathers() as gathers:
        args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=3)
        plan = build_cp_plan(batch_size=1)
        o1, _ = chunk_kda(**args, backend="torch", cp=plan)
        o2, _ = chunk_kda(**args, backend="torch", cp=plan)
        assert len(gathers) == 1 and torch.equal(o1, o2)
        chunk_kda(**{n: x.float() for n, x in args.items()}, backend="torch", cp=plan)  # a new signature
        chunk_kda(**args, backend="torch", cp=plan)
        assert len(gathers) == 2
        every = build_cp_plan(batch_size=1, check_every_call=True)
        for _ in range(3):
            chunk_kda(**args, backend="torch", cp=every)
        assert len(gathers) == 5
        mixed = build_cp_plan(batch_size=1, check_every_call=rank == 0)
        _expect_value_error(lambda: chunk_kda(**args, backend="torch", cp=mixed), "disagree on plan")
    dist.barrier()


def _on_new_cp_group(rank: int, world_size: int) -> None:
    """A plan over a ``new_cp_group`` of the last ``world_size - 1`` ranks (all ranks for 2) matches
    the reference; ranks outside the group take no part."""
    members = list(range(world_size)) if world_size == 2 else list(range(1, world_size))
    group = new_cp_group(members)
    if rank in members:
        assert dist.get_backend(group) == dist.get_backend()
        _run_on_group(members.index(rank), len(members), group)
    dist.barrier()


def _run_on_group(r: int, P: int, group) -> None:
    """One sequence of ``24 P`` tokens over ``group``, seen from group rank ``r``."""
    args = make_kda_inputs(1, 24 * P, 1, 1, 16, 16, gate="default", seed=13)
    lo, hi = 24 * r, 24 * (r + 1)
    local = {n: (x[:, lo:hi].detach().clone() if n in TOKEN_INPUTS else x) for n, x in args.items()}
    o, _ = chunk_kda(**local, backend="torch", cp=build_cp_plan(batch_size=1, group=group))
    ref_o, _ = reference.chunk_kda(**args)
    assert rel_err(o, ref_o[:, lo:hi]) < 1e-9, f"group rank {r}: {rel_err(o, ref_o[:, lo:hi]):.2e}"


def _run(rank: int, world_size: int) -> None:
    _on_new_cp_group(rank, world_size)
    _bad_inputs(rank, world_size)
    _checks_once_per_signature(rank, world_size)
    _calls_in_flight(rank, world_size)
    _all_cases(rank, world_size)


# 3 ranks in the default run (a first, a through and a last rank; a 2-rank subgroup); 2 and 4 with -m slow
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3,
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_cp_chunk_kda_matches_reference(world_size):
    run_ranks(_run, world_size, timeout_s=200)
