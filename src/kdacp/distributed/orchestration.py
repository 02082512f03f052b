"""Forward and backward orchestration of one rank's context-parallel chunk KDA: the rank's schedule.

The spans are the plan's (:class:`~kdacp.distributed.plan.RankLayout`): ``head`` (sequences begun on
an earlier rank), ``tail`` (sequences continued on a later rank), ``after_head``, ``before_tail``.
Each direction runs in critical-path order: what a peer waits for first, its message posted the
moment it exists, then all work that needs no incoming message, and the blocking receive last.

forward:   begin (post the receive)
           prepare(whole)                                gates, L2 norm, intra-chunk WY: one launch set
           through rank: summary(head) -> message (S_ext, M)
           else: state_pass(tail) -> message (the tail's final states)
           send                                          p2p: to rank + 1; allgather: the gather starts
           state_pass(between), output(between), output(tail)
           receive (block) -> state_pass(head), output(head)
backward:  begin
           through rank: backward_local(tail), G(tail) -> message (G, M^T)
           else: backward_local(head), backward_states(head) -> message (the head's initial-state
                 gradients)
           send
           backward_local(between), backward_states(between), backward_local(tail),
           backward_inputs(head), backward_inputs(between)
           receive (block) -> backward_states(tail), backward_inputs(tail)

``between``: the segments between head and tail (whole sequences; with no message to send, all of
``after_head`` forward and ``before_tail`` backward). The pass that makes the message covers only
the span it is about, so a packed rank posts it before the passes over its whole sequences (one
launch more per direction there; a rank of one sequence launches as before).

A "through" rank holds the middle of a chain (all its segments receive and send); only it needs
``M``, and its serial work per hop is ``M S_in + S_ext`` (``M^T dS_out + G`` backward). Every stage
runs once per span, over all of the span's segments (one varlen launch set). The order is tested
with a recording exchange in ``tests/distributed/test_schedule.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..backends.base import KDAInputs, LocalBackend, LocalGrads, LocalStates, Span
from ..caches import ROUTES
from . import comm
from .plan import CPPlan, through_ranks
from .strategies import AffineMessage, Route, StateExchange, make_exchange

__all__ = ["CPForward", "CPGrads", "cp_forward", "cp_backward"]


@dataclass
class CPForward:
    """``o [1, T_local, HV, V]``; ``final_state [N, HV, K, V]`` (every sequence, or ``None``);
    ``saved``: the backend's saved chunk data; ``local_initial [n, HV, K, V]``: the states the local
    segments started from, the received ones first, then those ``initial_state`` gave (without it only
    the received ones, maybe none: zero initial states are passed to the backends as none, as FLA's op
    does); ``transition``: ``M [n, HV, K, K]`` on through ranks, else ``None``;
    ``head_states``: the head's state pass (``h``, ``v_new``), kept so that the backward of a rank
    that sends gradients back does not recompute it on the critical path."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    saved: object
    local_initial: torch.Tensor
    transition: torch.Tensor | None
    head_states: LocalStates | None


@dataclass
class CPGrads(LocalGrads):
    """A rank's gradients: :class:`LocalGrads` over all ``T_local`` tokens, plus
    ``dinitial_state [N, HV, K, V]`` (rows of sequences that start on this rank; else zero) or ``None``."""

    dinitial_state: torch.Tensor | None


@lru_cache(maxsize=ROUTES)
def _routes(plan: CPPlan, local_length: int, state_shape, dtype, device) -> tuple[Route, Route]:
    """The forward route (states, rank r -> r + 1) and the backward route (gradients, r -> r - 1) of
    ``plan``'s layouts for ``local_length`` tokens per batch row. Routes are frozen and hold no per-call
    state, so the newest are kept (:data:`~kdacp.caches.ROUTES`; every layer of a step asks for the same)."""
    P, layouts = plan.world_size, plan.layouts(local_length)
    through = through_ranks(layouts)
    n = max(max(lay.num_send for lay in layouts), 1)
    shape = (n, *state_shape)
    forward = Route(plan.rank, plan.group, tuple(range(P)), tuple(lay.num_send for lay in layouts), through,
                    shape, dtype, device)
    backward = Route(plan.rank, plan.group, tuple(reversed(range(P))), tuple(lay.num_receive for lay in layouts),
                     through, shape, dtype, device)
    return forward, backward


def _sequences(segments) -> slice:
    """The global sequences of ``segments`` (consecutive in a :class:`RankLayout`) as a slice."""
    return slice(segments[0].sequence, segments[-1].sequence + 1) if segments else slice(0, 0)


def _by_sequence(plan: CPPlan, segments, local: torch.Tensor, kept: slice) -> torch.Tensor:
    """``[N, HV, K, V]``: the states ``local[kept]`` of ``segments[kept]`` at their sequences' rows, zeros
    elsewhere; ``local`` itself on one rank, where every sequence lies, in order."""
    if plan.world_size == 1:
        return local
    out = local.new_zeros(plan.num_sequences, *local.shape[1:])
    out[_sequences(segments[kept])] = local[kept]
    return out


def _cat(parts: list, dim: int):
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _rows(states: torch.Tensor | None, start: int, end: int | None = None) -> torch.Tensor | None:
    """``states[start:end]``, or ``None`` (zero states, passed as none) for ``None``."""
    return None if states is None else states[start:end]


def cp_forward(backend: LocalBackend, plan: CPPlan, inputs: KDAInputs, initial_state: torch.Tensor | None,
               output_final_state: bool, state_dtype: torch.dtype, exchange: StateExchange | None = None
               ) -> CPForward:
    """Run one rank's forward; see the module docstring for the order of stages. ``exchange``: default
    the plan's strategy's (:mod:`kdacp.bench.scaling` passes a probe that times the stages)."""
    T, HV, V, K = inputs.v.shape[1], inputs.v.shape[2], inputs.v.shape[3], inputs.q.shape[3]
    device = inputs.q.device
    layouts = plan.layouts(T // plan.batch_size)
    layout = layouts[plan.rank]
    route, _ = _routes(plan, T // plan.batch_size, (HV, K, V), state_dtype, device)
    exchange = exchange or make_exchange(plan.strategy)
    pending = exchange.begin(route)

    head, rest = layout.head, layout.after_head
    segments = layout.segments
    chunks = backend.prepare(inputs, layout.whole)
    starting = _sequences(segments[layout.num_receive:])  # the sequences that start on this rank
    n_known = len(segments) - layout.num_receive
    # zero initial states are passed as none (no fill kernel; FLA neither reads them nor forms their gradient)
    known_initial = None if initial_state is None else initial_state[starting].to(state_dtype).contiguous()

    message, transition, tail_states = None, None, None
    through = route.affine[plan.rank]
    tail, n_between = layout.tail, n_known - layout.num_send  # segments between head and tail
    if through:
        summary = backend.state_summary(chunks, head, with_transition=True)
        message, transition = AffineMessage(summary.state, summary.transition), summary.transition
    elif layout.num_send:  # the tail's pass alone: it ends before a pass that also covers whole sequences
        tail_states = backend.state_pass(chunks, tail, _rows(known_initial, n_between), True)
        message = AffineMessage(tail_states.final_state)
    exchange.send(pending, message)
    between = rest if tail_states is None else layout.span(rest.start, tail.start)
    between_initial = known_initial if tail_states is None else _rows(known_initial, 0, n_between)
    between_states, between_o, tail_o = None, None, None
    if not between.empty:
        between_states = backend.state_pass(chunks, between, between_initial, output_final_state)
        between_o = backend.output(chunks, between, between_initial, between_states)
    if tail_states is not None:
        tail_o = backend.output(chunks, tail, _rows(known_initial, n_between), tail_states)
    incoming = exchange.receive(pending)
    head_states, head_o = None, None
    if not head.empty:
        head_states = backend.state_pass(chunks, head, incoming, output_final_state)
        head_o = backend.output(chunks, head, incoming, head_states)
    pending.finish_sends()

    o = _cat([head_o, between_o, tail_o], 1)
    final_state = None
    if output_final_state:
        local_final = _cat([s and s.final_state for s in (head_states, between_states, tail_states)], 0)
        # the segments that end here form a prefix
        final_state = _by_sequence(plan, segments, local_final, slice(0, len(segments) - layout.num_send))
        if plan.world_size > 1:
            final_state = comm.all_reduce_sum(final_state, plan.group)
    if incoming is None and known_initial is None:  # no rows; the empty tensor keeps shape and dtype
        local_initial = torch.empty(0, HV, K, V, dtype=state_dtype, device=device)
    else:
        local_initial = _cat([incoming, known_initial if n_known else None], 0)
    return CPForward(o, final_state, backend.to_saved(chunks), local_initial, transition, head_states)


def _add(a, b):
    return b if a is None else a if b is None else a + b


def cp_backward(backend: LocalBackend, plan: CPPlan, saved, local_initial: torch.Tensor,
                transition: torch.Tensor | None, head_states: LocalStates | None, do: torch.Tensor,
                dfinal: torch.Tensor | None, output_final_state: bool, has_initial_state: bool,
                exchange: StateExchange | None = None) -> CPGrads:
    """Run one rank's backward, mirroring :func:`cp_forward`; ``do [1, T_local, HV, V]``,
    ``dfinal [N, HV, K, V]`` (this rank's gradient of the returned final states, or ``None``);
    ``exchange`` as for :func:`cp_forward`."""
    T, HV, V = do.shape[1], do.shape[2], do.shape[3]
    K = local_initial.shape[2]
    state_dtype = local_initial.dtype
    layouts = plan.layouts(T // plan.batch_size)
    layout = layouts[plan.rank]
    segments = layout.segments
    dht_all = None
    if output_final_state and plan.world_size == 1:
        dht_all = dfinal
    elif output_final_state:
        # The final states were replicated to every rank; their gradients add up at the owners.
        dht_all = torch.zeros(plan.num_sequences, HV, K, V, dtype=state_dtype, device=do.device)
        if dfinal is not None:
            dht_all += dfinal
        dht_all = comm.all_reduce_sum(dht_all, plan.group)
    _, route = _routes(plan, T // plan.batch_size, (HV, K, V), state_dtype, do.device)
    exchange = exchange or make_exchange(plan.strategy)
    pending = exchange.begin(route)

    known, tail = layout.before_tail, layout.tail
    n_known = len(segments) - layout.num_send

    def initial_of(first: int, end: int | None = None):
        """The initial states of segments ``[first, end)`` (received, or given; ``None`` for zeros)."""
        return None if first >= layout.num_receive and not has_initial_state else local_initial[first:end]

    def local_work(span: Span, initial: torch.Tensor):
        kept = head_states if span == layout.head else None
        return backend.backward_local(saved, span, do[:, span.start:span.end], initial, kept)

    def known_pass(span: Span, first: int, end: int):
        """``backward_local`` and ``backward_states`` of the span of segments ``[first, end)`` (they end here)."""
        dht = None if dht_all is None else dht_all[_sequences(segments[first:end])]
        return backend.backward_states(local_work(span, initial_of(first, end)), dht)

    head, n_head = layout.head, layout.num_receive
    message, head_states_b, tail_local = None, None, None
    if route.affine[plan.rank]:
        tail_local = local_work(tail, initial_of(n_known))
        message = AffineMessage(backend.state_gradient_summary(tail_local), transition.transpose(-1, -2))
    elif n_head:  # the head's pass alone: it ends before a pass that also covers whole sequences
        head_states_b = known_pass(head, 0, n_head)
        message = AffineMessage(head_states_b.dinitial_state)
    exchange.send(pending, message)
    between = known if head_states_b is None else layout.span(head.end, known.end)
    between_states = None
    if not between.empty:
        between_states = known_pass(between, 0 if head_states_b is None else n_head, n_known)
    if tail_local is None and not tail.empty:
        tail_local = local_work(tail, initial_of(n_known))
    known_grads = [backend.backward_inputs(s) for s in (head_states_b, between_states) if s is not None]
    dS_out = exchange.receive(pending)
    tail_states, tail_grads = None, None
    if not tail.empty:
        tail_states = backend.backward_states(tail_local, dS_out)
        tail_grads = backend.backward_inputs(tail_states)
    pending.finish_sends()

    parts: list[LocalGrads] = [g for g in (*known_grads, tail_grads) if g is not None]
    token = {name: _cat([getattr(g, name) for g in parts], 1) for name in ("dq", "dk", "dv", "dg", "dbeta")}
    dA_log = ddt_bias = None
    for g in parts:
        dA_log, ddt_bias = _add(dA_log, g.dA_log), _add(ddt_bias, g.ddt_bias)
    dinitial_state = None
    if has_initial_state:
        local = _cat([s and s.dinitial_state for s in (head_states_b, between_states, tail_states)], 0)
        # the segments that start here form a suffix
        dinitial_state = _by_sequence(plan, segments, local, slice(layout.num_receive, None))
    return CPGrads(**token, dA_log=dA_log, ddt_bias=ddt_bias, dinitial_state=dinitial_state)
