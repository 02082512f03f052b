"""Single-process tests of the KDA layer: FLA parameter layout, math against an independent
composition of the reference, short convolution, checkpointing and calls in flight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import kdacp
from kdacp.layers import KimiDeltaAttention, causal_conv1d, sequence_positions
from kdacp.reference import l2norm, recurrent_kda
from tests.helpers import rel_err

# FLA 0.6.0's KimiDeltaAttention(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=4,
# safe_gate=True, lower_bound=-5, conv_size=4), state dict names and shapes read from its source.
FLA_STATE_DICT = {
    "A_log": (4,), "dt_bias": (64,),
    "q_proj.weight": (32, 32), "k_proj.weight": (32, 32), "v_proj.weight": (64, 32),
    "q_conv1d.weight": (32, 1, 4), "k_conv1d.weight": (32, 1, 4), "v_conv1d.weight": (64, 1, 4),
    "f_proj.0.weight": (16, 32), "f_proj.1.weight": (64, 16), "b_proj.weight": (4, 32),
    "g_proj.0.weight": (16, 32), "g_proj.1.weight": (64, 16), "g_proj.1.bias": (64,),
    "o_norm.weight": (16,), "o_proj.weight": (32, 64),
}


def small_layer(gate_lower_bound=-5.0, seed=0, **kw):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(32, 2, 4, head_k_dim=16, head_v_dim=16, gate_lower_bound=gate_lower_bound,
                               backend="torch", **kw).double()
    with torch.no_grad():  # move off the initial values (A_log = 0, unit norm weight) so every term is exercised
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def naive_per_sequence(layer, x, cu_seqlens, initial_state, mix):
    """The naive layers' shared frame, per sequence: q, k, v through their projections, ``F.conv1d`` and SiLU,
    then ``mix(xs, q, k, v, initial) -> (o [1, t, HV, V] ready for o_proj, final state [1, HV, K, V])``;
    returns the outputs ``[B, T, hidden]`` and the final states stacked."""
    W = layer.conv_size
    B, T, _ = x.shape
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    ys, finals = torch.zeros(B, T, layer.hidden_size, dtype=x.dtype), []
    for n, (b, s, e) in enumerate(bounds):
        xs = x[b:b + 1, s:e]

        def conv(proj, mod):
            return F.silu(F.conv1d(proj(xs).transpose(1, 2), mod.weight, mod.bias, padding=W - 1,
                                   groups=mod.weight.shape[0])[..., :e - s].transpose(1, 2))

        q, k = conv(layer.q_proj, layer.q_conv1d), conv(layer.k_proj, layer.k_conv1d)
        v = conv(layer.v_proj, layer.v_conv1d)
        o, S = mix(xs, q, k, v, None if initial_state is None else initial_state[n:n + 1])
        ys[b, s:e] = layer.o_proj(o.flatten(-2))[0]
        finals.append(S[0])
    return ys, torch.stack(finals)


def naive_layer(layer, x, cu_seqlens=None, initial_state=None):
    """The layer's math written out per sequence: F.conv1d, the token-by-token recurrence, explicit norm."""
    K, V, lb = layer.head_k_dim, layer.head_v_dim, layer.gate_lower_bound

    def mix(xs, q, k, v, initial):
        z = (layer.f_proj(xs) + layer.dt_bias).unflatten(-1, (-1, K))
        if lb is None:
            g = -layer.A_log.exp()[:, None] * F.softplus(z)
        else:
            g = lb * torch.sigmoid(layer.A_log.exp()[:, None] * z)
        beta = torch.sigmoid(layer.b_proj(xs))
        o, S = recurrent_kda(l2norm(q.unflatten(-1, (-1, K))), l2norm(k.unflatten(-1, (-1, K))),
                             v.unflatten(-1, (-1, V)), g, beta, output_final_state=True, initial_state=initial)
        gate = torch.sigmoid(layer.g_proj(xs).unflatten(-1, (-1, V)))
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight * gate, S

    return naive_per_sequence(layer, x, cu_seqlens, initial_state, mix)


def test_state_dict_matches_fla_names_and_shapes():
    layer = KimiDeltaAttention(32, 2, 4, head_k_dim=16, head_v_dim=16)
    assert {n: tuple(p.shape) for n, p in layer.state_dict().items()} == FLA_STATE_DICT


def test_state_dict_round_trip_with_fla():
    fla_layers = pytest.importorskip("fla.layers", reason="needs the flash-linear-attention layers")
    fla = fla_layers.KimiDeltaAttention(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=4,
                                        safe_gate=True, lower_bound=-5.0, conv_size=4)
    ours = KimiDeltaAttention(32, 2, 4, head_k_dim=16, head_v_dim=16)
    ours.load_state_dict(fla.state_dict())
    fla.load_state_dict(ours.state_dict())
    for name, p in fla.state_dict().items():
        assert torch.equal(p, ours.state_dict()[name]), name


def check_against_naive(layer, naive, packed: bool) -> None:
    """``layer`` (hidden 32, 4 value heads of 16, float64) against ``naive(layer, x, cu, h0)``: outputs, final
    states and the gradients of the input, the initial states and every parameter; shared with GDN's tests."""
    torch.manual_seed(1)
    B, T = (1, 70) if packed else (2, 40)
    cu = torch.tensor([0, 2, 31, 33, 70]) if packed else None
    N = 4 if packed else B
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)
    h0 = 0.5 * torch.randn(N, 4, 16, 16, dtype=torch.float64, requires_grad=True)
    y, S = layer(x, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    y_ref, S_ref = naive(layer, x, cu, h0)
    assert rel_err(y, y_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12
    w = torch.randn_like(y)
    grads = torch.autograd.grad((y * w).sum() + S.sum(), [x, h0, *layer.parameters()])
    grads_ref = torch.autograd.grad((y_ref * w).sum() + S_ref.sum(), [x, h0, *layer.parameters()])
    for (name, _), a, b in zip([("x", 0), ("h0", 0), *layer.named_parameters()], grads, grads_ref):
        assert rel_err(a, b) < 1e-10, name


@pytest.mark.parametrize("gate_lower_bound", [-5.0, None])
@pytest.mark.parametrize("packed", [False, True])
def test_layer_matches_naive_composition(gate_lower_bound, packed):
    check_against_naive(small_layer(gate_lower_bound, conv_bias=True), naive_layer, packed)


def test_causal_conv1d_halo_and_packed_sequences():
    torch.manual_seed(0)
    x = torch.randn(2, 30, 8, dtype=torch.float64)
    w, b = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    whole = causal_conv1d(x, w, b)
    # A shard with the previous shard's last W-1 tokens as halo continues the sequence exactly.
    assert torch.allclose(causal_conv1d(x[:, 10:], w, b, halo=x[:, 7:10]), whole[:, 10:], rtol=0, atol=1e-14)
    # Sequence starts cut the window: a packed batch equals its sequences run apart.
    cu = torch.tensor([0, 1, 12, 30])
    packed = causal_conv1d(x[:1], w, b, cu_seqlens=cu)
    apart = torch.cat([causal_conv1d(x[:1, s:e], w, b) for s, e in [(0, 1), (1, 12), (12, 30)]], 1)
    assert torch.allclose(packed, apart, rtol=0, atol=1e-14)
    # A packed shard: only its first sequence continues the halo.
    shard = causal_conv1d(x[:1, 10:], w, b, halo=x[:1, 7:10], cu_seqlens=torch.tensor([0, 2, 20]))
    assert torch.allclose(shard, packed[:, 10:], rtol=0, atol=1e-14)
    # A NaN stays in its own sequence.
    bad = x[:1].clone()
    bad[0, 5] = float("nan")
    out = causal_conv1d(bad, w, b, cu_seqlens=cu)
    assert out[0, 12:].isfinite().all() and out[0, 5].isnan().all()
    assert sequence_positions(cu, 10, 5).tolist() == [9, 10, 0, 1, 2]


def test_checkpointing_and_calls_in_flight():
    layer = small_layer()
    torch.manual_seed(2)
    xs = [torch.randn(1, 50, 32, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ws = [torch.randn(1, 50, 32, dtype=torch.float64) for _ in range(2)]
    ref = [torch.autograd.grad((layer(x)[0] * w).sum(), [x, *layer.parameters()]) for x, w in zip(xs, ws)]
    # Both forwards first (checkpointed, so each is recomputed inside its backward), backwards in reverse.
    losses = [(checkpoint(lambda t: layer(t)[0], x, use_reentrant=False) * w).sum() for x, w in zip(xs, ws)]
    for i in (1, 0):
        got = torch.autograd.grad(losses[i], [xs[i], *layer.parameters()])
        for a, b in zip(got, ref[i]):
            assert rel_err(a, b) < 1e-13


def test_the_layers_split_reaches_the_recurrence(monkeypatch):
    """``split=`` on a layer runs its recurrence cut inside the device: the same outputs, final states and
    gradients as uncut (float64), the split seen by the op's schedule; a bad value is refused at construction."""
    import kdacp.cp.schedule
    seen = []
    real = kdacp.cp.schedule.chunks_per_piece
    monkeypatch.setattr(kdacp.cp.schedule, "chunks_per_piece", lambda split, *a: seen.append(split) or real(split, *a))
    results = []
    for split in (None, 3):
        layer = small_layer(-5.0, conv_bias=True)
        layer.split = split
        torch.manual_seed(4)
        x = torch.randn(1, 150, 32, dtype=torch.float64, requires_grad=True)
        y, S = layer(x, cu_seqlens=torch.tensor([0, 20, 150]), output_final_state=True)
        grads = torch.autograd.grad((y * torch.randn_like(y)).sum() + S.sum(), [x, *layer.parameters()])
        results.append((y, S, *grads))
    assert seen[-1] == 3 and None in seen
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-10
    with pytest.raises(ValueError, match="split must be 'auto', a positive int"):
        KimiDeltaAttention(32, 2, head_k_dim=16, head_v_dim=16, split=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(32, 2, 3, head_k_dim=16, head_v_dim=16)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        KimiDeltaAttention(32, 2, gate_lower_bound=-6.0, head_k_dim=16, head_v_dim=16)


def test_parallelize_sets_every_layer_of_a_model_of_kdacp_layers():
    model = torch.nn.Sequential(small_layer(), small_layer())
    marker = type("CP", (), {"validate_heads": lambda self, h, hv: None})()
    assert kdacp.parallelize(model, marker) is model
    assert all(m.cp is marker for m in model)
    kdacp.parallelize(model, None)
    assert all(m.cp is None for m in model)
    with pytest.raises(ValueError, match="kdacp.parallelize supports"):
        kdacp.parallelize(torch.nn.Linear(2, 2), marker)


def _fresh_single_device(monkeypatch, built: list):
    """A single-device context whose per-batch contexts append their global boundaries to ``built``."""
    from kdacp.cp import context
    build = context.build_cp_context
    monkeypatch.setattr(context, "build_cp_context",
                        lambda cu, **kw: built.append(None if cu is None else tuple(cu.tolist())) or build(cu, **kw))
    return context._SingleDevice()


def test_packed_batch_is_read_to_the_host_once_per_tensor(monkeypatch):
    """All layer calls of one batch share one per-batch context (one host copy of its cu_seqlens: one device
    sync on a GPU); a new tensor or an in-place change makes a new one."""
    built = []
    layer = small_layer()
    layer.cp = _fresh_single_device(monkeypatch, built)
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    cu = torch.tensor([0, 5, 40])
    y1, y2 = layer(x, cu_seqlens=cu)[0], layer(x, cu_seqlens=cu)[0]
    assert built == [(0, 5, 40)] and torch.equal(y1, y2)
    layer(x, cu_seqlens=cu.clone())
    cu[1] = 7
    y3 = layer(x, cu_seqlens=cu)[0]
    assert built == [(0, 5, 40), (0, 5, 40), (0, 7, 40)]
    assert torch.allclose(y3, layer(x, cu_seqlens=torch.tensor([0, 7, 40]))[0], rtol=0, atol=0)


def test_convolutions_check_the_batch_host_copy(monkeypatch):
    """The short convolutions get the batch's one host copy of its local boundaries: their kernels' check then
    reads it instead of copying the device tensor to the host (a sync per convolution on a GPU)."""
    from kdacp.cp import batch_context
    seen = []
    conv = batch_context.causal_conv1d
    monkeypatch.setattr(batch_context, "causal_conv1d",
                        lambda *a, **kw: seen.append(kw["cu_seqlens_cpu"]) or conv(*a, **kw))
    layer = small_layer()
    layer.cp = _fresh_single_device(monkeypatch, [])
    cu = torch.tensor([0, 5, 40])
    layer(torch.randn(1, 40, 32, dtype=torch.float64), cu_seqlens=cu)
    context = layer.cp.context(1, 40, cu)
    assert len(seen) == 3 and all(c is context.local_cu_seqlens_cpu for c in seen)
    assert context.local_cu_seqlens_cpu.tolist() == [0, 5, 40]


def test_per_batch_memo_is_bounded(monkeypatch):
    from kdacp.caches import CP_CONTEXTS
    layer = small_layer()
    layer.cp = _fresh_single_device(monkeypatch, [])
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    keep = [torch.tensor([0, i, 20]) for i in range(1, CP_CONTEXTS + 5)]
    for cu in keep:
        layer(x, cu_seqlens=cu)
    assert layer.cp._contexts.cache_info().currsize == CP_CONTEXTS


@pytest.mark.parametrize("layer_class", ["KimiDeltaAttention", "GatedDeltaNet"])
@pytest.mark.parametrize("argument, value, error", [
    ("num_heads", 0, ValueError), ("num_v_heads", -2, ValueError), ("head_k_dim", -1, ValueError),
    ("head_v_dim", 0, ValueError), ("hidden_size", 2.5, TypeError), ("conv_size", 0, ValueError)])
def test_constructor_names_a_bad_size(layer_class, argument, value, error):
    sizes = dict(hidden_size=64, num_heads=2, head_k_dim=16, head_v_dim=16)
    with pytest.raises(error, match=f"^{argument} must be a positive int, got {value}$"):
        getattr(kdacp, layer_class)(**{**sizes, argument: value})


@pytest.mark.parametrize("layer_class", ["KimiDeltaAttention", "GatedDeltaNet"])
def test_forward_names_a_bad_input_before_any_kernel(layer_class):
    layer = getattr(kdacp, layer_class)(hidden_size=64, num_heads=2, head_k_dim=16, head_v_dim=16, backend="torch")
    with pytest.raises(ValueError, match=r"^hidden_states must have shape \[B, T, hidden_size=64\], got \(1, 32, 48\)"):
        layer(torch.randn(1, 32, 48))
    with pytest.raises(ValueError, match="^hidden_states must have 3 dims"):
        layer(torch.randn(32, 64))
    with pytest.raises(TypeError, match="^hidden_states has dtype torch.float64 but the layer's parameters have "
                                        "torch.bfloat16"):
        layer.to(torch.bfloat16)(torch.randn(1, 32, 64, dtype=torch.float64))
    layer.float()
    with pytest.raises(ValueError, match=r"^cu_seqlens\[-1\] must equal T=32 \(the number of tokens\), got 40$"):
        layer(torch.randn(1, 32, 64), cu_seqlens=torch.tensor([0, 10, 40]))
    with pytest.raises(ValueError, match="^with cu_seqlens the batch size B must be 1"):
        layer(torch.randn(2, 16, 64), cu_seqlens=torch.tensor([0, 10, 32]))


def test_the_layers_split_compiles_as_one_graph_and_matches_eager(monkeypatch):
    """``torch.compile(layer, fullgraph=True)`` of a layer whose recurrence is cut inside the device: one graph
    (the recurrence an opaque region, the cut inside it), the eager layer's outputs, final states and gradients,
    and the cut seen running under the compiled call."""
    import kdacp.cp.schedule
    from torch._dynamo.testing import CompileCounterWithBackend
    seen = []
    real = kdacp.cp.schedule.chunks_per_piece
    monkeypatch.setattr(kdacp.cp.schedule, "chunks_per_piece", lambda split, *a: seen.append(split) or real(split, *a))
    layer = small_layer(-5.0, conv_bias=True)
    layer.split = 3
    torch.manual_seed(6)
    x = torch.randn(1, 150, 32, dtype=torch.float64)
    cu = torch.tensor([0, 20, 150])
    results = []
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    for call in (layer, torch.compile(layer, backend=counter, fullgraph=True)):
        seen.clear()
        leaf = x.clone().requires_grad_()
        y, S = call(leaf, cu_seqlens=cu, output_final_state=True)
        grads = torch.autograd.grad((y * torch.sin(y)).sum() + S.sum(), [leaf, *layer.parameters()])
        results.append((y, S, *grads))
        assert 3 in seen  # the cut ran in this call
    assert counter.frame_count == 1
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_a_layer_holding_every_head_takes_no_slice_of_its_parameters(family):
    """On one device every head is the layer's own: its gate parameters and convolution biases reach the recurrence
    as the parameters themselves and its convolution weights as views (no slice, whose backward allocates the whole
    gradient and copies into it: two launches a parameter on a GPU); a head shard (Ulysses) still gets its rows."""
    from kdacp.layers.delta_rule import head_rows
    layer = small_layer() if family == "kda" else kdacp.layers.GatedDeltaNet(
        32, 2, 4, head_k_dim=8, head_v_dim=8, conv_bias=True, backend="torch")
    HV, K = layer.num_v_heads, layer.head_k_dim
    gate = torch.zeros(1, 3, HV * K if family == "kda" else HV)
    arguments = layer.gate_arguments(gate, slice(0, HV))
    assert arguments["A_log"] is layer.A_log and arguments["dt_bias"] is layer.dt_bias
    for (weight, bias), conv in zip(layer.conv_weights(slice(0, layer.num_heads), slice(0, HV)),
                                    (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
        assert weight._base is conv.weight and weight.shape == conv.weight.shape[::2]
        assert bias is conv.bias
    shard = layer.gate_arguments(gate, slice(1, 2))["A_log"]
    assert torch.equal(shard, layer.A_log[1:2]) and torch.equal(head_rows(layer.A_log, slice(1, 2)), shard)
