"""The Kimi Delta Attention layer (Kimi Linear), FLA-compatible, with optional context parallelism."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..ops.kda import chunk_kda
from ..cp.context import ContextParallel
from .delta_rule import DeltaRuleLayer, head_rows, initial_dt_bias


class KimiDeltaAttention(DeltaRuleLayer):
    """KDA token mixer: projections, short convolutions, KDA recurrence, gated RMSNorm, output.

    Per token (``H`` q/k heads of dim ``K``, ``HV`` value heads of dim ``V``, ``HV % H == 0``)::

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))     # depthwise causal
        g       = lower_bound * sigmoid(exp(A_log) * (W_f2 W_f1 x + dt_bias))  # [HV, K], natural log
        beta    = sigmoid(W_b x)                                               # [HV]
        o       = KDA(l2norm(q), l2norm(k), v, g, beta)                        # [HV, V]
        y       = W_o (rmsnorm(o) * weight * sigmoid(W_g2 W_g1 x + b_g))

    With ``gate_lower_bound=None`` the gate is ``-exp(A_log) * softplus(W_f2 W_f1 x + dt_bias)``.
    Parameter names and shapes follow FLA's ``fla.layers.KimiDeltaAttention``, so state dicts load
    either way (``head_k_dim`` is FLA's ``head_dim``; ``head_v_dim`` its ``head_dim * expand_v``).

    Args:
        hidden_size: model width.
        num_heads: q/k heads ``H``.
        num_v_heads: value heads ``HV`` (default ``H``), a multiple of ``H``.
        head_k_dim, head_v_dim: ``K`` and ``V``.
        conv_size: short-convolution width ``W``.
        gate_lower_bound: the safe gate's bound in [-5, 0), or None for the softplus gate.
        conv_bias: bias in the short convolutions.
        norm_eps: RMSNorm epsilon.
        backend: KDA backend handed to ``chunk_kda`` (``"auto"``, ``"torch"``, ``"fla"``).
        cp: a :class:`ContextParallel`, or None for one device; may be set later (``layer.cp = ...``).
        split: the recurrence's split inside the device (``chunk_kda``'s ``split``), unless ``cp.split`` sets one.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int | None = None, head_k_dim: int = 128,
                 head_v_dim: int = 128, conv_size: int = 4, gate_lower_bound: float | None = -5.0,
                 conv_bias: bool = False, norm_eps: float = 1e-5, backend: str = "auto",
                 cp: ContextParallel | None = None, device=None, dtype=None, split="auto"):
        if gate_lower_bound is not None and not -5 <= gate_lower_bound < 0:
            raise ValueError(f"gate_lower_bound must be in [-5, 0) or None, got {gate_lower_bound!r}")
        super().__init__(hidden_size, num_heads, num_v_heads, head_k_dim, head_v_dim, conv_size, conv_bias,
                         norm_eps, "sigmoid", backend, cp, device=device, dtype=dtype, split=split)
        self.gate_lower_bound = gate_lower_bound
        HV = self.num_v_heads
        gate_dim, value_dim = HV * head_k_dim, HV * head_v_dim
        f = {"device": device, "dtype": dtype}
        # Low-rank (rank head_v_dim) gate projections, as in FLA.
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False, **f),
                                    nn.Linear(head_v_dim, gate_dim, bias=False, **f))
        # FLA's initialisation: A_log = 0 for the safe gate (its sigmoid slope exp(A_log) = 1), else
        # log U(1, 16); dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1].
        if gate_lower_bound is None:
            A_log = torch.empty(HV, device=device, dtype=torch.float32).uniform_(1, 16).log()
        else:
            A_log = torch.zeros(HV, device=device, dtype=torch.float32)
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(initial_dt_bias(gate_dim, device))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False, **f),
                                    nn.Linear(head_v_dim, value_dim, bias=True, **f))

    def _gate_repr(self) -> str:
        return f"gate_lower_bound={self.gate_lower_bound}, "

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.f_proj(x)

    op = staticmethod(chunk_kda)

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        K = self.head_k_dim
        return dict(g=gate.unflatten(-1, (-1, K)), A_log=head_rows(self.A_log, v_heads),
                    dt_bias=head_rows(self.dt_bias, slice(v_heads.start * K, v_heads.stop * K)),
                    lower_bound=self.gate_lower_bound,
                    safe_gate=self.gate_lower_bound is not None)
