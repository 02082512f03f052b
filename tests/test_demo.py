"""The demo's check can fail: with the convolution halo dropped, its errors leave the tolerance.

(tests/test_cli.py runs the demo end to end, where it passes; tests/models checks ``parallelize`` itself.)
"""
import torch

from tests.multiprocess import run_ranks


def _worker(rank, world_size, results):
    from kdacp.demo import demo_config, demo_worker
    from kdacp.layers import context_parallel
    from kdacp.workers import RankContext

    cfg = demo_config(world_size, seq_lens=(100, 156), steps=2)
    ctx = RankContext(rank, world_size, torch.device("cpu"), lambda message: None)
    worst = {}
    worst["intact"] = max(max(r["output_err"], r["loss_err"], r["grad_err"]) for r in demo_worker(ctx, cfg))
    real = context_parallel.ConvContext.left_halos
    context_parallel.ConvContext.left_halos = lambda self, xs, width: [None] * len(xs)
    try:
        worst["no halo"] = max(r["grad_err"] for r in demo_worker(ctx, cfg))
    finally:
        context_parallel.ConvContext.left_halos = real
    if rank == 0:
        results.update(worst, tolerance=cfg.tolerance)


def test_demo_check_passes_intact_and_fails_without_the_halo():
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_worker, 2, results)
    assert results["intact"] <= results["tolerance"] < results["no halo"] / 100, dict(results)
