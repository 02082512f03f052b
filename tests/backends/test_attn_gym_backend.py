"""The ``attn_gym`` backend on the CPU: its selection (``auto`` falls back, an explicit request names what is
missing), its limits (refused by name, or ``auto`` runs on FLA), and the conversion of attention-gym's V-major
maps into kdacp's summaries against the float64 reference. Its kernels run in
``tests/backends/test_attn_gym_backend_gpu.py``."""
from __future__ import annotations

import pytest
import torch

from kdacp import reference
from kdacp.backends import attn_gym_adapter, call, fla_adapter, resolve_backend
from kdacp.backends.attn_gym_adapter import MAX_GATE_MAGNITUDE, attn_gym_refusal
from kdacp.backends.attn_gym_backend import affine_map_of, gradient_map_of
from tests.helpers import make_kda_inputs, rel_err

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
    assert resolve_backend("auto", CUDA) == want
    assert resolve_backend("auto", torch.device("cpu")) == "torch"


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


@pytest.mark.parametrize("requested", ["auto", "attn_gym"])
def test_a_call_outside_the_limits_runs_on_fla_under_auto_and_is_refused_by_name(monkeypatch, requested):
    monkeypatch.setattr(call, "resolve_backend", lambda backend, device: "attn_gym")
    q, k, v = _meta(1, 64, 4, 4, K=64, V=64)
    arguments = dict(scalar_gate=False, **KIMI)
    if requested == "auto":
        assert call.call_backend("auto", CUDA, q, k, v, **arguments) == "fla"
    else:
        with pytest.raises(ValueError, match=r"backend='attn_gym' cannot run this call: .*K = V = 128"):
            call.call_backend("attn_gym", CUDA, q, k, v, **arguments)
    assert call.call_backend(requested, CUDA, *_meta(1, 64, 4, 4), **arguments) == "attn_gym"


def test_chunk_kda_refuses_attn_gym_on_the_cpu_before_running():
    from kdacp import chunk_kda
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
