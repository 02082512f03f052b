"""Single-process tests of the GDN layer: FLA parameter layout, and its math against an independent
composition (F.conv1d, the token-by-token GDN recurrence, the norm written out)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdacp.layers import GatedDeltaNet
from kdacp.reference import l2norm, recurrent_gated_delta_rule
from tests.layers.test_kda_layer import check_against_naive, naive_per_sequence

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
    """GDN's math written out per sequence: the scalar gate, the token-by-token recurrence, the swish-gated norm."""
    K, V = layer.head_k_dim, layer.head_v_dim

    def mix(xs, q, k, v, initial):
        g = -layer.A_log.exp() * F.softplus(layer.a_proj(xs) + layer.dt_bias)
        beta = torch.sigmoid(layer.b_proj(xs))
        o, S = recurrent_gated_delta_rule(l2norm(q.unflatten(-1, (-1, K))), l2norm(k.unflatten(-1, (-1, K))),
                                          v.unflatten(-1, (-1, V)), g, beta, output_final_state=True,
                                          initial_state=initial)
        z = layer.g_proj(xs).unflatten(-1, (-1, V))
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
        return o * z * torch.sigmoid(z), S

    return naive_per_sequence(layer, x, cu_seqlens, initial_state, mix)


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
