"""The ``flashqla`` backend: Gated DeltaNet's state pass and gradient pass on FlashQLA 0.1.3's fused kernels,
with kdacp's summaries beside them.

FlashQLA fuses a span's whole forward (gate cumsum, ``A = (I + kkt)^-1``, state pass and output) and its whole
backward (state recompute, gradient pass and input gradients), each from given initial states and, backward,
final-state gradients: what a rank's local work is once its incoming state or gradient is known. kdacp's stages
map onto it:

- ``prepare``: FLA's L2 norm and in-kernel gate forward (the natural-log gate per token); nothing else;
- ``state_pass``: FlashQLA's forward over the span from the given states (its own split inside the device,
  ``auto_cp``, where its cost model takes it); it makes the output too, which ``output`` returns;
- ``state_summary``, ``state_gradient_summary`` and the gradient pass over a prefix of the segments (the context-
  parallel exchange and kdacp's split, :mod:`kdacp.cp.split`): the ``fla`` GDN backend's stages on the same
  normalised inputs and gate (FLA's intra-chunk factors and kdacp's summary kernels), formed at the first call
  that needs them: a call on one device without the split never forms them;
- ``backward_states``: FlashQLA's backward over the span (``A`` and the gate cumsum recomputed by its kernels),
  which gives every input gradient and the initial states' at once; ``backward_inputs``: FLA's gate and L2-norm
  backward.

States are kdacp's ``[n, HV, K, V]`` float32 (FlashQLA's default layout, ``state_v_first=False``). Limits
(:func:`kdacp.backends.flashqla_adapter.flashqla_refusal`): ``K = V = 128``, bfloat16 or float16, chunks of 64.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .base import BackwardStates, KDAInputs, KDAOptions, LocalBackend, LocalStates, Span, tma_aligned
from .fla_backend import FlaBackend, FusedBackwardStates, FusedStates
from .fla_gdn_backend import FlaGDNBackend
from .flashqla_adapter import load_flashqla

CHUNK_SIZE = 64  # FlashQLA's chunk length on the GPUs kdacp runs it on


@dataclass
class FlashQLASaved:
    """What backward needs, token-first ``[1, T, ...]``: ``q, k [1, T, H, K]`` after the optional L2 norm (with
    ``q_rstd, k_rstd [1, T, H]``), ``v``, ``beta``, the natural-log gate per token ``gate [1, T, HV]`` (after the
    in-kernel gate), and for the gate's backward the raw ``g`` (gate in kernel, else ``None``), ``A_log``,
    ``dt_bias``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    gate: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    g: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None

    def narrow(self, span: Span) -> "FlashQLASaved":
        """The record of ``span``'s tokens (the parameters whole)."""
        return FlashQLASaved(*(None if t is None else t if name in ("A_log", "dt_bias") else tma_aligned(span.take(t))
                               for name, t in vars(self).items()))

    def summary_inputs(self) -> KDAInputs:
        """The inputs of the summaries' backend: normalised ``q, k`` and the gate as a plain natural-log one."""
        return KDAInputs(self.q, self.k, self.v, self.gate, self.beta)


class FlashQLAChunks:
    """Forward: the saved record over the prepared span, and the summaries' backend's chunk data, formed at first
    use (:attr:`summary_chunks`)."""

    def __init__(self, saved: FlashQLASaved, span: Span, summaries: LocalBackend):
        self.saved, self.span, self._summaries = saved, span, summaries

    @functools.cached_property
    def summary_chunks(self):
        return self._summaries.prepare(self.saved.summary_inputs(), self.span)


class FlashQLABackward:
    """One span's backward before the gradient pass: its saved record cut to the span, ``do``, the initial
    states, and the summaries' backend's backward over the same span, formed at first use
    (:attr:`summary_local`)."""

    def __init__(self, saved: FlashQLASaved, span: Span, do: torch.Tensor, initial_state: torch.Tensor | None,
                 summaries: LocalBackend):
        self.saved, self.span, self.do, self.initial_state = saved, span, do, initial_state
        self._summaries = summaries

    @property
    def own_span(self) -> Span:
        """:attr:`span` as a span of :attr:`saved` (which holds its tokens only)."""
        return Span(0, self.span.end - self.span.start, self.span.cu_seqlens)

    @functools.cached_property
    def summary_local(self):
        chunks = self._summaries.prepare(self.saved.summary_inputs(), self.own_span)
        return self._summaries.backward_local(self._summaries.to_saved(chunks), self.own_span, self.do,
                                              self.initial_state)


class FlashQLAGDNBackend(FlaBackend):
    """GDN on FlashQLA's fused forward and backward, on the scalar gate ``g [1, T, HV]`` (and ``dt_bias [HV]``
    with the gate in kernel); FLA's gate and L2 norm around them, the ``fla`` GDN backend's summaries beside."""

    name = "flashqla"
    parallel_pieces = False  # FlashQLA's fused pass splits a long segment itself
    summary_pieces = True  # the summaries are the fla backend's
    _gate_backward = FlaGDNBackend._gate_backward

    def __init__(self, options: KDAOptions):
        super().__init__(options)
        if options.gate != "scalar":
            raise ValueError(f"the flashqla backend runs GDN's scalar gate only, got gate={options.gate!r}")
        if options.chunk_size != CHUNK_SIZE:
            raise ValueError(f"the flashqla backend runs chunks of {CHUNK_SIZE} tokens, got "
                             f"chunk_size={options.chunk_size}")
        self.qla = load_flashqla()
        self.summaries = self._summary_backend(replace(options, use_qk_l2norm_in_kernel=False,
                                                       use_gate_in_kernel=False))

    @staticmethod
    def _summary_backend(options: KDAOptions) -> LocalBackend:
        """The backend whose summaries (and gradient pass over a prefix of the segments) serve this one's, for
        inputs already normalised and a natural-log gate: the ``fla`` GDN backend."""
        return FlaGDNBackend(options)

    def _boundaries(self, span: Span, device) -> torch.Tensor | None:
        """FlashQLA's ``cu_seqlens`` of ``span`` (int64, relative to its first token; None for one segment): the
        tensor FLA's arguments keep per batch, so that FlashQLA's own caches keyed by it (its split's plan, read on
        the host) hit on every later call of the batch."""
        return self._varlen(span, device)["cu_seqlens"]

    # forward

    def prepare(self, inputs: KDAInputs, span: Span) -> FlashQLAChunks:
        o, fla = self.options, self.fla
        # FlashQLA's kernels read dense rows: strided views are copied here, once
        x = KDAInputs(*(None if t is None else t.contiguous() for t in vars(inputs).values()))
        q, k, q_rstd, k_rstd = x.q, x.k, None, None
        if o.use_qk_l2norm_in_kernel:
            q, q_rstd = fla.l2norm_fwd(q)
            k, k_rstd = fla.l2norm_fwd(k)
        gate = fla.gdn_gate_fwd(x.g, x.A_log, x.dt_bias) if o.use_gate_in_kernel else x.g
        saved = FlashQLASaved(q, k, x.v, x.beta, gate, q_rstd, k_rstd, x.g if o.use_gate_in_kernel else None,
                              x.A_log, x.dt_bias)
        return FlashQLAChunks(saved, span, self.summaries)

    def state_summary(self, chunks: FlashQLAChunks, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        return self.summaries.state_summary(chunks.summary_chunks, span, with_transition, parts=parts,
                                            chunks_per_piece=chunks_per_piece)

    def state_pass(self, chunks: FlashQLAChunks, span: Span, initial_state: torch.Tensor | None,
                   output_final_state: bool) -> FusedStates:
        x = chunks.saved.narrow(span)
        _, _, o, _, final_state, _ = self.qla.forward(
            q=x.q, k=x.k, v=x.v, g=x.gate, beta=x.beta, scale=self.options.scale, initial_state=initial_state,
            cu_seqlens=self._boundaries(span, x.q.device), output_final_state=output_final_state, output_h=False,
            auto_cp=True, enable_fwd_cp_cache=False, is_train=False)
        return FusedStates(final_state if output_final_state else None, o=o)

    def output(self, chunks: FlashQLAChunks, span: Span, initial_state: torch.Tensor | None,
               states: FusedStates) -> torch.Tensor:
        return self._fused_output(span, states, chunks.saved.v.dtype)

    def to_saved(self, chunks: FlashQLAChunks) -> FlashQLASaved:
        return chunks.saved

    # backward

    def backward_local(self, saved: FlashQLASaved, span: Span, do: torch.Tensor, initial_state: torch.Tensor | None,
                       states: LocalStates | None = None) -> FlashQLABackward:
        # FlashQLA's backward recomputes the state pass itself: kept states are not read
        return FlashQLABackward(saved.narrow(span), span, do, initial_state, self.summaries)

    def state_gradient_summary(self, local: FlashQLABackward, segments: tuple[int, int] | None = None) -> torch.Tensor:
        return self.summaries.state_gradient_summary(local.summary_local, segments=segments)

    def backward_states(self, local: FlashQLABackward, dht: torch.Tensor | None,
                        segments: int | None = None) -> BackwardStates:
        if segments is not None and segments != local.span.num_segments:
            # the initial-state gradients of a prefix only (a head's message): the summaries' backend's pass
            states = self.summaries.backward_states(local.summary_local, dht, segments=segments)
            return BackwardStates(local.span.prefix(segments), states.dinitial_state)
        qla, x, o = self.qla, local.saved, self.options
        cu_seqlens = self._boundaries(local.own_span, x.q.device)
        gate_cumsum = qla.chunk_local_cumsum(x.gate, chunk_size=CHUNK_SIZE, cu_seqlens=cu_seqlens)
        A = qla.kkt_solve(k=x.k, b=x.beta, chunk_size=CHUNK_SIZE, cu_seqlens=cu_seqlens)
        dq, dk, dv, dbeta, dgate, dh0 = qla.backward(
            q=x.q, k=x.k, v=x.v, g=gate_cumsum, beta=x.beta, A=A, do=local.do.contiguous(),
            dht=None if dht is None else dht.contiguous(), scale=o.scale,
            initial_state=local.initial_state, cu_seqlens=cu_seqlens, auto_cp=True)
        return FusedBackwardStates.of(local.span, dh0, x, (dq, dk, dv, dgate.to(x.gate.dtype), dbeta), local.do)

    backward_inputs = FlaBackend._fused_backward_inputs
