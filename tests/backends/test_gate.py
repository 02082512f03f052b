"""The gate's kind: a scalar (GDN) gate on a backend of the per-channel gate, through
:class:`kdacp.backends.gate.BroadcastGate`, the one place it is broadcast over ``K``."""
from __future__ import annotations

import pytest
import torch

from kdacp.backends.base import KDAInputs, KDAOptions, LocalGrads, Span
from kdacp.backends.gate import BroadcastGate
from kdacp.reference.gdn import scalar_gate_as_kda


class _Inner:
    """A per-channel backend's two gate stages: ``prepare`` keeps what it gets, ``backward_inputs`` returns the
    per-channel gradients it is given in float32 (as FLA's KDA kernels may)."""

    name, parallel_pieces, summary_pieces = "inner", True, True

    def __init__(self, options, grads):
        self.options, self.grads, self.got = options, grads, None

    def prepare(self, inputs, span):
        self.got = inputs
        return "chunks"

    def state_pass(self, chunks, span, initial_state, output_final_state):
        return ("state_pass", chunks)

    def backward_inputs(self, states):
        return self.grads


def test_options_name_a_gate_kind():
    assert KDAOptions(scale=1.0).gate == "channel"
    with pytest.raises(ValueError, match="gate must be one of"):
        KDAOptions(scale=1.0, gate="head")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_broadcast_gate_hands_the_inner_backend_the_broadcast_and_sums_gradients_back(dtype):
    T, H, HV, K, V = 5, 1, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    inputs = KDAInputs(rnd(1, T, H, K).to(dtype), rnd(1, T, H, K).to(dtype), rnd(1, T, HV, V).to(dtype),
                       rnd(1, T, HV).to(dtype), rnd(1, T, HV).to(dtype), rnd(HV), rnd(HV))
    dg, ddt_bias = rnd(1, T, HV, K), rnd(HV * K)
    inner = _Inner(KDAOptions(scale=1.0, use_gate_in_kernel=True),
                   LocalGrads(*(rnd(1, T, H, K),) * 2, rnd(1, T, HV, V), dg, rnd(1, T, HV), rnd(HV), ddt_bias))
    backend = BroadcastGate(inner)
    assert backend.options.gate == "scalar" and backend.name == "inner"
    span = Span(0, T, (0, T))
    assert backend.prepare(inputs, span) == "chunks"
    g, dt_bias = scalar_gate_as_kda(inputs.g, K, inputs.dt_bias)
    assert torch.equal(inner.got.g, g) and torch.equal(inner.got.dt_bias, dt_bias) and inner.got.q is inputs.q
    assert backend.state_pass("chunks", span, None, False) == ("state_pass", "chunks")  # the inner's own stage
    grads = backend.backward_inputs(None)
    # as autograd sums the broadcast's gradient, once cast to the inputs' dtypes
    leaves = inputs.g.detach().requires_grad_(), inputs.dt_bias.detach().requires_grad_()
    g, dt_bias = scalar_gate_as_kda(*leaves[:1], K, leaves[1])
    want = torch.autograd.grad((g, dt_bias), leaves, (dg.to(dtype), ddt_bias))
    assert grads.dg.dtype == dtype and torch.equal(grads.dg, want[0])
    assert torch.equal(grads.ddt_bias, want[1]) and grads.dq is inner.grads.dq
    with pytest.raises(ValueError, match="per-channel gate"):
        BroadcastGate(backend)
