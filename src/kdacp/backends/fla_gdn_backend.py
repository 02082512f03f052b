"""The ``fla`` backend for Gated DeltaNet: FLA 0.6.0's GDN stage kernels, which read the scalar gate.

Same stages as :class:`.fla_backend.FlaBackend`, with ``g [1, T, HV]`` (and ``dt_bias [HV]`` with the
gate in kernel). FLA's GDN kernels keep ``q, k`` at their ``H`` heads and apply the gate to ``v_new``
rather than to the keys: ``kg^T v_new = k^T (exp2(gc_last - gc) v_new)`` for a scalar gate, so the
state pass, ``h`` and ``v_new`` are the same as KDA's with the gate broadcast over ``K``. Stages:
``prepare`` = L2 norm, gate cumsum (log2 units, chunk-local), the fused ``A = (I + kkt)^-1`` and
``w, u``; ``state_pass`` = the state kernel; ``output`` = the output kernel (``q k^T`` recomputed);
``backward_local`` = ``w, u`` recompute, (state recompute,) local ``dv``; ``backward_states`` = the
gradient state kernel; ``backward_inputs`` = ``dq, dk, dw, dg``, the WY backward, reverse gate cumsum,
gate and L2-norm backward. Saved for backward as FLA's ``chunk_gated_delta_rule`` (``w, u`` recomputed).

The summaries ``S_ext``, ``M`` and ``G`` are defined on KDA's per-channel intermediates
(:mod:`kdacp.reference.summary`): ``qg = q exp2(gc)``, ``kg = k exp2(gc_last - gc)`` per value head. The
summary kernels read the raw ``q, k`` at their ``H`` heads and the scalar ``gc [1, T, HV]`` (``raw_keys=True``
with the scalar-gate variant, the faster of the two gate forms there: benchmarks/RESULTS.md), so nothing
is materialised at ``HV`` heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KDAInputs, LocalGrads, LocalStates, Span
from .fla_backend import FlaBackend, FlaBackwardStates, TokenSaved
from ..kernels import state_gradient_summary, state_summary
from ..kernels.config import piece_config


@dataclass
class GDNSaved(TokenSaved):
    """What backward needs, token-first ``[1, T, ...]``: ``q``, ``k`` ``[1, T, H, K]`` after the optional
    L2 norm (with ``q_rstd``, ``k_rstd [1, T, H]``), ``v``, ``beta``, raw ``g`` (gate in kernel, else
    ``None``), its log2 chunk cumsum ``gc [1, T, HV]`` float32, and ``A = (I + kkt)^-1 [1, T, HV, BT]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    gc: torch.Tensor
    A: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None


@dataclass
class GDNChunks:
    """Forward chunk data: the saved part plus ``w [1, T, HV, K]`` and ``u [1, T, HV, V]``."""

    saved: GDNSaved
    w: torch.Tensor
    u: torch.Tensor


@dataclass
class GDNBackward:
    """One span's backward in progress: its saved inputs, the span, FLA's packed-sequence arguments,
    ``do``, the initial states, ``w``, the states ``h``, ``v_new`` and the local ``dv``."""

    saved: GDNSaved
    span: Span
    varlen: dict
    do: torch.Tensor
    initial_state: torch.Tensor
    w: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor
    dv: torch.Tensor


class FlaGDNBackend(FlaBackend):
    """GDN on FLA's GDN kernels; shares :class:`FlaBackend`'s packed-sequence arguments."""

    name = "fla"
    parallel_pieces = True  # FLA's GDN state kernel is faster in pieces
    gate_keyword = "g"  # one gate per head: ``g [1, T, HV]``

    def _gate_cumsum(self, g, A_log, dt_bias, varlen: dict) -> torch.Tensor:
        """``gc [1, T, HV]`` float32: chunk-local cumulative gate in log2 units."""
        o, fla = self.options, self.fla
        if o.use_gate_in_kernel:
            return fla.gdn_gate_chunk_cumsum(g=g, A_log=A_log, dt_bias=dt_bias, scale=fla.RCP_LN2,
                                             chunk_size=o.chunk_size, **varlen)
        return fla.chunk_local_cumsum(g=g, scale=fla.RCP_LN2, chunk_size=o.chunk_size, **varlen)

    def prepare(self, inputs: KDAInputs, span: Span) -> GDNChunks:
        o, p = self.options, self._normalized_inputs(inputs, span)
        x = p.inputs
        w, u, A = self.fla.chunk_gated_delta_rule_fwd_intra(k=p.k, v=x.v, g=p.gc, beta=x.beta, chunk_size=o.chunk_size,
                                                            **p.varlen)
        saved = GDNSaved(p.q, p.k, x.v, x.beta, x.g if o.use_gate_in_kernel else None, p.gc, A, p.q_rstd, p.k_rstd,
                         x.A_log, x.dt_bias)
        return GDNChunks(saved, w, u)

    def state_summary(self, chunks: GDNChunks, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        x = chunks.saved
        return state_summary(span.take(x.k), span.take(chunks.w), span.take(chunks.u), span.take(x.gc),
                             chunk_size=self.options.chunk_size,
                             output="both" if with_transition else "state", cu_seqlens=span.cu_seqlens_host(),
                             raw_keys=True, parts=parts, precision=self.options.summary_precision,
                             config=piece_config(chunks_per_piece))

    def state_pass(self, chunks: GDNChunks, span: Span, initial_state: torch.Tensor,
                   output_final_state: bool) -> LocalStates:
        x = chunks.saved
        return self._chunk_states(span.take(x.k), span.take(chunks.w), span.take(chunks.u), span.take(x.gc),
                                  initial_state, output_final_state, self._varlen(span, chunks.w.device))

    def output(self, chunks: GDNChunks, span: Span, initial_state: torch.Tensor, states: LocalStates) -> torch.Tensor:
        x = chunks.saved
        o = self.fla.chunk_fwd_o(q=span.take(x.q), k=span.take(x.k), v=states.v_new, h=states.h, g=span.take(x.gc),
                                 scale=self.options.scale, chunk_size=self.options.chunk_size,
                                 **self._varlen(span, chunks.w.device))
        return o.to(x.v.dtype)

    def backward_local(self, saved: GDNSaved, span: Span, do: torch.Tensor, initial_state: torch.Tensor,
                       states: LocalStates | None = None) -> GDNBackward:
        o, fla = self.options, self.fla
        x = saved.narrow(span)
        varlen = self._varlen(span, do.device)
        w, u = fla.gdn_recompute_w_u_fwd(k=x.k, v=x.v, beta=x.beta, A=x.A, g=x.gc, **varlen)
        h, v_new = self._kept_states(states, x.k, w, u, x.gc, initial_state, varlen)
        dv = fla.chunk_bwd_dv_local(q=x.q, k=x.k, do=do, g=x.gc, scale=o.scale, chunk_size=o.chunk_size, **varlen)
        return GDNBackward(x, span, varlen, do, initial_state, w, h, v_new, dv)

    def state_gradient_summary(self, local: GDNBackward, segments: tuple[int, int] | None = None) -> torch.Tensor:
        local = self._segments(local, *(segments or (0, local.span.num_segments)))
        x = local.saved
        return state_gradient_summary(x.q, x.k, local.w, x.gc, local.do, local.dv,
                                      self.options.scale, chunk_size=self.options.chunk_size,
                                      cu_seqlens=local.span.cu_seqlens_host(), raw_keys=True,
                                      precision=self.options.summary_precision)

    def backward_states(self, local: GDNBackward, dht: torch.Tensor | None,
                        segments: int | None = None) -> FlaBackwardStates:
        local = self._segments(local, 0, local.span.num_segments if segments is None else segments)
        x = local.saved
        return self._state_gradients(x.q, x.k, local.w, x.gc, local, dht, local.dv)

    def backward_inputs(self, states: FlaBackwardStates) -> LocalGrads:
        local = states.local
        o, fla, x, varlen = self.options, self.fla, local.saved, local.varlen
        # dq, dk come back summed over each q/k head's value heads
        dq, dk, dw, dg = fla.chunk_bwd_dqkwg(q=x.q, k=x.k, v=local.v_new, w=local.w, g=x.gc, h=local.h, dv=states.dv,
                                             do=local.do, dh=states.dh, scale=o.scale, chunk_size=o.chunk_size, **varlen)
        dk_wy, dv, dbeta, dg_wy = fla.gdn_prepare_wy_repr_bwd(k=x.k, v=x.v, beta=x.beta, A=x.A, dw=dw, du=states.dv,
                                                              g=x.gc, **varlen)
        dk.add_(dk_wy)
        dg.add_(dg_wy)
        return self._input_gradients(x, dq, dk, dv, dg, dbeta, varlen)

    def _gate_backward(self, x, dg: torch.Tensor):
        return self.fla.gdn_gate_bwd(g=x.g, A_log=x.A_log, dt_bias=x.dt_bias, dyg=dg)
