"""The ``fla`` GDN backend (FLA's GDN kernels on the scalar gate).

CPU: where ``fla-core`` is importable, its stages under the Triton interpreter against the float64 reference
(FLA's state kernels do not run under the interpreter, so the state pass there comes from the
reference). GPU: ``kdacp.chunk_gated_delta_rule`` and a one-rank ``chunk_gated_delta_rule`` with
``backend="fla"`` against FLA's own ``chunk_gated_delta_rule`` at Qwen3-Next shapes in bf16.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from kdacp import reference
from kdacp.backends.base import KDAInputs, KDAOptions, LocalStates, Span
from kdacp.reference.gdn import gdn_gate, scalar_gate_as_kda
from tests.helpers import rel_err


def _fla_gdn_backward():
    """Skip where FLA refuses its GDN backward (Hopper with Triton >= 3.4, < 3.7.1, no tilelang)."""
    from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported
    if not fla_gated_gdn_backward_supported():
        pytest.skip("FLA 0.6.0 refuses its gated GDN backward on this GPU and Triton (FLA issue #640)")


def _fla(monkeypatch=None):
    from kdacp.backends.fla_adapter import fla_available, load_fla
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    if not torch.cuda.is_available() and monkeypatch is not None:
        # Triton's autotuner times every config on a GPU driver; under the interpreter they all compute
        # the same thing, so the first one is taken.
        import triton.runtime.autotuner as autotuner
        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config, **k: [0.0, 0.0, 0.0])
    return load_fla()


def _gdn_case(T, H, HV, K, V, *, gate_in_kernel, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V), beta=torch.sigmoid(rnd(1, T, HV)))
    if gate_in_kernel:
        x.update(g=rnd(1, T, HV), A_log=0.5 * rnd(HV), dt_bias=0.5 * rnd(HV))
    else:
        x.update(g=F.logsigmoid(rnd(1, T, HV) + 2.0))
    return {n: t.to(dtype) if n not in ("A_log", "dt_bias") else t.float() for n, t in x.items()}


def _reference(x: dict, cu, options: KDAOptions):
    """The float64 chunked intermediates of the GDN inputs ``x`` as KDA with the gate broadcast over K."""
    x = {n: t.double() for n, t in x.items()}
    g = gdn_gate(x["g"], x["A_log"], x["dt_bias"]) if options.use_gate_in_kernel else x["g"]
    g, _ = scalar_gate_as_kda(g, x["q"].shape[-1])
    q, k = x["q"], x["k"]
    if options.use_qk_l2norm_in_kernel:
        q, k = reference.l2norm(q), reference.l2norm(k)
    return reference.chunk_kda_intermediates(q, k, x["v"], g, x["beta"], scale=options.scale,
                                             cu_seqlens=torch.tensor(cu), chunk_size=options.chunk_size)


@pytest.mark.parametrize("backend", ["torch", "fla"])
def test_prepare_call_runs_gdn_on_the_scalar_gate_with_fla_only(backend):
    """Both backends get GDN's own gate (``g [1, T, HV]``, ``dt_bias [HV]``, the kind ``"scalar"``): the fla
    backend runs FLA's GDN kernels on it, the torch backend the KDA reference on its broadcast, formed inside
    the backend (:class:`kdacp.backends.gate.BroadcastGate`)."""
    from kdacp.backends.call import prepare_call
    from kdacp.ops.gdn import gdn_gate_arguments
    if backend == "fla":
        _fla()
    x = _gdn_case(20, 1, 2, 8, 8, gate_in_kernel=True, dtype=torch.float32, seed=4)
    gate = gdn_gate_arguments(x["g"], True, x["A_log"], x["dt_bias"])
    gate.pop("use_gate_in_kernel")
    call = prepare_call(backend, x["q"], x["k"], x["v"], beta=x["beta"], scale=None, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, lower_bound=None, safe_gate=False, **gate)
    assert type(call.backend).__name__ == ("BroadcastGate" if backend == "torch" else "FlaGDNBackend")
    assert call.backend.options.gate == "scalar"
    assert call.inputs.g is x["g"] and call.inputs.dt_bias is x["dt_bias"]  # no broadcast formed here
    if backend == "torch":
        assert type(call.backend.inner).__name__ == "TorchBackend" and call.backend.inner.options.gate == "channel"
        from kdacp.backends.base import Span
        chunks = call.backend.prepare(call.inputs, Span(0, 20, (0, 20)))  # the broadcast, inside the backend
        g, dt_bias = scalar_gate_as_kda(x["g"], 8, x["dt_bias"])
        assert torch.equal(chunks.g, g) and torch.equal(chunks.dt_bias, dt_bias)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs FLA's kernels under the Triton interpreter on the CPU")
@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_stages_under_the_interpreter_match_the_float64_reference(monkeypatch, gate_in_kernel):
    _fla(monkeypatch)
    from kdacp.backends.fla_gdn_backend import FlaGDNBackend
    T, H, HV, K, V = 150, 1, 2, 64, 64  # the summary kernels need K, V >= 64
    cu = (0, 1, 64, 100, 150)
    x = _gdn_case(T, H, HV, K, V, gate_in_kernel=gate_in_kernel, dtype=torch.float32, seed=2 + gate_in_kernel)
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=gate_in_kernel, use_gate_in_kernel=gate_in_kernel)
    ref = _reference(x, cu, options)
    backend, span, head = FlaGDNBackend(options), Span(0, T, cu), Span(0, 100, cu[:4])
    chunks = backend.prepare(KDAInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("A_log"), x.get("dt_bias")),
                             span)
    tol = 1e-5  # float32 kernels against float64
    got = dict(gc=chunks.saved.gc, w=chunks.w, u=chunks.u)
    for name, a in got.items():
        b = ref.gc[..., 0] if name == "gc" else getattr(ref, name)
        assert rel_err(a, b) < tol, (name, rel_err(a, b))
    cut = slice(head.start, head.end)
    ref_summary = reference.state_summary(ref.kg[:, cut], ref.w[:, cut], ref.u[:, cut], ref.gc[:, cut],
                                          options.chunk_size, torch.tensor(head.cu_seqlens))
    summary = backend.state_summary(chunks, head, with_transition=True)
    assert rel_err(summary.offset, ref_summary.offset) < tol
    assert rel_err(summary.transition, ref_summary.transition) < tol
    # the state pass from the reference (FLA's state kernel needs a GPU), then the output kernel
    states = LocalStates(None, ref.h.float(), ref.v_new.float())
    assert rel_err(backend.output(chunks, span, None, states), ref.o) < tol
    do = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(5))
    local = backend.backward_local(backend.to_saved(chunks), span, do, torch.zeros(len(cu) - 1, HV, K, V), states)
    dv_local = reference.chunk_dv_local(ref.Aqk, do.double(), options.scale, options.chunk_size, torch.tensor(cu))
    assert rel_err(local.dv, dv_local) < tol
    G = reference.state_gradient_summary(ref.qg, ref.kg, ref.w, ref.gc, do.double(), dv_local, options.scale,
                                         options.chunk_size, torch.tensor(cu))
    assert rel_err(backend.state_gradient_summary(local), G) < tol


# Qwen3-Next's GDN: 16 q/k heads, 32 value heads, K = V = 128.
H, HV, K, V = 16, 32, 128, 128


def _gpu_inputs(T: int, cu, gate_in_kernel: bool, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    args = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V), beta=torch.sigmoid(rnd(1, T, HV)))
    N = 1 if cu is None else len(cu) - 1
    args["initial_state"] = 0.1 * rnd(N, HV, K, V, dtype=torch.float32)
    if gate_in_kernel:
        args.update(g=rnd(1, T, HV), A_log=torch.rand(HV, device="cuda", generator=gen).log(),
                    dt_bias=rnd(HV, dtype=torch.float32))
    else:
        args["g"] = F.logsigmoid(rnd(1, T, HV, dtype=torch.float32) + 3.0).bfloat16()
    args = {n: t.requires_grad_() for n, t in args.items()}
    args.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel, output_final_state=True)
    if cu is not None:
        args["cu_seqlens"] = torch.tensor(cu, device="cuda")
    return args


def _run(fn, args: dict, seed: int):
    """Output, final state and the gradients of every differentiable input under random weights."""
    leaves = {n: t for n, t in args.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    o, final = fn(**args)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, device="cuda")
    dht = torch.randn(final.shape, generator=gen, device="cuda")
    grads = torch.autograd.grad((o.float() * do).sum() + (final * dht).sum(), list(leaves.values()))
    return dict(o=o, final_state=final, **{"d" + n: g for n, g in zip(leaves, grads)})


def _one_rank_cp(**args):
    import torch.distributed as dist

    from kdacp.cp import build_cp_plan
    from kdacp.ops.gdn import chunk_gated_delta_rule
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    cu = args.pop("cu_seqlens", None)
    plan = build_cp_plan(None if cu is None else cu.cpu(), batch_size=None if cu is not None else 1)
    return chunk_gated_delta_rule(**args, backend="fla", cp=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one-sequence", "packed", "gate-in-kernel"])
@pytest.mark.parametrize("entry", ["chunk", "cp-1-rank"])
def test_fla_gdn_matches_fla_chunk_gated_delta_rule(case, entry):
    """bf16 at Qwen3-Next shapes: the same kernels as FLA's op, so the results agree to bf16 rounding
    of the extra summands (outputs, final states, every gradient)."""
    fla = _fla()
    _fla_gdn_backward()
    from kdacp.ops.gdn import chunk_gated_delta_rule
    T, cu = (4096, None) if case != "packed" else (4096, [0, 1, 700, 765, 3000, 4096])
    args = _gpu_inputs(T, cu, gate_in_kernel=case == "gate-in-kernel", seed=7)
    ours = (lambda **a: chunk_gated_delta_rule(**a, backend="fla")) if entry == "chunk" else _one_rank_cp
    got = _run(ours, args, seed=8)
    want = _run(fla.chunk_gated_delta_rule, args, seed=8)
    for name, b in want.items():
        assert rel_err(got[name], b) < 2e-3, (name, rel_err(got[name], b))


@pytest.mark.gpu
@pytest.mark.parametrize("gate_in_kernel", [False, True])
def test_fla_gdn_stages_match_torch_stages(gate_in_kernel):
    """Every stage, the summaries ``S_ext``, ``M``, ``G`` included, in bf16 at Qwen3-Next's heads
    against the ``torch`` backend on the broadcast gate in float64 (its ``dg``, ``ddt_bias`` summed over K)."""
    _fla()
    _fla_gdn_backward()
    from kdacp.backends.fla_gdn_backend import FlaGDNBackend
    from kdacp.backends.torch_backend import TorchBackend
    from tests.backends.test_fla_backend import _stage_results
    T = 300
    x = _gdn_case(T, H, HV, K, V, gate_in_kernel=gate_in_kernel, dtype=torch.bfloat16, seed=11)
    x = {n: t.cuda() for n, t in x.items()}
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel)
    gdn_inputs = KDAInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x.get("A_log"), x.get("dt_bias"))
    g, dt_bias = scalar_gate_as_kda(x["g"].double(), K, x["dt_bias"].double() if gate_in_kernel else None)
    kda_inputs = KDAInputs(x["q"].double(), x["k"].double(), x["v"].double(), g, x["beta"].double(),
                           x["A_log"].double() if gate_in_kernel else None, dt_bias)
    span, head = Span(0, T, (0, 100, T)), Span(0, 100, (0, 100))
    gen = torch.Generator(device="cuda").manual_seed(12)
    h0 = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    do = torch.randn(1, T, HV, V, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(2, HV, K, V, device="cuda", generator=gen)
    ref = _stage_results(TorchBackend(options), kda_inputs, span, h0.double(), do.double(), dht.double(), head)
    got = _stage_results(FlaGDNBackend(options), gdn_inputs, span, h0, do, dht, head)
    tol = 2e-2  # bf16 inputs and intermediates against the float64 reference
    for name, b in ref.items():
        if b is not None and name.startswith("dg"):
            b = b.sum(-1)
        if b is not None and name.startswith("ddt_bias"):
            b = b.view(HV, K).sum(-1)
        a = got[name]
        assert (a is None) == (b is None), name
        assert a is None or rel_err(a, b) < tol, (name, rel_err(a, b))


@pytest.mark.gpu
def test_fla_gdn_where_fla_refuses_its_backward_trains_on_kda_kernels():
    """Where FLA refuses its GDN backward, ``backend="fla"`` with gradients runs FLA's KDA kernels on the
    broadcast gate (forward-only calls keep FLA's GDN kernels): outputs and every gradient equal the
    ``torch`` backend's within bf16 rounding."""
    _fla()
    from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported
    from kdacp.ops.gdn import chunk_gated_delta_rule
    if fla_gated_gdn_backward_supported():
        pytest.skip("FLA's GDN backward runs on this GPU")
    args = _gpu_inputs(1024, [0, 300, 1024], gate_in_kernel=True, seed=13)
    got = _run(lambda **a: chunk_gated_delta_rule(**a, backend="fla"), args, seed=14)
    want = _run(lambda **a: chunk_gated_delta_rule(**a, backend="torch"), args, seed=14)
    for name, b in want.items():
        assert rel_err(got[name], b) < 2e-2, (name, rel_err(got[name], b))
    with torch.no_grad():
        o_fwd, _ = chunk_gated_delta_rule(**{n: t.detach() if isinstance(t, torch.Tensor) else t
                                             for n, t in args.items()}, backend="fla")
    assert rel_err(o_fwd, want["o"]) < 2e-2


def _kernels(fn, args: dict, calls: int = 3) -> list:
    """The CUDA kernel names one warm call of ``fn(**args)`` launches (``torch.profiler``), sorted."""
    from torch.profiler import ProfilerActivity, profile
    fn(**args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(**args)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) % calls == 0, names
    return sorted(names[:len(names) // calls])


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [None, [0, 1, 700, 765, 3000, 4096]])
def test_fla_gdn_forward_launches_flas_kernels_and_no_others(cu):
    """A forward without initial states on FLA's GDN kernels (no gradient wanted) launches the kernels of
    FLA's own op and nothing of kdacp's: no zero initial state, no broadcast ``dt_bias``."""
    fla = _fla()
    from kdacp.ops.gdn import chunk_gated_delta_rule
    args = _gpu_inputs(4096, cu, gate_in_kernel=True, seed=15)
    args = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in args.items() if n != "initial_state"}
    args["output_final_state"] = False
    if cu is not None:
        args["cu_seqlens_cpu"] = args["cu_seqlens"].cpu()
    with torch.no_grad():
        ours = _kernels(lambda **a: chunk_gated_delta_rule(**a, backend="fla"), args)
        theirs = _kernels(fla.chunk_gated_delta_rule, args)
    assert ours == theirs


@pytest.mark.gpu
def test_pieces_state_pass_matches_the_whole_pass():
    _fla()
    from kdacp.backends.fla_gdn_backend import FlaGDNBackend
    from tests.backends.test_fla_backend import assert_pieces_pass_matches_whole
    T = 4096
    x = {n: t.cuda() for n, t in _gdn_case(T, H, HV, K, V, gate_in_kernel=True, dtype=torch.bfloat16, seed=13).items()}
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    inputs = KDAInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"])
    h0 = torch.randn(1, HV, K, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(14))
    assert_pieces_pass_matches_whole(FlaGDNBackend(options), inputs, T, h0)
