"""The layer's short convolution: its fused path (kdacp's Triton kernels; on CPU under the Triton interpreter)
against its PyTorch path, through the ``ShortConvolution`` module as the layers call it."""
from __future__ import annotations

import pytest
import torch

from kdacp.layers import ShortConvolution
from kdacp.layers.short_conv import causal_conv1d
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(out, inputs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    return torch.autograd.grad((out * w).sum(), inputs)


def test_module_fused_equals_eager_on_a_channel_shard():
    torch.manual_seed(0)
    conv = ShortConvolution(48, 4, bias=True, device=DEVICE)
    assert set(conv.state_dict()) == {"weight", "bias"} and conv.weight.shape == (48, 1, 4)  # nn.Conv1d's
    x = torch.randn(1, 40, 16, device=DEVICE, requires_grad=True)
    halo = torch.randn(1, 3, 16, device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 2, 25, 40], device=DEVICE)
    where = dict(halo=halo, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), channels=slice(16, 32))
    outs = [conv(x, fused=fused, **where) for fused in (False, True)]
    assert rel_err(outs[1], outs[0]) < 1e-6
    inputs = [x, halo, conv.weight, conv.bias]
    fused = _grads(outs[1], inputs)
    for a, e in zip(fused, _grads(outs[0], inputs)):
        assert rel_err(a, e) < 1e-6
    # only the shard's channels of the parameters get gradients
    assert fused[2][16:32].abs().sum() > 0 and fused[2][:16].abs().sum() == fused[2][32:].abs().sum() == 0


def test_fused_falls_back_to_pytorch_outside_the_kernel_widths():
    torch.manual_seed(0)
    x, w = torch.randn(1, 20, 8, device=DEVICE), torch.randn(8, 5, device=DEVICE)
    assert torch.equal(causal_conv1d(x, w, fused=True), causal_conv1d(x, w, fused=False))


@pytest.mark.parametrize("activation", ["silu", None])
def test_activation_reaches_the_kernel(activation):
    torch.manual_seed(0)
    x, w = torch.randn(1, 20, 8, device=DEVICE), torch.randn(8, 3, device=DEVICE)
    fused, eager = (causal_conv1d(x, w, fused=f, activation=activation) for f in (True, False))
    assert rel_err(fused, eager) < 1e-6
