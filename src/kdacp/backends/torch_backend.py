"""The ``torch`` backend: every stage built on :mod:`kdacp.reference`.

Runs on any device and dtype (float64 included). It recomputes the chunked form inside each
stage rather than caching intermediates: it exists to be obviously right, not fast. Backward
differentiates the reference chunked form with autograd (in :meth:`TorchBackend.backward_states`).
The reference reads a span's boundaries on the host: they are handed over as host tensors (no device sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import reference
from ..affine import SummaryParts
from .base import BackwardStates, KDAInputs, KDAOptions, LocalGrads, LocalStates, Span


@dataclass(frozen=True)
class TorchBackward:
    """One span's backward before the gradient state pass: its inputs, output gradient and initial state."""

    saved: KDAInputs
    span: Span
    do: torch.Tensor
    initial_state: torch.Tensor


@dataclass(frozen=True)
class TorchBackwardStates(BackwardStates):
    """After the gradient state pass: the input gradients, computed with it."""

    grads: LocalGrads


class TorchBackend:
    name = "torch"
    parallel_pieces = True  # exact either way; keeps the pieces path under the CPU tests
    summary_pieces = True

    def __init__(self, options: KDAOptions):
        self.options = options

    def _span_inputs(self, chunks: KDAInputs, span: Span) -> KDAInputs:
        return KDAInputs(span.take(chunks.q), span.take(chunks.k), span.take(chunks.v), span.take(chunks.g),
                         span.take(chunks.beta), chunks.A_log, chunks.dt_bias)

    def _kwargs(self, x: KDAInputs, span: Span) -> dict:
        o = self.options
        return dict(scale=o.scale, cu_seqlens=span.cu_seqlens_host(),
                    use_qk_l2norm_in_kernel=o.use_qk_l2norm_in_kernel, use_gate_in_kernel=o.use_gate_in_kernel,
                    A_log=x.A_log, dt_bias=x.dt_bias, lower_bound=o.lower_bound, chunk_size=o.chunk_size)

    def _intermediates(self, chunks: KDAInputs, span: Span) -> reference.ChunkIntermediates:
        x = self._span_inputs(chunks, span)
        return reference.chunk_kda_intermediates(x.q, x.k, x.v, x.g, x.beta, **self._kwargs(x, span))

    def prepare(self, inputs: KDAInputs, span: Span) -> KDAInputs:
        """The (detached) raw inputs of all local tokens: every stage recomputes from them."""
        return KDAInputs(*(None if t is None else t.detach() for t in vars(inputs).values()))

    def state_summary(self, chunks: KDAInputs, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        inter = self._intermediates(chunks, span)
        C = self.options.chunk_size

        def summarise(cu):
            return reference.state_summary(inter.kg, inter.w, inter.u, inter.gc, C, cu)

        summary = summarise(span.cu_seqlens_host())
        if not parts:
            return summary if with_transition else summary._replace(transition=None)
        # pieces of chunks_per_piece chunks; by default each segment in two, cut at a chunk boundary near its
        # middle (one piece for one chunk)
        starts, counts = [], []
        for bos, eos in zip(span.cu_seqlens[:-1], span.cu_seqlens[1:]):
            n_chunks = -(-(eos - bos) // C)
            step = chunks_per_piece or max(-(-n_chunks // 2), 1)
            cuts = tuple(range(bos, eos, C * step))
            starts += cuts
            counts.append(len(cuts))
        pieces = summarise(torch.tensor((*starts, span.cu_seqlens[-1]), dtype=torch.int64))
        return SummaryParts(summary, pieces, tuple(starts), tuple(counts))

    def state_pass(self, chunks: KDAInputs, span: Span, initial_state: torch.Tensor,
                   output_final_state: bool) -> LocalStates:
        """The final states, and ``h``, ``v_new`` as :class:`reference.ChunkIntermediates` holds them."""
        x = self._span_inputs(chunks, span)
        inter = reference.chunk_kda_intermediates(x.q, x.k, x.v, x.g, x.beta, initial_state=initial_state,
                                                  **self._kwargs(x, span))
        return LocalStates(inter.final_state if output_final_state else None, inter.h, inter.v_new)

    def output(self, chunks: KDAInputs, span: Span, initial_state: torch.Tensor, states: LocalStates) -> torch.Tensor:
        """From the state pass's ``h`` and ``v_new`` (which may have run over the span cut into more
        segments at chunk boundaries), as the kernel backends do; without them, from ``initial_state``."""
        if states is None or states.h is None:
            x = self._span_inputs(chunks, span)
            return reference.chunk_kda(x.q, x.k, x.v, x.g, x.beta, initial_state=initial_state,
                                       **self._kwargs(x, span))[0]
        inter = self._intermediates(chunks, span)
        o = reference.chunk_output(inter.qg, inter.Aqk, states.v_new, states.h, self.options.scale,
                                   self.options.chunk_size, span.cu_seqlens_host())
        return o.to(chunks.v.dtype)

    def to_saved(self, chunks: KDAInputs) -> KDAInputs:
        return chunks

    def backward_local(self, saved: KDAInputs, span: Span, do: torch.Tensor, initial_state: torch.Tensor,
                       states: LocalStates | None = None) -> TorchBackward:
        return TorchBackward(saved, span, do, initial_state)

    @staticmethod
    def _segments(local: TorchBackward, first: int, last: int) -> TorchBackward:
        """``local`` cut to its span's segments ``first`` to ``last - 1``."""
        span = local.span.segments(first, last)
        offset = span.start - local.span.start
        return TorchBackward(local.saved, span, local.do[:, offset:offset + span.end - span.start],
                             None if local.initial_state is None else local.initial_state[first:last])

    def state_gradient_summary(self, local: TorchBackward, segments: tuple[int, int] | None = None) -> torch.Tensor:
        if segments is not None:
            local = self._segments(local, *segments)
        inter = self._intermediates(local.saved, local.span)
        cu, C, scale = local.span.cu_seqlens_host(), self.options.chunk_size, self.options.scale
        dv_local = reference.chunk_dv_local(inter.Aqk, local.do, scale, C, cu)
        return reference.state_gradient_summary(inter.qg, inter.kg, inter.w, inter.gc, local.do, dv_local, scale, C, cu)

    def backward_states(self, local: TorchBackward, dht: torch.Tensor | None,
                        segments: int | None = None) -> TorchBackwardStates:
        """Differentiates the reference chunked form once; the input gradients wait in the result."""
        if segments is not None:
            local = self._segments(local, 0, segments)
        x = self._span_inputs(local.saved, local.span)
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_() for t in
                      (x.q, x.k, x.v, x.g, x.beta, x.A_log, x.dt_bias, local.initial_state)]
            q, k, v, g, beta, A_log, dt_bias, h0 = leaves
            kwargs = self._kwargs(KDAInputs(q, k, v, g, beta, A_log, dt_bias), local.span)
            o, final_state = reference.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
            outputs, grads_out = [o], [local.do]
            if dht is not None:
                outputs.append(final_state)
                grads_out.append(dht.to(final_state.dtype))
            wrt = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(outputs, wrt, grads_out, allow_unused=True))
            grads = [None if t is None else next(grads) for t in leaves]
        return TorchBackwardStates(local.span, grads[7], LocalGrads(*grads[:7]))

    def backward_inputs(self, states: TorchBackwardStates) -> LocalGrads:
        return states.grads
