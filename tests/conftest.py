"""Test set-up: Triton runs under its interpreter where there is no GPU; `gpu` tests need CUDA."""
import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported, so that kernels run on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
