"""The ``flashqla`` backend on a Hopper or Blackwell GPU with FlashQLA 0.1.3 and FLA installed: the GDN op at real
sizes (4096 tokens, one sequence and log-normal documents, 4 and 32 value heads of 128, bf16, the gate and the
L2 norm in kernel, initial and final states), whole and split inside the device, against float64 and against the
``fla`` backend: the error of ``flashqla`` against float64 at most three times that of ``fla`` (both are bf16
noise).

    python -m pytest -m gpu tests/backends/test_flashqla_backend_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from kdacp.bench.batches import cu_seqlens_of, document_lengths
from tests.backends.test_attn_gym_backend_gpu import _run, assert_as_accurate_as_fla, skip_unless_usable

pytestmark = pytest.mark.gpu

K = V = 128


@pytest.fixture(scope="module", autouse=True)
def flashqla_here():
    skip_unless_usable("flashqla", scalar_gate=True)


def _case(batch: str, HV: int, T: int = 4096):
    """GDN inputs (Qwen3-Next's gate: ``A_log``, ``dt_bias`` in kernel; q/k heads half the value heads), the loss's
    output and final-state gradients."""
    lengths = document_lengths(batch, T, seed=5)
    N = len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(6)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    H = max(HV // 2, 1)
    args = dict(q=rnd(1, T, H, K).bfloat16(), k=rnd(1, T, H, K).bfloat16(), v=rnd(1, T, HV, V).bfloat16(),
                g=rnd(1, T, HV).bfloat16(), beta=torch.sigmoid(rnd(1, T, HV)).bfloat16(), A_log=0.5 * rnd(HV),
                dt_bias=rnd(HV), initial_state=0.5 * rnd(N, HV, K, V))
    args = {n: t.requires_grad_() for n, t in args.items()}
    args.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    if N > 1:
        args["cu_seqlens"] = torch.tensor(cu_seqlens_of(lengths), device="cuda")
    do = rnd(1, T, HV, V).bfloat16()
    dht = rnd(N, HV, K, V)
    return args, do, dht


@pytest.mark.parametrize("HV", [4, 32])
@pytest.mark.parametrize("batch", ["one_sequence", "lognormal"])
@pytest.mark.parametrize("split", [None, 4])
def test_op_at_real_size_is_as_accurate_as_fla(batch, HV, split):
    args, do, dht = _case(batch, HV)
    ref = _run("gdn", args, do, dht, None)
    fla = _run("gdn", args, do, dht, "fla")
    ours = _run("gdn", {**args, "split": split}, do, dht, "flashqla")
    assert_as_accurate_as_fla(ref, fla, ours, f"flashqla, {batch} HV={HV} split={split}")
