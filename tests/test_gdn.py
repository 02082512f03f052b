"""Gated DeltaNet: the chunked reference and ``kdacp.chunk_gated_delta_rule`` against the token-by-token
GDN recurrence, written out on its own (float64: outputs, final states, every gradient)."""
import pytest
import torch
import torch.nn.functional as F

from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.reference import gdn
from tests.helpers import rel_err


def gdn_inputs(B, T, H, HV, K, V, *, gate_in_kernel, cu=None, init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    args = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V), beta=torch.sigmoid(rnd(B, T, HV)))
    if gate_in_kernel:
        args.update(g=rnd(B, T, HV), A_log=0.5 * rnd(HV), dt_bias=0.5 * rnd(HV))
    else:
        args.update(g=F.logsigmoid(rnd(B, T, HV) + 2.0))
    if init:
        args["initial_state"] = 0.5 * rnd(B if cu is None else len(cu) - 1, HV, K, V)
    args = {n: x.requires_grad_() for n, x in args.items()}
    args.update(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate_in_kernel)
    if cu is not None:
        args["cu_seqlens"] = torch.tensor(cu)
    return args


def _check(fn, args, tol):
    o, S = fn(**args, output_final_state=True)
    o_ref, S_ref = gdn.recurrent_gated_delta_rule(**args, output_final_state=True)
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol
    leaves = {n: x for n, x in args.items() if isinstance(x, torch.Tensor) and x.requires_grad}
    gen = torch.Generator().manual_seed(9)
    w, wS = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(S.shape, generator=gen, dtype=S.dtype)
    got = torch.autograd.grad((o * w).sum() + (S * wS).sum(), list(leaves.values()))
    want = torch.autograd.grad((o_ref * w).sum() + (S_ref * wS).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, got, want):
        assert rel_err(a, b) < tol, name


@pytest.mark.parametrize("B, T, H, HV, cu, gate_in_kernel", [
    (2, 70, 1, 2, None, False),
    (1, 150, 2, 4, [0, 1, 64, 100, 150], True),
])
def test_chunk_reference_and_op_match_the_recurrence(B, T, H, HV, cu, gate_in_kernel):
    args = gdn_inputs(B, T, H, HV, 16, 8, gate_in_kernel=gate_in_kernel, cu=cu, seed=T)
    _check(gdn.chunk_gated_delta_rule, args, 1e-10)
    _check(lambda **a: chunk_gated_delta_rule(**a, backend="torch"), args, 1e-10)


def test_gdn_oracle_is_kda_with_a_constant_gate():
    """The sharing itself: KDA's oracle with the gate repeated over K is GDN's oracle."""
    from kdacp.reference import recurrent_kda
    args = gdn_inputs(1, 30, 1, 1, 8, 8, gate_in_kernel=False, seed=1)
    o, S = gdn.recurrent_gated_delta_rule(**args, output_final_state=True)
    kda = dict(args, g=args["g"][..., None].repeat(1, 1, 1, 8))
    o2, S2 = recurrent_kda(**kda, output_final_state=True)
    assert rel_err(o, o2) < 1e-13 and rel_err(S, S2) < 1e-13


def test_bad_gate_shapes_name_the_argument():
    args = gdn_inputs(1, 10, 1, 2, 8, 8, gate_in_kernel=True, init=False)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, HV\] = \(1, 10, 2\)"):
        chunk_gated_delta_rule(**dict(args, g=args["g"][..., :1]), backend="torch")
    with pytest.raises(ValueError, match=r"g must have 3 dims"):  # a KDA gate
        chunk_gated_delta_rule(**dict(args, g=args["g"][..., None].repeat(1, 1, 1, 8)), backend="torch")
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[HV\] = \[2\]"):
        chunk_gated_delta_rule(**dict(args, dt_bias=torch.zeros(16, dtype=torch.float64)), backend="torch")
    with pytest.raises(ValueError, match="A_log"):
        chunk_gated_delta_rule(**dict(args, A_log=None), backend="torch")


@pytest.mark.parametrize("B", [1, 2])
def test_the_gdn_call_reaches_the_backend_with_its_scalar_gate(monkeypatch, B):
    """GDN's call carries its own gate to the backend: the options' gate kind ``"scalar"``, ``g [1, B*T, HV]``
    and ``dt_bias [HV]`` as passed (not broadcast over ``K``); the ``torch`` backend (the KDA reference)
    broadcasts it inside (:class:`kdacp.backends.gate.BroadcastGate`), the only broadcast, with the gradients
    reaching ``g [B, T, HV]`` and ``dt_bias [HV]`` as the recurrence's."""
    import kdacp.ops.gdn

    seen = []
    run_prepared = kdacp.ops.gdn.run_prepared

    def recording_run_prepared(prepared, *args, **kwargs):
        seen.append(prepared)
        return run_prepared(prepared, *args, **kwargs)

    monkeypatch.setattr(kdacp.ops.gdn, "run_prepared", recording_run_prepared)
    args = gdn_inputs(B, 10, 1, 2, 8, 8, gate_in_kernel=True, init=False)
    _check(lambda **a: chunk_gated_delta_rule(**a, backend="torch"), args, 1e-10)
    assert len(seen) == 1
    backend, inputs = seen[0].backend, seen[0].inputs
    assert getattr(backend.options, "gate", None) == "scalar"
    assert tuple(inputs.g.shape) == (1, B * 10, 2) and torch.equal(inputs.g, args["g"].reshape(1, B * 10, 2))
    assert inputs.dt_bias is args["dt_bias"]
    from kdacp.backends.gate import BroadcastGate
    from kdacp.backends.torch_backend import TorchBackend
    assert isinstance(backend, BroadcastGate) and type(backend.inner) is TorchBackend
    assert backend.inner.options.gate == "channel"


def test_the_gdn_call_preparation_dispatches_no_op():
    """Host time: every dispatched op costs microseconds per call on a GPU host. Preparing GDN's gate for the
    KDA op dispatches nothing (the gate goes as it is, its kind in the options), the state dtype needs no op,
    and an unbatched output is returned as it is."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kdacp.backends.call import PreparedCall
    from kdacp.ops.gdn import gdn_gate_arguments
    from kdacp.reference.gates import compute_dtype

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    args = gdn_inputs(1, 10, 1, 2, 8, 8, gate_in_kernel=True, init=False)
    o = torch.zeros(1, 10, 2, 8)
    o16 = o.bfloat16()
    with Ops() as ops:
        gate = gdn_gate_arguments(args["g"], True, args["A_log"], args["dt_bias"])
        assert compute_dtype(args["q"]) == torch.float64 and compute_dtype(o16) == torch.float32
        assert PreparedCall(None, None, 1, 10, 2, 8).unpack(o) is o
    assert ops.names == []
    assert gate["g"] is args["g"] and gate["dt_bias"] is args["dt_bias"] and gate["gate"] == "scalar"
