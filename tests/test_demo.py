"""The demo's check can fail: with the convolution halo dropped, its errors leave the tolerance.

(tests/test_demo_end_to_end.py runs the demo as a user does, where it passes; tests/models checks ``parallelize``
itself.)
"""
import os
import subprocess
import sys

import pytest
import torch

from tests.multiprocess import run_ranks


def _worker(rank, world_size, results):
    from kdacp.demo import demo_config, demo_worker
    from kdacp.cp import batch_context
    from kdacp.workers import WorkerRank

    cfg = demo_config(world_size, seq_lens=(100, 156), steps=2)
    worker = WorkerRank(rank, world_size, torch.device("cpu"), lambda message: None)
    worst = {}
    worst["intact"] = max(max(r["output_err"], r["loss_err"], r["grad_err"]) for r in demo_worker(worker, cfg))
    real = batch_context.CPContext.left_halos
    batch_context.CPContext.left_halos = lambda self, xs, width: [None] * len(xs)
    try:
        worst["no halo"] = max(r["grad_err"] for r in demo_worker(worker, cfg))
    finally:
        batch_context.CPContext.left_halos = real
    if rank == 0:
        results.update(worst, tolerance=cfg.tolerance)


def test_demo_check_passes_intact_and_fails_without_the_halo():
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_worker, 2, results)
    assert results["intact"] <= results["tolerance"] < results["no halo"] / 100, dict(results)


def test_demo_on_cpu_with_fla_importable_runs_the_reference_on_pytorch():
    """Where FLA imports, transformers' Kimi Linear binds FLA's Triton kernels and calls them on CPU tensors
    too: without a GPU they fail ("0 active drivers"), so the demo's reference must use transformers' PyTorch
    code. Run as a user runs it: a fresh process without the TRITON_INTERPRET that conftest sets here."""
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not importable: transformers then binds no FLA kernel (CI)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kdacp.cli", "demo", "--world-size", "1", "--seq-lens", "100,28",
                           "--steps", "1"], capture_output=True, text=True, env=env, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASS" in proc.stdout
