"""The Kimi Delta Attention layer (Kimi Linear), FLA-compatible, with optional context parallelism."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..backends import resolve_backend
from .context_parallel import SINGLE_DEVICE, KDAContextParallel
from .norm import RMSNormGated
from .short_conv import ShortConvolution

__all__ = ["KimiDeltaAttention", "apply_context_parallel"]


class KimiDeltaAttention(nn.Module):
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
        cp: a :class:`KDAContextParallel`, or None for one device; may be set later (``layer.cp = ...``).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int | None = None, head_k_dim: int = 128,
                 head_v_dim: int = 128, conv_size: int = 4, gate_lower_bound: float | None = -5.0,
                 conv_bias: bool = False, norm_eps: float = 1e-5, backend: str = "auto",
                 cp: KDAContextParallel | None = None, device=None, dtype=None):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}")
        if gate_lower_bound is not None and not -5 <= gate_lower_bound < 0:
            raise ValueError(f"gate_lower_bound must be in [-5, 0) or None, got {gate_lower_bound!r}")
        if conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_size = head_k_dim, head_v_dim, conv_size
        self.gate_lower_bound, self.backend = gate_lower_bound, backend
        key_dim, value_dim, gate_dim = num_heads * head_k_dim, num_v_heads * head_v_dim, num_v_heads * head_k_dim
        f = {"device": device, "dtype": dtype}

        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False, **f)
        self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, **f)
        self.k_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, **f)
        self.v_conv1d = ShortConvolution(value_dim, conv_size, bias=conv_bias, **f)
        # Low-rank (rank head_v_dim) gate projections, as in FLA.
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False, **f),
                                    nn.Linear(head_v_dim, gate_dim, bias=False, **f))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **f)
        # FLA's initialisation: A_log = 0 for the safe gate (its sigmoid slope exp(A_log) = 1), else
        # log U(1, 16); dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1].
        if gate_lower_bound is None:
            A_log = torch.empty(num_v_heads, device=device, dtype=torch.float32).uniform_(1, 16).log()
        else:
            A_log = torch.zeros(num_v_heads, device=device, dtype=torch.float32)
        self.A_log = nn.Parameter(A_log)
        dt = torch.exp(torch.rand(gate_dim, device=device, dtype=torch.float32)
                       * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False, **f),
                                    nn.Linear(head_v_dim, value_dim, bias=True, **f))
        self.o_norm = RMSNormGated(head_v_dim, eps=norm_eps, **f)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False, **f)
        self.cp = cp

    @property
    def cp(self) -> KDAContextParallel | None:
        return self._cp

    @cp.setter
    def cp(self, cp: KDAContextParallel | None) -> None:
        if cp is not None:
            cp.validate_heads(self.num_heads, self.num_v_heads)
        self._cp = cp

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv_size={self.conv_size}, "
                f"gate_lower_bound={self.gate_lower_bound}, cp={self.cp}")

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        """Run the layer on this rank's tokens.

        Args:
            hidden_states: ``[B, T, hidden_size]``; under ``cp``, this rank's time shard (equal
                shards, in rank order) of the global batch.
            cu_seqlens: ``[N+1]`` int64 offsets of a packed batch (``B == 1``), global under ``cp``.
            initial_state: ``[N, HV, K, V]`` per (global) sequence, same on every rank.
            output_final_state: also return the final states.

        Returns:
            ``(y [B, T, hidden_size], final_state [N, HV, K, V] float32 or wider, or None)``; the
            final states are on every rank.
        """
        cp = SINGLE_DEVICE if self.cp is None else self.cp
        x = hidden_states
        K, V, W = self.head_k_dim, self.head_v_dim, self.conv_size
        # The recurrence's backend also picks the other parts: FLA's fused kernels with "fla".
        fused = resolve_backend(cp.backend or self.backend, x.device) == "fla"
        # Ulysses moves the convolutions' inputs, so each depthwise convolution then sees whole
        # sequences of its head shard and needs no halo inside the Ulysses group.
        q, k, v, g, beta = cp.to_heads([self.q_proj(x), self.k_proj(x), self.v_proj(x), self.f_proj(x),
                                        self.b_proj(x)])
        # beta in float32 (or wider), as FLA's layer computes it inside its kernel
        beta = beta.to(torch.promote_types(beta.dtype, torch.float32)).sigmoid()
        u, U = cp.head_shard()
        heads = slice(u * self.num_heads // U, (u + 1) * self.num_heads // U)
        v_heads = slice(u * self.num_v_heads // U, (u + 1) * self.num_v_heads // U)

        conv = cp.conv_context(q.shape[1], cu_seqlens)
        halos = conv.left_halos([q, k, v], W - 1)
        where = dict(cu_seqlens=conv.cu_seqlens, cu_seqlens_cpu=conv.cu_seqlens_cpu, fused=fused)
        q = self.q_conv1d(q, halos[0], channels=slice(heads.start * K, heads.stop * K), **where)
        k = self.k_conv1d(k, halos[1], channels=slice(heads.start * K, heads.stop * K), **where)
        v = self.v_conv1d(v, halos[2], channels=slice(v_heads.start * V, v_heads.stop * V), **where)

        o, final_state = cp.chunk_kda(
            q.unflatten(-1, (-1, K)), k.unflatten(-1, (-1, K)), v.unflatten(-1, (-1, V)), g.unflatten(-1, (-1, K)),
            beta, cu_seqlens=cu_seqlens, backend=self.backend,
            initial_state=None if initial_state is None else initial_state[:, v_heads].contiguous(),
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=self.A_log[v_heads], dt_bias=self.dt_bias[v_heads.start * K:v_heads.stop * K],
            lower_bound=self.gate_lower_bound, safe_gate=self.gate_lower_bound is not None)
        o, final_state = cp.to_sequence(o, final_state)
        o = self.o_norm(o, self.g_proj(x).unflatten(-1, (-1, V)), fused=fused)
        return self.o_proj(o.flatten(-2)), final_state


def apply_context_parallel(model: nn.Module, cp: KDAContextParallel | None) -> nn.Module:
    """Set ``cp`` on every :class:`KimiDeltaAttention` inside ``model`` (None turns it off); returns ``model``."""
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.cp = cp
    return model
