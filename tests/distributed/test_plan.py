"""Partition layouts of :class:`CPPlan` (no process group needed)."""
from kdacp.distributed.plan import CPPlan, LocalSegment


def _plan(cu=None, lengths=None, batch_size=1, world_size=3):
    return CPPlan(rank=0, world_size=world_size, group=None, strategy="p2p", batch_size=batch_size,
                  cu_seqlens=cu, local_lengths=lengths)


def test_packed_layout_cuts_sequences_at_rank_boundaries():
    layouts = _plan(cu=(0, 5, 100, 130), lengths=(40, 50, 40)).layouts(40)
    assert layouts[0].segments == (LocalSegment(0, 0, 5, False, False, 0), LocalSegment(1, 5, 40, False, True, 0))
    assert layouts[1].segments == (LocalSegment(1, 0, 50, True, True, 1),)
    assert layouts[2].segments == (LocalSegment(1, 0, 10, True, False, 2), LocalSegment(2, 10, 40, False, False, 2))
    assert [lay.through for lay in layouts] == [False, True, False]
    assert layouts[2].head_end == 10 and layouts[2].tail_start == 40 and layouts[0].tail_start == 5
    assert layouts[2].cu_seqlens(0, 40) == [0, 10, 40] and layouts[2].cu_seqlens(10, 40) == [0, 30]


def test_batch_rows_and_open_equal_split():
    plan = _plan(batch_size=2)
    layouts = plan.layouts(7)  # T_local read from the call
    assert layouts[1].segments == (LocalSegment(0, 0, 7, True, True, 1), LocalSegment(1, 7, 14, True, True, 1))
    assert layouts[0].num_send == 2 and layouts[0].num_receive == 0 and layouts[2].num_send == 0


def test_signature_depends_on_the_global_description():
    assert _plan(cu=(0, 9)).signature != _plan(cu=(0, 10)).signature
    assert _plan(cu=(0, 9)).signature == _plan(cu=(0, 9)).signature


def test_named_spans_mean_the_same_tokens_in_both_directions():
    from kdacp.backends.base import Span
    from kdacp.distributed.plan import rank_layouts
    first, middle, last = rank_layouts((0, 5, 100, 130), 1, (40, 50, 40))
    assert first.head.empty and first.tail == Span(5, 40, (0, 35)) and first.after_head == Span(0, 40, (0, 5, 40))
    assert first.after_head == first.whole == Span(0, 40, (0, 5, 40))
    assert middle.through and middle.head == middle.tail == middle.whole == Span(0, 50, (0, 50))
    assert last.head == Span(0, 10, (0, 10)) and last.after_head == Span(10, 40, (0, 30)) and last.tail.empty
    plan = _plan(cu=(0, 5, 100, 130), lengths=(40, 50, 40))
    assert plan.layouts(40) == (first, middle, last)
