"""kdacp.workers.launch: ``prepare`` runs in every rank's process before its process group exists."""
import os

import torch.distributed as dist

from kdacp.workers import launch

_BEFORE_GROUP = []  # filled in each rank's own process by _prepare


def _prepare():
    _BEFORE_GROUP.append(not dist.is_initialized())


def _rank(ctx):
    return ctx.rank, os.getpid(), list(_BEFORE_GROUP)


def test_prepare_runs_in_each_rank_before_its_group():
    results = launch(_rank, 2, prepare=_prepare, timeout_s=120)
    assert [r[0] for r in results] == [0, 1]
    assert results[0][1] != results[1][1] != os.getpid()  # each rank's own process
    assert [r[2] for r in results] == [[True], [True]]
    assert _BEFORE_GROUP == []  # not in the launching process
    # without it nothing runs
    assert [r[2] for r in launch(_rank, 2, timeout_s=120)] == [[], []]
