"""The ``flashqla`` backend: FlashQLA's availability and limits named before any kernel runs, and its stages and
the whole GDN op (packed documents, initial and final states, grouped value heads, the split inside the device,
context parallelism on gloo ranks) over the plain-PyTorch stand-in of FlashQLA's functions
(:mod:`tests.backends.stand_in_flashqla`) against the float64 reference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kdacp import chunk_gated_delta_rule
from kdacp.backends import BACKEND_SPECS, fla_adapter, fla_backend, flashqla_adapter, flashqla_backend
from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.backends.flashqla_adapter import flashqla_refusal
from kdacp.backends.flashqla_backend import FlashQLAGDNBackend
from kdacp.backends.gate import BroadcastGate
from kdacp.backends.registry import choose_backend
from kdacp.backends.torch_backend import TorchBackend
from tests.backends import stand_in_attn_gym, stand_in_flashqla
from tests.backends.test_attn_gym_backend import (_stage_inputs, compare, gdn_stage_case, scalar_gate_gradients,
                                                   sub_span_pass)
from tests.backends.test_fla_backend import _stage_results
from tests.helpers import rel_err
from tests.multiprocess import run_ranks
from tests.test_gdn import gdn_inputs


@pytest.fixture
def fresh_adapter():
    flashqla_adapter._load.cache_clear()
    yield
    flashqla_adapter._load.cache_clear()


def test_without_flashqla_the_request_names_the_package(monkeypatch, fresh_adapter):
    monkeypatch.setattr(flashqla_adapter, "_installed_version", lambda: None)
    with pytest.raises(ImportError, match="flash-qla is not installed.*pip install 'flash-qla==0.1.3'"):
        flashqla_adapter.require_flashqla()
    assert not flashqla_adapter.flashqla_available()


def test_another_version_is_refused(monkeypatch, fresh_adapter):
    monkeypatch.setattr(flashqla_adapter, "_installed_version", lambda: "0.1.2")
    with pytest.raises(ImportError, match="needs flash-qla==0.1.3.*found 0.1.2"):
        flashqla_adapter.require_flashqla()


def test_kernels_that_do_not_import_are_named(monkeypatch, fresh_adapter):
    def fail(module):  # as FlashQLA's package raises at import on a machine without a supported GPU
        raise ValueError("FlashQLA now support sm90, sm100, sm103, sm120 and sm121 only")
    monkeypatch.setattr(flashqla_adapter, "_installed_version", lambda: "0.1.3")
    monkeypatch.setattr(flashqla_adapter, "_import_module", fail)
    with pytest.raises(ImportError, match="flash_qla.ops.gated_delta_rule.chunk \\(ValueError: FlashQLA now support"):
        flashqla_adapter.require_flashqla()


def _meta(T=64, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16):
    q = torch.empty(1, T, H, K, dtype=dtype, device="meta")
    return q, q, torch.empty(1, T, HV, V, dtype=dtype, device="meta")


@pytest.mark.parametrize("change, words", [
    (dict(K=64), "K = V = 128, got K=64"),
    (dict(V=256), "K = V = 128, got K=128, V=256"),
    (dict(dtype=torch.float32), "all bfloat16 or all float16, got torch.float32"),
])
def test_calls_outside_flashqlas_limits_are_refused_by_name(change, words):
    assert words in flashqla_refusal(*_meta(**change))


def test_limits_that_hold():
    assert flashqla_refusal(*_meta()) is None
    assert flashqla_refusal(*_meta(dtype=torch.float16)) is None


def test_requests_refused_before_running():
    with pytest.raises(ValueError, match="backend='flashqla' needs CUDA tensors"):
        choose_backend("flashqla", torch.device("cpu"), scalar_gate=True)
    with pytest.raises(ValueError, match="does not serve KDA calls"):
        choose_backend("flashqla", torch.device("cpu"))
    args = gdn_inputs(1, 40, 1, 2, 8, 8, gate_in_kernel=False, seed=1)
    with pytest.raises(ValueError, match="backend='flashqla' needs CUDA tensors"):
        chunk_gated_delta_rule(**args, backend="flashqla")


def test_auto_never_picks_flashqla(monkeypatch):
    """Not among auto's candidates until measured: on a Hopper GPU with every package present auto stays on
    attention-gym's or FLA's kernels."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fla_adapter, "fla_available", lambda: True)
    monkeypatch.setattr(flashqla_adapter, "flashqla_available", lambda: True)
    assert BACKEND_SPECS["flashqla"].auto_priority == {}
    assert choose_backend("auto", torch.device("cuda"), scalar_gate=True).name != "flashqla"


def _summaries_on_torch(options: KDAOptions):
    """The summaries' backend on the CPU: the reference's stages on the broadcast gate."""
    return BroadcastGate(TorchBackend(replace(options, gate="channel")))


@pytest.fixture
def stand_in(monkeypatch):
    """The backend on the stand-ins (FlashQLA's functions, FLA's gate and L2 norm, the reference's summaries), and
    ``backend="flashqla"`` resolved to it on the CPU."""
    _use_stand_in(monkeypatch.setattr)


def _use_stand_in(setattr_) -> None:
    import kdacp.ops.kda
    setattr_(flashqla_backend, "load_flashqla", stand_in_flashqla.flashqla)
    setattr_(fla_backend, "load_fla", stand_in_attn_gym.fla)
    setattr_(FlashQLAGDNBackend, "_summary_backend", staticmethod(_summaries_on_torch))
    setattr_(kdacp.ops.kda, "choose_call_backend", lambda backend, device, **call: BACKEND_SPECS[backend])


K8 = 8


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_stages_over_the_stand_in_match_torch_stages(stand_in, gate_in_kernel):
    x, broadcast, options = gdn_stage_case(7, gate_in_kernel)
    T = x.q.shape[1]
    # a segment boundary off the chunk grid: the second segment's rows are cut where they are not aligned
    span, head, rest = Span(0, T, (0, 50, T)), Span(0, 50, (0, 50)), Span(50, T, (0, T - 50))
    h0, do, dht = _stage_inputs(18, T)
    ref = _stage_results(TorchBackend(options), broadcast, span, h0, do, dht, head)
    ref.update(sub_span_pass(TorchBackend(options), broadcast, span, rest, h0))
    ref.update(_rest_backward(TorchBackend(options), broadcast, span, rest, h0, do, dht))
    ours = FlashQLAGDNBackend(replace(options, gate="scalar"))
    got = _stage_results(ours, x, span, h0, do, dht, head)
    got.update(sub_span_pass(ours, x, span, rest, h0))
    got.update(_rest_backward(ours, x, span, rest, h0, do, dht))
    assert rel_err(ref["M"], torch.zeros_like(ref["M"])) > 0  # what crosses the cut weighs on the result
    compare(got, scalar_gate_gradients(ref, x.v.shape[2]), 1e-10)


def _rest_backward(backend, x: KDAInputs, span: Span, rest: Span, h0, do, dht) -> dict:
    """The backward of ``rest`` (the segments after the first) alone, from the record saved over ``span``: its
    gradient summary and its gradient pass."""
    saved = backend.to_saved(backend.prepare(x, span))
    local = backend.backward_local(saved, rest, do[:, rest.start:rest.end], h0[1:])
    G = backend.state_gradient_summary(local)
    states = backend.backward_states(local, dht[1:])
    return dict(G_rest=G, dinitial_state_rest=states.dinitial_state, dv_rest=backend.backward_inputs(states).dv)


def test_output_needs_the_state_pass_over_the_same_tokens(stand_in):
    args = gdn_inputs(1, 70, 1, 2, K8, K8, gate_in_kernel=False, seed=3)
    ours = FlashQLAGDNBackend(KDAOptions(scale=K8 ** -0.5, gate="scalar"))
    x = KDAInputs(*(args[n].detach() for n in ("q", "k", "v", "g", "beta")))
    chunks = ours.prepare(x, Span(0, 70, (0, 70)))
    states = ours.state_pass(chunks, Span(0, 30, (0, 30)), None, False)
    with pytest.raises(ValueError, match="made by its state pass over the same tokens"):
        ours.output(chunks, Span(0, 70, (0, 70)), None, states)


def _op_results(args: dict, backend: str, split=None) -> dict:
    gen = torch.Generator().manual_seed(11)
    leaves = {n: t for n, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    o, final = chunk_gated_delta_rule(**args, output_final_state=True, backend=backend, split=split)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(final.shape, generator=gen,
                                                                              dtype=final.dtype)
    grads = torch.autograd.grad((o * do).sum() + (final * dht).sum(), list(leaves.values()))
    return dict(o=o, final=final, **dict(zip(leaves, grads)))


@pytest.mark.parametrize("split", [None, 3])
def test_op_over_the_stand_in_matches_the_torch_backend(stand_in, split):
    """The whole op (autograd, saved record, initial and final states, packed documents, grouped value heads, the
    gate in kernel), whole and split inside the device into pieces whose boundaries are off the chunk grid."""
    args = gdn_inputs(1, 300, 1, 2, K8, K8, gate_in_kernel=True, cu=[0, 40, 41, 270, 300], seed=9)
    args["initial_state"] = torch.randn(4, 2, K8, K8, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(2)).requires_grad_()
    compare(_op_results(args, "flashqla", split), _op_results(args, "torch"), 1e-10)


def _cp_run(rank: int, world_size: int) -> None:
    from tests.cp.test_cp_gdn import _check
    _use_stand_in(lambda obj, name, value: setattr(obj, name, value))
    _check(rank, world_size, strategies=("p2p", "allgather"), backend="flashqla")


def test_cp_on_the_flashqla_backend_matches_reference():
    """Context parallelism on 3 gloo ranks (a through rank's summaries, a head's gradient pass over a prefix, a
    tail's pass after the head) against the token-by-token GDN recurrence."""
    run_ranks(_cp_run, 3, timeout_s=300)
