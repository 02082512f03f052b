"""The chunked WY form equals the token-by-token oracle: outputs, final states, every gradient."""
import itertools

import pytest
import torch

from kdacp.reference import chunk_kda, chunk_kda_intermediates, recurrent_kda
from tests.helpers import differentiable_inputs, make_kda_inputs, random_cu_seqlens, rel_err

GATES = ("plain", "default", "safe")
CASES = [
    (T, HV, KV, varlen, GATES[i % 3], bool((i // 3) % 2))
    for i, (T, HV, KV, varlen) in enumerate(itertools.product((1, 63, 64, 65, 200), (2, 4), ((64, 64), (32, 48)), (False, True)))
]


def _run_both(args, seed):
    torch.manual_seed(seed)
    outs = {}
    for name, fn in (("recurrent", recurrent_kda), ("chunk", chunk_kda)):
        o, s = fn(**args, output_final_state=True)
        do, ds = torch.randn_like(o), torch.randn_like(s)
        leaves = differentiable_inputs(args)
        grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), list(leaves.values()))
        outs[name] = (o, s, dict(zip(leaves, grads)))
        torch.manual_seed(seed)  # same dO, dS for both
    return outs


def _check(outs, tol):
    (o1, s1, g1), (o2, s2, g2) = outs["recurrent"], outs["chunk"]
    assert rel_err(o2, o1) < tol
    assert rel_err(s2, s1) < tol
    assert set(g1) == set(g2)
    for name in g1:
        assert rel_err(g2[name], g1[name]) < tol, name


@pytest.mark.parametrize("T,HV,KV,varlen,gate,init", CASES)
def test_chunk_matches_recurrent_float64(T, HV, KV, varlen, gate, init):
    seed = hash((T, HV, KV, varlen, gate, init)) % 2**31
    gen = torch.Generator().manual_seed(seed)
    B = 1 if varlen else 2
    cu = random_cu_seqlens(T, 3, gen) if varlen else None
    args = make_kda_inputs(B, T, 2, HV, *KV, gate=gate, initial_state=init, cu_seqlens=cu, seed=seed)
    _check(_run_both(args, seed), 1e-10)


@pytest.mark.parametrize("T,gate,varlen", [(65, "plain", False), (200, "default", True), (130, "safe", True)])
def test_chunk_matches_recurrent_float32(T, gate, varlen):
    cu = random_cu_seqlens(T, 3, torch.Generator().manual_seed(T)) if varlen else None
    args = make_kda_inputs(1 if varlen else 2, T, 2, 4, 32, 48, dtype=torch.float32, gate=gate,
                           initial_state=True, cu_seqlens=cu, seed=T)
    _check(_run_both(args, T), 1e-5)


def test_partial_chunks_and_chunk_size_do_not_change_results():
    args = make_kda_inputs(1, 150, 2, 2, 16, 8, initial_state=True, requires_grad=False, seed=3)
    o64, s64 = chunk_kda(**args, output_final_state=True)
    o16, s16 = chunk_kda(**args, output_final_state=True, chunk_size=16)
    assert rel_err(o16, o64) < 1e-12 and rel_err(s16, s64) < 1e-12


def test_intermediates_have_documented_shapes():
    cu = torch.tensor([0, 70, 100])
    args = make_kda_inputs(1, 100, 2, 4, 32, 48, cu_seqlens=cu, requires_grad=False, seed=1)
    inter = chunk_kda_intermediates(**args)
    assert inter.gc.shape == inter.qg.shape == inter.kg.shape == inter.w.shape == (1, 100, 4, 32)
    assert inter.u.shape == inter.v_new.shape == inter.o.shape == (1, 100, 4, 48)
    assert inter.Aqk.shape == (1, 100, 4, 64)
    assert inter.h.shape == (1, 3, 4, 32, 48)  # 2 chunks + 1 chunk
    assert inter.final_state.shape == (2, 4, 32, 48)
    # Aqk is lower triangular within each chunk.
    assert torch.all(inter.Aqk[0, 0, :, 1:] == 0) and torch.all(inter.Aqk[0, 70, :, 1:] == 0)
