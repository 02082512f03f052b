"""The attention-balance suite at CPU sizes: a rank's split attention calls against the dense document-causal
mask, and the suite's rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdacp.bench import balance
from kdacp.cp.layout import document_zigzag_layout, zigzag_layout


def _dense(q_all, k, v, cu, T):
    """Every token's attention with the dense ``[T, T]`` document-causal mask (the reference)."""
    t = torch.arange(T)
    bounds = torch.tensor(cu)
    doc = torch.searchsorted(bounds, t, right=True)
    mask = (t[None, :] <= t[:, None]) & (doc[None, :] == doc[:, None])
    return F.scaled_dot_product_attention(q_all, k, v, attn_mask=mask)


@pytest.mark.parametrize("P", [2, 3])
def test_rank_attention_is_the_dense_masked_attention(P):
    T = 12 * P
    cu = [0, 5, 5 + 2 * P, T]  # a document shorter than a chunk, one longer than a rank's share
    gen = torch.Generator().manual_seed(P)
    q, k = (torch.randn(1, 2, T, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, T, 6, generator=gen, dtype=torch.float64)
    want = _dense(q, k, v, cu, T)
    for layout, docs in ((zigzag_layout(T, P), None), (zigzag_layout(T, P), cu), (document_zigzag_layout(cu, P), cu)):
        ref = want if docs is not None else _dense(q, k, v, [0, T], T)
        for r in range(P):
            own = layout.local_token_index(r)
            got = balance.rank_attention(q[:, :, own], k, v, layout.ranges[r], docs)
            assert (got - ref[:, :, own]).abs().max() < 1e-12


def test_suite_rows_on_cpu(tmp_path):
    """The balance rows at CPU sizes, and the hybrid suite taking its measured throughput."""
    import statistics

    from kdacp.bench import hybrid
    from kdacp.bench.harness import write_results
    from tests.bench.test_hybrid_model import calibration_json
    rows = balance.run(tokens=64, world_sizes=(2, 4), iters=1, device="cpu")
    bal = {(r["P"], r["layout"]): r for r in rows if r["source"] == "balance"}
    assert set(bal) == {(P, name) for P in (2, 4) for name in balance.LAYOUTS}
    for P in (2, 4):
        assert bal[(P, "zigzag")]["pairs_max_over_mean"] < 1.02
        assert bal[(P, "contiguous")]["pairs_max_over_mean"] > 1.4
        assert all(bal[(P, n)]["time_max_over_mean"] >= 1 and bal[(P, n)]["step_tflops"] > 0 for n in balance.LAYOUTS)
    ranks = [r for r in rows if r["source"] == "rank"]
    assert len(ranks) == 2 * (2 + 4) and all(r["forward_ms"] > 0 and r["step_ms"] > 0 for r in ranks)
    with pytest.raises(ValueError, match="multiple of 2P"):
        balance.run(tokens=60, world_sizes=(8,), device="cpu")
    write_results("balance", rows, tmp_path, context=dict(date="d", device="cpu", gpus=0, torch="t", triton="t",
                                                          commit="c"))
    calibration_json(tmp_path / "scaling.json")
    predicted = hybrid.run(calibration=str(tmp_path / "scaling.json"), balance=str(tmp_path / "balance.json"),
                           tokens=(1024,), world_sizes=(2,), models=("kimi-linear-48b",), device="cpu")
    # the median through the suite's JSON: equal to rounding (a median of an even count averages two floats)
    assert predicted[0]["attention_tflops"] == pytest.approx(statistics.median(r["step_tflops"] for r in bal.values()),
                                                             rel=1e-12)
    with pytest.raises(ValueError, match="not both"):
        hybrid.run(calibration=str(tmp_path / "scaling.json"), balance=str(tmp_path / "balance.json"),
                   attention_tflops=1.0, device="cpu")
