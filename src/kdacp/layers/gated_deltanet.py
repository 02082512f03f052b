"""The Gated DeltaNet layer (Qwen3-Next, Qwen3.5), FLA-compatible, with optional context parallelism."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.gdn import chunk_gated_delta_rule
from ..cp.context import ContextParallel
from .delta_rule import DeltaRuleLayer, head_rows, initial_dt_bias


class GatedDeltaNet(DeltaRuleLayer):
    """GDN token mixer: the gated delta rule with one scalar decay per value head and token::

        g = -exp(A_log) * softplus(W_a x + dt_bias)                             # [HV], natural log
        y = W_o (rmsnorm(o) * weight * swish(W_g x))

    (the rest as :class:`~kdacp.layers.delta_rule.DeltaRuleLayer`). Parameter names and shapes follow
    FLA's ``fla.layers.GatedDeltaNet`` with ``use_gate=True`` (``head_k_dim`` is FLA's ``head_dim``,
    ``head_v_dim`` its ``head_dim * expand_v``). The recurrence is KDA's with the gate broadcast over
    ``K``, run on GDN's own scalar gate (FLA's GDN kernels with the ``fla`` backend; the per-channel backends
    broadcast it inside, :mod:`kdacp.ops.gdn`), so every context-parallel mode applies unchanged.

    Args:
        hidden_size, num_heads, num_v_heads, head_k_dim, head_v_dim, conv_size, conv_bias, norm_eps,
        backend, cp, split: as :class:`~kdacp.layers.KimiDeltaAttention` (defaults: Qwen3-Next's 16 q/k heads
        and 32 value heads of 128 are ``num_heads=16, num_v_heads=32, head_k_dim=head_v_dim=128``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int | None = None, head_k_dim: int = 128,
                 head_v_dim: int = 128, conv_size: int = 4, conv_bias: bool = False, norm_eps: float = 1e-5,
                 backend: str = "auto", cp: ContextParallel | None = None, device=None, dtype=None, split="auto"):
        super().__init__(hidden_size, num_heads, num_v_heads, head_k_dim, head_v_dim, conv_size, conv_bias,
                         norm_eps, "swish", backend, cp, device=device, dtype=dtype, split=split)
        HV = self.num_v_heads
        f = {"device": device, "dtype": dtype}
        self.a_proj = nn.Linear(hidden_size, HV, bias=False, **f)
        # FLA's initialisation: A = U(0, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1].
        self.A_log = nn.Parameter(torch.empty(HV, device=device, dtype=torch.float32).uniform_(0, 16).log())
        self.dt_bias = nn.Parameter(initial_dt_bias(HV, device))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Linear(hidden_size, HV * head_v_dim, bias=False, **f)

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.a_proj(x)

    op = staticmethod(chunk_gated_delta_rule)

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        return dict(g=gate, A_log=head_rows(self.A_log, v_heads), dt_bias=head_rows(self.dt_bias, v_heads))
