"""The ``fla`` backend: FLA 0.6.0's CUDA stage kernels, split where context parallelism waits.

Stages map to FLA's own: ``prepare`` = L2 norm, gate cumsum (log2 units, chunk-local) and the
intra-chunk WY kernel; ``forward_states`` = the state pass and the output kernel; ``backward`` =
FLA's whole local backward given an initial state and a final-state gradient. What is saved for
backward matches FLA's ``chunk_kda`` (``w``, ``u``, ``kg`` and ``h`` are recomputed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KDAInputs, KDAOptions, LocalForward, LocalGrads, Span
from .fla_adapter import load_fla
from .summaries import state_gradient_summary, state_summary

__all__ = ["FlaBackend"]


@dataclass
class FlaSaved:
    """What backward needs, token-first ``[1, T, ...]``: ``q``, ``k`` after the optional L2 norm
    (with ``q_rstd``, ``k_rstd [1, T, H]``), raw ``g`` (gate in kernel) or its log2 chunk cumsum
    ``gc``, and the intra-chunk matrices ``Aqk`` (scaled), ``Akk`` ``[1, T, HV, BT]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    gc: torch.Tensor | None
    Aqk: torch.Tensor
    Akk: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None

    def narrow(self, span: Span) -> "FlaSaved":
        cut = slice(span.start, span.end)
        return FlaSaved(*(t if t is None or name in ("A_log", "dt_bias") else t[:, cut]
                          for name, t in vars(self).items()))


@dataclass
class FlaChunks:
    """Forward chunk data: the saved part plus ``gc``, ``w``, ``kg [1, T, HV, K]`` and ``u [1, T, HV, V]``."""

    saved: FlaSaved
    gc: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor


class FlaBackend:
    name = "fla"

    def __init__(self, options: KDAOptions):
        self.options = options
        self.fla = load_fla()

    def _varlen(self, span: Span, device) -> dict:
        """FLA's packed-sequence arguments for ``span`` (none for a single segment)."""
        cu = span.cu_seqlens_tensor(device)
        if cu is None:
            return dict(cu_seqlens=None, chunk_indices=None)
        cu_cpu = torch.tensor(span.cu_seqlens, dtype=torch.int64)
        indices = self.fla.prepare_chunk_indices(cu, self.options.chunk_size, cu_seqlens_cpu=cu_cpu)
        return dict(cu_seqlens=cu, chunk_indices=indices)

    def _gate_cumsum(self, g, A_log, dt_bias, varlen: dict) -> torch.Tensor:
        """``gc [1, T, HV, K]`` float32: chunk-local cumulative gate in log2 units."""
        o, fla = self.options, self.fla
        if o.use_gate_in_kernel:
            return fla.kda_gate_chunk_cumsum(g=g, A_log=A_log, dt_bias=dt_bias, scale=fla.RCP_LN2,
                                             chunk_size=o.chunk_size, lower_bound=o.lower_bound, **varlen)
        return fla.chunk_local_cumsum(g=g, scale=fla.RCP_LN2, chunk_size=o.chunk_size, **varlen)

    def prepare(self, inputs: KDAInputs, span: Span) -> FlaChunks:
        o, fla = self.options, self.fla
        varlen = self._varlen(span, inputs.q.device)
        q, k, q_rstd, k_rstd = inputs.q, inputs.k, None, None
        if o.use_qk_l2norm_in_kernel:
            q, q_rstd = fla.l2norm_fwd(q)
            k, k_rstd = fla.l2norm_fwd(k)
        gc = self._gate_cumsum(inputs.g, inputs.A_log, inputs.dt_bias, varlen)
        w, u, _, kg, Aqk, Akk = fla.chunk_kda_fwd_intra(q=q, k=k, v=inputs.v, gk=gc, beta=inputs.beta, scale=o.scale,
                                                        chunk_size=o.chunk_size, safe_gate=o.safe_gate,
                                                        disable_recompute=False, **varlen)
        # With the gate in kernel FLA recomputes gc in backward instead of keeping it (memory).
        saved = FlaSaved(q, k, inputs.v, inputs.beta, inputs.g if o.use_gate_in_kernel else None,
                         None if o.use_gate_in_kernel else gc, Aqk, Akk, q_rstd, k_rstd, inputs.A_log, inputs.dt_bias)
        return FlaChunks(saved, gc, w, u, kg)

    def state_summary(self, chunks: FlaChunks, span: Span, with_transition: bool):
        cut = slice(span.start, span.end)
        summary = state_summary(chunks.kg[:, cut], chunks.w[:, cut], chunks.u[:, cut], chunks.gc[:, cut],
                                chunk_size=self.options.chunk_size, cu_seqlens=span.cu_seqlens_tensor(chunks.kg.device))
        return summary if with_transition else summary._replace(transition=None)

    def forward_states(self, chunks: FlaChunks, span: Span, initial_state: torch.Tensor,
                       output_final_state: bool) -> LocalForward:
        o, fla = self.options, self.fla
        cut = slice(span.start, span.end)
        varlen = self._varlen(span, chunks.kg.device)
        gc = chunks.gc[:, cut]
        h, v_new, final_state = fla.chunk_gated_delta_rule_fwd_h(
            k=chunks.kg[:, cut], w=chunks.w[:, cut], u=chunks.u[:, cut], gk=gc, initial_state=initial_state,
            output_final_state=output_final_state, chunk_size=o.chunk_size, **varlen)
        out = fla.chunk_gla_fwd_o_gk(q=chunks.saved.q[:, cut], v=v_new, g=gc, A=chunks.saved.Aqk[:, cut], h=h,
                                     scale=o.scale, chunk_size=o.chunk_size, **varlen)
        return LocalForward(out.to(chunks.saved.v.dtype), final_state)

    def to_saved(self, chunks: FlaChunks) -> FlaSaved:
        return chunks.saved

    def state_gradient_summary(self, saved: FlaSaved, span: Span, do: torch.Tensor) -> torch.Tensor:
        o, fla = self.options, self.fla
        x = saved.narrow(span)
        varlen = self._varlen(span, do.device)
        gc = x.gc if x.gc is not None else self._gate_cumsum(x.g, x.A_log, x.dt_bias, varlen)
        w, _, qg, kg = fla.recompute_w_u_fwd(q=x.q, k=x.k, v=x.v, beta=x.beta, A=x.Akk, gk=gc, **varlen)
        # dv_local = Aqk^T dO per chunk; the dA this kernel also returns needs v_new and is unused,
        # so any [1, T, HV, V] tensor stands in for it.
        _, dv_local = fla.chunk_kda_bwd_dAv(q=x.q, k=x.k, v=do, do=do, A=x.Aqk, scale=o.scale,
                                            chunk_size=o.chunk_size, **varlen)
        return state_gradient_summary(qg, kg, w, gc, do, dv_local, o.scale, chunk_size=o.chunk_size,
                                      cu_seqlens=varlen["cu_seqlens"])

    def backward(self, saved: FlaSaved, span: Span, do: torch.Tensor, dht: torch.Tensor | None,
                 initial_state: torch.Tensor) -> LocalGrads:
        o, fla = self.options, self.fla
        x = saved.narrow(span)
        varlen = self._varlen(span, do.device)
        dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = fla.chunk_kda_bwd(
            q=x.q, k=x.k, v=x.v, beta=x.beta, Aqk=x.Aqk, Akk=x.Akk, scale=o.scale, initial_state=initial_state,
            do=do, dht=None if dht is None else dht.float(), g=x.gc, g_org=x.g, chunk_size=o.chunk_size,
            safe_gate=o.safe_gate, lower_bound=o.lower_bound, use_gate_in_kernel=o.use_gate_in_kernel,
            A_log=x.A_log, dt_bias=x.dt_bias, disable_recompute=False, **varlen)
        if o.use_qk_l2norm_in_kernel:
            dq = fla.l2norm_bwd(x.q, x.q_rstd, dq)
            dk = fla.l2norm_bwd(x.k, x.k_rstd, dk)
        return LocalGrads(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)
