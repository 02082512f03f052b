"""Virtual ranks: every strategy's order of composition keeps the incoming states as accurate at many
ranks as at two (float64 summaries rounded to float32 on the wire, as ranks send them)."""
import pytest

from kdacp.bench.virtual import STRATEGY_ORDERS, run


def test_error_does_not_grow_with_ranks():
    rows = run(world_sizes=(2, 5, 16), HV=1, K=8, V=8)
    first, last = rows[0], rows[-1]
    for s in STRATEGY_ORDERS:
        # float32 messages: errors at float32 rounding, not growing with P
        assert 0 < last[f"{s}_state_err"] < 1e-6 and last[f"{s}_output_err"] < 1e-6, s
        assert last[f"{s}_state_err"] <= 2 * first[f"{s}_state_err"], s


def test_bad_tokens_per_rank():
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        run(world_sizes=(2,), tokens_per_rank=10)
