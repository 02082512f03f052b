"""The ``fla`` backend: FLA 0.6.0's CUDA stage kernels, split where context parallelism waits.

Stages map to FLA's own kernels: ``prepare`` = L2 norm, gate cumsum (log2 units, chunk-local) and
the intra-chunk WY kernel; ``state_pass`` = the state kernel; ``output`` = the output kernel;
``backward_local`` = WY recompute, (state recompute,) ``dAqk``/local ``dv``; ``backward_states`` =
the gradient state kernel; ``backward_inputs`` = the fused WY/q/k/g gradient kernel, the
intra-chunk backward, reverse gate cumsum, gate and L2-norm backward. What is saved for backward
matches FLA's ``chunk_kda`` (``w``, ``u``, ``kg`` recomputed); a state pass's ``h``/``v_new`` are
reused when the caller keeps them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import torch

from ..caches import FLA_VARLEN_BATCHES
from ..host_copies import to_device
from .base import BackwardStates, KDAInputs, KDAOptions, LocalGrads, LocalStates, Span
from .fla_adapter import load_fla
from ..kernels import state_gradient_summary, state_summary
from ..kernels.config import piece_config


class TokenSaved:
    """A dataclass of tensors ``[1, T, ...]`` saved for the backward, but for the per-head parameters ``A_log``
    and ``dt_bias``: :meth:`narrow` cuts the token ones to a span."""

    def narrow(self, span: Span):
        return type(self)(*(t if t is None or name in ("A_log", "dt_bias") else span.take(t)
                            for name, t in vars(self).items()))


@dataclass
class FlaSaved(TokenSaved):
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


@dataclass(frozen=True)
class FlaBackward:
    """One span's backward before the gradient state pass: its saved inputs, the span, FLA's
    packed-sequence arguments, ``do``, the initial states, the recomputed ``gc, w, qg, kg``, the
    states ``h``, ``v_new``, and the intra-chunk gradients ``dAqk`` and ``dv_local``."""

    saved: FlaSaved
    span: Span
    varlen: dict
    do: torch.Tensor
    initial_state: torch.Tensor
    gc: torch.Tensor
    w: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor
    dAqk: torch.Tensor
    dv_local: torch.Tensor


@dataclass(frozen=True)
class FlaBackwardStates(BackwardStates):
    """After the gradient state pass: ``local`` (the span's backward record: :class:`FlaBackward`, or
    the GDN backend's), the state gradients ``dh`` before each chunk and ``dv`` (the local ``dv``
    plus the part through the states)."""

    local: object
    dh: torch.Tensor
    dv: torch.Tensor


@dataclass
class FusedStates(LocalStates):
    """A span's state pass on a fused core (attention-gym's, FlashQLA's), with the output ``o [1, T_span, HV, V]``
    the core makes with it (:meth:`FlaBackend._fused_output`)."""

    o: torch.Tensor | None = None


@dataclass(frozen=True)
class FusedBackwardStates(BackwardStates):
    """After a fused gradient pass (attention-gym's, FlashQLA's: the input gradients with the initial states'):
    its ``grads = (dq, dk, dv, dgate, dbeta)`` before the gate and L2-norm backward, and the ``saved`` record they
    need (:meth:`FlaBackend._fused_backward_inputs`)."""

    saved: object
    grads: tuple

    @classmethod
    def of(cls, span: Span, dinitial_state: torch.Tensor | None, saved, grads: tuple,
           do: torch.Tensor) -> "FusedBackwardStates":
        """The states of ``span``; ``dinitial_state`` None (a fused core gives none where the forward had no initial
        states: they were zero) is zeros ``[n, HV, K, V]`` float32, shaped by ``saved``'s ``q, v``."""
        if dinitial_state is None:
            n, (HV, V), K = span.num_segments, saved.v.shape[2:], saved.q.shape[-1]
            dinitial_state = do.new_zeros(n, HV, K, V, dtype=torch.float32)
        return cls(span, dinitial_state, saved, tuple(grads))


@dataclass
class FlaChunks:
    """Forward chunk data: the saved part plus ``gc``, ``w``, ``kg [1, T, HV, K]`` and ``u [1, T, HV, V]``."""

    saved: FlaSaved
    gc: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor


@dataclass(frozen=True)
class FlaPrepared:
    """The first part of an FLA backend's ``prepare``: the ``inputs`` made contiguous, FLA's packed-sequence
    arguments ``varlen`` for the span, ``q, k`` after the optional L2 norm (``q_rstd, k_rstd`` its
    reciprocal norms, else ``None``) and the gate's log2 chunk cumsum ``gc`` (float32; the backend's
    ``_gate_cumsum`` gives its shape)."""

    inputs: KDAInputs
    varlen: dict
    q: torch.Tensor
    k: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    gc: torch.Tensor


@functools.lru_cache(maxsize=FLA_VARLEN_BATCHES)
def _fla_varlen(cu: tuple[int, ...], chunk_size: int, device: torch.device) -> dict:
    """FLA's ``cu_seqlens`` and ``chunk_indices`` (sequence, chunk within it) on ``device`` for the
    boundaries ``cu``, shared by every call on the same batch (callers must not modify them).

    Built on the host and moved from pinned memory without a device sync (a copy from pageable memory
    makes the host wait for the whole queue, and the GPU then idles). Kept across calls, for the 16
    newest batches: a backend is built per call, and rebuilding these cost two pinned allocations and
    copies per call, and missed FLA's own caches keyed by the ``cu_seqlens`` tensor (five more small
    kernels per call in its state pass)."""
    indices = [(n, i) for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])) for i in range(-(-(eos - bos) // chunk_size))]
    host = {name: torch.tensor(value, dtype=torch.int64) for name, value in (("cu_seqlens", cu),
                                                                             ("chunk_indices", indices))}
    return {name: to_device(t, device) for name, t in host.items()}


class FlaBackend:
    name = "fla"
    parallel_pieces = False  # FLA's KDA state kernel is no faster in pieces
    summary_pieces = True
    # the keyword of the cumulative gate in FLA's chunk-state kernels: per channel (``gk [1, T, HV, K]``)
    gate_keyword = "gk"

    def __init__(self, options: KDAOptions):
        self.options = options
        self.fla = load_fla()

    def _varlen(self, span: Span, device) -> dict:
        """FLA's packed-sequence arguments for ``span`` (none for a single segment): see :func:`_fla_varlen`."""
        if span.num_segments == 1:
            return dict(cu_seqlens=None, chunk_indices=None)
        return _fla_varlen(span.cu_seqlens, self.options.chunk_size, device)

    def _gate_cumsum(self, g, A_log, dt_bias, varlen: dict) -> torch.Tensor:
        """``gc [1, T, HV, K]`` float32: chunk-local cumulative gate in log2 units."""
        o, fla = self.options, self.fla
        if o.use_gate_in_kernel:
            return fla.kda_gate_chunk_cumsum(g=g, A_log=A_log, dt_bias=dt_bias, scale=fla.RCP_LN2,
                                             chunk_size=o.chunk_size, lower_bound=o.lower_bound, **varlen)
        return fla.chunk_local_cumsum(g=g, scale=fla.RCP_LN2, chunk_size=o.chunk_size, **varlen)

    def _chunk_states(self, k, w, u, gc, initial_state: torch.Tensor, output_final_state: bool,
                      varlen: dict) -> LocalStates:
        """FLA's chunk-state pass over one span's ``k, w, u`` and cumulative gate ``gc``: the state entering each
        chunk ``h``, the chunks' ``v_new`` and (``output_final_state``) each segment's final state."""
        h, v_new, final_state = self.fla.chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, **{self.gate_keyword: gc}, initial_state=initial_state,
            output_final_state=output_final_state, chunk_size=self.options.chunk_size, **varlen)
        return LocalStates(final_state, h, v_new)

    def _kept_states(self, states: LocalStates | None, k, w, u, gc, initial_state: torch.Tensor,
                     varlen: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, v_new)`` of the forward's ``states`` where it kept them, else recomputed (:meth:`_chunk_states`)."""
        if states is None or states.h is None:
            states = self._chunk_states(k, w, u, gc, initial_state, False, varlen)
        return states.h, states.v_new

    def _state_gradients(self, q, k, w, gc, local, dht: torch.Tensor | None, dv_local) -> FlaBackwardStates:
        """FLA's backward chunk-state pass over ``local`` (cut to its segments): the state gradients ``dh`` of
        every chunk, ``dh0`` of the initial states and the values' gradient ``dv``."""
        dh, dh0, dv = self.fla.chunk_gated_delta_rule_bwd_dhu(
            q=q, k=k, w=w, **{self.gate_keyword: gc}, h0=local.initial_state,
            dht=None if dht is None else dht.float().contiguous(), do=local.do, dv=dv_local,
            scale=self.options.scale, chunk_size=self.options.chunk_size, **local.varlen)
        return FlaBackwardStates(local.span, dh0, local, dh, dv)

    def _gate_backward(self, x, dg: torch.Tensor):
        """``(dg, dA_log, ddt_bias)``: the gate's gradient through FLA's in-kernel gate."""
        return self.fla.kda_gate_bwd(g=x.g, A_log=x.A_log, dt_bias=x.dt_bias, dyg=dg, lower_bound=self.options.lower_bound)

    def _input_gradients(self, x, dq, dk, dv, dg, dbeta, varlen: dict) -> LocalGrads:
        """The inputs' gradients from the chunk-local ones: ``dg`` summed back over each chunk (the forward's
        cumulative gate), through the in-kernel gate and the in-kernel q/k L2 norm where the options use them."""
        dg = self.fla.chunk_local_cumsum(dg, chunk_size=self.options.chunk_size, reverse=True, **varlen)
        return self._token_input_gradients(x, dq, dk, dv, dg, dbeta)

    def _token_input_gradients(self, x, dq, dk, dv, dg, dbeta) -> LocalGrads:
        """The inputs' gradients from those of the per-token gate (natural log) and of ``q, k`` after the
        optional L2 norm: through the in-kernel gate and the in-kernel L2 norm where the options use them.
        ``x`` holds the raw gate ``g``, ``A_log``, ``dt_bias``, the normalised ``q, k`` and ``q_rstd, k_rstd``."""
        o, fla = self.options, self.fla
        dA_log = ddt_bias = None
        if o.use_gate_in_kernel:
            dg, dA_log, ddt_bias = self._gate_backward(x, dg)
        if o.use_qk_l2norm_in_kernel:
            dq = fla.l2norm_bwd(x.q, x.q_rstd, dq)
            dk = fla.l2norm_bwd(x.k, x.k_rstd, dk)
        return LocalGrads(dq, dk, dv, dg, dbeta, dA_log, ddt_bias)

    def _fused_output(self, span: Span, states: LocalStates, dtype: torch.dtype) -> torch.Tensor:
        """``output`` of a backend on a fused core: the output its state pass over ``span``'s tokens made
        (:class:`FusedStates`), in ``dtype``."""
        if not isinstance(states, FusedStates) or states.o is None or states.o.shape[1] != span.end - span.start:
            raise ValueError(f"the {self.name} backend's output is made by its state pass over the same tokens: pass "
                             "that pass's result")
        return states.o.to(dtype)

    def _fused_backward_inputs(self, states: BackwardStates) -> LocalGrads:
        """``backward_inputs`` of a backend on a fused core: the gate and L2-norm backward of its
        :class:`FusedBackwardStates`."""
        if not isinstance(states, FusedBackwardStates):
            raise ValueError(f"the {self.name} backend's backward_inputs needs the gradient pass over the whole span "
                             "(backward_states without segments)")
        return self._token_input_gradients(states.saved, *states.grads)

    def _normalized_inputs(self, inputs: KDAInputs, span: Span) -> FlaPrepared:
        """What both FLA backends' ``prepare`` forms first: see :class:`FlaPrepared`."""
        o, fla = self.options, self.fla
        # FLA's stage kernels index dense tensors: strided views (a slice of a parameter, a permuted
        # activation) are copied here, once, as FLA's own entry points do.
        inputs = KDAInputs(*(None if t is None else t.contiguous() for t in vars(inputs).values()))
        varlen = self._varlen(span, inputs.q.device)
        q, k, q_rstd, k_rstd = inputs.q, inputs.k, None, None
        if o.use_qk_l2norm_in_kernel:
            q, q_rstd = fla.l2norm_fwd(q)
            k, k_rstd = fla.l2norm_fwd(k)
        gc = self._gate_cumsum(inputs.g, inputs.A_log, inputs.dt_bias, varlen)
        return FlaPrepared(inputs, varlen, q, k, q_rstd, k_rstd, gc)

    def prepare(self, inputs: KDAInputs, span: Span) -> FlaChunks:
        o, p = self.options, self._normalized_inputs(inputs, span)
        x = p.inputs
        w, u, _, kg, Aqk, Akk = self.fla.chunk_kda_fwd_intra(q=p.q, k=p.k, v=x.v, gk=p.gc, beta=x.beta, scale=o.scale,
                                                             chunk_size=o.chunk_size, safe_gate=o.safe_gate,
                                                             disable_recompute=False, **p.varlen)
        # With the gate in kernel FLA recomputes gc in backward instead of keeping it (memory).
        saved = FlaSaved(p.q, p.k, x.v, x.beta, x.g if o.use_gate_in_kernel else None,
                         None if o.use_gate_in_kernel else p.gc, Aqk, Akk, p.q_rstd, p.k_rstd, x.A_log, x.dt_bias)
        return FlaChunks(saved, p.gc, w, u, kg)

    def state_summary(self, chunks: FlaChunks, span: Span, with_transition: bool, parts: bool = False,
                      chunks_per_piece: int | None = None):
        # M only where it is read (ranks strictly inside a chain): the state-only kernel is cheaper.
        return state_summary(span.take(chunks.kg), span.take(chunks.w), span.take(chunks.u), span.take(chunks.gc),
                             chunk_size=self.options.chunk_size, output="both" if with_transition else "state",
                             cu_seqlens=span.cu_seqlens_host(), parts=parts,
                             precision=self.options.summary_precision, config=piece_config(chunks_per_piece))

    def state_pass(self, chunks: FlaChunks, span: Span, initial_state: torch.Tensor,
                   output_final_state: bool) -> LocalStates:
        return self._chunk_states(span.take(chunks.kg), span.take(chunks.w), span.take(chunks.u), span.take(chunks.gc),
                                  initial_state, output_final_state, self._varlen(span, chunks.kg.device))

    def output(self, chunks: FlaChunks, span: Span, initial_state: torch.Tensor, states: LocalStates) -> torch.Tensor:
        o = self.fla.chunk_gla_fwd_o_gk(q=span.take(chunks.saved.q), v=states.v_new, g=span.take(chunks.gc),
                                        A=span.take(chunks.saved.Aqk), h=states.h, scale=self.options.scale,
                                        chunk_size=self.options.chunk_size, **self._varlen(span, chunks.kg.device))
        return o.to(chunks.saved.v.dtype)

    def to_saved(self, chunks: FlaChunks) -> FlaSaved:
        return chunks.saved

    def backward_local(self, saved: FlaSaved, span: Span, do: torch.Tensor, initial_state: torch.Tensor,
                       states: LocalStates | None = None) -> FlaBackward:
        o, fla = self.options, self.fla
        x = saved.narrow(span)
        varlen = self._varlen(span, do.device)
        gc = x.gc if x.gc is not None else self._gate_cumsum(x.g, x.A_log, x.dt_bias, varlen)
        w, u, qg, kg = fla.recompute_w_u_fwd(q=x.q, k=x.k, v=x.v, beta=x.beta, A=x.Akk, gk=gc, **varlen)
        h, v_new = self._kept_states(states, kg, w, u, gc, initial_state, varlen)
        # dAqk = dO v_new^T (masked), dv_local = Aqk^T dO per chunk
        dAqk, dv_local = fla.chunk_kda_bwd_dAv(q=x.q, k=x.k, v=v_new, do=do, A=x.Aqk, scale=o.scale,
                                               chunk_size=o.chunk_size, **varlen)
        return FlaBackward(x, span, varlen, do, initial_state, gc, w, qg, kg, h, v_new, dAqk, dv_local)

    def state_gradient_summary(self, local: FlaBackward, segments: tuple[int, int] | None = None) -> torch.Tensor:
        local = self._segments(local, *(segments or (0, local.span.num_segments)))
        return state_gradient_summary(local.qg, local.kg, local.w, local.gc, local.do, local.dv_local,
                                      self.options.scale, chunk_size=self.options.chunk_size,
                                      cu_seqlens=local.span.cu_seqlens_host(),
                                      precision=self.options.summary_precision)

    def _segments(self, local, first: int, last: int):
        """``local`` (a :class:`FlaBackward` or the GDN one) cut to its segments ``first`` to ``last - 1``, as
        views: token-first tensors to their tokens, ``h`` to their chunks, ``initial_state`` to their rows."""
        if (first, last) == (0, local.span.num_segments):
            return local
        span = local.span.segments(first, last)
        # the segments within local's own tensors
        rows = Span(span.start - local.span.start, span.end - local.span.start, span.cu_seqlens)
        C = self.options.chunk_size
        chunks = [-(-(b - a) // C) for a, b in zip(local.span.cu_seqlens, local.span.cu_seqlens[1:])]
        h_rows = slice(sum(chunks[:first]), sum(chunks[:last]))
        cut = {}
        for f in fields(local):
            t = getattr(local, f.name)
            if f.name in ("span", "varlen") or t is None:
                continue
            cut[f.name] = (t.narrow(rows) if f.name == "saved" else t[first:last] if f.name == "initial_state"
                           else t[:, h_rows] if f.name == "h" else rows.take(t))
        return replace(local, span=span, varlen=self._varlen(span, local.do.device), **cut)

    def backward_states(self, local: FlaBackward, dht: torch.Tensor | None,
                        segments: int | None = None) -> FlaBackwardStates:
        local = self._segments(local, 0, local.span.num_segments if segments is None else segments)
        return self._state_gradients(local.qg, local.kg, local.w, local.gc, local, dht, local.dv_local)

    def backward_inputs(self, states: FlaBackwardStates) -> LocalGrads:
        local = states.local
        o, fla, x, varlen = self.options, self.fla, local.saved, local.varlen
        dq, dk, dv, dbeta, dg, dAkk = fla.chunk_kda_bwd_wy_dqkg_fused(
            q=x.q, k=x.k, v=x.v, v_new=local.v_new, g=local.gc, beta=x.beta, A=x.Akk, h=local.h, do=local.do,
            dh=states.dh, dv=states.dv, scale=o.scale, chunk_size=o.chunk_size, **varlen)
        dq, dk, dbeta, dg = fla.chunk_kda_bwd_intra(q=x.q, k=x.k, g=local.gc, beta=x.beta, dAqk=local.dAqk, dAkk=dAkk,
                                                    dq=dq, dk=dk, db=dbeta, dg=dg, chunk_size=o.chunk_size,
                                                    safe_gate=o.safe_gate, **varlen)
        H, HV = x.q.shape[2], x.v.shape[2]
        if HV > H:  # grouped values: q/k head h served HV/H value heads
            dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(3)
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(3)
        return self._input_gradients(x, dq, dk, dv, dg, dbeta, varlen)
