"""Forward and backward orchestration of one rank's context-parallel chunk KDA: the rank's schedule.

The spans are the plan's (:class:`~kdacp.cp.plan.RankLayout`): ``head`` (sequences begun on
an earlier rank) and ``rest`` (``after_head``: sequences that start here, the last of which, the tail,
may continue on a later rank). Each direction runs in critical-path order: what a peer waits for first,
its message posted the moment it exists, then all work that needs no incoming message, and the
blocking receive last.

forward:   begin (post the receive)
           prepare(whole)                                gates, L2 norm, intra-chunk WY: one launch set
           through rank: summary(head, which is the whole rank) -> message (S_ext, M)
           a tail: state_pass(rest) -> message (the tail's final states: the pass's last rows)
           send                                          p2p: to rank + 1; allgather: the gather starts
           a tail: output(rest)
           receive (block) -> a tail: state_pass(head), output(head); else: state_pass(whole), output(whole)
                              (a through rank whose backend gains from it: the pass over its summary's
                              pieces at once, each from the state entering it)
backward:  begin
           backward_local(whole)                         one launch set over the rank's tokens
           through rank: G(whole) -> message (G, M^T)
           no tail: backward_states(whole) -> message (its head rows: the head's initial-state gradients)
           else: backward_states(head) -> message (the head's initial-state gradients)
           send
           receive (block) -> backward_states(whole; the tail's rows from the message)
           backward_inputs(whole)

Every stage runs once per span, over all of the span's segments (one varlen launch set). Only a rank
with a tail splits its forward, over the rest (whose pass makes the message) and the head (which waits);
every other rank runs its forward, and every rank its backward, as one launch set over its tokens, what
one device runs on them, so that its outputs and input gradients are not joined from parts (a join copies
every input gradient once more, per layer). The cost is in when messages leave: a rank without a tail waits for its head's
states before its whole pass, and sends its head's state gradients with the whole backward pass (its
receiver first runs its own local work); in a training step ranks run ahead of each other as a wavefront
(:func:`kdacp.bench.scaling_model.predict_step`), so such a wait is paid once per stretch of layers, not
per layer. The backward's extra work is the head's own gradient state pass, only on a rank whose tail
waits for a message. The sequences whose forward pass makes no message (whole ones after the head) ride
in the same launch as the tail's, rather than after a launch of the tail's alone: that posts the message
later by their share of the pass (its receiver has its own whole sequences to run meanwhile); a separate
tail cost a packed rank about 0.2 ms of split launches.

Under a layout whose ranks hold several ranges (zigzag, a caller's ranges: several *positions* of the
chain, :mod:`~kdacp.cp.layout`), the routes run over positions and a rank exchanges one message per
position it holds (:mod:`~kdacp.cp.exchanges`). A rank of one position runs the schedule above; a
rank of several runs one launch set over all of its tokens (:func:`_forward_positions`,
:func:`_backward_positions`):

forward:   begin; prepare(whole); the pass over its sending span (first to last sending segment): the summary
           (S_ext, M) where a message is affine, else the state pass from the known initial states -> messages;
           send; receive (block); state_pass(whole) and output(whole), each segment from its incoming state
           (the pass's states kept for the backward, as a through rank's)
backward:  begin; backward_local(whole, from the kept states); G (the gradient summary over the segments from the
           first receiving one to the last, or the gradient pass where a known final-state gradient enters a
           receiving segment) -> messages; send; receive (block); backward_states(whole); backward_inputs(whole)

Its whole pass waits for the last of its incoming states (for zigzag, the one of its later range), rather
than splitting its launches per range.

A "through" rank holds the middle of a chain (all its segments receive and send); only it needs
``M``, and its serial work per hop is ``M S_in + S_ext`` (``M^T dS_out + G`` backward). Its summary kernel
cuts the rank into pieces walked in parallel; where the backend's state kernel gains from it
(``backend.parallel_pieces``), their own summaries, kept, give the state entering each piece once ``S_in``
arrives, and the state pass, the work after the message, runs over the pieces at once rather than along
the whole rank. The order is
tested with a recording exchange in ``tests/cp/test_schedule.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..affine import AffineMap, apply_state_summary, entry_states
from ..backends.base import KDAInputs, LocalBackend, LocalGrads, LocalStates
from ..caches import ROUTES
from ..host_copies import put_rows, row_taker, take_rows
from . import collectives
from .plan import CPPlan, RankLayout, chain_links
from .split import RankBackward, SplitPieces, chunks_per_piece, split_state_pass
from .exchanges import Route, StateExchange, make_exchange


@dataclass
class CPForward:
    """``o [1, T_local, HV, V]``; ``final_state [N, HV, K, V]`` (every sequence, or ``None``);
    ``saved``: the backend's saved chunk data; ``local_initial [n, HV, K, V]``: the states the local
    segments started from, the received ones first, then those ``initial_state`` gave (without it zeros,
    or no rows at all where no segment receives: zero initial states are then passed to the backends as
    none, as FLA's op does); ``transition``: ``M [n, HV, K, K]`` on through ranks, else ``None``;
    ``head_states``: the state pass (``h``, ``v_new``) of the whole rank where its backward sends gradients
    back after its local pass (the head is the whole rank, or the rank holds several positions), kept so that
    the backward does not recompute it on the critical path; else ``None``; ``split``: the pieces the rank's
    state pass was cut into (:mod:`~kdacp.cp.split`), which its backward runs over, or ``None``."""

    o: torch.Tensor
    final_state: torch.Tensor | None
    saved: object
    local_initial: torch.Tensor
    transition: torch.Tensor | None
    head_states: LocalStates | None
    split: SplitPieces | None = None


@dataclass
class CPGrads(LocalGrads):
    """A rank's gradients: :class:`LocalGrads` over all ``T_local`` tokens, plus
    ``dinitial_state [N, HV, K, V]`` (rows of sequences that start on this rank; else zero) or ``None``."""

    dinitial_state: torch.Tensor | None


@lru_cache(maxsize=ROUTES)
def _routes(plan: CPPlan, local_length: int, state_shape, dtype, device) -> tuple[Route, Route]:
    """The forward route (states, along the layout's chain in token order) and the backward route
    (gradients, the chain reversed) of ``plan``'s layouts for ``local_length`` tokens per batch row. Routes
    are frozen and hold no per-call state, so the newest are kept (:data:`~kdacp.caches.ROUTES`; every
    layer of a step asks for the same)."""
    links = chain_links(plan.layouts(local_length))
    holders, through = tuple(link.rank for link in links), tuple(link.through for link in links)
    n = max(max(link.num_send for link in links), 1)
    shape = (n, *state_shape)
    forward = Route(plan.rank, plan.group, holders, tuple(link.num_send for link in links), through,
                    shape, dtype, device)
    backward = Route(plan.rank, plan.group, holders[::-1], tuple(link.num_receive for link in links)[::-1],
                     through[::-1], shape, dtype, device)
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


def cp_forward(backend: LocalBackend, plan: CPPlan, inputs: KDAInputs, initial_state: torch.Tensor | None,
               output_final_state: bool, state_dtype: torch.dtype, exchange: StateExchange | None = None,
               split=None) -> CPForward:
    """Run one rank's forward; see the module docstring for the order of stages. ``exchange``: default
    the plan's strategy's (:mod:`kdacp.bench.scaling` passes a probe that times the stages); ``split``: the
    split inside the device (:func:`~kdacp.cp.split.chunks_per_piece`), applied to the state pass of a
    rank of one position that runs it over its whole tokens (one device, a through rank, a rank without a
    tail)."""
    T, HV, V, K = inputs.v.shape[1], inputs.v.shape[2], inputs.v.shape[3], inputs.q.shape[3]
    device = inputs.q.device
    layouts = plan.layouts(T // plan.batch_size)
    layout = layouts[plan.rank]
    route, _ = _routes(plan, T // plan.batch_size, (HV, K, V), state_dtype, device)
    exchange = exchange or make_exchange(plan.strategy)
    length = chunks_per_piece(split, backend, layout.whole, HV, K, V, device)
    if len(layout.positions) > 1:
        return _forward_positions(backend, plan, layout, route, exchange, inputs, initial_state, output_final_state,
                                  state_dtype, length)
    position = layout.positions[0]
    pending = exchange.begin(route)

    head, rest = layout.head, layout.after_head
    segments = layout.segments
    chunks = backend.prepare(inputs, layout.whole)
    starting = _sequences(segments[layout.num_receive:])  # the sequences that start on this rank
    n_known = len(segments) - layout.num_receive
    # zero initial states are passed as none (no fill kernel; FLA neither reads them nor forms their gradient)
    known_initial = None if initial_state is None else initial_state[starting].to(state_dtype).contiguous()

    message, transition, rest_states, rest_o, pieces, cut = None, None, None, None, None, None
    if route.affine[position]:  # a through rank: its one segment both receives and sends
        summary = backend.state_summary(chunks, head, with_transition=True,
                                        parts=bool(length) or backend.parallel_pieces, chunks_per_piece=length)
        if length or backend.parallel_pieces:
            pieces, summary = summary, summary.summary
        message, transition = summary, summary.transition
    elif layout.num_send:  # one launch over every segment after the head; the tail's states are its last rows
        rest_states = backend.state_pass(chunks, rest, known_initial, True)
        message = AffineMap(rest_states.final_state[-layout.num_send:])
    exchange.send(pending, (message,))
    if rest_states is not None:
        rest_o = backend.output(chunks, rest, known_initial, rest_states)
    incoming, = exchange.receive(pending)
    local_initial = _rows([(incoming, layout.num_receive), (known_initial if n_known else None, n_known)])
    kept = None
    if pieces is not None and len(pieces.starts) > len(pieces.counts):
        # a through rank: its pass runs over the summary's pieces at once, each from the state entering it
        entries = entry_states(pieces, incoming)
        states = backend.state_pass(chunks, head.cut(pieces.starts), entries, output_final_state)
        if length:  # its backward runs over the pieces too
            cut = SplitPieces(pieces.starts, pieces.counts, entries, pieces.parts.transition)
        o = backend.output(chunks, layout.whole, local_initial, states)
        # each segment's final state is its last piece's
        last = [sum(pieces.counts[:i + 1]) - 1 for i in range(len(pieces.counts))]
        local_final = None if states.final_state is None else take_rows(states.final_state, last)
        kept = states
    elif rest_states is None:  # no pass made a message: one pass over the whole rank
        if length:
            states, cut = split_state_pass(backend, chunks, layout.whole, local_initial, output_final_state, length)
        else:
            states = backend.state_pass(chunks, layout.whole, local_initial, output_final_state)
        o = backend.output(chunks, layout.whole, local_initial, states)
        local_final = states.final_state
        kept = states if rest.empty and not head.empty else None  # the head is the whole rank
    else:  # the head waited for its incoming states
        head_states = None if head.empty else backend.state_pass(chunks, head, incoming, output_final_state)
        head_o = None if head.empty else backend.output(chunks, head, incoming, head_states)
        o = _cat([head_o, rest_o], 1)
        local_final = _cat([s and s.final_state for s in (head_states, rest_states)], 0) if output_final_state else None
    pending.finish_sends()

    final_state = None
    if output_final_state:  # the segments that end here form a prefix
        final_state = _by_sequence(plan, segments, local_final, slice(0, len(segments) - layout.num_send))
        if plan.world_size > 1:
            final_state = collectives.all_reduce_sum(final_state, plan.group)
    if local_initial is None:  # no rows; the empty tensor keeps shape and dtype
        local_initial = torch.empty(0, HV, K, V, dtype=state_dtype, device=device)
    return CPForward(o, final_state, backend.to_saved(chunks), local_initial, transition, kept, cut)


def _rows(parts: list) -> torch.Tensor | None:
    """The state rows of consecutive groups of a rank's segments, ``parts`` ``[(rows or None, n)]`` in order:
    ``None`` stands for ``n`` zero rows where another group has rows; ``None`` when no group has any (zero
    states are passed to the backends as none)."""
    like = next((t for t, _ in parts if t is not None), None)
    if like is None:
        return None
    return _cat([like.new_zeros(n, *like.shape[1:]) if t is None and n else t for t, n in parts], 0)


def cp_backward(backend: LocalBackend, plan: CPPlan, saved, local_initial: torch.Tensor,
                transition: torch.Tensor | None, head_states: LocalStates | None, do: torch.Tensor,
                dfinal: torch.Tensor | None, output_final_state: bool, has_initial_state: bool,
                exchange: StateExchange | None = None, split: SplitPieces | None = None) -> CPGrads:
    """Run one rank's backward, mirroring :func:`cp_forward`; ``do [1, T_local, HV, V]``,
    ``dfinal [N, HV, K, V]`` (this rank's gradient of the returned final states, or ``None``);
    ``exchange`` as for :func:`cp_forward`; ``split``: the forward's ``CPForward.split``."""
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
        dht_all = collectives.all_reduce_sum(dht_all, plan.group)
    _, route = _routes(plan, T // plan.batch_size, (HV, K, V), state_dtype, do.device)
    exchange = exchange or make_exchange(plan.strategy)
    if len(layout.positions) > 1:
        return _backward_positions(backend, plan, layout, route, exchange, saved, local_initial, transition,
                                   head_states, do, dht_all, has_initial_state, split)
    position = len(route.order) - 1 - layout.positions[0]  # the backward route runs the chain reversed
    pending = exchange.begin(route)

    n_head, n_known = layout.num_receive, len(segments) - layout.num_send
    # one launch set over the whole rank (over the pieces its forward's state pass was cut into, if any)
    local = RankBackward(backend, saved, layout.whole, do, local_initial if len(local_initial) else None,
                         head_states, split)
    final_grads = None if dht_all is None or not n_known else dht_all[_sequences(segments[:n_known])]
    message, states = None, None
    if route.affine[position]:  # a through rank: its one segment both receives and sends
        message = AffineMap(local.gradient_summary(), transition.transpose(-1, -2))
    elif layout.num_send == 0:  # nothing to wait for: the whole pass, whose head rows are the message
        states = local.gradient_pass(final_grads)
        if n_head:
            message = AffineMap(states.dinitial_state[:n_head])
    elif n_head:  # the head's segments end here: their own pass makes the message, ahead of the whole pass
        head_dht = None if final_grads is None else final_grads[:n_head]
        message = AffineMap(local.gradient_pass(head_dht, segments=n_head).dinitial_state)
    exchange.send(pending, (message,))
    dS_out, = exchange.receive(pending)
    if states is None:
        states = local.gradient_pass(_rows([(final_grads, n_known), (dS_out, layout.num_send)]))
    grads = backend.backward_inputs(states)
    pending.finish_sends()

    dinitial_state = None
    if has_initial_state:  # the segments that start here form a suffix
        dinitial_state = _by_sequence(plan, segments, states.dinitial_state, slice(n_head, None))
    return CPGrads(**vars(grads), dinitial_state=dinitial_state)


def _state_rows(rows: list) -> torch.Tensor | None:
    """``[len(rows), HV, K, V]``: the rows (``None``: zeros); ``None`` when every row is ``None`` (zero
    states are passed to the backends as none)."""
    like = next((r for r in rows if r is not None), None)
    if like is None:
        return None
    return torch.stack([like.new_zeros(like.shape) if r is None else r for r in rows])


def _rows_with_incoming(takes: list[bool], positions: list[int], incoming: dict, other: list) -> torch.Tensor | None:
    """:func:`_state_rows` of one row per segment: where ``takes[j]``, the next row of ``incoming[positions[j]]``
    (``[n, HV, K, V]``, each position's rows taken in order), else ``other[j]`` (``[HV, K, V]`` or ``None``: zeros).
    A run of segments taking a position's rows is one slice of its tensor (the whole tensor where it takes them
    all), so a rank of many positions joins its values in one ``cat``, not a view and a row a segment."""
    runs: list = []  # (position, first row, rows) or a row of other
    seen: dict = {}
    for take, p, row in zip(takes, positions, other):
        if not take:
            runs.append(row)
        elif runs and isinstance(runs[-1], list) and runs[-1][0] == p:
            runs[-1][2] += 1
            seen[p] += 1
        else:
            runs.append([p, seen.get(p, 0), 1])
            seen[p] = seen.get(p, 0) + 1
    like = next((incoming[r[0]] for r in runs if isinstance(r, list)), None)
    if like is None:
        return _state_rows(other)
    parts = []
    for r in runs:
        if isinstance(r, list):
            x = incoming[r[0]]
            parts.append(x if (r[1], r[2]) == (0, x.shape[0]) else x[r[1]:r[1] + r[2]])
        else:
            parts.append(like.new_zeros(1, *like.shape[1:]) if r is None else r.unsqueeze(0))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sending_span(layout: RankLayout) -> tuple[int, int]:
    """``(first, last + 1)``: the indices of the first and last segments of ``layout`` that send (``(0, 0)``:
    none); the span between them is what a rank of several positions runs its message's pass over."""
    sending = [j for j, s in enumerate(layout.segments) if s.sends]
    return (sending[0], sending[-1] + 1) if sending else (0, 0)


def _forward_positions(backend: LocalBackend, plan: CPPlan, layout: RankLayout, route: Route,
                       exchange: StateExchange, inputs: KDAInputs, initial_state: torch.Tensor | None,
                       output_final_state: bool, state_dtype: torch.dtype, length: int | None) -> CPForward:
    """The forward of a rank holding several positions of the chain (ranges of the layout), in critical-path
    order: the pass that makes its messages (over the segments from its first sending one to its last: the
    summary ``(S_ext, M)`` where a message is affine, and a sequence that starts in its range then sends
    ``M S_0 + S_ext``; else the state pass from the known initial states), the send, the blocking receive, then
    one state pass and one output over all of its tokens, each segment from its incoming, given or zero state
    (cut into pieces of ``length`` chunks where that is not ``None``: :mod:`~kdacp.cp.split`)."""
    segments = layout.segments
    HV, K, V = inputs.v.shape[2], inputs.q.shape[3], inputs.v.shape[3]
    pending = exchange.begin(route)
    chunks = backend.prepare(inputs, layout.whole)
    given = None if initial_state is None else initial_state.to(state_dtype)
    first, last = _sending_span(layout)
    span = layout.span(segments[first].start, segments[last - 1].end) if last else None
    offsets = transition = None
    if last and any(s.sends and s.receives for s in segments):  # an affine message: (S_ext, M) of every segment
        summary = backend.state_summary(chunks, span, with_transition=True)
        offsets, transition = summary
        if given is not None:  # a sequence that starts in its range sends M S_0 + S_ext
            known = [j for j in range(first, last) if segments[j].sends and not segments[j].receives]
            if known:
                rows = [j - first for j in known]
                offsets = offsets.clone()
                put_rows(offsets, rows, apply_state_summary(take_rows(offsets, rows), take_rows(transition, rows),
                                                            take_rows(given, [segments[j].sequence for j in known])))
    elif last:  # every message is a final state: the pass from the known initial states
        starts = _state_rows([None if given is None or s.receives else given[s.sequence]
                              for s in segments[first:last]])
        offsets = backend.state_pass(chunks, span, starts, True).final_state
    messages = []
    offset_rows = None if offsets is None else row_taker(offsets)
    transition_rows = None if transition is None else row_taker(transition)
    for p in route.positions:
        rows = [j - first for j in layout.sending_by_position.get(p, ())]
        if not rows:
            messages.append(None)
        else:
            messages.append(AffineMap(offset_rows(rows), transition_rows(rows) if route.affine[p] else None))
    exchange.send(pending, messages)
    incoming = dict(zip(route.positions, exchange.receive(pending)))
    local_initial = _rows_with_incoming([s.receives for s in segments], [s.position for s in segments], incoming,
                                        [None if given is None or s.receives else given[s.sequence] for s in segments])
    cut = None
    if length:
        states, cut = split_state_pass(backend, chunks, layout.whole, local_initial, output_final_state, length)
    else:
        states = backend.state_pass(chunks, layout.whole, local_initial, output_final_state)
    o = backend.output(chunks, layout.whole, local_initial, states)
    pending.finish_sends()
    final_state = None
    if output_final_state:  # each sequence ends in one segment, somewhere in the chain
        final_state = states.final_state.new_zeros(plan.num_sequences, HV, K, V)
        ends = [j for j, s in enumerate(segments) if not s.sends]
        put_rows(final_state, [segments[j].sequence for j in ends], take_rows(states.final_state, ends))
        final_state = collectives.all_reduce_sum(final_state, plan.group)
    if local_initial is None:  # no rows; the empty tensor keeps shape and dtype
        local_initial = torch.empty(0, HV, K, V, dtype=state_dtype, device=inputs.q.device)
    # the backward's affine messages read M of the segments of the sending span (kept only where one is affine)
    transition = transition if any(route.affine[p] for p in route.positions) else None
    # its states kept: the backward's messages follow its local pass, which would otherwise run this pass again
    return CPForward(o, final_state, backend.to_saved(chunks), local_initial, transition, states, cut)


def _backward_positions(backend: LocalBackend, plan: CPPlan, layout: RankLayout, route: Route,
                        exchange: StateExchange, saved, local_initial: torch.Tensor,
                        transition: torch.Tensor | None, kept: LocalStates | None, do: torch.Tensor,
                        dht_all: torch.Tensor | None, has_initial_state: bool, split: SplitPieces | None) -> CPGrads:
    """The backward of a rank holding several positions, mirroring :func:`_forward_positions`: the local
    backward over the whole rank (from the forward's ``kept`` states of the whole rank, if any); where a segment
    receives, its message is the gradient reaching its initial state with the known final-state gradients (zero
    where a segment sends: ``G``, sent with ``M^T`` by a through position), from the gradient summary where no
    known gradient enters, else from a gradient state pass; after the exchange, the gradient state pass and the
    input gradients over the whole rank."""
    segments = layout.segments
    L = len(route.order)
    pending = exchange.begin(route)
    local = RankBackward(backend, saved, layout.whole, do, local_initial if len(local_initial) else None, kept, split)
    known = [None if dht_all is None or s.sends else dht_all[s.sequence] for s in segments]
    receiving = [j for j, s in enumerate(segments) if s.receives]
    first, _ = _sending_span(layout)
    messages = [None] * len(route.positions)
    if receiving:
        if all(segments[j].sends or known[j] is None for j in receiving):
            # every message is G (a through position's, or a final-state gradient of zero): the gradient summary,
            # over the segments from the first receiving one to the last (zigzag's first rank: its last range)
            low = receiving[0]
            dinitial = local.gradient_summary(segments=(low, receiving[-1] + 1))
        else:  # the pass with the known final-state gradients (zero where a segment sends, giving G there)
            low, dinitial = 0, local.gradient_pass(_state_rows(known)).dinitial_state
        gradient_rows = row_taker(dinitial)
        transposed_rows = None if transition is None else row_taker(transition.transpose(-1, -2))
        for k, i in enumerate(route.positions):
            rows = layout.receiving_by_position.get(L - 1 - i, ())
            if rows and route.affine[i]:
                messages[k] = AffineMap(gradient_rows([j - low for j in rows]),
                                        transposed_rows([j - first for j in rows]))
            elif rows:
                messages[k] = AffineMap(gradient_rows([j - low for j in rows]))
    exchange.send(pending, messages)
    incoming = {L - 1 - i: x for i, x in zip(route.positions, exchange.receive(pending))}
    dht = _rows_with_incoming([s.sends for s in segments], [s.position for s in segments], incoming, known)
    states = local.gradient_pass(dht)
    grads = backend.backward_inputs(states)
    pending.finish_sends()
    dinitial_state = None
    if has_initial_state:  # each sequence starts in one segment
        starting = [j for j, s in enumerate(segments) if not s.receives]
        dinitial_state = states.dinitial_state.new_zeros(plan.num_sequences, *states.dinitial_state.shape[1:])
        put_rows(dinitial_state, [segments[j].sequence for j in starting], take_rows(states.dinitial_state, starting))
    return CPGrads(**vars(grads), dinitial_state=dinitial_state)
