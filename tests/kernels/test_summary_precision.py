"""The summary kernels' precision policies (:class:`kdacp.kernels.SummaryPrecision`) on bf16 inputs.

Each policy's error against float64 (on the same bf16 values) must fall in its own band, and the bands
do not overlap: three pieces ~1e-7 (float32 accumulation), two ~3e-6, one ~2e-3 on these inputs, so a
kernel that splits into the wrong number of pieces fails. A one-piece product is further checked
against a float64 emulation of the same rounding (the float32 operand rounded to bf16 before each
product), which it matches to float32 accumulation; two or three pieces are ~1e-3 away from it.
The inputs are random rather than chunked-KDA intermediates: their chunk products are not small next to
the decayed state, so every product's rounding reaches the summaries (on real intermediates two and
three pieces differ by a factor of 2 only, see test_summary_kernels.py).
"""
import pytest
import torch

from kdacp import kernels as kn
from kdacp import reference as ref
from kdacp.kernels.precision import DEFAULT_LOW_PRECISION, SummaryPrecision, resolve_precision
from tests.helpers import rel_err
from tests.kernels.test_summary_kernels import DEVICE, SCALE, gated_from_raw, ref_grad, ref_summary

POLICIES = ("exact", "two_piece", "mixed", "one_piece", "one_piece_forward")
# (lower, upper) bound of the relative error against float64, by bf16 pieces (measured 0.9e-7 .. 1.5e-7,
# 2.8e-6 .. 6.3e-6 and 2.0e-3 .. 4.4e-3 over these inputs and layouts)
BANDS = {3: (0.0, 6e-7), 2: (6e-7, 3e-5), 1: (3e-4, 1e-2)}
EMULATION_TOL = 2e-5  # a one-piece kernel against its float64 emulation (float32 accumulation only)
T, HV, K, V = 200, 2, 64, 64


def _chunk_local(raw: torch.Tensor) -> torch.Tensor:
    """Cumulative sums of ``raw [1, T, ...]`` restarting every 64 tokens (the kernels read chunk-local gates)."""
    out = torch.empty_like(raw)
    for s in range(0, raw.shape[1], 64):
        out[:, s:s + 64] = raw[:, s:s + 64].cumsum(1)
    return out


def synthetic(seed=0, H=None):
    """bf16 kernel inputs (gates float32, ``dv`` float32) and the same values in float64; with ``H`` the
    GDN form: raw ``q, k [1, T, H, K]`` and a scalar gate ``gc [1, T, HV]`` (float64: gated, broadcast)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, amp=1.0):
        return (amp * torch.randn(*shape, generator=gen)).to(DEVICE)

    heads = HV if H is None else H
    low = dict(qg=rnd(1, T, heads, K).bfloat16(), kg=rnd(1, T, heads, K, amp=0.1).bfloat16(),
               w=rnd(1, T, HV, K, amp=0.1).bfloat16(), u=rnd(1, T, HV, V).bfloat16(), do=rnd(1, T, HV, V).bfloat16(),
               dv=rnd(1, T, HV, V).float())
    decay = -0.05 * torch.rand(1, T, HV, *(() if H is not None else (K,)), generator=gen)
    low["gc"] = _chunk_local(decay).float().to(DEVICE)
    if H is None:
        return low, {n: t.double() for n, t in low.items()}
    low["q"], low["k"] = low.pop("qg"), low.pop("kg")
    return low, gated_from_raw(low)


# what each policy promises, bf16 pieces of (S_ext / G, M): stated here, not read from the code under test
# in the forward summary and, where they differ, in the gradient summary
PROMISED = {"exact": (3, 3), "two_piece": (2, 2), "mixed": (2, 1), "one_piece": (1, 1), "one_piece_forward": (1, 1)}
PROMISED_BACKWARD = {"one_piece_forward": (2, 2)}


def _pieces(policy: str, backward: bool = False) -> tuple[int, int]:
    return PROMISED_BACKWARD.get(policy, PROMISED[policy]) if backward else PROMISED[policy]


def _in_band(err: float, pieces: int) -> bool:
    lo, hi = BANDS[pieces]
    return lo <= err < hi


# every policy with the state's rows first; with columns first (the same pieces, another loop order) the
# policies of two and of one forward piece, the others slow
@pytest.mark.parametrize("policy, v_first", [(p, False) for p in POLICIES] + [
    pytest.param(p, True, marks=() if p in ("two_piece", "one_piece_forward") else pytest.mark.slow)
    for p in POLICIES])
def test_each_policy_rounds_with_its_own_piece_count(policy, v_first):
    low, x = synthetic()
    S_ref, M_ref = ref_summary(x)
    pieces, m_pieces = _pieces(policy)
    # one sub-segment, and two-chunk ones folded with their transitions (a one-chunk M is exact: its
    # first product is with the identity)
    for L in (None, 2):
        config = kn.SummaryConfig(v_first=v_first, chunks_per_program=L)
        S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], config=config, precision=policy)
        assert _in_band(rel_err(M, M_ref), m_pieces), (L, rel_err(M, M_ref))
        G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                      config=config, precision=policy)
        # cut into sub-segments, G is folded with their M^T, rounded as the transition
        g_pieces, g_m_pieces = _pieces(policy, backward=True)
        assert _in_band(rel_err(G, ref_grad(x)), g_pieces if L is None else g_m_pieces), (L, rel_err(G, ref_grad(x)))
        if L is None:  # (cut, S also carries the rounding of the M it is folded with)
            S_only, _ = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], output="state", config=config,
                                         precision=policy)
            assert _in_band(rel_err(S, S_ref), pieces) and _in_band(rel_err(S_only, S_ref), pieces)


@pytest.mark.parametrize("variant", ["scalar", "view"])
@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_with_raw_keys(policy, variant):
    """GDN's raw keys: gated operands are rounded after their gate is applied, and the ``G`` update's
    paired product (both bf16 pieces side by side) follows the policy too."""
    H = 1
    low, x = synthetic(seed=1, H=H)
    gc = low["gc"] if variant == "scalar" else low["gc"].unsqueeze(-1).expand(1, T, HV, K)
    pieces, m_pieces = _pieces(policy)
    S_ref, M_ref = ref_summary(x)
    S, M = kn.state_summary(low["k"], low["w"], low["u"], gc, raw_keys=True, precision=policy)
    assert _in_band(rel_err(S, S_ref), pieces) and _in_band(rel_err(M, M_ref), m_pieces), (rel_err(S, S_ref),
                                                                                             rel_err(M, M_ref))
    G = kn.state_gradient_summary(low["q"], low["k"], low["w"], gc, low["do"], low["dv"], SCALE, raw_keys=True,
                                  precision=policy)
    assert _in_band(rel_err(G, ref_grad(x)), _pieces(policy, backward=True)[0]), rel_err(G, ref_grad(x))


def round_pieces(x: torch.Tensor, pieces: int) -> torch.Tensor:
    """float64 ``x`` rounded to float32, then to the sum of its first ``pieces`` bf16 pieces (float64)."""
    rest, out = x.float(), torch.zeros_like(x)
    for _ in range(pieces):
        piece = rest.bfloat16()
        out = out + piece.double()
        rest = rest - piece.float()
    return out


def emulated(x, pieces: int):
    """``(S_ext, M, G)`` of one sequence in float64 with the float32 operand of every state product rounded
    to ``pieces`` bf16 pieces, as the kernels' per-channel walks round it."""
    kg, w, u, gc, qg, do, dv = (x[n][0] for n in ("kg", "w", "u", "gc", "qg", "do", "dv"))
    S, M = kg.new_zeros(HV, K, V), torch.eye(K, dtype=kg.dtype, device=kg.device).repeat(HV, 1, 1)
    dS = kg.new_zeros(HV, K, V)
    chunks = ref.chunk_bounds(0, T, 64)
    for s, e in chunks:
        decay = torch.exp2(gc[e - 1])[..., None]
        v = u[s:e] - torch.einsum("chk,hkv->chv", w[s:e], round_pieces(S, pieces))
        S = decay * S + torch.einsum("chk,chv->hkv", kg[s:e], round_pieces(v, pieces))
        vm = -torch.einsum("chk,hkj->chj", w[s:e], round_pieces(M, pieces))
        M = decay * M + torch.einsum("chk,chj->hkj", kg[s:e], round_pieces(vm, pieces))
    for s, e in reversed(chunks):
        dvp = torch.einsum("chk,hkv->chv", kg[s:e], round_pieces(dS, pieces)) + dv[s:e]
        dS = (torch.exp2(gc[e - 1])[..., None] * dS + SCALE * torch.einsum("chk,chv->hkv", qg[s:e], do[s:e])
              - torch.einsum("chk,chv->hkv", w[s:e], round_pieces(dvp, pieces)))
    return S[None], M[None], dS[None]


@pytest.mark.parametrize("v_first", [False, True])
def test_one_piece_matches_its_emulation(v_first):
    low, x = synthetic(seed=2)
    config = kn.SummaryConfig(v_first=v_first)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], config=config, precision="one_piece")
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  config=config, precision="one_piece")
    one = emulated(x, 1)
    for got, want in zip((S, M, G), one):
        assert rel_err(got, want) < EMULATION_TOL, rel_err(got, want)
    # the emulation tells piece counts apart: two pieces are far from it
    two = emulated(x, 2)
    assert all(rel_err(a, b) > 20 * EMULATION_TOL for a, b in zip(one, two))


def test_policy_names_and_defaults():
    assert resolve_precision(None, torch.bfloat16) is DEFAULT_LOW_PRECISION
    assert resolve_precision(None, torch.float16) is SummaryPrecision.EXACT
    assert resolve_precision(None, torch.float32) is SummaryPrecision.EXACT
    assert resolve_precision("mixed", torch.bfloat16) is SummaryPrecision.MIXED
    assert resolve_precision(SummaryPrecision.ONE_PIECE, torch.bfloat16) is SummaryPrecision.ONE_PIECE
    # fp16 and float32 inputs run float32 products under every policy
    assert {SummaryPrecision(p).pieces(torch.float32) for p in POLICIES} == {(0, 0)}
    assert {SummaryPrecision(p).pieces(torch.float16) for p in POLICIES} == {(0, 0)}
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("two", torch.bfloat16)


def test_bad_precision_raises_before_running():
    low, _ = synthetic()
    with pytest.raises(ValueError, match="precision must be one of"):
        kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], precision="bf16")
    with pytest.raises(ValueError, match="precision must be one of"):
        kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  precision=2)


def test_default_is_the_named_default_and_float32_is_exact():
    low, x = synthetic()
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"])
    S_d, M_d = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], precision=DEFAULT_LOW_PRECISION)
    assert torch.equal(S, S_d) and torch.equal(M, M_d)
    f32 = {n: t.float() for n, t in low.items()}
    S_ref, M_ref = ref_summary(x)
    for policy in (None, "one_piece"):  # float32 products whatever the policy
        S32, M32 = kn.state_summary(f32["kg"], f32["w"], f32["u"], f32["gc"], precision=policy)
        assert rel_err(S32, S_ref) < 6e-7 and rel_err(M32, M_ref) < 6e-7
