"""Forward and backward orchestration of one rank's context-parallel chunk KDA.

A rank's local segments split into the receiving prefix ``head`` (waits for states from rank - 1)
and the rest; in backward into the sending suffix ``tail`` (waits for state gradients from
rank + 1) and the rest. Work that does not wait runs before the exchange:

forward:  post receive -> prepare (gates, intra-chunk WY) -> [through rank: summary (S_ext, M)]
          [else: state pass + output of the rest, whose last final state is sent on at once]
          -> exchange -> state pass + output of the head
backward: post receive -> [through rank: G] [else: gradients of the rest, whose head gradient is
          sent back at once] -> exchange -> gradients of the tail

A "through" rank holds the middle of a chain (all its segments receive and send); only it needs
``M``, and its serial work per hop is ``M S_in + S_ext`` (``M^T dS_out + G`` backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends.base import KDAInputs, LocalBackend, LocalGrads, Span
from . import comm
from .plan import CPPlan, RankLayout
from .strategies import AffineMessage, Route, make_exchange

__all__ = ["CPForward", "CPGrads", "cp_forward", "cp_backward"]


@dataclass
class CPForward:
    """``o [1, T_local, HV, V]``; ``final_state [N, HV, K, V]`` (every sequence, or ``None``);
    ``saved``: the backend's saved chunk data; ``local_initial [n_seg, HV, K, V]``: the state each
    local segment started from; ``transition``: ``M [n, HV, K, K]`` on through ranks, else ``None``."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    saved: object
    local_initial: torch.Tensor
    transition: torch.Tensor | None


@dataclass
class CPGrads:
    """Token gradients ``[1, T_local, ...]``, ``dA_log``/``ddt_bias`` summed over local tokens, and
    ``dinitial_state [N, HV, K, V]`` (rows of sequences that start on this rank; else zero) or ``None``."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dinitial_state: torch.Tensor | None


def _span(layout: RankLayout, start: int, end: int) -> Span:
    return Span(start, end, tuple(layout.cu_seqlens(start, end)) if end > start else (0,))


def _routes(plan: CPPlan, layouts, state_shape, dtype, device) -> tuple[Route, Route]:
    """The forward route (states, rank r -> r + 1) and the backward route (gradients, r -> r - 1)."""
    P = plan.world_size
    through = tuple(lay.through and P > 1 and lay.num_receive > 0 for lay in layouts)
    n = max(max(lay.num_send for lay in layouts), 1)
    shape = (n, *state_shape)
    forward = Route(plan.rank, plan.group, tuple(range(P)), tuple(lay.num_send for lay in layouts), through,
                    shape, dtype, device)
    backward = Route(plan.rank, plan.group, tuple(reversed(range(P))), tuple(lay.num_receive for lay in layouts),
                     through, shape, dtype, device)
    return forward, backward


def _cat(parts: list, dim: int):
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def cp_forward(backend: LocalBackend, plan: CPPlan, inputs: KDAInputs, initial_state: torch.Tensor | None,
               output_final_state: bool, state_dtype: torch.dtype) -> CPForward:
    """Run one rank's forward; see the module docstring for the order of stages."""
    T, HV, V, K = inputs.v.shape[1], inputs.v.shape[2], inputs.v.shape[3], inputs.q.shape[3]
    layouts = plan.layouts(T // max(1, plan.batch_size))
    layout = layouts[plan.rank]
    route, _ = _routes(plan, layouts, (HV, K, V), state_dtype, inputs.q.device)
    exchange = make_exchange(plan.strategy)
    pending = exchange.begin(route)

    head, rest = _span(layout, 0, layout.head_end), _span(layout, layout.head_end, T)
    chunks = backend.prepare(inputs, _span(layout, 0, T))
    segments = layout.segments
    known_initial = torch.zeros(len(segments) - layout.num_receive, HV, K, V, dtype=state_dtype, device=inputs.q.device)
    if initial_state is not None:
        for i, seg in enumerate(segments[layout.num_receive:]):
            known_initial[i] = initial_state[seg.sequence]

    message, transition, rest_out = None, None, None
    through = route.affine[plan.rank]
    if through:
        summary = backend.state_summary(chunks, head, with_transition=True)
        message, transition = AffineMessage(summary.state, summary.transition), summary.transition
    if not rest.empty:
        need_final = output_final_state or layout.num_send > 0
        rest_out = backend.forward_states(chunks, rest, known_initial, need_final)
        if layout.num_send and not through:
            message = AffineMessage(rest_out.final_state[-layout.num_send:])
    incoming = exchange.exchange(pending, message)
    head_out = None
    if not head.empty:
        head_out = backend.forward_states(chunks, head, incoming, output_final_state)
    pending.finish_sends()

    o = _cat([head_out and head_out.o, rest_out and rest_out.o], 1)
    final_state = None
    if output_final_state:
        local_final = _cat([head_out and head_out.final_state, rest_out and rest_out.final_state], 0)
        final_state = torch.zeros(plan.num_sequences, HV, K, V, dtype=state_dtype, device=o.device)
        for i, seg in enumerate(segments):
            if not seg.sends:
                final_state[seg.sequence] = local_final[i]
        final_state = comm.all_reduce_sum(final_state, plan.group)
    local_initial = _cat([incoming, known_initial if len(known_initial) else None], 0)
    return CPForward(o, final_state, backend.to_saved(chunks), local_initial, transition)


def _add(a, b):
    return b if a is None else a if b is None else a + b


def cp_backward(backend: LocalBackend, plan: CPPlan, saved, local_initial: torch.Tensor,
                transition: torch.Tensor | None, do: torch.Tensor, dfinal: torch.Tensor | None,
                output_final_state: bool, has_initial_state: bool) -> CPGrads:
    """Run one rank's backward, mirroring :func:`cp_forward`; ``do [1, T_local, HV, V]``,
    ``dfinal [N, HV, K, V]`` (this rank's gradient of the returned final states, or ``None``)."""
    T, HV, V = do.shape[1], do.shape[2], do.shape[3]
    K = local_initial.shape[2]
    state_dtype = local_initial.dtype
    layouts = plan.layouts(T // max(1, plan.batch_size))
    layout = layouts[plan.rank]
    segments = layout.segments
    dht_all = None
    if output_final_state:
        # The final states were replicated to every rank; their gradients add up at the owners.
        dht_all = torch.zeros(plan.num_sequences, HV, K, V, dtype=state_dtype, device=do.device)
        if dfinal is not None:
            dht_all += dfinal
        dht_all = comm.all_reduce_sum(dht_all, plan.group)
    _, route = _routes(plan, layouts, (HV, K, V), state_dtype, do.device)
    exchange = make_exchange(plan.strategy)
    pending = exchange.begin(route)

    tail_start = layout.tail_start
    known, tail = _span(layout, 0, tail_start), _span(layout, tail_start, T)
    n_known = len(segments) - layout.num_send
    message, known_grads = None, None
    if route.affine[plan.rank]:
        G = backend.state_gradient_summary(saved, tail, do)
        message = AffineMessage(G, transition.transpose(-1, -2))
    elif not known.empty:
        dht_known = None if dht_all is None else dht_all[[s.sequence for s in segments[:n_known]]]
        known_grads = backend.backward(saved, known, do[:, :tail_start], dht_known, local_initial[:n_known])
        if layout.num_receive:
            message = AffineMessage(known_grads.dinitial_state[:layout.num_receive])
    dS_out = exchange.exchange(pending, message)
    tail_grads = None
    if not tail.empty:
        tail_grads = backend.backward(saved, tail, do[:, tail_start:], dS_out, local_initial[n_known:])
    pending.finish_sends()

    parts: list[LocalGrads] = [g for g in (known_grads, tail_grads) if g is not None]
    token = {name: _cat([getattr(g, name) for g in parts], 1) for name in ("dq", "dk", "dv", "dg", "dbeta")}
    dA_log = ddt_bias = None
    for g in parts:
        dA_log, ddt_bias = _add(dA_log, g.dA_log), _add(ddt_bias, g.ddt_bias)
    dinitial_state = None
    if has_initial_state:
        local = _cat([g.dinitial_state for g in parts], 0)
        dinitial_state = torch.zeros(plan.num_sequences, HV, K, V, dtype=state_dtype, device=do.device)
        for i, seg in enumerate(segments):
            if not seg.receives:
                dinitial_state[seg.sequence] = local[i]
    return CPGrads(**token, dA_log=dA_log, ddt_bias=ddt_bias, dinitial_state=dinitial_state)
