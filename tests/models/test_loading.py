"""transformers' kernel-fallback notices, through kdacp's loaders: printed once in a process, not once per kernel
function."""
from __future__ import annotations

import logging

import torch
import transformers  # noqa: F401  (in the `test` extra)

from tests.models.test_kimi_linear_cp import _config


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_kernel_fallback_notice_is_said_at_most_once():
    import transformers.utils.logging as hf_logging

    from kdacp.integrations.transformers import load_kimi_linear
    kimi = load_kimi_linear()
    hf_logging.warning_once.cache_clear()  # notices an earlier test printed would hide those of this one
    records = _Records()
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    logger.addHandler(records)
    try:
        for seed in (0, 1):  # two constructions, each run forward: the convolution and the delta rule fall back
            torch.manual_seed(seed)
            model = kimi.KimiLinearForCausalLM(_config())
            with torch.no_grad():
                model(torch.randint(3, 50, (1, 12)))
    finally:
        logger.removeHandler(records)
    notices = [m for m in records.messages if "falling back to its reference PyTorch implementation" in m]
    assert len(notices) <= 1, notices
