"""The kernels suite's GDN case, small and in float32 on the Triton interpreter (no FLA): its float64
truth (the gating included) and our rows."""
import pytest
import torch

from kdacp import reference as ref
from kdacp.bench.kernels import gdn_gated, run_gdn


def test_gdn_gated_matches_the_reference_chunked_form():
    gen = torch.Generator().manual_seed(0)
    T, H, HV, K = 192, 2, 4, 16
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen, dtype=torch.float64))
    it = ref.chunk_kda_intermediates(q, k, torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64),
                                     ref.scalar_gate_as_kda(g, K)[0], torch.rand(1, T, HV, generator=gen,
                                                                                 dtype=torch.float64))
    qg, kg = gdn_gated(q, k, it.gc[..., 0], 64)
    assert torch.allclose(qg, it.qg, rtol=1e-13, atol=0) and torch.allclose(kg, it.kg, rtol=1e-13, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the full-size suite")
def test_gdn_rows_on_the_interpreter():
    rows = run_gdn(T=192, H=1, HV=2, K=64, V=64, dtype=torch.float32, with_fla=False, device="cpu",
                   timing=dict(warmup=0, rounds=1, iters=1))
    errors = {r["kernel"]: [v for c, v in r.items() if c.startswith("err_")] for r in rows}
    assert len(errors) == 10  # both gate forms x (pre-gated, raw) x (S_ext+M, G), S_ext only, the eager gating
    for name, errs in errors.items():
        assert all(e < 1e-6 for e in errs), name
    assert all(r["ms"] > 0 for r in rows)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        run_gdn(T=100, H=1, HV=2, K=64, V=64, with_fla=False, device="cpu")
