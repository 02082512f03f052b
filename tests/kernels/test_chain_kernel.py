"""The chain kernel (:mod:`kdacp.affine.chain`) under the Triton interpreter against the float64 chain of
:func:`kdacp.affine.chain_states`: both directions, with and without incoming states, a masked column tile."""
from __future__ import annotations

import pytest
import torch

from kdacp.affine import AffineMap, chain_states
from kdacp.affine.chain import chain_states as chain_kernel


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_initial", [False, True])
@pytest.mark.parametrize("block_v", [None, 16])  # 16: two column tiles, the second partial
def test_chain_kernel_matches_float64(reverse, with_initial, block_v):
    gen = torch.Generator().manual_seed(7 + reverse + 2 * with_initial)
    counts = (3, 1, 4)
    NW, HV, K, V = sum(counts), 2, 16, 24  # V = 24: a partial column tile of 32
    S = torch.randn(NW, HV, K, V, generator=gen)
    M = torch.randn(NW, HV, K, K, generator=gen) * 0.3
    x0 = torch.randn(len(counts), HV, K, V, generator=gen) if with_initial else None
    seqs = torch.tensor([(0, 3), (3, 1), (4, 4)], dtype=torch.int64)
    entries, out = chain_kernel(S, M, seqs, x0, reverse, block_v=block_v)
    want_entries, want_out = chain_states(AffineMap(S.double(), M.double()), counts,
                                          None if x0 is None else x0.double(), reverse)
    torch.testing.assert_close(entries.double(), want_entries, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)


def test_chain_kernel_refuses_mismatched_transitions():
    with pytest.raises(ValueError, match="transitions must have shape"):
        chain_kernel(torch.zeros(3, 1, 16, 16), torch.zeros(2, 1, 16, 16), torch.tensor([(0, 3)]), None, False)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        chain_kernel(torch.zeros(3, 1, 16, 16), torch.zeros(3, 1, 16, 16), torch.tensor([(0, 3)]), None, False,
                     block_v=24)
