"""``kdacp.compile.run_opaque`` on one process: a region that reads an int64 tensor's values on the host (as the
token mixer reads the document boundaries) compiles into one graph that a new batch of boundaries replays, with
the outputs and every gradient of eager mode; compiled directly, the same region does not compile in one graph. The models under ``kdacp.parallelize``: tests/models/test_compile_cp.py."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch._dynamo.testing

from kdacp.compile import hold_for_regions, run_opaque
from tests.helpers import rel_err


@dataclass(frozen=True)
class _SegmentScan:
    """A cumulative sum of ``x [T, C] * w [C]`` (plus ``bias [C]`` if given) restarting at each boundary of
    ``cu [N+1]``, whose values it reads on the host; with ``total``, also each segment's sum ``[N, C]``."""

    total: bool

    def __call__(self, x, cu, w, bias):
        y = x * w if bias is None else x * w + bias
        parts = [y[s:e].cumsum(0) for s, e in zip(cu.tolist(), cu[1:].tolist())]
        out = torch.cat(parts)
        return (out, torch.stack([p[-1] for p in parts])) if self.total else (out,)

    def fake(self, x, cu, w, bias):
        out = x.new_empty(x.shape)
        return (out, x.new_empty(cu.shape[0] - 1, x.shape[1])) if self.total else (out,)


def _loss(x, cu, w, bias, total: bool, opaque: bool):
    """A loss through the region, with traced work before (``sin``) and after it (a square)."""
    inputs = (x.sin(), cu, w, bias)
    outs = run_opaque(_SegmentScan, (total,), *inputs) if opaque else _SegmentScan(total)(*inputs)
    return sum((o ** 2).sum() for o in outs)


def _gradients(fn, x, cu, w, bias, total, opaque):
    params = [t for t in (x, w, bias) if t is not None]
    for p in params:
        p.grad = None
    loss = fn(x, cu, w, bias, total, opaque)
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in params]


@pytest.mark.parametrize("total, with_bias", [(False, True), (True, False)])
def test_opaque_region_compiles_once_and_matches_eager(total, with_bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 3, generator=g, requires_grad=True), torch.randn(3, generator=g, requires_grad=True)
    bias = torch.randn(3, generator=g, requires_grad=True) if with_bias else None  # a None input otherwise
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    for cu in ([0, 5, 12], [0, 9, 12], [0, 1, 12]):  # new boundaries, same count: the same graph
        cu = torch.tensor(cu)
        eager = _gradients(_loss, x, cu, w, bias, total, True)
        got = _gradients(compiled, x, cu, w, bias, total, True)
        for e, c in zip(eager, got):
            assert rel_err(c, e) < 1e-6
    assert counter.frame_count == 1


# The failing backward compilation makes autograd's anomaly mode print the forward's traceback as a warning:
# the failure this test expects, not a problem of the run.
@pytest.mark.filterwarnings("ignore:Error detected in CumsumBackward0:UserWarning")
def test_region_compiled_directly_does_not_trace():
    """The mechanism matters: without run_opaque the boundaries read on the host become data-dependent sizes,
    which one graph (``fullgraph=True``, torchtitan's per-block compile) does not compile (torch 2.13: the
    backward's compilation fails on a guard on them)."""
    x, w = torch.randn(12, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        torch.compile(_loss, backend="aot_eager", fullgraph=True)(x, torch.tensor([0, 5, 12]), w, None, False, False)


@pytest.mark.slow
def test_opaque_region_under_inductor():
    """Inductor checks every custom op's output strides against its fake implementation's: the region's input a
    transposed view (its gradient computed in another layout), the op's outputs and gradients still match."""
    g = torch.Generator().manual_seed(1)
    x_t, w = torch.randn(3, 12, generator=g, requires_grad=True), torch.randn(3, generator=g, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    for cu in ([0, 5, 12], [0, 9, 12]):
        cu = torch.tensor(cu)
        want = _gradients(lambda *a: _loss(x_t.t(), *a[1:]), x_t, cu, w, None, True, True)
        got = _gradients(lambda *a: compiled(x_t.t(), *a[1:]), x_t, cu, w, None, True, True)
        for e, c in zip(want, got):
            assert rel_err(c, e) < 1e-5
    assert counter.frame_count == 1


def test_document_count_marked_dynamic_compiles_once():
    """The number of boundaries is a shape: marked dynamic (``torch._dynamo.mark_dynamic(cu_seqlens, 0)``), batches
    with other document counts replay the same graph too."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(12, 3, generator=g, requires_grad=True), torch.randn(3, generator=g, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True)
    for cu in ([0, 5, 12], [0, 2, 9, 12], [0, 1, 2, 3, 12]):
        cu = torch.tensor(cu)
        torch._dynamo.mark_dynamic(cu, 0)
        for e, c in zip(_gradients(_loss, x, cu, w, None, True, True), _gradients(compiled, x, cu, w, None, True, True)):
            assert rel_err(c, e) < 1e-6
    assert counter.frame_count == 1


def _loss_through_copy(x, cu, w):
    """The region's first input made differentiable by in-place copies into slices of a new tensor (how Hugging
    Face's MLA builds its keys): dynamo's record of ``requires_grad`` for that tensor stays False."""
    y = x.new_empty(x.shape)
    y[:, :1].copy_(x[:, :1].sin())
    y[:, 1:].copy_(x[:, 1:].cos())
    out, = run_opaque(_SegmentScan, (False,), y, cu, w, None)
    return (out ** 2).sum()


def test_input_made_differentiable_in_place_gets_its_gradient():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(12, 3, generator=g, requires_grad=True), torch.randn(3, generator=g, requires_grad=True)
    cu = torch.tensor([0, 5, 12])
    grads = []
    for fn in (_loss_through_copy, torch.compile(_loss_through_copy, backend="aot_eager", fullgraph=True)):
        x.grad = w.grad = None
        fn(x, cu, w).backward()
        assert x.grad is not None, "no gradient reached the input made differentiable in place"
        grads.append((x.grad.clone(), w.grad.clone()))
    for e, c in zip(*grads):
        assert rel_err(c, e) < 1e-6


@dataclass(frozen=True)
class _ScaledBy:
    """``x * owner.scale``: a region whose setting is an object (as the token mixers' hooks are)."""

    owner: object

    def __call__(self, x):
        return (x * self.owner.scale,)

    def fake(self, x):
        return (x.new_empty(x.shape),)


class _Owner:
    def __init__(self, scale: float, held: bool):
        self.scale = scale
        if held:
            hold_for_regions(self)


def _strict_constant_call(tx, fn, name, args, kwargs):
    """torch 2.11's conversion of a constant function's arguments (2.13 also passes objects, guarded by
    identity): constants and tensors only."""
    from torch._dynamo.source import ConstantSource
    def convert(x):
        return x.get_real_value() if x.is_tensor() else x.as_python_constant()
    result = fn(*map(convert, args), **{k: convert(v) for k, v in kwargs.items()})
    return tx.output.register_attr_or_module(result, name, source=ConstantSource(name))


@pytest.mark.parametrize("held", [True, False])
def test_object_settings_compile_where_dynamo_passes_constants_only(monkeypatch, held):
    """A region's object settings reach compiled code as held keys, so the graph compiles where dynamo hands a
    constant function nothing but constants (torch 2.11, emulated). Fails, as on an H200 with torch 2.11, when
    the object is passed itself (here: not held, so the lookup refuses it)."""
    import torch._dynamo.variables.functions as dynamo_functions
    monkeypatch.setattr(dynamo_functions, "invoke_and_store_as_constant", _strict_constant_call)
    torch._dynamo.reset()
    owner = _Owner(3.0, held)
    x = torch.randn(4)
    compiled = torch.compile(lambda t: run_opaque(_ScaledBy, (owner,), t)[0] + 1, backend="aot_eager", fullgraph=True)
    if held:
        assert torch.equal(compiled(x), x * 3.0 + 1)
    else:
        with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="hold_for_regions"):
            compiled(x)


def _cudagraph_blockers(fn, *args) -> list:
    """Compile ``fn`` with AOTAutograd and run it forward and backward on ``args``: for the forward graph and the
    backward graph, the first node Inductor would keep out of a CUDA graph (its target), or None."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    found = []

    def record(gm, example_inputs):
        node = get_first_incompatible_cudagraph_node(gm)
        found.append(None if node is None else node.target)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)(*args).backward()
    return found


def test_a_region_reading_boundaries_stays_out_of_cuda_graphs():
    """A region given the boundaries launches what their values say: a CUDA graph recorded on one batch would
    replay that batch's work on the next (``mode="reduce-overhead"``). Its forward and backward ops are the ones
    Inductor keeps out of CUDA graphs; a region of floating tensors alone is not kept out."""
    x, w = torch.randn(12, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    blockers = _cudagraph_blockers(_loss, x, torch.tensor([0, 5, 12]), w, None, False, True)
    assert [str(b) for b in blockers] == ["kdacp.opaque_region_reading_values.default",
                                          "kdacp.opaque_region_reading_values_backward.default"]
    owner = _Owner(2.0, held=True)
    scaled = lambda t: run_opaque(_ScaledBy, (owner,), t)[0].sum()  # noqa: E731
    assert _cudagraph_blockers(scaled, torch.randn(4, requires_grad=True)) == [None, None]
