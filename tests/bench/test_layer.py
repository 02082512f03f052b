"""The layer suite times the hybrid mode (Ulysses groups of 2, state passing across them) on 4 gloo ranks."""
import torch.distributed as dist

from kdacp.bench import layer
from tests.multiprocess import run_ranks


def _hybrid(rank, world_size):
    rows = layer.run(t_local=32, hidden=32, heads=2, head_dim=8, modes=("hybrid",), batches=("docs7",), warmup=1,
                     rounds=1, iters=1, group=dist.group.WORLD, device="cpu", dtype=layer.torch.float32,
                     backend="torch")
    assert [(r["run"], r["ranks"], r["docs"]) for r in rows] == [("kdacp_one_rank", 1, 7), ("kdacp_hybrid", 4, 7)]
    assert all(r["ms"] > 0 for r in rows)


def test_layer_suite_times_hybrid():
    run_ranks(_hybrid, 4)
