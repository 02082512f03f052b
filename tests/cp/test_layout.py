"""Token layouts: coverage, chain order, built-ins, and the refusals of bad ranges."""
import pytest
import torch

from kdacp.bench.batches import cu_seqlens_of, document_lengths
from kdacp.bench.hybrid_model import attention_balance
from kdacp.cp.layout import (balanced_document_layout, causal_pairs, contiguous_layout,
                             document_zigzag_layout, make_layout, ranges_layout, zigzag_layout)


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


def _holders(layout, a, b):
    """The ranks holding tokens of ``[a, b)``."""
    return {r for r, rs in enumerate(layout.ranges) for s, e in rs if s < b and a < e}


@pytest.mark.parametrize("P", [2, 3, 8])
def test_balanced_documents_cut_long_ones_per_document_and_keep_short_ones_whole(P):
    # long documents (>= whole_below) of every rounding, short ones of one token up to just under the bar
    cu = cu_seqlens_of([1, 70 * P + 3, 5, 39, 2, 64 * P, 17, 3, 41, 1, 100 * P + 1, 11, 40, 6, 9])
    lay = balanced_document_layout(cu, P, whole_below=42)
    assert torch.equal(_covered(lay), torch.arange(cu[-1]))
    shares = sorted(lay.local_lengths)
    assert shares[-1] - shares[0] <= 1, lay.local_lengths  # level, up to the total's remainder
    zz = document_zigzag_layout(cu, P)
    cut_short = 0
    for a, b in zip(cu[:-1], cu[1:]):
        if b - a >= 42:  # each rank holds its two zigzag chunks of a long document
            for r in range(P):
                mine = [(max(s, a), min(e, b)) for s, e in zz.ranges[r] if s < b and a < e]
                assert mine
                assert all(any(s2 <= s and e <= e2 for s2, e2 in lay.ranges[r]) for s, e in mine), (a, b, r)
                held = sum(max(0, min(e, b) - max(s, a)) for s, e in lay.ranges[r])
                assert held == sum(e - s for s, e in mine), (a, b, r)  # and nothing else of it
        else:
            cut_short += len(_holders(lay, a, b)) > 1
    assert cut_short <= P - 1  # only the fill of the ranks' last room cuts a short document


def test_balanced_documents_level_attention_with_fewer_state_passing_pieces():
    """Log-normal documents over 8 ranks: attention pairs within 4% of level, where contiguous ranks are 1.5x
    apart and the greedy placement matters (short documents placed in stream order leave 1.05-1.06), with
    under a third of per-document zigzag's pieces that receive a state."""
    P = 8
    for seed in range(3):
        cu = cu_seqlens_of(document_lengths("lognormal", 16384 * P, seed=seed))
        lay = balanced_document_layout(cu, P)
        assert attention_balance(lay, cu) < 1.04, seed
        assert attention_balance(contiguous_layout(cu[-1], P), cu) > 1.5, seed
        starts = set(cu)
        receiving = max(sum(s not in starts for s, _ in rs) for rs in lay.ranges)
        zz = max(sum(s not in starts for s, _ in rs) for rs in document_zigzag_layout(cu, P).ranges)
        assert 3 * receiving < zz, (seed, receiving, zz)


def test_causal_pairs_count_each_query_s_keys_in_its_document():
    cu = [0, 3, 10]
    assert causal_pairs([(0, 10)], cu) == 1 + 2 + 3 + sum(range(1, 8))
    assert causal_pairs([(1, 5)], cu) == 2 + 3 + 1 + 2
    assert causal_pairs([(0, 2), (8, 10)], cu) == 1 + 2 + 6 + 7


def test_balanced_documents_refuse_bad_arguments_by_name():
    with pytest.raises(ValueError, match="whole_below must be a positive int"):
        balanced_document_layout([0, 4, 8], 2, whole_below=0)
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        balanced_document_layout([0, 4, 4, 8], 2)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        balanced_document_layout([0, 8], 0)


def test_balanced_documents_all_long_is_document_zigzag_with_its_uneven_rounding():
    cu = [0, 7, 20, 33]  # chunks of 7 and 13 tokens over 2P = 4 and 6 differ by a token
    for P in (2, 3):
        assert balanced_document_layout(cu, P, whole_below=1).ranges == document_zigzag_layout(cu, P).ranges
