"""attention-gym's CP stages beside kdacp's (:mod:`kdacp.bench.attn_gym_cp`): refused by name where it cannot
run; on a Hopper GPU with attention-gym installed, a through rank's output and forward summary agree with FLA's
op from the same incoming state (bf16 noise), for KDA and GDN, one sequence and packed."""
from __future__ import annotations

import pytest
import torch

from kdacp.bench import attn_gym_cp


def test_refused_by_name_without_gpu():
    reason = attn_gym_cp.unavailable(torch.device("cpu"))
    assert reason is not None and "CUDA GPU" in reason
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        attn_gym_cp.run(device="cpu")


def test_unknown_family_named():
    if attn_gym_cp.unavailable(torch.device("cuda")) is not None:
        pytest.skip("needs attention-gym on a Hopper GPU")
    with pytest.raises(ValueError, match="families"):
        attn_gym_cp.run(families=("mamba",))


@pytest.mark.gpu
@pytest.mark.parametrize("family", attn_gym_cp.FAMILIES)
@pytest.mark.parametrize("batch", ["one_sequence", "lognormal"])
def test_through_rank_matches_fla(family, batch):
    if attn_gym_cp.unavailable(torch.device("cuda")) is not None:
        pytest.skip(attn_gym_cp.unavailable(torch.device("cuda")))
    (row,) = attn_gym_cp.through_rank_rows(family, batch, 2048, 4, 128, torch.device("cuda"), 0, 1, 1)
    assert row["receives"] and row["sends"]
    assert row["o_err"] < 1e-2, row
    assert row["summary_err"] < 1e-2, row
