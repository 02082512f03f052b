"""Determinism on one GPU: two runs on the same inputs give bitwise-equal outputs and gradients, for
the op (``fla`` backend, packed, initial states, Kimi Linear's safe gate), the summary kernels and
the layer. FLA 0.6.0's KDA, convolution and norm kernels use no atomics, and neither do kdacp's."""
import pytest
import torch

from kdacp.kernels import state_gradient_summary, state_summary
from kdacp.layers import KimiDeltaAttention
from kdacp.ops.kda import chunk_kda
from tests.helpers import differentiable_inputs, make_kda_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fla():
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")


def _bitwise(runs: list[list[torch.Tensor]], what: str) -> None:
    first, second = runs
    assert len(first) == len(second)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"{what}: result {i} differs between two runs"


def test_op_is_deterministic():
    _fla()
    cu = torch.tensor([0, 100, 1000, 1500, 4096], device="cuda")
    args = make_kda_inputs(1, 4096, 32, 32, 128, 128, gate="safe", dtype=torch.bfloat16, initial_state=True,
                           cu_seqlens=cu, device="cuda", seed=5)
    args["initial_state"] = args["initial_state"].detach().float().requires_grad_()
    leaves = list(differentiable_inputs(args).values())
    do = torch.randn(1, 4096, 32, 128, device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator("cuda").manual_seed(6))
    runs = []
    for _ in range(2):
        o, final = chunk_kda(**args, output_final_state=True, backend="fla")
        grads = torch.autograd.grad((o.float() * do.float()).sum() + final.sum(), leaves)
        runs.append([o, final, *grads])
    _bitwise(runs, "chunk_kda")


def test_summary_kernels_are_deterministic():
    """Real chunked-KDA intermediates (random ones make the transitions explode to Inf and NaN, which
    ``torch.equal`` never calls equal), 32 heads of 128, two packed sequences."""
    from tests.kernels.test_summary_kernels import make
    x, _ = make(1, 2048, 32, 128, 128, torch.bfloat16, cu=(0, 700, 2048))
    cu = torch.tensor([0, 700, 2048])
    runs = [[*state_summary(x["kg"], x["w"], x["u"], x["gc"], output="both", cu_seqlens=cu),
             state_gradient_summary(x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], 0.1, cu_seqlens=cu)]
            for _ in range(2)]
    assert all(torch.isfinite(t).all() for t in runs[0])
    _bitwise(runs, "summary kernels")


def test_layer_is_deterministic():
    _fla()
    torch.manual_seed(0)
    layer = KimiDeltaAttention(1024, 8, head_k_dim=128, head_v_dim=128, backend="fla", device="cuda",
                               dtype=torch.bfloat16)
    x = torch.randn(1, 4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 700, 3000, 4096], device="cuda")
    runs = []
    for _ in range(2):
        y = layer(x, cu_seqlens=cu)[0]
        runs.append([y, *torch.autograd.grad(y.float().square().sum(), [x, *layer.parameters()])])
    _bitwise(runs, "KimiDeltaAttention")
