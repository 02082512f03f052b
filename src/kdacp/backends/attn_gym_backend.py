"""The ``attn_gym`` backend: attention-gym 0.0.17's staged KDA and GDN cores for training, with FLA's
gate and L2-norm kernels around them.

attention-gym splits its cores where context parallelism waits, as kdacp does, but in coarser stages: its
forward handle (``chunk_kda_prepare`` / ``chunk_gdn_prepare``: gate scan and intra-chunk WY factors) gives
summaries and ``run`` (state pass and output in one); its backward handle (``*_prepare_backward``: the
recompute, with the state pass from the initial states) gives reverse summaries and ``run`` (gradient state
pass and input gradients in one). kdacp's stages map onto them:

- ``prepare``: FLA's L2 norm and in-kernel gate forward (a natural-log gate per token), then attention-gym's
  forward handle over the span;
- ``state_summary``: attention-gym's summaries of the span's segments (float32 maps), in kdacp's layout;
- ``state_pass``: its ``run`` on the span (on a span inside the prepared one, a handle cut to its tokens),
  which also makes the output; ``output`` returns that output;
- ``backward_local``: its backward handle; ``state_gradient_summary``: its reverse summaries' offsets;
- ``backward_states``: its backward ``run`` (the input gradients wait in the result); for a prefix of the
  span's segments only the initial-state gradients are asked for, and they come from the reverse summaries
  applied to the given final-state gradients (exact: the gradient is affine in them), with no second pass;
- ``backward_inputs``: FLA's gate and L2-norm backward.

attention-gym's states are V-major, ``[N, HV, V, K]`` (kdacp's: ``[N, HV, K, V]``), and its maps act on the
right: ``H_out = H_in A + B`` packed ``[HV, V + K, K] = [B; A]``, so kdacp's ``S_ext = B^T`` and ``M = A^T``;
reverse ``dH_in = dH_out R + C``, so ``G = C^T`` and ``dS_in = R^T dS_out + G``.

Which calls run here (:func:`kdacp.backends.call.prepare_call`): training calls; a call that wants no
gradient runs on FLA's backends, whose forward is as fast for KDA (2.220 against 2.243 ms at 16K tokens,
32 heads of 128, one H200) and faster for GDN (1.148 against 1.832 ms). The limits are checked before
(:func:`kdacp.backends.attn_gym_adapter.attn_gym_refusal`). FLA's ``safe_gate`` is a kernel choice of
FLA's with no effect on the result; attention-gym's kernels need no such hint.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..affine import AffineMap
from ..caches import ATTN_GYM_BOUNDARIES
from ..host_copies import to_device
from .attn_gym_adapter import load_attn_gym
from .base import BackwardStates, KDAInputs, KDAOptions, LocalStates, Span, tma_aligned
from .fla_backend import FlaBackend, FusedBackwardStates, FusedStates
from .fla_gdn_backend import FlaGDNBackend

CHUNK_SIZE = 64  # attention-gym's only chunk size


@functools.lru_cache(maxsize=ATTN_GYM_BOUNDARIES)
def _int32_on(values: tuple, device: torch.device) -> torch.Tensor:
    """``values`` (a tuple, or a tuple of pairs) as a contiguous int32 tensor on ``device``, copied from pinned
    memory without a device sync; shared by every call on the same batch (callers must not modify it)."""
    host = torch.tensor(values, dtype=torch.int32)
    return to_device(host, device)


def _boundaries(span: Span, device: torch.device) -> torch.Tensor | None:
    """attention-gym's ``cu_seqlens`` of ``span`` (relative to its first token), None for one segment (its
    dense kernels)."""
    return None if span.num_segments == 1 else _int32_on(span.cu_seqlens, device)


def _bounds(span: Span, origin: int, device: torch.device) -> torch.Tensor:
    """``int32 [n, 2]``: ``span``'s segments as ``[start, stop)`` offsets into a handle whose tokens begin at
    global offset ``origin``: the rows attention-gym's summaries take (whole segments of its span)."""
    base = span.start - origin
    cu = span.cu_seqlens
    return _int32_on(tuple((base + a, base + b) for a, b in zip(cu[:-1], cu[1:])), device)


def _to_kv(state: torch.Tensor | None) -> torch.Tensor | None:
    """attention-gym's ``[n, HV, V, K]`` state as kdacp's ``[n, HV, K, V]`` (contiguous: it may be sent)."""
    return None if state is None else state.transpose(-1, -2).contiguous()


def _to_vk(state: torch.Tensor | None) -> torch.Tensor | None:
    """kdacp's ``[n, HV, K, V]`` state as attention-gym's ``[n, HV, V, K]`` (a view; attention-gym copies it to
    its layout)."""
    return None if state is None else state.transpose(-1, -2)


def affine_map_of(maps: torch.Tensor, with_transition: bool = True) -> AffineMap:
    """kdacp's ``AffineMap(S_ext [n, HV, K, V], M [n, HV, K, K] or None)`` of attention-gym's forward maps
    ``[n, HV, V + K, K] = [B; A]`` (``H_out = H_in A + B`` on V-major states): ``S_ext = B^T``, ``M = A^T``."""
    V = maps.shape[-2] - maps.shape[-1]
    return AffineMap(_to_kv(maps[..., :V, :]), _to_kv(maps[..., V:, :]) if with_transition else None)


def gradient_map_of(maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G [n, HV, K, V], M [n, HV, K, K])`` of attention-gym's reverse maps ``[n, HV, V + K, K] = [C; R]``
    (``dH_in = dH_out R + C`` on V-major gradients): ``G = C^T`` and ``R = M`` (so ``dS_in = M^T dS_out + G``)."""
    V = maps.shape[-2] - maps.shape[-1]
    return _to_kv(maps[..., :V, :]), maps[..., V:, :]


# The fields of the saved records that are not token-first: attention-gym's boundaries, the gate's parameters.
_BOUNDARY_FIELDS = ("cu_seqlens", "chunk_offsets")
_PARAMETER_FIELDS = ("A_log", "dt_bias")


@dataclass
class AttnGymSaved:
    """What backward needs besides attention-gym's tape: the raw gate ``g`` (gate in kernel, else ``None``),
    the L2 norm's reciprocal norms ``q_rstd, k_rstd [1, T, H]`` (or ``None``), ``A_log``, ``dt_bias``.
    Subclasses add the tape's fields, named as attention-gym names them."""

    g: torch.Tensor | None
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None

    def tape(self, tape_type):
        """attention-gym's tape (a NamedTuple of ``tape_type``) from this record's fields."""
        return tape_type(*(getattr(self, name) for name in tape_type._fields))


@dataclass
class AttnGymKDASaved(AttnGymSaved):
    """attention-gym's ``ChunkKDASaved``: ``q, k`` after the L2 norm, ``v``, its gate scan ``cumulative_gate``
    and ``beta`` (float32), the intra-chunk factors ``aqk, akk [1, T, HV, 64]``, its int32 ``cu_seqlens`` and
    ``chunk_offsets`` (``None`` on its dense path)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cumulative_gate: torch.Tensor
    beta: torch.Tensor
    aqk: torch.Tensor | None
    akk: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


@dataclass
class AttnGymGDNSaved(AttnGymSaved):
    """attention-gym's ``ChunkGDNSaved``: as :class:`AttnGymKDASaved` with the scalar gate's scan
    ``cumulative_gate [1, T, HV]`` and the WY inverse ``inverse [1, T, HV, 64]`` instead of ``aqk, akk``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cumulative_gate: torch.Tensor
    beta: torch.Tensor
    inverse: torch.Tensor
    cu_seqlens: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


@dataclass(frozen=True)
class AttnGymChunks:
    """Forward: attention-gym's forward handle ``prepared`` over ``span`` and kdacp's part of the saved record
    (an :class:`AttnGymSaved` without the tape)."""

    prepared: object
    span: Span
    extra: AttnGymSaved


@dataclass
class AttnGymBackward:
    """One span's backward before the gradient pass: its saved record cut to the span, attention-gym's backward
    ``handle``, and ``ran``: whether the handle's ``run`` was called (it releases its tensors as it goes, so a
    second pass rebuilds the handle from ``do`` and ``initial_state``, V-major)."""

    saved: AttnGymSaved
    span: Span
    do: torch.Tensor
    initial_state: torch.Tensor | None
    handle: object
    ran: bool = False


class AttnGymBackend(FlaBackend):
    """KDA on attention-gym's staged core (``chunk_kda_prepare``); FLA's gate and L2 norm around it."""

    name = "attn_gym"
    parallel_pieces = False  # its summaries cover whole segments only
    summary_pieces = False
    saved_type = AttnGymKDASaved
    tape_name = "ChunkKDASaved"

    def __init__(self, options: KDAOptions):
        super().__init__(options)
        if options.chunk_size != CHUNK_SIZE:
            raise ValueError(f"the attn_gym backend runs chunks of {CHUNK_SIZE} tokens, got "
                             f"chunk_size={options.chunk_size}")
        if options.summary_precision is not None:
            raise ValueError(f"summary_precision={options.summary_precision!r} chooses the fla backend's summary "
                             "kernels; the attn_gym backend's summaries are attention-gym's own (pass None)")
        self.ag = load_attn_gym()

    # the family's pieces (GDN overrides them)

    def _gate(self, x: KDAInputs) -> torch.Tensor:
        """The natural-log gate per token (KDA ``[1, T, HV, K]``, GDN ``[1, T, HV]``): ``g``, or with the gate in
        kernel its forward (float32). KDA calls take the bounded gate in kernel only
        (:func:`~kdacp.backends.attn_gym_adapter.attn_gym_refusal`)."""
        return self._gate_forward(x) if self.options.use_gate_in_kernel else x.g

    def _gate_forward(self, x: KDAInputs) -> torch.Tensor:
        return self.fla.kda_gate_fwd(x.g, x.A_log, x.dt_bias, lower_bound=self.options.lower_bound)

    def _prepare_core(self, q, k, v, gate, beta, cu_seqlens):
        return self.ag.chunk_kda_prepare(q, k, v, gate, beta, cu_seqlens=cu_seqlens, scale=self.options.scale)

    def _prepare_backward_core(self, tape, do, initial_state):
        return self.ag.chunk_kda_prepare_backward(tape, do, initial_state, scale=self.options.scale)

    # spans inside the prepared one

    def _cut(self, record, span: Span, device):
        """``(record cut, metadata)``: ``record`` (attention-gym's tape, a NamedTuple, or an
        :class:`AttnGymSaved`) with its token-first tensors cut to ``span`` (offsets into the record's tokens)
        and ``span``'s own boundaries and chunk offsets, and attention-gym's chunk metadata of ``span``. Segments
        are chunked from their own first tokens, so the rows cut are those the span alone would have."""
        metadata = self.ag.prepare_ragged_chunk_metadata(_int32_on(span.cu_seqlens, device), span.end - span.start,
                                                         CHUNK_SIZE)
        fields = record._asdict() if hasattr(record, "_asdict") else vars(record)
        cut = {name: tma_aligned(span.take(t)) for name, t in fields.items()
               if t is not None and name not in _BOUNDARY_FIELDS + _PARAMETER_FIELDS}
        cut.update(cu_seqlens=metadata.cu_seqlens, chunk_offsets=metadata.chunk_offsets)
        return (record._replace(**cut) if hasattr(record, "_replace") else dataclasses.replace(record, **cut)), metadata

    def _handle_on(self, chunks: AttnGymChunks, span: Span):
        """The forward handle of ``span``: the prepared one where ``span`` is its span, else one cut to it."""
        whole = chunks.span
        if (span.start, span.end, span.cu_seqlens) == (whole.start, whole.end, whole.cu_seqlens):
            return chunks.prepared
        inner = Span(span.start - whole.start, span.end - whole.start, span.cu_seqlens)
        p = chunks.prepared
        saved, metadata = self._cut(p.saved, inner, p.saved.q.device)
        factors = p.factors._replace(**{name: tma_aligned(inner.take(t)) for name, t in p.factors._asdict().items()})
        return dataclasses.replace(p, saved=saved, factors=factors, metadata=metadata)

    # forward

    def prepare(self, inputs: KDAInputs, span: Span) -> AttnGymChunks:
        o, fla = self.options, self.fla
        # attention-gym's kernels read dense rows: strided views are copied here, once
        x = KDAInputs(*(None if t is None else span.take(t).contiguous() if t.dim() > 1 else t.contiguous()
                        for t in vars(inputs).values()))
        q, k, q_rstd, k_rstd = x.q, x.k, None, None
        if o.use_qk_l2norm_in_kernel:
            q, q_rstd = fla.l2norm_fwd(q)
            k, k_rstd = fla.l2norm_fwd(k)
        prepared = self._prepare_core(q, k, x.v, self._gate(x), x.beta, _boundaries(span, x.q.device))
        extra = AttnGymSaved(x.g if o.use_gate_in_kernel else None, q_rstd, k_rstd, x.A_log, x.dt_bias)
        return AttnGymChunks(prepared, span, extra)

    def state_summary(self, chunks: AttnGymChunks, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        if parts:
            raise ValueError("the attn_gym backend summarises whole segments only (summary_pieces is False)")
        maps = chunks.prepared.state_summaries(_bounds(span, chunks.span.start, chunks.prepared.saved.q.device))
        return affine_map_of(maps, with_transition)

    def state_pass(self, chunks: AttnGymChunks, span: Span, initial_state: torch.Tensor | None,
                   output_final_state: bool) -> FusedStates:
        # attention-gym's run makes the output with the states
        o, final_state = self._handle_on(chunks, span).run(_to_vk(initial_state), output_final_state=output_final_state)
        return FusedStates(_to_kv(final_state) if output_final_state else None, o=o)

    def output(self, chunks: AttnGymChunks, span: Span, initial_state: torch.Tensor | None,
               states: FusedStates) -> torch.Tensor:
        return self._fused_output(span, states, chunks.prepared.saved.v.dtype)

    def to_saved(self, chunks: AttnGymChunks) -> AttnGymSaved:
        return self.saved_type(**vars(chunks.extra), **chunks.prepared.saved._asdict())

    # backward

    def backward_local(self, saved: AttnGymSaved, span: Span, do: torch.Tensor, initial_state: torch.Tensor | None,
                       states: LocalStates | None = None) -> AttnGymBackward:
        # attention-gym's backward handle recomputes the state pass itself: kept states are not read
        if span.start != 0 or span.end != saved.q.shape[1]:
            saved, _ = self._cut(saved, span, do.device)
        h0 = _to_vk(initial_state)
        handle = self._prepare_backward_core(saved.tape(getattr(self.ag, self.tape_name)), do, h0)
        return AttnGymBackward(saved, span, do, h0, handle)

    def _handle(self, local: AttnGymBackward):
        """``local``'s backward handle, rebuilt where its ``run`` released its tensors."""
        if local.ran:
            local.handle = self._prepare_backward_core(local.saved.tape(getattr(self.ag, self.tape_name)), local.do,
                                                       local.initial_state)
            local.ran = False
        return local.handle

    def _reverse_maps(self, local: AttnGymBackward, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
        """``(G [n, HV, K, V], M [n, HV, K, K])`` of ``span``'s segments (a prefix of ``local.span``), from
        attention-gym's reverse summaries (:func:`gradient_map_of`)."""
        maps = self._handle(local).state_grad_summaries(_bounds(span, local.span.start, local.do.device))
        return gradient_map_of(maps)

    def state_gradient_summary(self, local: AttnGymBackward, segments: tuple[int, int] | None = None) -> torch.Tensor:
        # attention-gym's reverse summaries run over a prefix of the span: the rows of segments are taken after
        G = self._reverse_maps(local, local.span if segments is None else local.span.prefix(segments[1]))[0]
        return G if segments is None else G[segments[0]:]

    def backward_states(self, local: AttnGymBackward, dht: torch.Tensor | None,
                        segments: int | None = None) -> BackwardStates:
        if segments is not None and segments != local.span.num_segments:
            span = local.span.prefix(segments)
            G, M = self._reverse_maps(local, span)
            dinitial = G if dht is None else G + M.transpose(-1, -2) @ dht.to(M.dtype)
            return BackwardStates(span, dinitial)
        handle = self._handle(local)
        local.ran = True
        *grads, dh0 = handle.run(_to_vk(dht))  # attention-gym reads it as float32
        return FusedBackwardStates.of(local.span, _to_kv(dh0), local.saved, grads, local.do)

    backward_inputs = FlaBackend._fused_backward_inputs


class AttnGymGDNBackend(AttnGymBackend):
    """GDN on attention-gym's staged core (``chunk_gdn_prepare``), on the scalar gate ``g [1, T, HV]`` (and
    ``dt_bias [HV]`` with the gate in kernel); FLA's gate and L2 norm around it."""

    saved_type = AttnGymGDNSaved
    tape_name = "ChunkGDNSaved"
    _gate_backward = FlaGDNBackend._gate_backward

    def _gate_forward(self, x: KDAInputs) -> torch.Tensor:
        return self.fla.gdn_gate_fwd(x.g, x.A_log, x.dt_bias)

    def _prepare_core(self, q, k, v, gate, beta, cu_seqlens):
        # always its packed kernels: attention-gym 0.0.17's dense GDN path (no cu_seqlens) returns NaN outputs
        # and final states on an H200 (4096 tokens, 16 q/k and 32 value heads), its packed path of one segment not
        if cu_seqlens is None:
            cu_seqlens = _int32_on((0, q.shape[1]), q.device)
        return self.ag.chunk_gdn_prepare(q, k, v, gate, beta, cu_seqlens=cu_seqlens, scale=self.options.scale)

    def _prepare_backward_core(self, tape, do, initial_state):
        return self.ag.chunk_gdn_prepare_backward(tape, do, initial_state, scale=self.options.scale)
