"""State-summary identities, with hypothesis choosing the split points."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdacp.reference import (apply_state_gradient_summary, apply_state_summary, chunk_dv_local,
                             chunk_kda_intermediates, compose_state_summaries, state_gradient_summary,
                             state_summary, transition)
from tests.helpers import make_kda_inputs, rel_err

HV, K, V, C = 2, 16, 8, 16
SCALE = K ** -0.5


def _segment(args, s, e):
    return {n: (x[:, s:e] if n in ("q", "k", "v", "g", "beta") else x) for n, x in args.items()}


def _summary(args, s, e):
    inter = chunk_kda_intermediates(**_segment(args, s, e), chunk_size=C)
    return state_summary(inter.kg, inter.w, inter.u, inter.gc, chunk_size=C), inter


splits = st.integers(2, 120).flatmap(lambda T: st.tuples(st.just(T), st.integers(1, T - 1)))


@settings(max_examples=15, deadline=None)
@given(splits, st.sampled_from(["plain", "safe"]), st.integers(0, 2**31 - 1))
def test_apply_and_compose(split, gate, seed):
    T, cut = split
    args = make_kda_inputs(1, T, 1, HV, K, V, gate=gate, requires_grad=False, seed=seed)
    S_in = torch.randn(1, HV, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    whole, _ = _summary(args, 0, T)
    first, _ = _summary(args, 0, cut)
    second, _ = _summary(args, cut, T)
    ref = chunk_kda_intermediates(**args, initial_state=S_in, chunk_size=C).final_state
    assert rel_err(apply_state_summary(*whole, S_in), ref) < 1e-10
    composed = compose_state_summaries(first, second)
    assert rel_err(composed.offset, whole.offset) < 1e-10
    assert rel_err(composed.transition, whole.transition) < 1e-10
    # Applying the pieces one after the other is the same as the whole.
    assert rel_err(apply_state_summary(*second, apply_state_summary(*first, S_in)), ref) < 1e-10
    M = transition(*( _summary(args, 0, T)[1].__dict__[n] for n in ("kg", "w", "gc")), chunk_size=C)
    assert rel_err(M, whole.transition) < 1e-12


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 120), st.sampled_from(["plain", "default"]), st.integers(0, 2**31 - 1))
def test_gradient_summary_matches_autograd(T, gate, seed):
    gen = torch.Generator().manual_seed(seed)
    args = make_kda_inputs(1, T, 1, HV, K, V, gate=gate, requires_grad=False, seed=seed)
    S_in = torch.randn(1, HV, K, V, dtype=torch.float64, generator=gen).requires_grad_()
    inter = chunk_kda_intermediates(**args, initial_state=S_in, chunk_size=C)
    do = torch.randn(inter.o.shape, dtype=torch.float64, generator=gen)
    dS_out = torch.randn(S_in.shape, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        dv = chunk_dv_local(inter.Aqk, do, SCALE, chunk_size=C)
        G = state_gradient_summary(inter.qg, inter.kg, inter.w, inter.gc, do, dv, SCALE, chunk_size=C)
        M = state_summary(inter.kg, inter.w, inter.u, inter.gc, chunk_size=C).transition
    (g_zero,) = torch.autograd.grad((inter.o * do).sum(), S_in, retain_graph=True)
    assert rel_err(G, g_zero) < 1e-10
    (g_full,) = torch.autograd.grad((inter.o * do).sum() + (inter.final_state * dS_out).sum(), S_in)
    assert rel_err(apply_state_gradient_summary(G, M, dS_out), g_full) < 1e-10


def test_packed_summaries_are_per_sequence():
    cu = torch.tensor([0, 10, 50, 90])
    args = make_kda_inputs(1, 90, 1, HV, K, V, cu_seqlens=cu, requires_grad=False, seed=7)
    inter = chunk_kda_intermediates(**args, chunk_size=C)
    S, M = state_summary(inter.kg, inter.w, inter.u, inter.gc, chunk_size=C, cu_seqlens=cu)
    assert S.shape == (3, HV, K, V) and M.shape == (3, HV, K, K)
    assert rel_err(S, inter.final_state) < 1e-12
    for n in range(3):
        alone, _ = _summary({k: v for k, v in args.items() if k != "cu_seqlens"}, int(cu[n]), int(cu[n + 1]))
        assert rel_err(M[n], alone.transition[0]) < 1e-12


def test_summaries_are_float32_for_low_precision_inputs():
    args = make_kda_inputs(1, 40, 1, HV, K, V, requires_grad=False, seed=2, dtype=torch.bfloat16)
    inter = chunk_kda_intermediates(**args, chunk_size=C)
    S, M = state_summary(inter.kg.bfloat16(), inter.w.bfloat16(), inter.u.bfloat16(), inter.gc, chunk_size=C)
    assert S.dtype == M.dtype == torch.float32
    assert apply_state_summary(S.bfloat16(), M.bfloat16(), S.bfloat16()).dtype == torch.float32
