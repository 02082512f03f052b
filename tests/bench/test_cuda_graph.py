"""``benchmarks/cuda_graph.py``: its refusals by name, before any GPU work (the captures themselves need a GPU:
``bash benchmarks/one_gpu.sh graph OUT``)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import run_script


@pytest.mark.parametrize("args, named", [(("--captures", "step,replay"), "--captures"),
                                         (("--batches", "docs9"), "--batches"),
                                         (("--tokens", "3"), "--tokens"),
                                         (("--tokens", "2048,4k"), "--tokens")])
def test_cuda_graph_refuses_bad_arguments_by_name(monkeypatch, capsys, args, named):
    run = run_script(monkeypatch, capsys, "cuda_graph", *args)
    assert run.returncode == 2 and named in run.stderr, run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_cuda_graph_refuses_without_a_gpu(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "cuda_graph")
    assert run.returncode == 2 and "CUDA graphs need a CUDA GPU" in run.stderr, run.stderr
