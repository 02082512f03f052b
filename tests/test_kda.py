"""``kdacp.ops.kda.chunk_kda`` (torch backend) against the token-by-token reference."""
import pytest
import torch

from kdacp import reference
from kdacp.ops.kda import ChunkKDAFunction, chunk_kda
from tests.helpers import differentiable_inputs, make_kda_inputs, rel_err


@pytest.mark.parametrize("B, T, cu, gate, init, HV", [
    (1, 130, None, "plain", False, 1),
    (2, 70, None, "default", True, 2),
    (1, 150, [0, 1, 64, 100, 150], "safe", True, 1),
])
def test_chunk_kda_torch_backend_matches_recurrent(B, T, cu, gate, init, HV):
    cu = None if cu is None else torch.tensor(cu)
    args = make_kda_inputs(B, T, 1, HV, 16, 8, gate=gate, initial_state=init, cu_seqlens=cu, seed=T)
    o, final = chunk_kda(**args, output_final_state=True, backend="torch")
    ref_o, ref_final = reference.recurrent_kda(**args, output_final_state=True)
    assert rel_err(o, ref_o) < 1e-10 and rel_err(final, ref_final) < 1e-10
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dfinal = torch.randn(final.shape, generator=gen, dtype=final.dtype)
    leaves = differentiable_inputs(args)
    got = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), list(leaves.values()))
    want = torch.autograd.grad((ref_o * do).sum() + (ref_final * dfinal).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, got, want):
        assert rel_err(a, b) < 1e-10, name


def test_chunk_kda_without_final_state_or_initial_state():
    args = make_kda_inputs(1, 40, 1, 1, 16, 16, seed=0)
    o, final = chunk_kda(**args, backend="auto")  # auto is torch on CPU
    assert final is None and o.shape == (1, 40, 1, 16)
    o.sum().backward()
    assert args["q"].grad is not None


def test_chunk_kda_bad_backend_and_inputs():
    args = make_kda_inputs(1, 8, 1, 1, 16, 16, requires_grad=False, seed=0)
    with pytest.raises(ValueError, match="backend"):
        chunk_kda(**args, backend="triton")
    with pytest.raises(ValueError, match="fla"):
        chunk_kda(**args, backend="fla")  # CPU tensors
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(**dict(args, beta=args["beta"][:, :4]), backend="torch")


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_the_ops_refuse_a_layer_mode_as_cp(op):
    """``cp`` of the ops is a per-batch :class:`~kdacp.cp.CPContext` or its :class:`~kdacp.cp.CPPlan`; the layers'
    ``ContextParallel`` is refused before any work, in one line that says what to pass instead."""
    import kdacp.cp
    from kdacp.ops.gdn import chunk_gated_delta_rule
    args = make_kda_inputs(1, 8, 1, 1, 16, 16, requires_grad=False, seed=0)
    if op == "gdn":
        args["g"] = args["g"][..., 0]
    cp = kdacp.cp.ContextParallel.__new__(kdacp.cp.ContextParallel)  # the type is what is checked
    with pytest.raises(TypeError) as raised:
        (chunk_kda if op == "kda" else chunk_gated_delta_rule)(**args, backend="torch", cp=cp)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("cp must be a CPContext")
    assert "kdacp.build_cp_plan" in message and "ContextParallel" in message and "layer" in message


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_the_ops_run_on_a_one_device_context(op):
    """``cp=`` a one-device :class:`~kdacp.cp.CPContext` (no plan) runs the op over the context's local boundaries:
    outputs, final states and gradients equal those of the call given the same ``cu_seqlens``; boundaries given
    beside the context are refused."""
    import kdacp.cp
    from kdacp.ops.gdn import chunk_gated_delta_rule
    fn = chunk_kda if op == "kda" else chunk_gated_delta_rule
    args = make_kda_inputs(1, 40, 2, 2, 16, 16, seed=3)
    if op == "gdn":
        args["g"] = args["g"][..., 0].detach().requires_grad_()
    cu = torch.tensor([0, 7, 29, 40])
    context = kdacp.cp.build_cp_context(cu, local_length=40)
    results = []
    for where in (dict(cp=context), dict(cu_seqlens=cu)):
        leaves = differentiable_inputs(args)
        o, final = fn(**leaves, backend="torch", output_final_state=True, **where)
        (o.square().sum() + final.sum()).backward()
        results.append([o, final] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta")])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass neither cu_seqlens nor cu_seqlens_cpu"):
        fn(**args, backend="torch", cp=context, cu_seqlens=cu)


def test_a_one_device_context_is_not_validated_again_per_call(monkeypatch):
    """The boundaries a one-device context checked when it was built are not checked again, nor its plan built, on
    each op call given it (per-call host work); the inputs are still checked against it, by name."""
    import kdacp.cp.batch_context
    import kdacp.ops.kda
    counts = {"boundaries_checked": 0, "plans_built": 0}
    real_check, real_plan = kdacp.ops.kda.check_kda_inputs, kdacp.ops.kda.one_rank_plan

    def check(*a, **k):
        counts["boundaries_checked"] += k.get("cu_seqlens") is not None
        return real_check(*a, **k)

    def plan(*a, **k):
        counts["plans_built"] += 1
        return real_plan(*a, **k)
    monkeypatch.setattr(kdacp.ops.kda, "check_kda_inputs", check)
    for module in (kdacp.ops.kda, kdacp.cp.batch_context):
        monkeypatch.setattr(module, "one_rank_plan", plan, raising=False)
    args = make_kda_inputs(1, 40, 1, 2, 8, 8, gate="safe", requires_grad=False, seed=4)
    cu = torch.tensor([0, 7, 29, 40])
    context = kdacp.cp.batch_context.build_cp_context(cu, local_length=40)
    results = [chunk_kda(**args, backend="torch", cp=context)[0] for _ in range(3)]
    assert counts == {"boundaries_checked": 0, "plans_built": 1}, counts  # the context's plan, built once
    chunk_kda(**args, backend="torch", cu_seqlens=cu)
    assert counts == {"boundaries_checked": 1, "plans_built": 2}, counts  # the call's own boundaries, checked
    assert all(torch.equal(o, results[0]) for o in results)
    short = {n: t[:, :30] if isinstance(t, torch.Tensor) and t.dim() > 1 else t for n, t in args.items()}
    with pytest.raises(ValueError, match="q has B=1, T=30, but the context cp holds 3 sequence"):
        chunk_kda(**short, backend="torch", cp=context)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = \(3, 2, 8, 8\)"):
        chunk_kda(**args, backend="torch", cp=context, initial_state=torch.zeros(1, 2, 8, 8))


def test_chunk_kda_reads_cu_seqlens_cpu_instead_of_the_device_copy():
    """With ``cu_seqlens_cpu`` (FLA's argument) the boundaries are taken from the host copy."""
    cu = torch.tensor([0, 3, 70, 100])
    args = make_kda_inputs(1, 100, 1, 2, 16, 8, gate="safe", cu_seqlens=cu, requires_grad=False, seed=5)
    o, final = chunk_kda(**args, output_final_state=True, backend="torch")
    o2, final2 = chunk_kda(**dict(args, cu_seqlens=None), cu_seqlens_cpu=cu, output_final_state=True,
                           backend="torch")
    assert torch.equal(o, o2) and torch.equal(final, final2) and final.shape[0] == 3


def test_chunk_kda_takes_autograd_only_where_a_gradient_is_wanted(monkeypatch):
    """Without a gradient to form (no_grad, or no input requiring one) the op runs without its autograd
    wrapper, with the same outputs; with one, through it (the output then has a graph to the inputs)."""
    args = make_kda_inputs(2, 70, 1, 2, 16, 8, gate="safe", initial_state=True, seed=3)
    o_grad, final_grad = chunk_kda(**args, output_final_state=True, backend="torch")
    assert o_grad.grad_fn is not None and final_grad.grad_fn is not None

    def refuse(*a, **k):
        raise AssertionError("ChunkKDAFunction.apply ran without a gradient to form")

    monkeypatch.setattr(ChunkKDAFunction, "apply", refuse)
    with torch.no_grad():
        o, final = chunk_kda(**args, output_final_state=True, backend="torch")
    plain = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    o2, final2 = chunk_kda(**plain, output_final_state=True, backend="torch")
    for a in (o, o2):
        assert torch.equal(a, o_grad.detach())
    for a in (final, final2):
        assert torch.equal(a, final_grad.detach())
    with pytest.raises(AssertionError, match="without a gradient"):  # a gradient wanted: the wrapper runs
        chunk_kda(**args, backend="torch")


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_float32_gate_with_bfloat16_inputs(op):
    """FLA's ops take a float32 g with bfloat16 q, k, v (its gate kernels return float32): the gate is used as
    given (every backend accumulates it in float32), so the result is within the bf16 tolerance of the float64
    reference, as the same call with g rounded to bfloat16 is; dg comes back float32."""
    from kdacp.ops.gdn import chunk_gated_delta_rule
    args = make_kda_inputs(1, 70, 2, 2, 16, 16, initial_state=True, requires_grad=False, seed=7)
    if op == "gdn":
        args["g"] = torch.nn.functional.logsigmoid(torch.randn(1, 70, 2, dtype=torch.float64) + 2.0)
    fn, oracle = (chunk_kda, reference.recurrent_kda) if op == "kda" else (
        chunk_gated_delta_rule, reference.recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(8)
    do, dht = torch.randn(1, 70, 2, 16, generator=gen, dtype=torch.float64), torch.randn(1, 2, 16, 16, generator=gen,
                                                                                         dtype=torch.float64)

    def run(f, inputs):
        inputs = {n: x.detach().requires_grad_() for n, x in inputs.items()}
        o, final = f(**inputs, output_final_state=True)
        grads = torch.autograd.grad((o.double() * do).sum() + (final.double() * dht).sum(), list(inputs.values()))
        return o, final, dict(zip(inputs, grads))

    ref = run(oracle, args)
    tol = 2e-2  # bf16 inputs and intermediates against the float64 reference
    low = {n: x.to(torch.bfloat16) for n, x in args.items() if n in ("q", "k", "v", "beta")}
    for g_dtype in (torch.float32, torch.bfloat16):
        o, final, grads = run(lambda **a: fn(**a, backend="torch"),
                              {**args, **low, "g": args["g"].to(g_dtype), "initial_state": args["initial_state"].float()})
        assert o.dtype == torch.bfloat16 and grads["g"].dtype == g_dtype and grads["q"].dtype == torch.bfloat16
        assert rel_err(o, ref[0]) < tol and rel_err(final, ref[1]) < tol, g_dtype
        for name, grad in grads.items():
            assert rel_err(grad, ref[2][name]) < tol, (g_dtype, name, rel_err(grad, ref[2][name]))
