"""A rank that fails inside ``chunk_kda`` (forward or backward) makes every other rank of the group
fail within the group's timeout (``new_cp_group(timeout=...)``) instead of hanging; the failing rank
raises its own error, the others' errors carry a note naming what kdacp waited for (the peer).
gloo, 3 ranks, every strategy of ``STRATEGIES``: a forward fault on the middle rank and a backward
fault on the last rank."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import kdacp
from kdacp.ops import kda
from kdacp.cp import STRATEGIES, build_cp_plan, groups, new_cp_group
from kdacp.ops.kda import chunk_kda
from tests.helpers import make_kda_inputs
from tests.multiprocess import run_ranks

TIMEOUT_S = 1.5
SLACK_S = 6.0  # compute and process start-up on a loaded 2-core machine


def _group_timeouts(rank: int, P: int) -> None:
    assert kdacp.new_cp_group is new_cp_group
    default = groups.group_timeout()
    assert default == timedelta(seconds=90)  # tests/multiprocess.py's init_process_group timeout
    assert groups.group_timeout(new_cp_group()) == default  # the default group's, not torch's 30 min
    assert groups.group_timeout(new_cp_group(timeout=7)) == timedelta(seconds=7)
    assert groups.group_timeout(new_cp_group(list(range(P)), timeout=timedelta(seconds=8))) == timedelta(seconds=8)
    for bad in (0, -1.0, "5", True):
        with pytest.raises(ValueError, match="timeout"):
            new_cp_group(timeout=bad)


def _faults(rank: int, P: int) -> None:
    _group_timeouts(rank, P)
    for strategy in STRATEGIES:
        for phase, failing in (("forward", 1), ("backward", P - 1)):
            group = new_cp_group(timeout=TIMEOUT_S)
            plan = build_cp_plan(batch_size=1, group=group, strategy=strategy)
            args = make_kda_inputs(1, 16, 1, 1, 16, 16, gate="default", initial_state=True, seed=rank)
            chunk_kda(**args, backend="torch", cp=plan)[0].sum().backward()  # a good step first
            name = "cp_forward" if phase == "forward" else "cp_backward"
            real = getattr(kda, name)
            message = f"injected {phase} fault on rank {rank}"

            def boom(*a, **k):
                raise RuntimeError(message)

            if rank == failing:
                setattr(kda, name, boom)
            error, start = None, time.monotonic()
            try:
                o, _ = chunk_kda(**args, backend="torch", cp=plan)
                o.sum().backward()
                # A training step then sums the ranks' parameter-gradient shares over the group.
                dist.all_reduce(args["A_log"].grad, group=group)
            except Exception as e:  # noqa: BLE001 - any error counts, a hang does not
                error = e
            elapsed = time.monotonic() - start
            setattr(kda, name, real)
            where = f"[{strategy}, {phase} fault on rank {failing}, rank {rank}]"
            if rank == failing:
                assert error is not None and message in str(error), f"{where}: {error!r}"
            else:
                assert error is not None, f"{where}: finished although rank {failing} failed"
                assert "injected" not in str(error), f"{where}: {error!r}"
                assert elapsed < TIMEOUT_S + SLACK_S, f"{where}: failed after {elapsed:.1f} s: {error!r}"
                # kdacp's wait says what it waited for and the likely cause.
                assert any("kdacp:" in n and "group rank" in n or "group did not" in n
                           for n in getattr(error, "__notes__", ())), f"{where}: {error!r} has no kdacp note"
            dist.barrier()  # default group: the failing rank waits here until the others have failed


def test_a_failing_rank_fails_the_others_within_the_timeout():
    run_ranks(_faults, 3, timeout_s=120)
