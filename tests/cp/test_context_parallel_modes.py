"""``ContextParallel``'s modes as the README writes them: ``hybrid`` without ``ulysses_size`` takes the smallest
divisor of the group size, and refuses a group size with none by name."""
import pytest

from kdacp.cp.context import hybrid_ulysses_size
from tests.multiprocess import run_ranks


def test_hybrid_ulysses_size_is_the_smallest_proper_divisor():
    assert [hybrid_ulysses_size(P) for P in (2, 3, 4, 6, 8, 9)] == [None, None, 2, 2, 2, 3]


def _hybrid(rank, world_size):
    import torch.distributed as dist

    import kdacp
    if world_size == 4:
        cp = kdacp.ContextParallel("hybrid")
        assert cp.ulysses_size == 2 and cp.state_size == 2
    else:
        with pytest.raises(ValueError, match="hybrid mode needs 1 < ulysses_size < P"):
            kdacp.ContextParallel("hybrid")
    dist.barrier()  # no rank leaves while another still connects the subgroups


@pytest.mark.parametrize("world_size", [3, 4])
def test_hybrid_mode_picks_its_ulysses_size(world_size):
    run_ranks(_hybrid, world_size)
