"""The soak suite on 2 gloo ranks, briefly: kdacp's caches stay bounded while every step brings a new
packed batch (growth of memory, threads or files shows only over a long run, not checked here)."""
import math

import torch.distributed as dist

from kdacp.bench import soak
from kdacp.caches import CP_CONTEXTS
from tests.multiprocess import run_ranks


def _soak(rank, world_size):
    # a new packed batch every step: 10 steps outnumber the CP_CONTEXTS (8) kept
    rows = soak.run(steps=10, every=4, group=dist.group.WORLD, seq_lens=(60, 25, 90, 29))
    assert [r["step"] for r in rows] == [1, 4, 8, 10]  # the first, every 4th and the last
    assert all(r["context_memo"] <= CP_CONTEXTS for r in rows) and rows[-1]["context_memo"] == CP_CONTEXTS
    # a plan's verification memo goes with the plan: at most the batches kept, plus one in flight
    assert all(r["verified_plans"] <= CP_CONTEXTS + 1 for r in rows)
    assert all(math.isfinite(r["loss"]) and r["rss_MB"] > 0 and r["fds"] > 0 for r in rows)


def test_soak_short_run_keeps_caches_bounded():
    run_ranks(_soak, 2)


def test_soak_rows_default_to_a_twentieth_of_the_steps():
    import pytest
    with pytest.raises(ValueError, match="steps and every must be >= 1"):
        soak.run(steps=0)
