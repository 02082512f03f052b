"""benchmarks/megatron_gdn.py on the CPU: Megatron's own GDN (on plain-PyTorch stand-ins of its FLA calls) and
kdacp's at cp = 1 agree on the same weights and inputs, one sequence and packed, forward and forward+backward; and
a Megatron backward that fails (as FLA's GDN backward does on the H200 with Triton 3.6) is reported in its row
while kdacp's step is still timed."""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # not in the default run: .ci/run runs it in its own environment
pytest.importorskip("megatron.core", reason="needs megatron-core 0.19.2 (see tests/integrations/test_megatron.py)")

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def megatron_gdn():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        yield importlib.import_module("megatron_gdn")


def test_script_compares_the_layers_on_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "megatron_gdn.py"), "--seq-lens", "64",
                           "--batches", "one_sequence,docs7", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "megatron_gdn.json").read_text())["rows"]
    assert [(r["batch"], r["pass"]) for r in rows] == [(b, p) for b in ("one_sequence", "docs7")
                                                       for p in ("forward", "forward+backward")]
    for r in rows:
        assert r["megatron_note"] == "" and r["megatron_ms"] > 0 and r["kdacp_ms"] > 0, r
        assert r["out_rel_diff"] < 1e-5, r  # float32: output and input gradient
        if r["pass"] == "forward+backward":
            # A_log's and dt_bias' gradients: sums of cancelling terms from float32 gates (module docstring)
            assert r["param_rel_diff"] < 3e-2, r
    assert "| docs7 | 7 | 64 |" in done.stdout


class _Linear(torch.nn.Module):
    """A stand-in layer with Megatron's call signature; ``refuse_backward``: its backward raises as FLA's does."""

    def __init__(self, hidden: int, refuse_backward: bool):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.refuse_backward = refuse_backward

    def forward(self, x, attention_mask, packed_seq_params=None):
        y = self.proj(x)
        return (_Refused.apply(y) if self.refuse_backward else y), None


class _Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        raise NotImplementedError("chunk_bwd_dqkwg is not supported on Hopper\nsecond line")


def test_failed_megatron_backward_is_reported_and_kdacp_still_timed(megatron_gdn):
    torch.manual_seed(0)
    megatron, kdacp = _Linear(8, refuse_backward=True), _Linear(8, refuse_backward=False)
    kdacp.load_state_dict(megatron.state_dict())
    forward, step = megatron_gdn.measure(megatron, kdacp, "one_sequence", 16, 8, torch.float32, torch.device("cpu"),
                                         warmup=0, rounds=1, iters=1)
    assert forward["megatron_note"] == "" and forward["out_rel_diff"] == 0.0
    assert step["megatron_note"] == "backward failed: NotImplementedError: chunk_bwd_dqkwg is not supported on Hopper"
    assert math.isnan(step["megatron_ms"]) and math.isnan(step["ratio"]) and math.isnan(step["out_rel_diff"])
    assert step["kdacp_ms"] > 0
