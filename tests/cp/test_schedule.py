"""The order of one rank's work, forward and backward, against what the schedule claims.

Each rank role runs in this process (:class:`~kdacp.bench.rank_role.RankRole`) with a recording exchange (a
:class:`~kdacp.bench.rank_role.StandInExchange` that records the calls and hands back zeros) and a recording
backend (the torch backend, recording each stage and its span), so the order is seen without other ranks.
The claims (``kdacp.cp.schedule``):

- a rank posts its receive before any work, and its send before any work the receiver does not
  need (outputs, input gradients, and everything on the span that itself waits);
- it blocks (``receive``) only after all work that needs no incoming message.
"""
from __future__ import annotations

import pytest
import torch

from kdacp.backends.base import KDAInputs, KDAOptions
from kdacp.backends.torch_backend import TorchBackend
from kdacp.bench.rank_role import RankRole, StandInExchange
from kdacp.cp.plan import CPPlan, rank_layouts
from tests.helpers import make_kda_inputs


class RecordingExchange(StandInExchange):
    """Logs ``begin``, a ``send`` that passes something on and a ``receive`` that gets something."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def begin(self, route):
        self.log.append(("begin", None))
        return super().begin(route)

    def send(self, pending, messages):
        route = pending.route
        if any(m is not None and route.target(i) is not None for i, m in zip(route.positions, messages)):
            self.log.append(("send", None))
        super().send(pending, messages)

    def receive(self, pending):
        route = pending.route
        if any(route.source(i) is not None for i in route.positions):
            self.log.append(("receive", None))
        return super().receive(pending)


class RecordingBackend:
    def __init__(self, log: list):
        self.inner, self.log = TorchBackend(KDAOptions(scale=0.25)), log
        self.name, self.options, self.spans = "recording", self.inner.options, []

    def __getattr__(self, stage):
        fn = getattr(self.inner, stage)
        if not callable(fn):  # settings such as parallel_pieces
            return fn

        def call(*args, **kwargs):
            spans = [a for a in args if hasattr(a, "cu_seqlens") and hasattr(a, "start")]
            local_span = getattr(args[0], "span", None) if args else None
            span = spans[0] if spans else local_span
            chosen = kwargs.get("segments")
            if span is not None and chosen is not None:  # a pass over some of the span's segments
                span = span.segments(*chosen) if isinstance(chosen, tuple) else span.prefix(chosen)
            if span is not None:  # the stages that do work on a span (not to_saved)
                self.log.append((stage, (span.start, span.end)))
                self.spans.append((stage, span))
            return fn(*args, **kwargs)
        return call


# (cu_seqlens, tokens per rank): a chain through a middle rank; packed documents cut at a rank edge; a
# rank whose head and tail are different documents, with a whole document between them
LAYOUTS = [((0, 5, 100, 130), (40, 50, 40)), ((0, 30, 45, 60, 64), (32, 32)),
           ((0, 20, 40, 50, 80, 96), (32, 32, 32))]


def _run(rank: int, cu, lengths):
    log: list = []
    layouts = rank_layouts(cu, 1, lengths)
    plan = CPPlan(rank=rank, world_size=len(lengths), group=None, strategy="p2p", batch_size=1, cu_seqlens=cu,
                  local_lengths=lengths, rank_layouts=layouts)
    args = make_kda_inputs(1, lengths[rank], 1, 1, 16, 16, gate="plain", requires_grad=False, seed=rank)
    role = RankRole(plan, RecordingBackend(log), KDAInputs(**args))
    fwd = role.forward(RecordingExchange(log))
    forward_log = list(log)
    log.clear()
    role.backward(fwd, torch.randn_like(fwd.o), exchange=RecordingExchange(log))
    return layouts[rank], forward_log, list(log)


def _index(log, event) -> int | None:
    return next((i for i, e in enumerate(log) if e[0] == event), None)


@pytest.mark.parametrize("cu, lengths", LAYOUTS)
def test_forward_sends_first_and_blocks_last(cu, lengths):
    for rank in range(len(lengths)):
        layout, log, _ = _run(rank, cu, lengths)
        head = (layout.head.start, layout.head.end)
        assert log[0] == ("begin", None)
        send, receive = _index(log, "send"), _index(log, "receive")
        assert (send is not None) == (layout.num_send > 0) and (receive is not None) == (layout.num_receive > 0)
        if send is not None:
            # nothing the receiver does not need comes first: no output, nothing on the waiting head
            assert all(stage != "output" and (span != head or layout.through) for stage, span in log[1:send]), log
        if receive is not None and layout.num_send and not layout.through:
            # a tail: all independent work is done before blocking, after it only the head's work
            assert all(span == head for _, span in log[receive + 1:]), log
            assert all(span != head or stage == "prepare" for stage, span in log[1:receive]), log
        elif receive is not None:  # no tail to send from (or a through rank): one pass over the whole rank
            whole = (0, layout.num_tokens)
            assert log[receive + 1:] == [("state_pass", whole), ("output", whole)], log


@pytest.mark.parametrize("cu, lengths", LAYOUTS)
def test_backward_sends_first_and_blocks_last(cu, lengths):
    for rank in range(len(lengths)):
        layout, _, log = _run(rank, cu, lengths)
        whole = (0, layout.num_tokens)
        assert log[0] == ("begin", None)
        send, receive = _index(log, "send"), _index(log, "receive")
        # backward, gradients flow from the tail's successor to the head's predecessor
        assert (send is not None) == (layout.num_receive > 0) and (receive is not None) == (layout.num_send > 0)
        if send is not None:
            assert all(stage != "backward_inputs" for stage, _ in log[1:send]), log
        if receive is not None:
            # after blocking only the passes that need the message, over the whole rank
            assert log[receive + 1:] == [("backward_states", whole), ("backward_inputs", whole)], log
            assert ("backward_local", whole) in log[1:receive], log


@pytest.mark.parametrize("cu, lengths", LAYOUTS)
def test_message_posted_right_after_the_pass_that_makes_it(cu, lengths):
    """Between the shared ``prepare`` and the send, only the pass that makes the message: forward the
    pass over every segment after the head (the tail and the rank's whole sequences in one launch),
    backward the local work over the whole rank, then the summary (a through rank), the pass over the
    whole rank (no tail: nothing to wait for), or the head's own pass (a tail that waits)."""
    for rank in range(len(lengths)):
        layout, forward, backward = _run(rank, cu, lengths)
        whole, head, rest = ((s.start, s.end) for s in (layout.whole, layout.head, layout.after_head))
        if layout.num_send:
            made = ("state_summary", head) if layout.through else ("state_pass", rest)
            assert forward[1:_index(forward, "send")] == [("prepare", whole), made], forward
        if layout.num_receive:
            made = (("state_gradient_summary", whole) if layout.through else ("backward_states", whole)
                    if layout.num_send == 0 else ("backward_states", head))
            assert backward[1:_index(backward, "send")] == [("backward_local", whole), made], backward


@pytest.mark.parametrize("cu, lengths", LAYOUTS)
def test_a_packed_rank_runs_each_stage_once_per_span(cu, lengths):
    """What one device launches once over the rank's tokens, a rank launches once per span: forward over
    the head and over everything after it where a tail sends (not the tail alone and the whole sequences
    before it apart), else over the whole rank; backward over the whole rank (and the head's own pass for
    the message), so that no outputs or gradients are joined from parts."""
    for rank in range(len(lengths)):
        layout, forward, backward = _run(rank, cu, lengths)
        whole, head, rest = ((s.start, s.end) for s in (layout.whole, layout.head, layout.after_head))
        assert {span for _, span in forward if span is not None} <= {whole, head, rest}, forward
        assert {span for _, span in backward if span is not None} <= {whole, head}, backward
        assert [e for e in backward if e[0] in ("backward_local", "backward_inputs")] == [
            ("backward_local", whole), ("backward_inputs", whole)], backward
        if not layout.num_send or layout.through:  # nothing splits the forward either
            assert [e for e in forward if e[0] in ("state_pass", "output")] == [
                ("state_pass", whole), ("output", whole)], forward
        for log in (forward, backward):
            assert len(set(log)) == len(log), log


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_zero_initial_states_are_passed_as_none(rank):
    """Without ``initial_state`` the spans that start on a rank get no initial state (FLA then neither
    reads nor differentiates one: no zero fill, no ``dh0``); a received state is passed as is; and the
    results equal those with explicit zero initial states."""
    cu, lengths = LAYOUTS[0]
    layouts = rank_layouts(cu, 1, lengths)
    plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=cu,
                  local_lengths=lengths, rank_layouts=layouts)
    args = KDAInputs(**make_kda_inputs(1, lengths[rank], 1, 1, 16, 16, gate="plain", requires_grad=False, seed=rank))
    do = torch.randn(1, lengths[rank], 1, 16, dtype=torch.float64)
    got = {}
    for name, initial in (("none", None), ("zeros", torch.zeros(len(cu) - 1, 1, 16, 16, dtype=torch.float64))):
        seen = []
        backend = TorchBackend(KDAOptions(scale=0.25))
        for stage in ("state_pass", "backward_local"):
            inner = getattr(backend, stage)

            def record(*a, _inner=inner, _stage=stage, **k):
                seen.append((_stage, a[1].start, a[2] is None if _stage == "state_pass" else a[3] is None))
                return _inner(*a, **k)
            setattr(backend, stage, record)
        role = RankRole(plan, backend, args, initial_state=initial)
        fwd = role.forward(StandInExchange())
        grads = role.backward(fwd, do, exchange=StandInExchange())
        got[name] = (fwd.o, grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta)
        head_end = layouts[rank].head_end
        for stage, start, passed_none in seen:
            # only spans that start after the head (segments that start here) can be given none
            assert passed_none == (name == "none" and start >= head_end), (stage, start, seen)
    for a, b in zip(got["none"], got["zeros"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rank_layouts_take_lists_and_reuse_equal_layouts():
    """Layouts are cached per description (their spans are computed once), whatever sequence type describes it."""
    a = rank_layouts([0, 5, 100, 130], 1, [40, 50, 40])
    assert a is rank_layouts((0, 5, 100, 130), 1, (40, 50, 40))
    assert [lay.num_tokens for lay in a] == [40, 50, 40] and a[1].through


@pytest.mark.parametrize("parallel_pieces", [True, False])
def test_through_rank_runs_its_pass_in_pieces_only_where_the_backend_gains(parallel_pieces):
    """One sequence over three ranks of 200 tokens (four 64-token chunks each): the through rank's pass
    after the message runs over its summary's pieces (the torch backend cuts a segment in two) where the
    backend says its state kernel gains from it, else along the whole rank."""
    log: list = []
    lengths = (200, 200, 200)
    plan = CPPlan(rank=1, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=lengths, rank_layouts=rank_layouts(None, 1, lengths))
    backend = RecordingBackend(log)
    backend.parallel_pieces = parallel_pieces
    args = make_kda_inputs(1, 200, 1, 1, 16, 16, gate="plain", requires_grad=False, seed=1)
    RankRole(plan, backend, KDAInputs(**args)).forward(RecordingExchange(log))
    passes = [span for stage, span in backend.spans if stage == "state_pass"]
    assert len(passes) == 1 and (passes[0].start, passes[0].end) == (0, 200)
    assert passes[0].cu_seqlens == ((0, 128, 200) if parallel_pieces else (0, 200))


def test_a_rank_of_several_positions_sends_first_and_runs_one_launch_set():
    """Zigzag over 3 ranks, one sequence of 240 tokens (40-token chunks): rank 0 holds the chain's ends, rank 1
    two through positions, rank 2 one range (the contiguous schedule). A rank of several positions makes its
    messages first (rank 0: the pass over its first range only; rank 1: the summary of both ranges), sends,
    blocks, then runs one state pass and one output over all of its tokens; backward the local work, the
    gradient summary (rank 0: over its last range, the only one that receives; rank 1: both), the send, the block,
    one gradient pass and the input gradients."""
    from kdacp.cp.layout import zigzag_layout
    from kdacp.cp.plan import layout_rank_layouts
    layout = zigzag_layout(240, 3)
    layouts = layout_rank_layouts(None, 1, layout)
    assert [lay.positions for lay in layouts] == [(0, 4), (1, 3), (2,)]
    for rank, made, summed in ((0, ("state_pass", (0, 40)), (40, 80)), (1, ("state_summary", (0, 80)), (0, 80))):
        log: list = []
        plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                      local_lengths=layout.local_lengths, layout=layout)
        args = make_kda_inputs(1, 80, 1, 1, 16, 16, gate="plain", requires_grad=False, seed=rank)
        role = RankRole(plan, RecordingBackend(log), KDAInputs(**args))
        fwd = role.forward(RecordingExchange(log))
        whole = (0, 80)
        assert log == [("begin", None), ("prepare", whole), made, ("send", None), ("receive", None),
                       ("state_pass", whole), ("output", whole)], log
        log.clear()
        role.backward(fwd, torch.randn_like(fwd.o), exchange=RecordingExchange(log))
        assert log == [("begin", None), ("backward_local", whole), ("state_gradient_summary", summed),
                       ("send", None), ("receive", None), ("backward_states", whole),
                       ("backward_inputs", whole)], log


def test_a_rank_of_several_positions_keeps_its_state_pass_for_the_backward():
    """A rank of several positions sends its backward's messages after its local pass, so that pass starts from
    the states its forward kept (a through rank's rule) rather than running the state pass again: the forward's
    whole-rank state pass is what ``backward_local`` receives. Fails when the forward keeps nothing."""
    from kdacp.cp.layout import zigzag_layout

    class Capturing(RecordingBackend):
        def __init__(self, log):
            super().__init__(log)
            self.passes, self.given = [], []

        def state_pass(self, chunks, span, initial_state, output_final_state):
            states = self.inner.state_pass(chunks, span, initial_state, output_final_state)
            self.passes.append(((span.start, span.end), states))
            return states

        def backward_local(self, saved, span, do, initial_state, states=None):
            self.given.append(states)
            return self.inner.backward_local(saved, span, do, initial_state, states)

    layout = zigzag_layout(240, 3)
    for rank in (0, 1):
        backend = Capturing([])
        plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                      local_lengths=layout.local_lengths, layout=layout)
        role = RankRole(plan, backend, KDAInputs(**make_kda_inputs(1, 80, 1, 1, 16, 16, gate="plain",
                                                                    requires_grad=False, seed=rank)))
        fwd = role.forward(StandInExchange())
        role.backward(fwd, torch.randn_like(fwd.o), exchange=StandInExchange())
        whole_pass = [states for span, states in backend.passes if span == (0, 80)]
        assert len(whole_pass) == 1 and backend.given == whole_pass, (rank, backend.passes, backend.given)


def test_rows_with_incoming_takes_each_position_s_rows_in_order():
    """A rank's entering states joined in one ``cat``: each segment that takes a value gets the next row of its
    position's message (runs of one position as one slice, a message taken whole as itself), the others their
    given row or zeros; every row as the one-row-at-a-time join gives it, and ``None`` where nothing enters."""
    from kdacp.cp.schedule import _rows_with_incoming, _state_rows
    gen = torch.Generator().manual_seed(5)
    incoming = {3: torch.randn(2, 2, 4, 3, generator=gen), 5: torch.randn(1, 2, 4, 3, generator=gen),
                8: torch.randn(3, 2, 4, 3, generator=gen)}
    given = torch.randn(4, 2, 4, 3, generator=gen)
    cases = [  # (takes, positions, other)
        ([True, True, False, True, True, True, True], [3, 3, 0, 5, 8, 8, 8],
         [None, None, given[1], None, None, None, None]),                               # runs of one position
        ([True, False, True, True], [8, 0, 8, 8], [None, None, None, None]),           # a position's rows apart
        ([False, True, False], [0, 5, 0], [given[0], None, None]),                       # a zero row among them
        ([True], [5], [None]),                                                           # one message, whole
    ]
    for takes, positions, other in cases:
        seen, naive = {}, []
        for take, p, row in zip(takes, positions, other):
            if take:
                naive.append(incoming[p][seen.get(p, 0)])
                seen[p] = seen.get(p, 0) + 1
            else:
                naive.append(row)
        assert torch.equal(_rows_with_incoming(takes, positions, incoming, other), _state_rows(naive))
    assert _rows_with_incoming([False, False], [0, 0], incoming, [None, None]) is None
    assert torch.equal(_rows_with_incoming([False], [0], incoming, [given[2]]), given[2:3])
