"""Partition layouts of :class:`CPPlan` (no process group needed)."""
from kdacp.cp.plan import CPPlan, LocalSegment


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
    from kdacp.cp.plan import rank_layouts
    first, middle, last = rank_layouts((0, 5, 100, 130), 1, (40, 50, 40))
    assert first.head.empty and first.tail == Span(5, 40, (0, 35)) and first.after_head == Span(0, 40, (0, 5, 40))
    assert first.after_head == first.whole == Span(0, 40, (0, 5, 40))
    assert middle.through and middle.head == middle.tail == middle.whole == Span(0, 50, (0, 50))
    assert last.head == Span(0, 10, (0, 10)) and last.after_head == Span(10, 40, (0, 30)) and last.tail.empty
    plan = _plan(cu=(0, 5, 100, 130), lengths=(40, 50, 40))
    assert plan.layouts(40) == (first, middle, last)


def test_document_zigzag_segments_and_chain_by_hand():
    """Documents [0, 3) and [3, 20) zigzagged over 2 ranks (chunks of 1, 1, 1, 0 and 5, 4, 4, 4 tokens): rank 0
    holds [0, 1), [3, 8), [16, 20); rank 1 [1, 3) and [8, 16) (its adjacent chunks merged). The chain runs
    through the ranges in token order; only [8, 16) lies inside a document on both sides."""
    from kdacp.cp.layout import document_zigzag_layout
    from kdacp.cp.plan import ChainLink, chain_links, layout_rank_layouts
    layout = document_zigzag_layout([0, 3, 20], 2)
    assert layout.ranges == (((0, 1), (3, 8), (16, 20)), ((1, 3), (8, 16)))
    first, second = layout_rank_layouts((0, 3, 20), 1, layout)
    assert first.segments == (LocalSegment(0, 0, 1, False, True, 0), LocalSegment(1, 1, 6, False, True, 2),
                              LocalSegment(1, 6, 10, True, False, 4))
    assert second.segments == (LocalSegment(0, 0, 2, True, False, 1), LocalSegment(1, 2, 10, True, True, 3))
    assert first.positions == (0, 2, 4) and second.positions == (1, 3)
    assert chain_links((first, second)) == (ChainLink(0, 1, 0, False), ChainLink(1, 0, 1, False),
                                            ChainLink(0, 1, 0, False), ChainLink(1, 1, 1, True),
                                            ChainLink(0, 0, 1, False))
    # batch rows: the layout applies to each row, the rows' segments one after the other
    rows = layout_rank_layouts(None, 2, layout)[1]
    assert [(s.sequence, s.start, s.end, s.position) for s in rows.segments] == [
        (0, 0, 2, 1), (0, 2, 10, 3), (1, 10, 12, 1), (1, 12, 20, 3)]


def test_a_plan_without_a_layout_is_contiguous_and_an_open_split_is_read_from_the_call():
    from kdacp.cp.layout import contiguous_layout, zigzag_layout
    assert _plan(cu=(0, 5, 100, 130), lengths=(40, 50, 40)).layout_for(40) == contiguous_layout(130, 3, (40, 50, 40))
    open_zigzag = CPPlan(rank=0, world_size=3, group=None, strategy="p2p", batch_size=2, cu_seqlens=None,
                         local_lengths=None, layout_name="zigzag")
    assert open_zigzag.layout is None and open_zigzag.layout_for(10) == zigzag_layout(30, 3)
    assert open_zigzag.lengths_for(10) == (10, 10, 10) and open_zigzag.layouts(10)[0].positions == (0, 4)
    assert open_zigzag.signature != _plan(batch_size=2).signature
