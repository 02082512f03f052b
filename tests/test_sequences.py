"""``kdacp.sequences``: the one description of a batch's sequences that the reference, the kernels and
the layers read."""
import pytest
import torch

from kdacp.sequences import sequence_bounds, sequence_positions


def test_bounds_of_rows_and_of_packed_sequences():
    assert sequence_bounds(3, 5) == ((0, 0, 5), (1, 0, 5), (2, 0, 5))
    assert sequence_bounds(1, 12, torch.tensor([0, 3, 10, 12])) == ((0, 0, 3), (0, 3, 10), (0, 10, 12))


@pytest.mark.parametrize("B, cu, error, match", [
    (1, torch.tensor([0, 5, 5, 12]), ValueError, "strictly increasing"),
    (1, torch.tensor([0, 5, 11]), ValueError, r"cu_seqlens\[-1\] must equal T=12"),
    (2, torch.tensor([0, 12]), ValueError, "B must be 1"),
    (1, torch.tensor([0.0, 12.0]), TypeError, "int64"),
    (1, [0, 12], TypeError, "torch.Tensor"),
])
def test_bad_boundaries_name_cu_seqlens(B, cu, error, match):
    with pytest.raises(error, match=match):
        sequence_bounds(B, 12, cu)


def test_positions_restart_at_each_boundary():
    cu = torch.tensor([0, 11, 14, 20])
    assert sequence_positions(cu, 9, 7).tolist() == [9, 10, 0, 1, 2, 0, 1]
    assert sequence_positions(cu, 0, 20).tolist() == [*range(11), 0, 1, 2, *range(6)]
