"""One sequence of 1M tokens on one GPU, cut into virtual ranks: the incoming state of the last
virtual rank, formed from the other ranks' summaries (``S_out = M S_in + S_ext``, float32 messages)
as ``cp_chunk_kda`` forms it, against one unsplit pass with float32 states; at the safe gate's two
extremes (every decay at the lower bound -5, and decays near 0, where the state forgets least).

Run on the GPU machine; at 8 heads it needs about 40 GB."""
import pytest
import torch

from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.kda import chunk_kda
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, H, K, V = 1 << 20, 8, 128, 128


def _inputs(gate_logit: float) -> dict:
    gen = torch.Generator("cuda").manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    # Safe gate g = -5 sigmoid(exp(A_log) (logit + dt_bias)): a large logit puts every decay at the
    # lower bound, a very negative one near 0.
    return dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, V),
                g=(gate_logit + rnd(1, T, H, K)).to(torch.bfloat16),
                beta=torch.rand(1, T, H, generator=gen, device="cuda").to(torch.bfloat16),
                A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(H * K, device="cuda"))


@pytest.mark.parametrize("gate_logit", [20.0, -20.0], ids=["decay_at_lower_bound", "decay_near_zero"])
@pytest.mark.parametrize("P", [2, 8])
def test_million_tokens_virtual_ranks(P, gate_logit):
    from kdacp.backends import make_backend
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    x = _inputs(gate_logit)
    settings = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True)
    with torch.no_grad():
        o_ref, final_ref = chunk_kda(**x, output_final_state=True, backend="fla", **settings)
        backend = make_backend("fla", KDAOptions(scale=K ** -0.5, **settings))
        n = T // P
        state = None
        for r in range(P - 1):  # what each rank sends: its summary applied to the incoming state
            cut = slice(r * n, (r + 1) * n)
            inputs = KDAInputs(*(x[name][:, cut] for name in ("q", "k", "v", "g", "beta")), x["A_log"], x["dt_bias"])
            span = Span(0, n, (0, n))
            summary = backend.state_summary(backend.prepare(inputs, span), span, with_transition=True)
            state = summary.state if state is None else summary.state + summary.transition @ state
        last = slice((P - 1) * n, T)
        o_last, final = chunk_kda(**{name: t[:, last] if t.dim() > 1 else t for name, t in x.items()},
                                  initial_state=state, output_final_state=True, backend="fla", **settings)
    e_state, e_out = rel_err(final, final_ref), rel_err(o_last, o_ref[:, last])
    print(f"1M tokens, P={P}, gate logit {gate_logit}: final state {e_state:.2e}, last rank's outputs {e_out:.2e}")
    assert torch.isfinite(final).all() and torch.isfinite(o_last).all()
    # bf16 outputs round at 4e-3; the states stay float32 all the way
    assert e_state < 1e-3 and e_out < 1e-2, (e_state, e_out)
