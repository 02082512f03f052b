"""Cross-rank checks of ``chunk_kda`` name dtypes, and reject a dtype mix on every rank alike."""
from __future__ import annotations

import pytest
import torch

from kdacp.distributed import build_cp_plan
from kdacp.kda import chunk_kda
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
    with pytest.raises(TypeError, match="v has dtype torch.float64 but q has torch.float32; q, k, v and g must share"):
        chunk_kda(**mixed, backend="torch", cp=plan)
    # beta may be wider than the rest (FLA's layer passes float32 beta with bfloat16 inputs).
    wide = dict(args, **{n: args[n].float() for n in ("q", "k", "v", "g")})
    o, _ = chunk_kda(**wide, backend="torch", cp=plan)
    assert o.dtype == torch.float32


def test_dtype_errors_name_the_dtypes():
    run_ranks(_dtype_errors, 2, timeout_s=120)
