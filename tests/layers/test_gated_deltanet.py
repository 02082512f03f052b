"""Single-process tests of the GDN layer: FLA parameter layout, and its math against an independent
composition (F.conv1d, the token-by-token GDN recurrence, the norm written out)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdacp.layers import GatedDeltaNet
from kdacp.reference import l2norm, recurrent_gated_delta_rule
from tests.layers.test_kda_layer import check_against_naive

# FLA 0.6.0's GatedDeltaNet(hidden_size=32, head_dim=16, expand_v=1, num_heads=2, num_v_heads=4,
# conv_size=4), state dict names and shapes read from its source.
FLA_STATE_DICT = {
    "A_log": (4,), "dt_bias": (4,),
    "q_proj.weight": (32, 32), "k_proj.weight": (32, 32), "v_proj.weight": (64, 32),
    "a_proj.weight": (4, 32), "b_proj.weight": (4, 32),
    "q_conv1d.weight": (32, 1, 4), "k_conv1d.weight": (32, 1, 4), "v_conv1d.weight": (64, 1, 4),
    "g_proj.weight": (64, 32), "o_norm.weight": (16,), "o_proj.weight": (32, 64),
}


def small_layer(seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(32, 2, 4, head_k_dim=16, head_v_dim=16, conv_bias=True, backend="torch").double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def naive_layer(layer, x, cu_seqlens=None, initial_state=None):
    K, V, W = layer.head_k_dim, layer.head_v_dim, layer.conv_size
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
        g = -layer.A_log.exp() * F.softplus(layer.a_proj(xs) + layer.dt_bias)
        beta = torch.sigmoid(layer.b_proj(xs))
        o, S = recurrent_gated_delta_rule(l2norm(q.unflatten(-1, (-1, K))), l2norm(k.unflatten(-1, (-1, K))),
                                          v.unflatten(-1, (-1, V)), g, beta, output_final_state=True,
                                          initial_state=None if initial_state is None else initial_state[n:n + 1])
        z = layer.g_proj(xs).unflatten(-1, (-1, V))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
        ys[b, s:e] = layer.o_proj((o * z * torch.sigmoid(z)).flatten(-2))[0]
        finals.append(S[0])
    return ys, torch.stack(finals)


def test_state_dict_matches_fla_names_and_shapes():
    layer = GatedDeltaNet(32, 2, 4, head_k_dim=16, head_v_dim=16)
    assert {n: tuple(p.shape) for n, p in layer.state_dict().items()} == FLA_STATE_DICT


def test_state_dict_round_trip_with_fla():
    fla_layers = pytest.importorskip("fla.layers", reason="needs the flash-linear-attention layers")
    fla = fla_layers.GatedDeltaNet(hidden_size=32, head_dim=16, expand_v=1, num_heads=2, num_v_heads=4, conv_size=4)
    ours = GatedDeltaNet(32, 2, 4, head_k_dim=16, head_v_dim=16)
    ours.load_state_dict(fla.state_dict())
    fla.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("packed", [False, True])
def test_layer_matches_naive_composition(packed):
    check_against_naive(small_layer(), naive_layer, packed)
