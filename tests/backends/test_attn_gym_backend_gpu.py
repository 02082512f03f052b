"""The ``attn_gym`` backend on a Hopper GPU with attention-gym 0.0.17 (``[linear]``) and FLA installed.

Every stage (forward pass on the whole span and on a span inside it, summaries, output, backward record,
gradient summary, gradient pass over the span and over a prefix of its segments, input gradients) against
the ``torch`` backend in float64, KDA and GDN, packed segments with initial and final states; and the ops
(``kdacp.chunk_kda``, ``kdacp.chunk_gated_delta_rule``) at real sizes (16K tokens, one sequence and
log-normal documents, 32 value heads of 128, bf16) against float64 and against the ``fla`` backend: the
error of ``attn_gym`` against float64 at most three times that of ``fla`` (both are bf16 noise).

    python -m pytest -m gpu tests/backends/test_attn_gym_backend_gpu.py
"""
from __future__ import annotations

import pytest
import torch

from kdacp import chunk_gated_delta_rule, chunk_kda, reference
from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.backends.torch_backend import TorchBackend
from kdacp.bench.batches import cu_seqlens_of, document_lengths
from kdacp.reference.gdn import scalar_gate_as_kda
from tests.backends.test_attn_gym_backend import compare, sub_span_pass
from tests.backends.test_fla_backend import _stage_results
from tests.helpers import differentiable_inputs, make_kda_inputs, rel_err

pytestmark = pytest.mark.gpu

K = V = 128


def skip_unless_usable(backend: str, **call) -> None:
    """Skip unless ``backend`` resolves on this machine's GPU for a call of ``call`` (``resolve_backend``'s)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kdacp.backends import resolve_backend
    try:
        resolve_backend(backend, torch.device("cuda"), **call)
    except (ImportError, ValueError) as e:
        pytest.skip(f"the {backend} backend is not usable here: {e}")


def assert_as_accurate_as_fla(ref: dict, fla: dict, ours: dict, label: str) -> None:
    """Each result of ``ours`` (:func:`_run`'s) within 3x ``fla``'s error against the float64 ``ref`` and within
    2e-2 of ``fla``'s; the errors printed under ``label``."""
    rows = []
    for name, want in ref.items():
        e_fla, e_ours, e_pair = rel_err(fla[name], want), rel_err(ours[name], want), rel_err(ours[name], fla[name])
        rows.append(f"{name} {e_ours:.2e} / {e_fla:.2e} (vs fla {e_pair:.2e})")
        assert e_ours <= 3 * e_fla + 1e-4, (name, e_ours, e_fla)
        assert e_pair < 2e-2, (name, e_pair)
    print(f"\n[{label}] error vs float64, ours / fla: " + "; ".join(rows))


@pytest.fixture(scope="module", autouse=True)
def attn_gym_here():
    skip_unless_usable("attn_gym")


def _inputs(args: dict) -> KDAInputs:
    return KDAInputs(*(args.get(n) for n in ("q", "k", "v", "g", "beta")),
                     *(args[n].float() if n in args else None for n in ("A_log", "dt_bias")))


def _stage_case(T, HV, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h0 = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    return h0, do, dht


def test_kda_stages_match_torch_stages():
    from kdacp.backends.attn_gym_backend import AttnGymBackend
    T, H = 300, 32
    args = make_kda_inputs(1, T, H, H, K, V, gate="safe", dtype=torch.bfloat16, requires_grad=False, device="cuda",
                           seed=1, gate_shift=-4.0)
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                         safe_gate=True)
    x = _inputs(args)
    span, head, rest = Span(0, T, (0, 100, T)), Span(0, 100, (0, 100)), Span(100, T, (0, T - 100))
    h0, do, dht = _stage_case(T, H, 2)
    x64 = KDAInputs(*(None if t is None else t.double() for t in vars(x).values()))
    ref = _stage_results(TorchBackend(options), x64, span, h0.double(), do.double(), dht.double(), head)
    ref.update(sub_span_pass(TorchBackend(options), x64, span, rest, h0.double()))
    ours = AttnGymBackend(options)
    got = _stage_results(ours, x, span, h0, do, dht, head)
    got.update(sub_span_pass(ours, x, span, rest, h0))
    compare(got, ref, 2e-2)  # bf16 inputs and intermediates against the float64 reference


@pytest.mark.parametrize("gate_in_kernel", [True, False])
def test_gdn_stages_match_torch_stages_on_the_broadcast_gate(gate_in_kernel):
    from kdacp.backends.attn_gym_backend import AttnGymGDNBackend
    T, H, HV = 300, 16, 32  # grouped value heads, as Qwen3-Next
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k = (torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16()
    beta = torch.sigmoid(torch.randn(1, T, HV, device="cuda", generator=gen)).bfloat16()
    if gate_in_kernel:
        g = torch.randn(1, T, HV, device="cuda", generator=gen).bfloat16()
        A_log = 0.5 * torch.randn(HV, device="cuda", generator=gen)
        dt_bias = torch.randn(HV, device="cuda", generator=gen)
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, device="cuda", generator=gen) + 3).bfloat16()
        A_log = dt_bias = None
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel)
    x = KDAInputs(q, k, v, g, beta, A_log, dt_bias)
    g_kda, dt_kda = scalar_gate_as_kda(g, K, dt_bias)
    x64 = KDAInputs(*(None if t is None else t.double() for t in (q, k, v, g_kda, beta, A_log, dt_kda)))
    span, head, rest = Span(0, T, (0, 100, T)), Span(0, 100, (0, 100)), Span(100, T, (0, T - 100))
    h0, do, dht = _stage_case(T, HV, 4)
    ref = _stage_results(TorchBackend(options), x64, span, h0.double(), do.double(), dht.double(), head)
    ref.update(sub_span_pass(TorchBackend(options), x64, span, rest, h0.double()))
    for suffix in ("", "_kept"):  # the reference's gate gradients are per channel: GDN's sum them over K
        ref["dg" + suffix] = ref["dg" + suffix].sum(-1)
        if ref["ddt_bias" + suffix] is not None:
            ref["ddt_bias" + suffix] = ref["ddt_bias" + suffix].view(HV, K).sum(-1)
    ours = AttnGymGDNBackend(options)
    got = _stage_results(ours, x, span, h0, do, dht, head)
    got.update(sub_span_pass(ours, x, span, rest, h0))
    compare(got, ref, 2e-2)


def _real_size_case(family: str, batch: str, T: int = 4096):
    """Inputs at a real width (4096 tokens: the float64 reference's autograd at 16K tokens and 32 heads does not
    fit in an H200's memory): 32 value heads of 128 (KDA: Kimi Linear's safe gate, H = 32; GDN: Qwen3-Next's
    16 q/k heads), bf16, float32 gate parameters and initial states, and the loss's output and state gradients."""
    lengths = document_lengths(batch, T, seed=5)
    cu = torch.tensor(cu_seqlens_of(lengths), device="cuda") if len(lengths) > 1 else None
    N, HV = len(lengths), 32
    if family == "kda":
        args = make_kda_inputs(1, T, 32, HV, K, V, gate="safe", dtype=torch.bfloat16, initial_state=True,
                               cu_seqlens=cu, device="cuda", seed=6)
        args["safe_gate"] = True
    else:
        gen = torch.Generator(device="cuda").manual_seed(6)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
        args = dict(q=rnd(1, T, 16, K).bfloat16(), k=rnd(1, T, 16, K).bfloat16(), v=rnd(1, T, HV, V).bfloat16(),
                    g=rnd(1, T, HV).bfloat16(), beta=torch.sigmoid(rnd(1, T, HV)).bfloat16(), A_log=0.5 * rnd(HV),
                    dt_bias=rnd(HV), initial_state=0.5 * rnd(N, HV, K, V), use_gate_in_kernel=True,
                    use_qk_l2norm_in_kernel=True)
        args = {n: t.requires_grad_() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
        if cu is not None:
            args["cu_seqlens"] = cu
    for name in ("A_log", "dt_bias", "initial_state"):
        args[name] = args[name].detach().float().requires_grad_()
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(N, HV, K, V, device="cuda", generator=gen)
    return args, do, dht


def _run(family: str, args: dict, do, dht, backend: str | None):
    """``(o, final_state, gradients of every leaf)`` of the op on ``backend``; ``None``: the float64 reference."""
    leaves = differentiable_inputs(args)
    if backend is None:
        leaves = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
        x = {**args, **leaves}
        if family == "gdn":
            x["g"], x["dt_bias"] = scalar_gate_as_kda(x["g"], K, x["dt_bias"])  # autograd sums the broadcast back
        x.pop("safe_gate", None)
        o, final = reference.chunk_kda(**x, output_final_state=True)
    else:
        op = chunk_kda if family == "kda" else chunk_gated_delta_rule
        o, final = op(**args, output_final_state=True, backend=backend)
    loss = (o.double() * do.double()).sum() + (final.double() * dht.double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(o=o.detach(), final_state=final.detach(), **{"d" + n: g for n, g in zip(leaves, grads)})


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("batch", ["one_sequence", "lognormal"])
def test_op_at_real_size_is_as_accurate_as_fla(family, batch):
    args, do, dht = _real_size_case(family, batch)
    ref = _run(family, args, do, dht, None)
    fla = _run(family, args, do, dht, "fla")
    ours = _run(family, args, do, dht, "attn_gym")
    assert_as_accurate_as_fla(ref, fla, ours, f"attn_gym, {family} {batch}")


def test_training_runs_attention_gym_and_inference_fla():
    from kdacp.backends.call import prepare_call
    args = make_kda_inputs(1, 128, 4, 4, K, V, gate="safe", dtype=torch.bfloat16, device="cuda", seed=8)
    options = dict(scale=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=args["A_log"],
                   dt_bias=args["dt_bias"], lower_bound=-5.0, safe_gate=True)
    tensors = {n: args[n] for n in ("q", "k", "v", "g", "beta")}
    assert type(prepare_call("attn_gym", **tensors, **options).backend).__name__ == "AttnGymBackend"
    with torch.no_grad():
        assert type(prepare_call("attn_gym", **tensors, **options).backend).__name__ == "FlaBackend"
