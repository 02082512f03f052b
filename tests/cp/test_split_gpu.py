"""The split inside one GPU at real sizes: bf16 KDA (Kimi Linear's gate) and GDN at 4 heads of 128, one sequence
and packed documents, forward and backward, against the float64 reference of the same inputs; the split's error
(forced to 8 and 32 pieces) at most 1.05x that of FLA's own op on the same inputs (outputs, final states and
every input gradient). Where FLA refuses its GDN backward (FLA 0.6.0 on Hopper with Triton < 3.7.1 and no tilelang:
:func:`~kdacp.backends.fla_adapter.fla_gated_gdn_backward_supported`), GDN's baseline is kdacp's op without the
split, which then trains on FLA's KDA kernels. A forward alone (``torch.no_grad()``, as prefill runs it) is checked
against FLA's forward too: there GDN runs FLA's GDN kernels and their summaries."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kdacp import reference
from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported
from kdacp.bench.inputs import random_inputs
from kdacp.bench.timing import capture
from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.ops.kda import chunk_kda
from kdacp.reference.gdn import chunk_gated_delta_rule as reference_gdn
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, H = 8192, 4


def _case(family: str, packed: bool):
    x = random_inputs(T, H, H, 128, 128, gate=family, seed=3)
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True,
                   cu_seqlens=torch.tensor([0, 1000, 1063, 5000, T], device="cuda") if packed else None)
    if family == "kda":
        options.update(use_gate_in_kernel=True, lower_bound=-5.0, A_log=x["A_log"].float(),
                       dt_bias=x["dt_bias"].float())
        tensors = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    else:
        g = (-x["A_log"].float().exp() * F.softplus(x["g"].float() + x["dt_bias"].float())).to(torch.bfloat16)
        tensors = dict(q=x["q"], k=x["k"], v=x["v"], g=g, beta=x["beta"])
    N = 1 if not packed else 4
    tensors["initial_state"] = torch.randn(N, H, 128, 128, device="cuda") * 0.1
    return tensors, options


def _run(op, tensors: dict, options: dict, do, dfinal, dtype=None):
    leaves = {n: (t.to(dtype) if dtype else t).detach().requires_grad_() for n, t in tensors.items()}
    o, final = op(**leaves, **options)
    torch.autograd.backward([o, final], [do.to(o.dtype), dfinal.to(final.dtype)])
    return [o, final] + [leaves[n].grad for n in leaves]


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("packed", [False, True])
def test_split_error_within_fla_error(family, packed):
    fla = pytest.importorskip("fla.ops.kda" if family == "kda" else "fla.ops.gated_delta_rule")
    ours_op = chunk_kda if family == "kda" else chunk_gated_delta_rule
    baseline, baseline_name = (fla.chunk_kda if family == "kda" else fla.chunk_gated_delta_rule), "FLA's"
    if family == "gdn" and not fla_gated_gdn_backward_supported():
        baseline, baseline_name = functools.partial(ours_op, split=None, backend="fla"), "the unsplit op's"
    tensors, options = _case(family, packed)
    gen = torch.Generator("cuda").manual_seed(5)
    do = torch.randn(tensors["v"].shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    dfinal = torch.randn(tensors["initial_state"].shape, generator=gen, device="cuda")
    ref_options = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for n, v in options.items()}
    ref_op = reference.chunk_kda if family == "kda" else reference_gdn
    truth = _run(ref_op, tensors, ref_options, do, dfinal, torch.float64)
    theirs = _run(baseline, tensors, options, do, dfinal)
    names = ["o", "final_state", *tensors]
    for pieces in (8, 32):
        ours = _run(ours_op, tensors, dict(options, split=pieces, backend="fla"), do, dfinal)
        for name, t, f, o in zip(names, truth, theirs, ours):
            e_fla, e_ours = rel_err(f, t), rel_err(o, t)
            assert e_ours <= 1.05 * e_fla + 1e-6, \
                f"{name} at {pieces} pieces: {e_ours:.3e} against {baseline_name} {e_fla:.3e}"


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("packed", [False, True])
def test_split_inference_error_within_fla_error(family, packed):
    """A forward alone (``torch.no_grad()``: prefill), which runs GDN on FLA's GDN kernels even where FLA refuses
    its GDN backward: the output and final states cut into 8 and 32 pieces within 1.05x of FLA's own error."""
    fla = pytest.importorskip("fla.ops.kda" if family == "kda" else "fla.ops.gated_delta_rule")
    fla_op = fla.chunk_kda if family == "kda" else fla.chunk_gated_delta_rule
    ours_op = chunk_kda if family == "kda" else chunk_gated_delta_rule
    tensors, options = _case(family, packed)
    ref_options = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                   for n, v in options.items()}
    ref_op = reference.chunk_kda if family == "kda" else reference_gdn
    with torch.no_grad():
        truth = ref_op(**{n: t.double() for n, t in tensors.items()}, **ref_options)
        theirs = fla_op(**tensors, **options)
        for pieces in (8, 32):
            ours = ours_op(**tensors, **dict(options, split=pieces, backend="fla"))
            for name, t, f, o in zip(("o", "final_state"), truth, theirs, ours):
                e_fla, e_ours = rel_err(f, t), rel_err(o, t)
                assert e_ours <= 1.05 * e_fla + 1e-6, \
                    f"{name} at {pieces} pieces: {e_ours:.3e} against FLA's {e_fla:.3e}"


@pytest.mark.parametrize("packed", [False, True])
def test_split_replays_from_a_cuda_graph(packed):
    """KDA's forward and backward cut into 8 pieces, captured in a CUDA graph once and replayed: eager's outputs,
    final states and input gradients (the cut's plan and the pieces' boundaries were made in the warm-up, before
    the capture; a host sync or a copy from pageable memory inside would fail the capture)."""
    pytest.importorskip("fla.ops.kda")
    tensors, options = _case("kda", packed)
    leaves = {n: t.detach().requires_grad_() for n, t in tensors.items()}
    do = torch.randn(tensors["v"].shape, generator=torch.Generator("cuda").manual_seed(2), device="cuda",
                     dtype=torch.bfloat16)

    def step():
        o, final = chunk_kda(**leaves, **dict(options, split=8, backend="fla"))
        return (o, final, *torch.autograd.grad(o, list(leaves.values()), do))

    eager = [t.clone() for t in step()]
    graph, replayed = capture(step, warmup=2)
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(["o", "final_state", *leaves], replayed, eager):
        assert rel_err(got, want) < 1e-6, f"{name}: {rel_err(got, want):.2e}"
