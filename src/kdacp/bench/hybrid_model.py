"""The whole-model step of a hybrid model (linear-attention layers and softmax attention layers) under
context parallelism, per token layout: a prediction composed event by event in
:func:`kdacp.cp.cost_model.simulate`, as :mod:`kdacp.bench.scaling_model` composes the mixer-only step.

Four schemes (:data:`SCHEMES`), one sequence of ``T`` tokens over ``P`` ranks:

- ``contiguous+gather``: rank ``r`` holds tokens ``[rT/P, (r+1)T/P)``; attention gathers K/V along the
  sequence and rank ``r`` attends ``(2r+1)/P^2`` of the causal key-query pairs (:func:`causal_pairs`): the
  last rank ``(2P-1)/P`` times the mean, and every rank waits for it at the next collective.
- ``contiguous+ulysses``: the same layout, attention by Ulysses (all-to-all to ``H/P`` heads of the whole
  sequence and back): balanced work; needs ``H % P == 0`` (otherwise no row).
- ``zigzag+gather``: the zigzag layout (``2P`` chunks, rank ``r`` holds ``r`` and ``2P-1-r``): balanced
  attention; the linear-attention layers run kdacp's state chain over the ``2P`` ranges in global order
  (``0 -> 1 -> .. -> P-1 -> P-1 -> .. -> 0``, rank ``P-1``'s two chunks one range): ``2P-1`` positions, every
  rank but the last twice in it, near its start and near its end, so no rank runs ahead of the others by a
  layer as under the contiguous layout's wavefront.
- ``megatron-relayout`` (the peer row, Megatron-Core's scheme): zigzag for attention, and around every
  linear-attention layer a conversion zigzag -> contiguous before it and back after it (forward; the backward
  converts the gradients the same way), each rank sending its two chunks of ``T/(2P)`` hidden states to their
  contiguous owners (``T/(2P) * hidden * 2`` bytes each, point to point over the link); the linear layers
  then run the contiguous chain.

Per layer and rank (programs of :mod:`kdacp.cp.cost_model`'s ops, merged per rank):

- linear attention: the calibrated stage times of each rank role (:class:`StageTimes`, measured by the
  scaling suite at ``t_cal`` tokens a rank with ``HV_cal`` heads of ``K_cal x V_cal``) scaled linearly to
  the range's tokens and to the model's ``HV * K * V`` (launch costs of small ranges are not scaled
  down: a prediction for few tokens a rank is optimistic), the exchange (``p2p``, ``allgather`` or ``scan``;
  the best of the three is reported) on the ``P`` or ``2P - 1`` positions of the chain, a rank of two
  ranges running them as :func:`kdacp.cp.cost_model.programs` does.
- softmax attention: the K/V all-gather (ring, ``(P-1)`` steps of the rank's K/V bytes; its backward a
  reduce-scatter of the same size), or Ulysses' two all-to-alls (``(P-1)`` steps of ``1/P`` of the rank's
  bytes each); the causal attention compute of the rank's queries from FLOPs:
  ``2 * pairs * H * (Dqk + Dv)`` forward, :data:`BACKWARD_FLOP_RATIO` times that backward, at
  ``attention_flops`` per second (measured by the ``balance`` suite, or the stated default). Not
  overlapped with the exchange (ring attention would hide part of the gather).
- every rank meets at the loss.

One GPU's step on the same ``T`` tokens: the calibrated one-device mixer times scaled to ``T``, and all
``T(T+1)/2`` pairs' attention FLOPs. Parallel efficiency = one GPU's step / (``P`` x the CP step). Only the
token mixers are modelled: projections, MLPs/MoE and norms work per token and split perfectly, so the whole
model's efficiency is at least the one reported.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kdacp.cp.cost_model import DEFAULT_LINK, Link, RoleStages, StageTimes, programs, simulate
from kdacp.cp.layout import TokenLayout, contiguous_layout, zigzag_layout
from kdacp.cp.layout import causal_pairs as ranges_causal_pairs

from .scaling_model import chain_route

__all__ = ["ATTENTION_FLOPS", "BACKWARD_FLOP_RATIO", "HYBRID_MODELS", "MIXER_STRATEGIES", "SCHEMES", "Calibrated",
           "HybridPrediction", "HybridShapes", "attention_balance", "causal_pairs", "one_gpu_step", "predict_hybrid"]

SCHEMES = ("contiguous+gather", "contiguous+ulysses", "zigzag+gather", "megatron-relayout")
MIXER_STRATEGIES = ("p2p", "allgather", "scan")
# Achieved causal-attention throughput on one H200 in bf16 (FLOPs per second, forward and backward), an order of
# magnitude for FlashAttention-3 class kernels at long sequences, not a measurement: pass the balance suite's.
ATTENTION_FLOPS = 400e12
# FlashAttention's backward recomputes the scores: five matrix products against the forward's two, 2.5x its FLOPs.
BACKWARD_FLOP_RATIO = 2.5
_BF16 = 2  # bytes of an activation on the wire


@dataclass(frozen=True)
class HybridShapes:
    """A hybrid model's token mixers: ``layer_types`` in order (``"linear"`` or ``"attention"``), the
    linear-attention heads (``HV`` value heads of ``K x V``), the attention's ``H`` query heads, the ``H_kv``
    key/value heads it exchanges (after any up-projection) of ``Dqk`` / ``Dv``, and ``hidden``."""

    name: str
    layer_types: tuple[str, ...]
    hidden: int
    HV: int
    K: int
    V: int
    H: int
    H_kv: int
    Dqk: int
    Dv: int


def _types(pattern: str) -> tuple[str, ...]:
    return tuple("linear" if c == "L" else "attention" for c in pattern)


# transformers 5.25's KimiLinearConfig() defaults (Kimi-Linear-48B-A3B): 27 layers, MLA at layers 4, 8, .. 24
# (21 KDA, 6 MLA), KDA 32 heads of 128, MLA 32 heads with q/k of 128 + 64 (rope) and v of 128; kdacp's K/V
# all-gather moves the up-projected keys and values (all 32 heads).
KIMI_LINEAR_48B = HybridShapes("kimi-linear-48b", _types("LLLLA" + "LLLA" * 5 + "LL"), hidden=2304, HV=32, K=128,
                               V=128, H=32, H_kv=32, Dqk=192, Dv=128)
# transformers 5.25's Qwen3NextConfig() defaults (Qwen3-Next-80B-A3B): 48 layers, full attention every 4th
# (36 Gated DeltaNet, 12 gated attention), GDN 32 value heads of 128 (16 key heads), attention 16 heads,
# 2 key/value heads of 256.
QWEN3_NEXT_80B = HybridShapes("qwen3-next-80b", _types("LLLA" * 12), hidden=2048, HV=32, K=128, V=128, H=16, H_kv=2,
                              Dqk=256, Dv=256)
HYBRID_MODELS = {s.name: s for s in (KIMI_LINEAR_48B, QWEN3_NEXT_80B)}


def causal_pairs(layout: TokenLayout, rank: int, cu_seqlens=None) -> int:
    """Key-query pairs ``rank``'s queries attend under causal attention with the document mask of global
    ``cu_seqlens`` (ints; None: one sequence): :func:`kdacp.cp.layout.causal_pairs` of its ranges."""
    bounds = [0, layout.num_tokens] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    return ranges_causal_pairs(layout.ranges[rank], bounds)


def attention_balance(layout: TokenLayout, cu_seqlens=None) -> float:
    """Max over mean of the ranks' causal pairs (:func:`causal_pairs`): 1 is perfectly balanced."""
    pairs = [causal_pairs(layout, r, cu_seqlens) for r in range(layout.world_size)]
    return max(pairs) * len(pairs) / sum(pairs)


@dataclass(frozen=True)
class Calibrated:
    """What the model is computed from: the scaling suite's ``stages`` measured at ``t_cal`` tokens a rank with
    ``HV_cal`` heads of ``K_cal x V_cal`` (:func:`kdacp.bench.calibration.measure_stages`), the ``link`` and the
    achieved ``attention_flops`` (per second)."""

    stages: StageTimes
    t_cal: int
    HV_cal: int
    K_cal: int
    V_cal: int
    link: Link = DEFAULT_LINK
    attention_flops: float = ATTENTION_FLOPS

    def scaled(self, shapes: HybridShapes, tokens: float) -> StageTimes:
        """The stage times of ``tokens`` tokens of ``shapes``' linear attention: every local stage and the
        one-device times scaled by tokens and ``HV*K*V``, the exchange's own products by ``HV*K*V*(K+V)``, the
        message sizes recomputed (float32 states)."""
        heads = shapes.HV * shapes.K * shapes.V / (self.HV_cal * self.K_cal * self.V_cal)
        f = tokens / self.t_cal * heads
        st = self.stages

        def roles(d):
            return {r: RoleStages(s.ready * f, s.between * f, s.after * f) for r, s in d.items()}
        products = heads * (shapes.K + shapes.V) / (self.K_cal + self.V_cal)
        return dataclasses.replace(
            st, forward=roles(st.forward), backward=roles(st.backward), one_device=tuple(x * f for x in st.one_device),
            apply_s=st.apply_s * heads, compose_s=st.compose_s * products,
            state_bytes=shapes.HV * shapes.K * shapes.V * 4, summary_bytes=shapes.HV * shapes.K * (shapes.K + shapes.V) * 4)


def _attention_flops(pairs: float, shapes: HybridShapes) -> float:
    """Forward FLOPs of causal attention over ``pairs`` key-query pairs: ``QK^T`` and ``PV``."""
    return 2 * pairs * shapes.H * (shapes.Dqk + shapes.Dv)


def one_gpu_step(shapes: HybridShapes, T: int, cal: Calibrated) -> float:
    """Seconds of one GPU's training step of the token mixers on all ``T`` tokens (module docstring)."""
    linear = sum(cal.scaled(shapes, T).one_device)
    attention = _attention_flops(T * (T + 1) / 2, shapes) * (1 + BACKWARD_FLOP_RATIO) / cal.attention_flops
    n_lin = shapes.layer_types.count("linear")
    return n_lin * linear + (len(shapes.layer_types) - n_lin) * attention


def _role(c: int, n: int) -> str:
    return "first" if c == 0 else "last" if c == n - 1 else "through"


def _mixer_layer(strategy: str, layout: TokenLayout, times: StageTimes, base: float, direction: str, key
                 ) -> list[list[tuple]]:
    """One linear-attention layer's programs by rank: the chain over ``layout``'s ranges in the direction states
    flow, ``times`` scaled to ``base`` tokens (each range's stages scaled on to its own length), a rank of
    several ranges running them as :func:`kdacp.cp.cost_model.programs` does (``holders``)."""
    n = len(layout.chain)
    order = list(range(n)) if direction == "forward" else list(reversed(range(n)))
    per_role = times.forward if direction == "forward" else times.backward
    stages = []
    for c in order:
        p, s = layout.chain[c], per_role[_role(c, n)]
        f = (p.end - p.start) / base
        stages.append(RoleStages(s.ready * f, s.between * f, s.after * f))
    emits, affine = chain_route(n)
    return programs(strategy, emits, affine, stages, times, key, holders=[layout.chain[c].rank for c in order])


@dataclass(frozen=True)
class HybridPrediction:
    """One scheme's predicted step (seconds, the slowest rank), the best mixer strategy, and one GPU's step on
    the same total tokens."""

    model: str
    scheme: str
    T: int
    P: int
    strategy: str
    step_s: float
    one_gpu_s: float
    attention_imbalance: float

    @property
    def efficiency(self) -> float:
        return self.one_gpu_s / (self.P * self.step_s)


def predict_hybrid(shapes: HybridShapes, scheme: str, T: int, P: int, cal: Calibrated,
                   strategies=MIXER_STRATEGIES) -> HybridPrediction | None:
    """The training step of ``shapes``' token mixers on one sequence of ``T`` tokens over ``P`` ranks under
    ``scheme`` (one of :data:`SCHEMES`; module docstring), the best of the mixers' exchange ``strategies``; None
    where the scheme does not apply (Ulysses with ``H % P != 0``).

    Raises:
        ValueError: an unknown scheme or strategy, ``P < 2`` or ``T`` not a multiple of ``2P``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not strategies or set(strategies) - set(MIXER_STRATEGIES):
        raise ValueError(f"strategies must be some of {MIXER_STRATEGIES}, got {strategies!r}")
    if isinstance(P, bool) or not isinstance(P, int) or P < 2:
        raise ValueError(f"P must be an int >= 2, got {P!r}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 2 * P or T % (2 * P):
        raise ValueError(f"T must be a positive multiple of 2P={2 * P}, got {T!r}")
    if scheme == "contiguous+ulysses" and shapes.H % P:
        return None
    attention_layout = contiguous_layout(T, P) if scheme.startswith("contiguous") else zigzag_layout(T, P)
    mixer_layout = zigzag_layout(T, P) if scheme == "zigzag+gather" else contiguous_layout(T, P)
    pairs = [causal_pairs(attention_layout, r) for r in range(P)]
    if scheme == "contiguous+ulysses":
        pairs = [T * (T + 1) / 2 / P] * P
    base = T / (2 * P)
    times = cal.scaled(shapes, base)
    best = None
    for strategy in strategies:
        progs = _step(shapes, scheme, strategy, mixer_layout, times, base, pairs, T, P, cal)
        step = max(simulate(progs, cal.link))
        if best is None or step < best[1]:
            best = (strategy, step)
    return HybridPrediction(shapes.name, scheme, T, P, best[0], best[1], one_gpu_step(shapes, T, cal),
                            max(pairs) * P / sum(pairs))


def _attention_layer(shapes: HybridShapes, scheme: str, pairs: list[float], T: int, P: int, cal: Calibrated,
                     direction: str, key) -> list[list[tuple]]:
    """One softmax-attention layer's programs by rank (module docstring)."""
    ratio = 1.0 if direction == "forward" else BACKWARD_FLOP_RATIO
    compute = [("compute", _attention_flops(p, shapes) * ratio / cal.attention_flops) for p in pairs]
    local = T // P
    if scheme == "contiguous+ulysses":
        r = math.lcm(shapes.H_kv, P) // shapes.H_kv
        qkv = local / P * (shapes.H * shapes.Dqk + r * shapes.H_kv * (shapes.Dqk + shapes.Dv)) * _BF16
        out = local / P * shapes.H * shapes.Dv * _BF16
        first, second = (qkv, out) if direction == "forward" else (out, qkv)
        return [[("gather", (key, 0), first), ("wait", (key, 0)), c, ("gather", (key, 1), second), ("wait", (key, 1))]
                for c in compute]
    kv = local * shapes.H_kv * (shapes.Dqk + shapes.Dv) * _BF16
    if direction == "forward":  # gather K/V, attend
        return [[("gather", key, kv), ("wait", key), c] for c in compute]
    return [[c, ("gather", key, kv), ("wait", key)] for c in compute]  # attend, reduce-scatter dK/dV


def _relayout(P: int, T: int, hidden: int, to_contiguous: bool) -> list[list[tuple]]:
    """Megatron-Core's conversion of one layer's hidden states between zigzag and contiguous, by rank: chunk ``c``
    of ``2P`` moves between its zigzag owner (``c`` or ``2P-1-c``) and its contiguous owner (``c // 2``)."""
    nbytes = T // (2 * P) * hidden * _BF16
    moves = [(c if c < P else 2 * P - 1 - c, c // 2) for c in range(2 * P)]  # (zigzag owner, contiguous owner)
    if not to_contiguous:
        moves = [(b, a) for a, b in moves]
    progs = [[] for _ in range(P)]
    for src, dst in moves:
        if src != dst:
            progs[src].append(("send", dst, nbytes))
    for src, dst in moves:
        if src != dst:
            progs[dst].append(("recv", src))
    return progs


def _step(shapes: HybridShapes, scheme: str, strategy: str, mixer_layout: TokenLayout, times: StageTimes,
          base: float, pairs: list[float], T: int, P: int, cal: Calibrated) -> list[list[tuple]]:
    """Every rank's program of one training step: the layers' forwards in order, the loss (every rank meets),
    the backwards in reverse order."""
    progs = [[] for _ in range(P)]

    def add(layer_progs):
        for prog, mine in zip(progs, layer_progs):
            prog += mine

    def layer(i: int, direction: str):
        key = (direction, i)
        if shapes.layer_types[i] == "attention":
            add(_attention_layer(shapes, scheme, pairs, T, P, cal, direction, key))
            return
        relayout = scheme == "megatron-relayout"
        if relayout:
            add(_relayout(P, T, shapes.hidden, to_contiguous=True))
        add(_mixer_layer(strategy, mixer_layout, times, base, direction, key))
        if relayout:
            add(_relayout(P, T, shapes.hidden, to_contiguous=False))

    for i in range(len(shapes.layer_types)):
        layer(i, "forward")
    for prog in progs:
        prog += [("barrier", "loss"), ("wait", "loss")]
    for i in reversed(range(len(shapes.layer_types))):
        layer(i, "backward")
    return progs
