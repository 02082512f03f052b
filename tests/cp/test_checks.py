"""Cross-rank checks of ``chunk_kda`` name dtypes, and reject a dtype mix on every rank alike."""
from __future__ import annotations

import pytest
import torch

from kdacp.cp import build_cp_plan
from kdacp.ops.kda import chunk_kda
from tests.helpers import make_kda_inputs
from tests.multiprocess import run_ranks


def _dtype_errors(rank: int, world_size: int) -> None:
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=0)
    plan = build_cp_plan(batch_size=1)
    # Rank 0 runs in float32, the others in float64.
    ranked = {n: x.float() for n, x in args.items()} if rank == 0 else args
    with pytest.raises(ValueError, match=r"disagree on q/k dtype: values by rank \[torch\.float32, torch\.float64"):
        chunk_kda(**ranked, backend="torch", cp=plan)
    # Rank 0 passes a float32 k with a float64 q.
    split = dict(args, k=args["k"].float()) if rank == 0 else args
    with pytest.raises(ValueError, match=r"values by rank \[torch\.float64/torch\.float32, torch\.float64"):
        chunk_kda(**split, backend="torch", cp=plan)
    # Every rank passes the same mix: every rank raises the local message.
    mixed = dict(args, q=args["q"].float(), k=args["k"].float())
    with pytest.raises(TypeError, match="v has dtype torch.float64 but q has torch.float32; q, k and v must share"):
        chunk_kda(**mixed, backend="torch", cp=plan)
    # beta may be wider than the rest (FLA's layer passes float32 beta with bfloat16 inputs).
    wide = dict(args, **{n: args[n].float() for n in ("q", "k", "v", "g")})
    o, _ = chunk_kda(**wide, backend="torch", cp=plan)
    assert o.dtype == torch.float32


def test_dtype_errors_name_the_dtypes():
    run_ranks(_dtype_errors, 2, timeout_s=120)


def _precision_errors(rank: int, world_size: int) -> None:
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=0)
    plan = build_cp_plan(batch_size=1)
    # ranks that ask for different summary precisions are told which asked for what
    ranked = "exact" if rank == 0 else "one_piece"
    with pytest.raises(ValueError, match=r"disagree on summary_precision: values by rank \[exact, one_piece\]"):
        chunk_kda(**args, backend="torch", cp=plan, summary_precision=ranked)
    # an unknown name on one rank: that rank names it, the others stop instead of waiting
    bad = "bf16" if rank == 0 else None
    match = "summary_precision must be one of" if rank == 0 else "rank\\(s\\) \\[0\\] rejected their inputs"
    with pytest.raises(ValueError, match=match):
        chunk_kda(**args, backend="torch", cp=plan, summary_precision=bad)
    o, _ = chunk_kda(**args, backend="torch", cp=plan, summary_precision="exact")
    assert o.shape == args["v"].shape


def test_summary_precision_is_checked_across_ranks():
    run_ranks(_precision_errors, 2, timeout_s=120)


def test_summary_precision_is_checked_on_one_device():
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=0)
    with pytest.raises(ValueError, match="summary_precision must be one of"):
        chunk_kda(**args, backend="torch", summary_precision="fast")


def _plan_errors(rank: int, world_size: int) -> None:
    args = make_kda_inputs(1, 20, 1, 1, 16, 16, requires_grad=False, seed=0)
    # the last rank's boundaries differ at index 2: every rank is told where, and each rank's value there
    cu = [0, 10, 41 if rank == world_size - 1 else 40, 60]
    with pytest.raises(ValueError, match=r"^chunk_kda: ranks disagree on plan: cu_seqlens differ first at index 2 "
                                         r"\(rank 0: 40, rank 1: 40, rank 2: 41\); every rank must pass the same plan"):
        chunk_kda(**args, backend="torch", cp=build_cp_plan(cu))
    # a scalar entry: its value by rank
    strategy = "allgather" if rank == 1 else "p2p"
    with pytest.raises(ValueError, match=r"ranks disagree on plan: strategy by rank \['p2p', 'allgather', 'p2p'\]"):
        chunk_kda(**args, backend="torch", cp=build_cp_plan(batch_size=1, strategy=strategy))
    # every rank still runs the next call
    o, _ = chunk_kda(**args, backend="torch", cp=build_cp_plan([0, 10, 40, 60]))
    assert o.shape == args["v"].shape


def test_plan_disagreement_names_the_differing_boundaries():
    run_ranks(_plan_errors, 3, timeout_s=120)
