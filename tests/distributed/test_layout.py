"""Token layouts: coverage, chain order, built-ins, and the refusals of bad ranges."""
import pytest
import torch

from kdacp.distributed.layout import (contiguous_layout, document_zigzag_layout, make_layout, ranges_layout,
                                      zigzag_layout)


def _covered(layout):
    index = torch.cat([layout.local_token_index(r) for r in range(layout.world_size)])
    return index.sort().values


@pytest.mark.parametrize("P,T", [(1, 8), (2, 16), (3, 25), (4, 64), (3, 5)])
def test_zigzag_covers_once_and_chains_in_order(P, T):
    lay = zigzag_layout(T, P)
    assert torch.equal(_covered(lay), torch.arange(T))
    starts = [p.start for p in lay.chain]
    assert starts == sorted(starts) and lay.chain[-1].end == T
    if T % (2 * P) == 0 and P > 1:
        assert lay.local_lengths == (T // P,) * P
        # chunk order 0 -> 1 -> ... -> P-1 -> P-1 -> ... -> 0 (the middle two merge on rank P-1)
        ranks = [p.rank for p in lay.chain]
        assert ranks == list(range(P)) + list(reversed(range(P - 1)))


def test_zigzag_rank_holds_chunks_r_and_mirror():
    lay = zigzag_layout(16, 4)
    assert lay.ranges[0] == ((0, 2), (14, 16))
    assert lay.ranges[3] == ((6, 10),)  # chunks 3 and 4 are adjacent: one range
    assert not lay.is_contiguous and contiguous_layout(16, 4).is_contiguous


def test_document_zigzag_per_document():
    cu = [0, 8, 11, 20]
    lay = document_zigzag_layout(cu, 2)
    assert torch.equal(_covered(lay), torch.arange(20))
    # document 0 (8 tokens): chunks of 2, rank 0 holds [0, 2) and [6, 8); document 1 (3 tokens): chunks
    # of 1, 1, 1, 0, rank 0 holds [8, 9), which joins [6, 8)
    assert lay.ranges[0][:2] == ((0, 2), (6, 9))
    assert lay.ranges[1][:2] == ((2, 6), (9, 11))
    for r in range(2):
        local = lay.local_cu_seqlens(r, cu)
        assert local[0] == 0 and local[-1] == lay.local_lengths[r]
        assert all(b > a for a, b in zip(local[:-1], local[1:]))


def test_local_cu_seqlens_cuts_documents_at_range_edges():
    lay = ranges_layout([[(0, 3), (7, 10)], [(3, 7)]])
    assert lay.local_cu_seqlens(0, [0, 5, 10]) == [0, 3, 6]
    assert lay.local_cu_seqlens(1, [0, 5, 10]) == [0, 2, 4]
    assert lay.local_cu_seqlens(0) == [0, 3, 6]
    assert lay.owner(8) == (0, 4) and lay.owner(4) == (1, 1)


def test_ranges_merge_adjacent_and_allow_empty_rank():
    lay = ranges_layout([[(0, 2), (2, 5)], [], [(5, 6)]])
    assert lay.ranges == (((0, 5),), (), ((5, 6),))
    assert lay.local_lengths == (5, 0, 1)


@pytest.mark.parametrize("ranges,match", [
    ([[(0, 3)], [(2, 5)]], "overlap"),
    ([[(0, 3)], [(4, 5)]], "gap"),
    ([[(3, 5), (0, 3)]], "ascending"),
    ([[(0, 0)]], "empty"),
    ([[(0, 2.5)]], "ints"),
])
def test_bad_ranges_are_refused_by_name(ranges, match):
    with pytest.raises(ValueError, match=match):
        ranges_layout(ranges)


def test_make_layout_checks_sizes():
    assert make_layout("zigzag", 2, 8) == zigzag_layout(8, 2)
    assert make_layout("document_zigzag", 2, 8, [0, 4, 8]) == document_zigzag_layout([0, 4, 8], 2)
    with pytest.raises(ValueError, match="layout must cover"):
        make_layout(zigzag_layout(8, 2), 2, 16)
    with pytest.raises(ValueError, match="layout must be"):
        make_layout("spiral", 2, 8)
    with pytest.raises(ValueError, match="does not split evenly"):
        contiguous_layout(7, 2)
