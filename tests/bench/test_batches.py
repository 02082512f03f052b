"""The benchmark batches: lengths add up, are deterministic, and shard at the rank edges."""
import pytest

from kdacp.bench.batches import DOCS_7, cu_seqlens_of, document_lengths
from kdacp.distributed.plan import local_cu_seqlens


def test_document_lengths():
    assert document_lengths("one_sequence", 100) == (100,)
    assert document_lengths("docs7", 32768) == DOCS_7
    assert document_lengths("docs7", 16384) == (7777, 3000, 5607)
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
