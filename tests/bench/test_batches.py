"""The benchmark batches: lengths add up, are deterministic, and shard at the rank edges."""
import pytest

from kdacp.bench.batches import DOCS_7, cu_seqlens_of, document_lengths, local_cu_seqlens


def test_document_lengths():
    assert document_lengths("one_sequence", 100) == (100,)
    assert document_lengths("docs7", 32768) == DOCS_7
    assert document_lengths("docs7", 65536) == DOCS_7 * 2
    a, b = document_lengths("lognormal", 65536, seed=3), document_lengths("lognormal", 65536, seed=3)
    assert a == b and sum(a) == 65536 and min(a) >= 1 and len(a) > 5
    assert document_lengths("lognormal", 65536, seed=4) != a
    with pytest.raises(ValueError, match="batch must be one of"):
        document_lengths("nope", 10)


def test_local_cu_seqlens_cut_documents_at_the_edges():
    cu = cu_seqlens_of(DOCS_7)
    assert cu[:3] == [0, 7777, 10777] and cu[-1] == 32768
    assert local_cu_seqlens(cu, 0, 16384) == [0, 7777, 10777, 16384]
    assert local_cu_seqlens(cu, 16384, 32768) == [0, 6393, 6906, 7906, 8906, 16384]


@pytest.mark.parametrize("total", [7, 64, 128, 512, 16384, 32767])
def test_batches_hold_their_documents_at_small_sizes(total):
    """The layer suite on CPU runs 512-token batches: docs7 once held one document there (one 512-token cut
    of its first), and lognormal one too (its median was 2048)."""
    docs7 = document_lengths("docs7", total)
    assert len(docs7) == 7 and sum(docs7) == total and min(docs7) >= 1
    # the proportions of DOCS_7, to the rounding and the one token each keeps
    assert max(abs(n / total - d / sum(DOCS_7)) for n, d in zip(docs7, DOCS_7)) <= 5 / total
    lognormal = document_lengths("lognormal", total)
    assert sum(lognormal) == total and (len(lognormal) >= 4 or total < 64)
    with pytest.raises(ValueError, match="7 documents need at least 7 tokens"):
        document_lengths("docs7", 6)
