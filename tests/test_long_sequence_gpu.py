"""One sequence of 1M tokens on one GPU, cut into virtual ranks: the incoming state of the last
virtual rank, formed from the other ranks' summaries (``S_out = M S_in + S_ext``, float32 messages)
as ``chunk_kda`` forms it, then the last rank's pass; at the safe gate's two extremes (every decay
at the lower bound -5, and decays near 0, where the state forgets least).

The final state is held to the float64 reference of the same bf16 inputs (run piece by piece, the
state carried in float64): context parallelism must be no further from it than FLA's own unsplit
pass, whose bf16 intermediate ``v_new`` costs it about 2e-3 when decays near 0 keep the whole
history. The last rank's outputs are compared with the unsplit pass's.

Run on the GPU machine; at 8 heads it needs about 40 GB."""
import functools

import pytest
import torch

from kdacp.backends.base import KDAInputs, KDAOptions, Span
from kdacp.ops.kda import chunk_kda
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


SETTINGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)


def float64_final_state(x: dict, piece: int = 1 << 15) -> torch.Tensor:
    """The reference's final state ``[1, HV, K, V]`` (float64) of inputs ``x`` (one sequence), run
    ``piece`` tokens at a time with the state carried in float64 (memory: one piece's intermediates)."""
    from kdacp import reference as ref
    T = x["q"].shape[1]
    state = None
    for start in range(0, T, piece):
        cut = slice(start, min(start + piece, T))
        _, state = ref.chunk_kda(*(x[n][:, cut].double() for n in ("q", "k", "v", "g", "beta")),
                                 initial_state=state, output_final_state=True, A_log=x["A_log"].double(),
                                 dt_bias=x["dt_bias"].double(), **SETTINGS)
    return state


@functools.cache
def _truth(gate_logit: float) -> torch.Tensor:
    return float64_final_state(_inputs(gate_logit))


@pytest.mark.parametrize("gate_logit", [20.0, -20.0], ids=["decay_at_lower_bound", "decay_near_zero"])
@pytest.mark.parametrize("P", [2, 8])
def test_million_tokens_virtual_ranks(P, gate_logit):
    from kdacp.backends import make_backend
    from kdacp.backends.fla_adapter import fla_available
    if not fla_available():
        pytest.skip("fla-core 0.6.0 is not installed")
    x = _inputs(gate_logit)
    settings = dict(SETTINGS, safe_gate=True)
    with torch.no_grad():
        # split=None: this test is about the exchange's error (the split's own: tests/cp/test_split_gpu.py)
        o_ref, final_ref = chunk_kda(**x, output_final_state=True, backend="fla", split=None, **settings)
        backend = make_backend("fla", KDAOptions(scale=K ** -0.5, **settings))
        n = T // P
        state = None
        for r in range(P - 1):  # what each rank sends: its summary applied to the incoming state
            cut = slice(r * n, (r + 1) * n)
            inputs = KDAInputs(*(x[name][:, cut] for name in ("q", "k", "v", "g", "beta")), x["A_log"], x["dt_bias"])
            span = Span(0, n, (0, n))
            summary = backend.state_summary(backend.prepare(inputs, span), span, with_transition=True)
            state = summary.offset if state is None else summary.offset + summary.transition @ state
        last = slice((P - 1) * n, T)
        o_last, final = chunk_kda(**{name: t[:, last] if t.dim() > 1 else t for name, t in x.items()},
                                  initial_state=state, output_final_state=True, backend="fla", split=None,
                                  **settings)
    truth = _truth(gate_logit)
    e_cp, e_fla, e_out = rel_err(final, truth), rel_err(final_ref, truth), rel_err(o_last, o_ref[:, last])
    print(f"1M tokens, P={P}, gate logit {gate_logit}: final state against float64: virtual ranks {e_cp:.2e}, "
          f"FLA unsplit {e_fla:.2e}; last rank's outputs against FLA unsplit {e_out:.2e}")
    assert torch.isfinite(final).all() and torch.isfinite(o_last).all()
    assert e_cp <= 1.1 * e_fla + 1e-5 and e_cp < 5e-3, (e_cp, e_fla)
    assert e_out < 1e-2, e_out  # bf16 outputs round at 4e-3
