"""The ``attn_gym`` backend on the CPU: its selection (``auto`` falls back, an explicit request names what is
missing), its limits (refused by name, or ``auto`` runs on FLA), the conversion of attention-gym's V-major
maps into kdacp's summaries against the float64 reference, and every stage and the ops over a plain-PyTorch
stand-in of attention-gym's staged cores (:mod:`tests.backends.stand_in_attn_gym`) against the ``torch``
backend in float64. Its kernels run in ``tests/backends/test_attn_gym_backend_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from kdacp import chunk_gated_delta_rule, chunk_kda, reference
from kdacp.backends import (BACKEND_SPECS, attn_gym_adapter, attn_gym_backend, call, fla_adapter, fla_backend,
                            resolve_backend)
from kdacp.backends.attn_gym_adapter import MAX_GATE_MAGNITUDE, attn_gym_refusal
from kdacp.backends.attn_gym_backend import AttnGymBackend, AttnGymGDNBackend, affine_map_of, gradient_map_of
from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.backends.torch_backend import TorchBackend
from kdacp.reference.gdn import scalar_gate_as_kda
from tests.backends import stand_in_attn_gym
from tests.backends.test_fla_backend import _stage_results
from tests.helpers import differentiable_inputs, make_kda_inputs, rel_err

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


@pytest.fixture
def fresh_adapter():
    """The adapter's memo cleared before and after (tests fake what it finds)."""
    attn_gym_adapter._load.cache_clear()
    yield
    attn_gym_adapter._load.cache_clear()


def _fake_installed(monkeypatch, version="0.0.17", failing_module=None):
    """attn-gym ``version`` seen as installed; importing ``failing_module`` raises as on a machine without the
    CuTe DSL; other stage modules yield stand-ins."""
    def fake_import(module):
        if module == failing_module:
            raise ModuleNotFoundError("No module named 'cutlass'")
        return type("Module", (), {attr: object() for _, (m, attr) in attn_gym_adapter._STAGES.items()})

    monkeypatch.setattr(attn_gym_adapter, "_installed_version", lambda: version)
    monkeypatch.setattr(attn_gym_adapter, "_import_module", fake_import)


def test_explicit_request_without_attn_gym_names_the_package(monkeypatch, fresh_adapter):
    monkeypatch.setattr(attn_gym_adapter, "_installed_version", lambda: None)
    monkeypatch.setattr(fla_adapter, "require_fla", lambda: None)
    with pytest.raises(ImportError, match=r"attn-gym is not installed; pip install 'attn-gym\[linear\]==0.0.17'"):
        resolve_backend("attn_gym", CUDA)
    assert not attn_gym_adapter.attn_gym_available()


def test_explicit_request_without_its_gpu_kernels_names_the_extra(monkeypatch, fresh_adapter):
    _fake_installed(monkeypatch, failing_module="attn_gym.linear.kda.stages")
    monkeypatch.setattr(fla_adapter, "require_fla", lambda: None)
    with pytest.raises(ImportError) as e:
        resolve_backend("attn_gym", CUDA)
    message = str(e.value)
    for part in ("attn_gym.linear.kda.stages", "No module named 'cutlass'", "nvidia-cutlass-dsl",
                 "nvidia_cutlass_dsl/dsl_packages"):
        assert part in message, message


def test_a_version_other_than_the_pinned_one_is_refused(monkeypatch, fresh_adapter):
    _fake_installed(monkeypatch, version="0.0.18")
    with pytest.raises(ImportError, match=r"needs attn-gym==0.0.17.*found 0.0.18"):
        attn_gym_adapter.require_attn_gym()


def test_explicit_request_needs_cuda_tensors():
    with pytest.raises(ValueError, match="backend='attn_gym' needs CUDA tensors, got device cpu"):
        resolve_backend("attn_gym", torch.device("cpu"))


def test_explicit_request_on_another_gpu_is_refused(monkeypatch, fresh_adapter):
    _fake_installed(monkeypatch)
    monkeypatch.setattr(fla_adapter, "require_fla", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"capability \(9, 0\) \(Hopper\), got \(8, 0\)"):
        resolve_backend("attn_gym", CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_backend("attn_gym", CUDA) == "attn_gym"


@pytest.mark.parametrize("fla, attn_gym, capability, want", [
    (True, True, (9, 0), "attn_gym"),
    (True, True, (10, 0), "fla"),    # measured on Hopper only
    (True, True, (8, 0), "fla"),
    (True, False, (9, 0), "fla"),    # not installed
    (False, True, (9, 0), "torch"),  # the attn_gym backend runs FLA's kernels too
])
def test_auto_picks_attn_gym_only_on_hopper_with_both_installed(monkeypatch, fla, attn_gym, capability, want):
    monkeypatch.setattr(fla_adapter, "fla_available", lambda: fla)
    monkeypatch.setattr(attn_gym_adapter, "attn_gym_available", lambda: attn_gym)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_backend("auto", CUDA, scalar_gate=True) == want
    assert resolve_backend("auto", torch.device("cpu"), scalar_gate=True) == "torch"
    # KDA's layer trains faster on FLA's kernels: auto never picks attention-gym for it
    assert resolve_backend("auto", CUDA) == ("fla" if fla else "torch")


def _meta(B, T, H, HV, K=128, V=128, dtype=torch.bfloat16):
    return (torch.empty(B, T, H, K, dtype=dtype, device="meta"), torch.empty(B, T, H, K, dtype=dtype, device="meta"),
            torch.empty(B, T, HV, V, dtype=dtype, device="meta"))


KIMI = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, summary_precision=None)


@pytest.mark.parametrize("change, words", [
    (dict(K=64, V=64), "K = V = 128, got K=64, V=64"),
    (dict(V=64), "K = V = 128, got K=128, V=64"),
    (dict(dtype=torch.float32), "all bfloat16 or all float16"),
    (dict(HV=64), "HV == H), got H=32, HV=64"),
    (dict(use_qk_l2norm_in_kernel=False, dtype=torch.float16), "float16 needs use_qk_l2norm_in_kernel=True"),
    (dict(summary_precision="exact"), "summary_precision='exact'"),
    (dict(use_gate_in_kernel=False), "use_gate_in_kernel=False"),
    (dict(lower_bound=None), "lower_bound=None"),
    (dict(lower_bound=-6.0), "lower_bound=-6.0"),
])
def test_kda_calls_outside_attention_gyms_limits_are_refused_by_name(change, words):
    shape = dict(B=1, T=1024, H=32, HV=32, K=128, V=128, dtype=torch.bfloat16)
    options = dict(KIMI)
    for name, value in change.items():
        (shape if name in shape else options)[name] = value
    q, k, v = _meta(**shape)
    assert attn_gym_refusal(*_meta(1, 1024, 32, 32), scalar_gate=False, **KIMI) is None
    reason = attn_gym_refusal(q, k, v, scalar_gate=False, **options)
    assert reason is not None and words in reason, reason


def test_limits_that_hold():
    # float16 with the L2 norm in kernel; the gate's bound at attention-gym's own limit
    assert attn_gym_refusal(*_meta(1, 64, 4, 4, dtype=torch.float16), scalar_gate=False, **KIMI) is None
    at_limit = dict(KIMI, lower_bound=-MAX_GATE_MAGNITUDE)
    assert attn_gym_refusal(*_meta(1, 64, 4, 4), scalar_gate=False, **at_limit) is None
    # GDN: grouped value heads and any gate (plain, or softplus in kernel without a bound)
    for options in (dict(KIMI, lower_bound=None), dict(KIMI, use_gate_in_kernel=False, lower_bound=None)):
        assert attn_gym_refusal(*_meta(1, 64, 4, 8), scalar_gate=True, **options) is None


def test_gdn_tensors_past_int32_offsets_are_refused():
    options = dict(KIMI, lower_bound=None)
    T = 2 ** 31 // (16 * 128)  # B*T*HV*128 == 2**31: the largest attention-gym's GDN kernels index
    assert attn_gym_refusal(*_meta(1, T, 16, 16), scalar_gate=True, **options) is None
    reason = attn_gym_refusal(*_meta(1, T + 1, 16, 16), scalar_gate=True, **options)
    assert "int32 offsets" in reason and f"B*T={T + 1}, HV=16" in reason
    assert "int32 offsets" in attn_gym_refusal(*_meta(2, T // 2 + 1, 16, 16), scalar_gate=True, **options)


def test_the_gate_bound_is_attention_gyms():
    constants = pytest.importorskip("attn_gym.linear.kda.constants")
    assert MAX_GATE_MAGNITUDE == pytest.approx(constants.MAX_GATE_LOWER_BOUND_MAGNITUDE, abs=1e-12)


def _fake_hopper_with_both(monkeypatch):
    monkeypatch.setattr(fla_adapter, "fla_available", lambda: True)
    monkeypatch.setattr(fla_adapter, "require_fla", lambda: None)
    monkeypatch.setattr(attn_gym_adapter, "attn_gym_available", lambda: True)
    monkeypatch.setattr(attn_gym_adapter, "require_attn_gym", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("requested", ["auto", "attn_gym"])
def test_a_call_outside_the_limits_runs_on_fla_under_auto_and_is_refused_by_name(monkeypatch, requested):
    _fake_hopper_with_both(monkeypatch)
    q, k, v = _meta(1, 64, 4, 4, K=64, V=64)
    arguments = dict(scalar_gate=True, **dict(KIMI, lower_bound=None))
    if requested == "auto":
        assert call.choose_call_backend("auto", CUDA, q, k, v, **arguments).name == "fla"
    else:
        with pytest.raises(ValueError, match=r"backend='attn_gym' cannot run this call: .*K = V = 128"):
            call.choose_call_backend("attn_gym", CUDA, q, k, v, **arguments)
    assert call.choose_call_backend(requested, CUDA, *_meta(1, 64, 4, 4), **arguments).name == "attn_gym"


@pytest.mark.parametrize("requested, scalar_gate, want", [
    ("auto", True, "attn_gym"),      # GDN trains faster on attention-gym's core
    ("auto", False, "fla"),          # KDA's layer trains faster on FLA's kernels
    ("attn_gym", False, "attn_gym"),  # asked for by name
])
def test_auto_runs_only_gdn_on_attention_gym(monkeypatch, requested, scalar_gate, want):
    _fake_hopper_with_both(monkeypatch)
    arguments = dict(KIMI, lower_bound=None if scalar_gate else KIMI["lower_bound"])
    got = call.choose_call_backend(requested, CUDA, *_meta(1, 64, 4, 4), scalar_gate=scalar_gate, **arguments)
    assert got.name == want


def test_chunk_kda_refuses_attn_gym_on_the_cpu_before_running():
    x = make_kda_inputs(1, 64, 2, 2, 8, 8, gate="safe", dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="backend='attn_gym' needs CUDA tensors"):
        chunk_kda(**x, backend="attn_gym")


def _segment(seed: int, T=70, H=2, K=8):
    """A float64 segment (V == K, so the identity is a state) and its reference outputs and final state from a
    given initial state, as a function."""
    x = make_kda_inputs(1, T, H, H, K, K, gate="plain", seed=seed, requires_grad=False)
    x["g"] = 0.02 * x["g"]  # a slow decay: what enters the segment weighs on what leaves it

    def run(initial_state, **kwargs):
        return reference.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=initial_state,
                                   output_final_state=True, chunk_size=64, **kwargs)
    return x, run


def test_forward_maps_convert_to_kdacps_summary():
    """attention-gym's map ``[B; A]`` with ``H_out = H_in A + B`` on V-major states, built from the reference
    final states, gives back kdacp's ``(S_ext, M)`` with ``S_out = M S_in + S_ext``."""
    _, run = _segment(1)
    K, H = 8, 2
    zero = torch.zeros(1, H, K, K, dtype=torch.float64)
    S_ext = run(zero)[1]
    A = run(torch.eye(K, dtype=torch.float64).expand(1, H, K, K))[1].transpose(-1, -2) - S_ext.transpose(-1, -2)
    maps = torch.cat([S_ext.transpose(-1, -2), A], dim=-2)  # [1, H, V + K, K]
    S_in = torch.randn(1, H, K, K, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    H_out = S_in.transpose(-1, -2) @ maps[..., K:, :] + maps[..., :K, :]  # attention-gym's merge_state
    assert rel_err(H_out.transpose(-1, -2), run(S_in)[1]) < 1e-12  # the map holds for any state
    summary = affine_map_of(maps)
    assert summary.offset.shape == (1, H, K, K) and summary.offset.is_contiguous()
    assert rel_err(summary.transition @ S_in + summary.offset, run(S_in)[1]) < 1e-12
    assert affine_map_of(maps, with_transition=False).transition is None
    # the mechanism is seen: the map read without the transposes is not the summary
    assert rel_err(maps[..., K:, :] @ S_in + maps[..., :K, :].transpose(-1, -2), run(S_in)[1]) > 1e-3


def test_reverse_maps_convert_to_kdacps_gradient_summary():
    """attention-gym's reverse map ``[C; R]`` with ``dH_in = dH_out R + C`` gives kdacp's ``(G, M)`` with
    ``dS_in = M^T dS_out + G``, the initial state's gradient the reference's autograd gives."""
    x, run = _segment(3)
    K, H, T = 8, 2, 70
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(1, T, H, K, dtype=torch.float64, generator=gen)
    M = (run(torch.eye(K, dtype=torch.float64).expand(1, H, K, K))[1]
         - run(torch.zeros(1, H, K, K, dtype=torch.float64))[1])

    def dinitial(dS_out):
        S_in = torch.randn(1, H, K, K, dtype=torch.float64, generator=gen).requires_grad_()
        o, S_out = run(S_in)
        return torch.autograd.grad((o * do).sum() + (S_out * dS_out).sum(), S_in)[0]

    G = dinitial(torch.zeros(1, H, K, K, dtype=torch.float64))
    maps = torch.cat([G.transpose(-1, -2), M], dim=-2)  # [C; R], R = M
    dS_out = torch.randn(1, H, K, K, dtype=torch.float64, generator=gen)
    dH_in = dS_out.transpose(-1, -2) @ maps[..., K:, :] + maps[..., :K, :]  # attention-gym's fold
    want = dinitial(dS_out)
    assert rel_err(dH_in.transpose(-1, -2), want) < 1e-12
    G_got, M_got = gradient_map_of(maps)
    assert rel_err(M_got.transpose(-1, -2) @ dS_out + G_got, want) < 1e-12
    # the mechanism is seen: M in place of M^T is another gradient
    assert rel_err(M_got @ dS_out + G_got, want) > 1e-3


def sub_span_pass(backend, x: KDAInputs, span: Span, rest: Span, h0):
    """The forward pass and the summary of ``rest`` (the segments after the first) alone, from a handle prepared
    on ``span``."""
    chunks = backend.prepare(x, span)
    states = backend.state_pass(chunks, rest, h0[1:], True)
    summary = backend.state_summary(chunks, rest, True)
    return dict(o_rest=backend.output(chunks, rest, h0[1:], states), final_rest=states.final_state,
                S_ext_rest=summary.offset, M_rest=summary.transition)


def compare(got: dict, ref: dict, tol: float):
    for name, b in ref.items():
        a = got[name]
        assert (a is None) == (b is None), name
        assert a is None or rel_err(a, b) < tol, (name, rel_err(a, b))


@pytest.fixture
def stand_in(monkeypatch):
    """The backend on :mod:`tests.backends.stand_in_attn_gym`, and the ops resolving ``"attn_gym"`` to it."""
    monkeypatch.setattr(attn_gym_backend, "load_attn_gym", stand_in_attn_gym.attn_gym)
    monkeypatch.setattr(fla_backend, "load_fla", stand_in_attn_gym.fla)
    import kdacp.ops.kda
    monkeypatch.setattr(kdacp.ops.kda, "choose_call_backend", lambda backend, device, **call: BACKEND_SPECS[backend])


K8 = 8


def _stage_inputs(seed: int, T: int):
    gen = torch.Generator().manual_seed(seed)
    h0 = torch.randn(2, 2, K8, K8, dtype=torch.float64, generator=gen)
    do = torch.randn(1, T, 2, K8, dtype=torch.float64, generator=gen)
    dht = torch.randn(2, 2, K8, K8, dtype=torch.float64, generator=gen)
    return h0, do, dht


def test_kda_stages_over_the_stand_in_match_torch_stages(stand_in):
    T = 150
    x = make_kda_inputs(1, T, 2, 2, K8, K8, gate="safe", seed=5, requires_grad=False, gate_shift=-4.0)
    options = KDAOptions(scale=K8 ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                         safe_gate=True)
    inputs = KDAInputs(*(x.get(n) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")))
    span, head, rest = Span(0, T, (0, 50, T)), Span(0, 50, (0, 50)), Span(50, T, (0, T - 50))
    h0, do, dht = _stage_inputs(6, T)
    results = []
    for backend in (TorchBackend(options), AttnGymBackend(options)):
        r = _stage_results(backend, inputs, span, h0, do, dht, head)
        r.update(sub_span_pass(backend, inputs, span, rest, h0))
        results.append(r)
    ref, got = results
    assert rel_err(ref["M"], torch.zeros_like(ref["M"])) > 0  # what crosses the cut weighs on the result
    compare(got, ref, 1e-10)


def gdn_stage_case(seed: int, gate_in_kernel: bool, T: int = 150, H: int = 1, HV: int = 2):
    """``(inputs, broadcast, options)``: GDN's stage inputs (scalar gate ``[1, T, HV]``, ``dt_bias [HV]``), the same
    with the gate broadcast over ``K`` for the ``torch`` backend's KDA stages, and the options (q/k L2 norm in kernel,
    the gate in kernel or a natural-log one)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K8, dtype=torch.float64, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, K8, dtype=torch.float64, generator=gen)
    beta = torch.sigmoid(torch.randn(1, T, HV, dtype=torch.float64, generator=gen))
    g = torch.randn(1, T, HV, dtype=torch.float64, generator=gen) - 4.0
    A_log, dt_bias = (torch.randn(HV, dtype=torch.float64, generator=gen) for _ in range(2))
    if not gate_in_kernel:
        g, A_log, dt_bias = torch.nn.functional.logsigmoid(g + 8.0), None, None
    options = KDAOptions(scale=K8 ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel)
    g_kda, dt_kda = scalar_gate_as_kda(g, K8, dt_bias)
    return KDAInputs(q, k, v, g, beta, A_log, dt_bias), KDAInputs(q, k, v, g_kda, beta, A_log, dt_kda), options


def scalar_gate_gradients(ref: dict, HV: int) -> dict:
    """``ref`` (stage results of the ``torch`` backend on the broadcast gate) with its gate gradients summed over
    ``K``, as GDN's scalar gate receives them."""
    ref = dict(ref)
    for name in [n for n in ref if n.startswith(("dg", "ddt_bias")) and ref[n] is not None]:
        ref[name] = ref[name].view(HV, K8).sum(-1) if name.startswith("ddt_bias") else ref[name].sum(-1)
    return ref


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_gdn_stages_over_the_stand_in_match_torch_stages(stand_in, gate_in_kernel):
    x, broadcast, options = gdn_stage_case(7, gate_in_kernel)
    T = x.q.shape[1]
    span, head, rest = Span(0, T, (0, 50, T)), Span(0, 50, (0, 50)), Span(50, T, (0, T - 50))
    h0, do, dht = _stage_inputs(8, T)
    ref = _stage_results(TorchBackend(options), broadcast, span, h0, do, dht, head)
    ref.update(sub_span_pass(TorchBackend(options), broadcast, span, rest, h0))
    ours = AttnGymGDNBackend(options)
    got = _stage_results(ours, x, span, h0, do, dht, head)
    got.update(sub_span_pass(ours, x, span, rest, h0))
    compare(got, scalar_gate_gradients(ref, x.v.shape[2]), 1e-10)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_ops_over_the_stand_in_match_the_torch_backend(stand_in, family):
    """The whole op (autograd, saved record, initial and final states, packed documents) on ``attn_gym``."""
    cu = torch.tensor([0, 40, 41, 170, 200])
    x = make_kda_inputs(1, 200, 2, 4 if family == "gdn" else 2, K8, K8, gate="safe" if family == "kda" else "default",
                        initial_state=True, cu_seqlens=cu, seed=9, gate_shift=-4.0)
    if family == "gdn":  # one gate per value head, dt_bias [HV]
        x["g"] = x["g"][..., 0].detach().requires_grad_()
        x["dt_bias"] = x["dt_bias"].detach()[:4].requires_grad_()
    op = chunk_kda if family == "kda" else chunk_gated_delta_rule
    gen = torch.Generator().manual_seed(10)
    do = torch.randn(1, 200, x["v"].shape[2], K8, dtype=torch.float64, generator=gen)
    dht = torch.randn(4, x["v"].shape[2], K8, K8, dtype=torch.float64, generator=gen)
    leaves = differentiable_inputs(x)
    results = []
    for backend in ("torch", "attn_gym"):
        o, final = op(**x, output_final_state=True, backend=backend)
        grads = torch.autograd.grad((o * do).sum() + (final * dht).sum(), list(leaves.values()))
        results.append(dict(o=o, final=final, **dict(zip(leaves, grads))))
    compare(results[1], results[0], 1e-10)


def test_a_second_gradient_pass_rebuilds_the_released_handle(stand_in):
    """attention-gym's backward ``run`` releases its handle: a second pass over the same record (a rank of
    several positions runs two) rebuilds it, and gives what the first gave."""
    T = 100
    x = make_kda_inputs(1, T, 2, 2, K8, K8, gate="safe", seed=11, requires_grad=False)
    options = KDAOptions(scale=K8 ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)
    backend = AttnGymBackend(options)
    span = Span(0, T, (0, 30, T))
    chunks = backend.prepare(KDAInputs(*(x.get(n) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))), span)
    h0, do, dht = _stage_inputs(12, T)
    local = backend.backward_local(backend.to_saved(chunks), span, do, h0)
    first = backend.backward_states(local, dht)
    second = backend.backward_states(local, dht)
    assert local.handle is not first.saved and rel_err(second.dinitial_state, first.dinitial_state) < 1e-14
    with pytest.raises(AssertionError, match="run twice"):  # the stand-in's handle is released as attention-gym's
        local.handle.run(None)
