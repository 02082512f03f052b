"""The gated delta-rule token mixer (KDA, GDN), written once: projections, short convolutions with the
context-parallel halo, the recurrence through the context-parallel hooks, gated RMSNorm, output.

:func:`mix_tokens` runs that sequence on any modules that supply its parts (:class:`MixerParts`): kdacp's own
layers (:class:`DeltaRuleLayer`; a subclass adds its gate's parameters and says how its gate reaches the
recurrence) and the Hugging Face adapters (:mod:`kdacp.integrations.transformers`), each on its own modules.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn as nn

from ..backends import backend_fuses
from ..compile import run_opaque
from ..reference.gates import compute_dtype
from ..validation import check_hidden_states, check_layer_sizes
from ..cp.context import SINGLE_DEVICE, ContextParallel
from ..cp.split import check_split
from .norm import RMSNormGated, rms_norm_gated
from .short_conv import ShortConvolution


def initial_dt_bias(n: int, device=None) -> torch.Tensor:
    """FLA's initial ``dt_bias [n]`` float32: ``softplus^-1(dt)`` with ``dt`` log-uniform in [1e-3, 1e-1]
    (at least 1e-4)."""
    dt = torch.exp(torch.rand(n, device=device, dtype=torch.float32) * (math.log(0.1) - math.log(0.001))
                   + math.log(0.001)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def head_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """``t[rows]``, a head shard's rows of a parameter (``rows`` a step-1 slice of its first dim), or ``t`` itself
    where the shard holds every row: a slice's backward allocates the whole gradient and copies into it (two
    launches a parameter), which one device and the state-passing modes, holding every head, need not pay. Read
    from the slice's fields: torch 2.11's Dynamo broke the layer's graph where this called ``slice.indices``."""
    whole = rows.start in (None, 0) and (rows.stop is None or rows.stop >= t.shape[0]) and rows.step in (None, 1)
    return t if whole else t[rows]


def beta_from_logits(b: torch.Tensor) -> torch.Tensor:
    """The delta rule's write strength ``sigmoid(b)``, in float32 (or wider), as FLA's layers compute it
    inside their kernels; ``b [B, T, HV]`` logits in any float dtype."""
    return b.to(torch.promote_types(b.dtype, torch.float32)).sigmoid()


class Projected(NamedTuple):
    """A token mixer's projections of its tokens ``x [B, T, hidden]``, every channel dim head-major.

    ``q, k [B, T, H*K]``, ``v [B, T, HV*V]`` (before the short convolution); ``gate [B, T, HV*c]``: the
    decay's logits; ``beta [B, T, HV]``: the write strength's logits; ``output_gate [B, T, HV*V]``: the
    gated norm's gate.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gate: torch.Tensor
    beta: torch.Tensor
    output_gate: torch.Tensor


class MixerParts(Protocol):
    """What a token mixer's modules supply to :func:`mix_tokens`. Every method reads the modules' parameters
    when called (never a tensor kept from earlier: FSDP2 and other wrappers replace parameters)."""

    num_heads: int    # H
    num_v_heads: int  # HV
    head_k_dim: int   # K
    head_v_dim: int   # V
    op: Callable      # the recurrence, kdacp.chunk_kda (KDA) or kdacp.chunk_gated_delta_rule (GDN)

    def project(self, x: torch.Tensor) -> Projected:
        """The projections of ``x [B, T, hidden]``."""

    def conv_weights(self, heads: slice, v_heads: slice) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight [C, W], bias [C] or None)`` of the q, k and v short convolutions, for the channels of
        key heads ``heads`` (q, k) and value heads ``v_heads`` (v)."""

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        """:attr:`op`'s gate keywords (``g``, ``A_log``, ``dt_bias``, ...; the gate is applied in the
        kernel) for ``gate``: the logits of value heads ``v_heads``."""

    def norm_arguments(self) -> tuple[torch.Tensor, float, str]:
        """``(weight [V], eps, activation)`` of the gated RMSNorm (:func:`rms_norm_gated`)."""

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of ``o [B, T, HV*V]``."""


def mix_tokens(parts: MixerParts, cp, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None, backend: str,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False, split="auto"):
    """Run a gated delta-rule token mixer on this rank's tokens::

        q, k, v = silu(conv(q)), silu(conv(k)), silu(conv(v))   # depthwise causal, halo before each range
        o       = recurrence(l2norm(q), l2norm(k), v, gate, sigmoid(beta))
        y       = output(rmsnorm_gated(o, output_gate))

    Args:
        parts: the modules' parts (:class:`MixerParts`).
        cp: the context-parallel hooks (:class:`~kdacp.cp.hooks.CPHooks`: :class:`ContextParallel` or
            :data:`SINGLE_DEVICE`).
        x: ``[B, T, hidden]``, this rank's tokens of the global batch under ``cp`` (its layout's ranges, in
            global order).
        cu_seqlens: ``[N+1]`` int64 global offsets of a packed batch (``B == 1``), or None. The same tensor
            for every layer of a step (its host copy and plan are built once).
        backend: the recurrence's backend when ``cp.backend`` is None (``"auto"``, ``"torch"``, ``"fla"``,
            ``"attn_gym"``); ``"fla"`` and ``"attn_gym"`` also run the convolution and the norm as FLA's fused kernels.
        initial_state: ``[N, HV, K, V]`` per (global) sequence, the same on every rank.
        output_final_state: also return the final states.
        split: the recurrence's split inside the device when ``cp.split`` is None (:func:`kdacp.chunk_kda`'s).

    Returns:
        ``(y [B, T, hidden], final_state [N, HV, K, V] float32 or wider, on every rank, or None)``.
    """
    K, V = parts.head_k_dim, parts.head_v_dim
    fused = bool(backend_fuses(cp.backend or backend, x.device))
    p = parts.project(x)
    # Ulysses moves the convolutions' inputs, so each depthwise convolution then sees whole sequences of its
    # head shard and needs no halo inside the Ulysses group.
    q, k, v, gate, beta = cp.to_heads([p.q, p.k, p.v, p.gate, p.beta])
    beta = beta_from_logits(beta)
    heads, v_heads = cp.head_slice(parts.num_heads), cp.head_slice(parts.num_v_heads)

    gate_arguments = parts.gate_arguments(gate, v_heads)
    gate_tensors = {name: a for name, a in gate_arguments.items() if isinstance(a, torch.Tensor)}
    gate_options = tuple((name, a) for name, a in gate_arguments.items() if name not in gate_tensors)
    # under torch.compile one opaque op: it reads the batch's boundaries on the host (kdacp.compile)
    o, *final_state = run_opaque(
        _ConvolveAndRecur, (cp, parts.op, K, V, backend, fused, tuple(gate_tensors), gate_options, output_final_state,
                            split),
        q, k, v, beta, cu_seqlens, None if initial_state is None else initial_state[:, v_heads].contiguous(),
        *(w for pair in parts.conv_weights(heads, v_heads) for w in pair), *gate_tensors.values())
    o, final_state = cp.to_sequence(o, final_state[0] if output_final_state else None)
    weight, eps, activation = parts.norm_arguments()
    o = rms_norm_gated(o, p.output_gate.unflatten(-1, (-1, V)), weight, eps, activation, fused)
    return parts.output(o.flatten(-2)), final_state


@dataclass(frozen=True)
class _ConvolveAndRecur:
    """The part of :func:`mix_tokens` that reads the batch's document boundaries: the short convolutions with
    their halo, then the recurrence, through the hooks of ``cp``, on the head-sharded tokens (an
    :class:`kdacp.compile.OpaqueRegion`). Settings: ``op``, the head dims ``K``, ``V``, the recurrence's
    ``backend``, ``fused`` convolutions, the names of the gate's tensor keywords and its other keywords
    ``(name, value)``, whether the final states are returned, and the recurrence's ``split`` (``cp.split`` first)."""

    cp: object
    op: Callable
    K: int
    V: int
    backend: str
    fused: bool
    gate_names: tuple
    gate_options: tuple
    output_final_state: bool
    split: str | int | None = "auto"

    def __call__(self, q, k, v, beta, cu_seqlens, initial_state, q_weight, q_bias, k_weight, k_bias, v_weight, v_bias,
                 *gate_tensors) -> tuple[torch.Tensor, ...]:
        """``q, k [B, T, H*K]``, ``v [B, T, HV*V]``, ``beta [B, T, HV]``, the global ``cu_seqlens``,
        ``initial_state [N, HV, K, V]`` or None, the convolutions' weights and biases (:meth:`MixerParts.conv_weights`)
        and the gate's tensors -> ``(o [B, T, HV, V],)``, and ``final_state`` second where asked for."""
        K, V, cp = self.K, self.V, self.cp
        context = cp.context(*q.shape[:2], cu_seqlens, q.device)
        q, k, v = context.short_convolution([q, k, v], [q_weight, k_weight, v_weight], [q_bias, k_bias, v_bias],
                                            fused=self.fused)
        o, final_state = context.recurrence(
            self.op, q.unflatten(-1, (-1, K)), k.unflatten(-1, (-1, K)), v.unflatten(-1, (-1, V)), beta=beta,
            backend=cp.backend or self.backend, split=self.split if cp.split is None else cp.split,
            initial_state=initial_state,
            output_final_state=self.output_final_state, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            **dict(zip(self.gate_names, gate_tensors)), **dict(self.gate_options))
        return (o, final_state) if self.output_final_state else (o,)

    def fake(self, q, k, v, beta, cu_seqlens, initial_state, *weights_and_gate) -> tuple[torch.Tensor, ...]:
        B, T, HV = v.shape[0], v.shape[1], v.shape[2] // self.V
        o = v.new_empty(B, T, HV, self.V)
        if not self.output_final_state:
            return (o,)
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return o, q.new_empty(N, HV, self.K, self.V, dtype=compute_dtype(q))


class DeltaRuleLayer(nn.Module):
    """The shared skeleton. Per token::

        q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))    # depthwise causal
        beta    = sigmoid(W_b x)                                              # [HV], float32
        o       = recurrence(l2norm(q), l2norm(k), v, gate(x), beta)          # [HV, V]
        y       = W_o rmsnorm_gated(o, g_proj(x))

    Args:
        hidden_size, num_heads (``H``), num_v_heads (``HV``, a multiple of ``H``), head_k_dim (``K``),
        head_v_dim (``V``), conv_size, conv_bias, norm_eps: as FLA's layers.
        norm_activation: the output gate's activation (``"sigmoid"`` or ``"swish"``).
        backend: ``"auto"``, ``"torch"``, ``"fla"`` or ``"attn_gym"``; ``"fla"`` and ``"attn_gym"`` (``auto`` on
            CUDA with FLA installed) also run the short convolution and the norm as FLA's fused kernels.
        cp: a :class:`ContextParallel`, or None for one device; may be set later.
        split: the recurrence's split inside the device (:func:`kdacp.chunk_kda`'s: ``"auto"``, the default, an
            int, or None for none), unless ``cp.split`` sets one.

    Raises:
        TypeError, ValueError: a size that is not a positive int, or ``num_v_heads`` not a multiple of
            ``num_heads`` (naming the argument).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: int | None, head_k_dim: int, head_v_dim: int,
                 conv_size: int, conv_bias: bool, norm_eps: float, norm_activation: str, backend: str,
                 cp: ContextParallel | None, device=None, dtype=None, split="auto"):
        super().__init__()
        check_split(split)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        check_layer_sizes(hidden_size=hidden_size, num_heads=num_heads, num_v_heads=num_v_heads,
                          head_k_dim=head_k_dim, head_v_dim=head_v_dim, conv_size=conv_size)
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim, self.conv_size = head_k_dim, head_v_dim, conv_size
        self.backend, self.split = backend, split
        key_dim, value_dim = num_heads * head_k_dim, num_v_heads * head_v_dim
        f = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False, **f)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False, **f)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False, **f)
        self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, **f)
        self.k_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, **f)
        self.v_conv1d = ShortConvolution(value_dim, conv_size, bias=conv_bias, **f)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **f)
        self.o_norm = RMSNormGated(head_v_dim, eps=norm_eps, activation=norm_activation, **f)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False, **f)
        self.cp = cp

    @property
    def cp(self) -> ContextParallel | None:
        return self._cp

    @cp.setter
    def cp(self, cp: ContextParallel | None) -> None:
        if cp is not None:
            cp.validate_heads(self.num_heads, self.num_v_heads)
        self._cp = cp

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv_size={self.conv_size}, "
                f"{self._gate_repr()}cp={self.cp}")

    def _gate_repr(self) -> str:
        """The gate's settings for :meth:`extra_repr` (``"name=value, "``), if any."""
        return ""

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's raw logits ``[B, T, C]``, head-major over value heads (``C = HV * c``)."""
        raise NotImplementedError

    def gate_arguments(self, gate: torch.Tensor, v_heads: slice) -> dict:
        """:meth:`MixerParts.gate_arguments`, by the subclass."""
        raise NotImplementedError

    def project(self, x: torch.Tensor) -> Projected:
        return Projected(self.q_proj(x), self.k_proj(x), self.v_proj(x), self._gate_logits(x), self.b_proj(x),
                         self.g_proj(x))

    def conv_weights(self, heads: slice, v_heads: slice) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        K, V = self.head_k_dim, self.head_v_dim
        channels = (slice(heads.start * K, heads.stop * K),) * 2 + (slice(v_heads.start * V, v_heads.stop * V),)
        return [(head_rows(conv.weight.squeeze(1), c), None if conv.bias is None else head_rows(conv.bias, c))
                for conv, c in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), channels)]

    def norm_arguments(self) -> tuple[torch.Tensor, float, str]:
        return self.o_norm.weight, self.o_norm.eps, self.o_norm.activation

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o)

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        """Run the layer on this rank's tokens (:func:`mix_tokens` on its own modules).

        Args:
            hidden_states: ``[B, T, hidden_size]``; under ``cp``, this rank's tokens of the global batch
                (its ranges under ``cp.layout``, in global order).
            cu_seqlens: ``[N+1]`` int64 offsets of a packed batch (``B == 1``), global under ``cp``.
                Pass the same tensor to every layer of a step: it is read to the host once.
            initial_state: ``[N, HV, K, V]`` per (global) sequence, same on every rank.
            output_final_state: also return the final states.

        Returns:
            ``(y [B, T, hidden_size], final_state [N, HV, K, V] float32 or wider, or None)``; the
            final states are on every rank.

        Raises:
            TypeError, ValueError: ``hidden_states`` not ``[B, T, hidden_size]`` of the parameters' dtype (any
                floating dtype under autocast), ``cu_seqlens`` with ``B != 1`` or (without ``cp``) not ending at
                ``T``; and what the op (:attr:`op`) raises, naming the argument. Before any kernel runs.
        """
        check_hidden_states(hidden_states, self.hidden_size, self.o_proj.weight.dtype, cu_seqlens)
        return mix_tokens(self, SINGLE_DEVICE if self.cp is None else self.cp, hidden_states, cu_seqlens=cu_seqlens,
                          backend=self.backend, initial_state=initial_state, output_final_state=output_final_state,
                          split=self.split)
