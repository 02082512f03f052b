"""Triton summary kernels against the float64 reference (CPU: Triton interpreter; GPU: `gpu` marker).

Inputs are real chunked-KDA intermediates rounded to the kernel dtype; the ground truth is the
reference run in float64 on exactly those rounded values, so any gap is the kernels' own rounding.
"""
import functools

import pytest
import torch

from kdacp import affine
from kdacp import kernels as kn
from kdacp import reference as ref
from tests.helpers import make_kda_inputs, rel_err

FIELDS = ("qg", "kg", "w", "u", "gc", "Aqk")
TOL = 1e-5  # float32 rounding along the chunk chain (measured ~1e-7 .. 1e-6)
# the policy the tests below hold bf16 inputs to (fp16/fp32 inputs run float32 products under any);
# every policy against its own emulation: test_precision_policies_match_their_emulation
PINNED = "two_piece"
SCALE = 0.125
# the small cases run on the GPU too where there is one (there they exercise the bf16 split products,
# which the interpreter cannot: it sends bf16 inputs through float32)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def _intermediates(B, T, HV, K, V, cu=None, seed=0, device=DEVICE, chunk_size=64):
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    args = make_kda_inputs(B, T, HV, HV, K, V, dtype=torch.float64, requires_grad=False, seed=seed,
                           cu_seqlens=cu_seqlens, device=device)
    it = ref.chunk_kda_intermediates(**args, chunk_size=chunk_size)
    out = {n: getattr(it, n) for n in FIELDS}
    gen = torch.Generator().manual_seed(seed + 1)
    out["do"] = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(device)
    out["dv"] = ref.chunk_dv_local(out["Aqk"], out["do"], SCALE, chunk_size=chunk_size,
                                   cu_seqlens=args.get("cu_seqlens"))
    return out


def make(B, T, HV, K, V, dtype, cu=None, seed=0, device=DEVICE, chunk_size=64):
    """Kernel inputs in ``dtype`` (``gc`` float32) and the same values in float64."""
    x = _intermediates(B, T, HV, K, V, cu, seed, device, chunk_size)
    low = {n: x[n].to(torch.float32 if n in ("gc", "dv") else dtype) for n in x}
    return low, {n: t.double() for n, t in low.items()}


def cfg(L):
    return None if L is None else kn.SummaryConfig(block_v=32, chunks_per_program=L)


def ref_summary(x, cu=None, chunk_size=64):
    return ref.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=chunk_size, cu_seqlens=cu)


def ref_grad(x, cu=None, chunk_size=64):
    return ref.state_gradient_summary(x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], SCALE,
                                      chunk_size=chunk_size, cu_seqlens=cu)


# (B, T, HV, K, V, dtype, chunks per program): partial last chunks, T < 64, one sub-segment or several
CASES = [
    (2, 150, 2, 64, 64, torch.float32, None),
    (1, 37, 2, 64, 128, torch.float32, None),
    (1, 1, 1, 64, 64, torch.float32, None),
    (1, 200, 1, 128, 64, torch.float32, 1),
    (1, 300, 2, 64, 64, torch.float32, 2),
    (1, 130, 1, 64, 256, torch.float32, 1),
    (1, 190, 2, 64, 64, torch.bfloat16, 1),
    (1, 100, 1, 128, 128, torch.bfloat16, None),
    (1, 129, 2, 64, 64, torch.float16, 2),
]


@pytest.mark.parametrize("B,T,HV,K,V,dtype,L", CASES)
def test_state_summary_modes_match_reference(B, T, HV, K, V, dtype, L):
    low, x = make(B, T, HV, K, V, dtype)
    S_ref, M_ref = ref_summary(x)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], config=cfg(L), precision=PINNED)
    assert S.dtype == M.dtype == torch.float32
    assert S.shape == (B, HV, K, V) and M.shape == (B, HV, K, K)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    S_only, none = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], output="state", config=cfg(L),
                                    precision=PINNED)
    assert none is None and rel_err(S_only, S_ref) < TOL
    none, M_only = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], output="transition", config=cfg(L),
                                    precision=PINNED)
    assert none is None and rel_err(M_only, M_ref) < TOL
    M_t = kn.transition(low["kg"], low["w"], low["gc"], config=cfg(L), precision=PINNED)
    assert rel_err(M_t, ref.transition(x["kg"], x["w"], x["gc"])) < TOL


@pytest.mark.parametrize("B,T,HV,K,V,dtype,L", CASES)
def test_state_gradient_summary_matches_reference(B, T, HV, K, V, dtype, L):
    low, x = make(B, T, HV, K, V, dtype)
    dv_before = low["dv"].clone()
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  config=cfg(L), precision=PINNED)
    assert G.dtype == torch.float32 and G.shape == (B, HV, K, V)
    assert rel_err(G, ref_grad(x)) < TOL
    assert torch.equal(low["dv"], dv_before)


# (T, K, V, dtype, config, precision): both state layouts and two piece counts (exact policies; the
# others are tested against their own emulation below)
LAYOUTS = [
    (150, 64, 64, torch.float32, kn.SummaryConfig(v_first=True, chunks_per_program=1, max_registers=168), None),
    (100, 128, 64, torch.bfloat16, kn.SummaryConfig(v_first=True), "exact"),
    (200, 64, 128, torch.bfloat16, kn.SummaryConfig(v_first=True, chunks_per_program=2), "two_piece"),
    (200, 64, 64, torch.bfloat16, kn.SummaryConfig(v_first=False, chunks_per_program=1, num_warps=2), "exact"),
    (150, 64, 64, torch.float32, kn.SummaryConfig(v_first=False, chunks_per_program=1), "exact"),
]


@pytest.mark.parametrize("T,K,V,dtype,config,precision", LAYOUTS)
def test_layouts_and_precisions(T, K, V, dtype, config, precision):
    low, x = make(1, T, 2, K, V, dtype)
    S_ref, M_ref = ref_summary(x)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], config=config, precision=precision)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    S_only, _ = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], output="state", config=config,
                                 precision=precision)
    assert rel_err(S_only, S_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  config=config, precision=precision)
    assert rel_err(G, ref_grad(x)) < TOL


@pytest.mark.parametrize("chunk_size,T,L", [(16, 90, None), (32, 100, 2), (128, 200, 1)])
def test_other_chunk_sizes(chunk_size, T, L):
    low, x = make(1, T, 2, 64, 64, torch.float32, chunk_size=chunk_size)
    S_ref, M_ref = ref_summary(x, chunk_size=chunk_size)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], chunk_size=chunk_size, config=cfg(L),
                            precision=PINNED)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  chunk_size=chunk_size, config=cfg(L), precision=PINNED)
    assert rel_err(G, ref_grad(x, chunk_size=chunk_size)) < TOL
    # the chunking matters: the same inputs read at chunk size 64 (other last chunks) give another summary
    if chunk_size != 64:
        assert rel_err(kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], precision=PINNED).offset, S_ref) > 1e-3


@pytest.mark.parametrize("field,value", [("block_v", 48), ("num_warps", 3), ("v_first", 1),
                                         ("num_stages", 0), ("chunks_per_program", 2.0), ("max_registers", 16),
                                         ("max_registers", 256), ("max_registers", 168.0)])
def test_bad_summary_config_raises(field, value):
    with pytest.raises(ValueError, match=f"SummaryConfig.{field} must be"):
        kn.SummaryConfig(**{field: value})


def test_launch_falls_back_to_fewer_stages_when_shared_memory_runs_out():
    from triton.runtime.errors import OutOfResources

    from kdacp.kernels.pipelining import launch_fitting_stages

    class Kernel:  # stands for a Triton kernel whose buffers fit in shared memory up to ``fits`` stages
        def __init__(self, fits):
            self.fits, self.tried = fits, []

        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **constants):
                self.tried.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    kernel = Kernel(fits=2)
    launch_fitting_stages(kernel, (1,), (torch.zeros(1),), {"BT": 64}, 4, 4)
    assert kernel.tried == [4, 3, 2]
    launch_fitting_stages(kernel, (1,), (torch.zeros(1),), {"BT": 64}, 4, 4)  # remembered
    assert kernel.tried == [4, 3, 2, 2]
    kernel = Kernel(fits=0)
    with pytest.raises(OutOfResources):
        launch_fitting_stages(kernel, (1,), (), {}, 4, 2)
    assert kernel.tried == [2, 1]


def test_launch_passes_the_register_limit_to_triton():
    from kdacp.kernels.pipelining import launch_fitting_stages

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **options):
                seen.append(options)
            return launch

    launch_fitting_stages(Kernel(), (1,), (), {"BT": 64}, 4, 2, max_registers=168)
    launch_fitting_stages(Kernel(), (1,), (), {"BT": 64}, 4, 2)
    assert seen == [{"BT": 64, "maxnreg": 168}, {"BT": 64}]


def test_head_range_and_head_first_w_without_copies():
    low, x = make(1, 140, 5, 64, 64, torch.float32)
    hs, nh = 1, 3
    sel = {n: t[:, :, hs:hs + nh] for n, t in x.items()}
    w_hf = low["w"].transpose(1, 2).contiguous()  # [B, HV, T, K]
    S, M = kn.state_summary(low["kg"], w_hf, low["u"], low["gc"], head_start=hs, num_heads=nh, w_head_first=True,
                            config=cfg(1), precision=PINNED)
    S_ref, M_ref = ref_summary(sel)
    assert S.shape == (1, nh, 64, 64)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], low["kg"], w_hf, low["gc"], low["do"], low["dv"], SCALE,
                                  head_start=hs, num_heads=nh, w_head_first=True, config=cfg(1), precision=PINNED)
    assert rel_err(G, ref_grad(sel)) < TOL
    # strided views (a head slice of the tensors) work too
    views = {n: t[:, :, hs:hs + nh] for n, t in low.items()}
    assert not views["kg"].is_contiguous()
    S2, M2 = kn.state_summary(views["kg"], views["w"], views["u"], views["gc"], precision=PINNED)
    assert rel_err(S2, S_ref) < TOL and rel_err(M2, M_ref) < TOL


CU = (0, 70, 200, 261, 262)


@pytest.mark.parametrize("L", [None, 1])
def test_packed_sequences_and_segments(L):
    low, x = make(1, CU[-1], 2, 64, 64, torch.float32, cu=CU)
    cu = torch.tensor(CU, dtype=torch.int64)
    S_ref, M_ref = ref_summary(x, cu)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], cu_seqlens=cu, config=cfg(L), precision=PINNED)
    assert S.shape == (len(CU) - 1, 2, 64, 64)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  cu_seqlens=cu, config=cfg(L), precision=PINNED)
    assert rel_err(G, ref_grad(x, cu)) < TOL
    s, e = CU[1], CU[2]
    seg = {n: t[:, s:e] for n, t in x.items()}
    S1, M1 = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], segment=(s, e), config=cfg(L), precision=PINNED)
    assert S1.shape == (1, 2, 64, 64)
    assert rel_err(S1, S_ref[1:2]) < TOL and rel_err(M1, M_ref[1:2]) < TOL
    G1 = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                   segment=(s, e), config=cfg(L), precision=PINNED)
    assert rel_err(G1, ref_grad(seg)) < TOL


@pytest.mark.parametrize("L,raw", [(3, False), (5, False), (None, False), (2, True)])
def test_summary_parts_give_the_state_entering_every_sub_segment(L, raw):
    """``parts=True``: the kernel's sub-segment summaries, unfolded, and :func:`affine.entry_states`
    from them are the float64 states at each sub-segment's first token (from a random initial state),
    and the parts compose to the summary; the last sub-segment is partial (T = 300). ``raw``: GDN's raw
    keys, two value heads on one key head, scalar gate (64-token chunks); else 16-token chunks."""
    T = 300
    if raw:
        C = 64
        low, _ = make_gdn(1, T, 1, 2, 64, 64, torch.float32)
        x, k = gated_from_raw(low), low["k"]
    else:
        C = 16
        low, x = make(1, T, 2, 64, 64, torch.float32, chunk_size=C)
        k = low["kg"]
    out = kn.state_summary(k, low["w"], low["u"], low["gc"], chunk_size=C, config=cfg(L), raw_keys=raw, parts=True,
                           precision=PINNED)
    n = len(out.starts)
    assert out.starts[0] == 0 and all(s % C == 0 for s in out.starts) and list(out.starts) == sorted(set(out.starts))
    assert out.parts.offset.shape[0] == out.parts.transition.shape[0] == n > 1
    if L is not None:
        assert n == -(-(-(-T // C)) // L)

    def truth(end):
        return ref_summary({f: t[:, :end] for f, t in x.items()}, chunk_size=C)

    S0 = torch.randn(2, 64, 64, dtype=torch.float64, device=DEVICE)
    assert out.counts == (n,)
    entering = affine.entry_states(out, S0[None].float())
    assert entering.shape == (n, 2, 64, 64)
    for j, start in enumerate(out.starts):
        expected = S0 if start == 0 else truth(start).transition[0] @ S0 + truth(start).offset[0]
        assert rel_err(entering[j], expected) < TOL, j
    S_all, M_all = truth(T)
    assert rel_err(out.summary.offset, S_all) < TOL and rel_err(out.summary.transition, M_all) < TOL
    with pytest.raises(ValueError, match="output='both'"):
        kn.state_summary(k, low["w"], low["u"], low["gc"], chunk_size=C, output="state", raw_keys=raw, parts=True,
                         precision=PINNED)


def test_summary_parts_of_packed_sequences():
    """Packed sequences: each one's pieces follow each other, ``counts`` says how many are whose, and the
    states entering them are those of each sequence from its own initial state."""
    low, x = make(1, CU[-1], 2, 64, 64, torch.float32, cu=CU)
    cu = torch.tensor(CU, dtype=torch.int64)
    out = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], cu_seqlens=cu, config=cfg(1), parts=True,
                           precision=PINNED)
    chunks = [-(-(e - s) // 64) for s, e in zip(CU[:-1], CU[1:])]
    assert out.counts == tuple(chunks)
    assert out.starts == tuple(s + 64 * j for s, n in zip(CU[:-1], chunks) for j in range(n))
    S0 = torch.randn(len(CU) - 1, 2, 64, 64, dtype=torch.float64, device=DEVICE)
    entering = affine.entry_states(out, S0.float())
    for j, start in enumerate(out.starts):
        n = next(i for i in range(len(CU) - 1) if CU[i] <= start < CU[i + 1])
        seg = {f: t[:, CU[n]:start] for f, t in x.items()}
        expected = S0[n] if start == CU[n] else ref_summary(seg).transition[0] @ S0[n] + ref_summary(seg).offset[0]
        assert rel_err(entering[j], expected) < TOL, j
    with pytest.raises(ValueError, match="one packed row"):
        kn.state_summary(low["kg"].expand(2, -1, -1, -1), low["w"].expand(2, -1, -1, -1),
                         low["u"].expand(2, -1, -1, -1), low["gc"].expand(2, -1, -1, -1), parts=True, precision=PINNED)
    with pytest.raises(TypeError, match="parts must be a bool"):
        kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], parts=1, precision=PINNED)


def test_compose_and_apply_match_reference_in_float32_under_autocast():
    low, x = make(1, 256, 2, 64, 64, torch.float32)
    halves = [{n: t[:, a:b] for n, t in low.items()} for a, b in ((0, 128), (128, 256))]
    first, second = (kn.state_summary(h["kg"], h["w"], h["u"], h["gc"], precision=PINNED) for h in halves)
    S_ref, M_ref = ref_summary(x)
    S_in = torch.randn(1, 2, 64, 64, dtype=torch.float64, device=DEVICE)
    dS_out = torch.randn(1, 2, 64, 64, dtype=torch.float64, device=DEVICE)
    G1 = torch.randn(1, 2, 64, 64, device=DEVICE)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        S, M = affine.compose_state_summaries(first, second)
        out = affine.apply_state_summary(S, M, S_in.float())
        dS_in = affine.apply_state_gradient_summary(G1, M, dS_out.float())
    assert S.dtype == M.dtype == out.dtype == dS_in.dtype == torch.float32
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    assert rel_err(out, ref.apply_state_summary(S_ref, M_ref, S_in)) < TOL
    assert rel_err(dS_in, ref.apply_state_gradient_summary(G1.double(), M_ref, dS_out)) < TOL
    # the kernel's folded summary equals the composition of its halves
    S_k, M_k = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], config=cfg(2), precision=PINNED)
    assert rel_err(S_k, S) < TOL and rel_err(M_k, M) < TOL


def _bad_cases():
    low, _ = make(1, 70, 2, 64, 64, torch.float32)
    kg, w, u, gc = low["kg"], low["w"], low["u"], low["gc"]
    return [
        (dict(kg=kg.tolist()), TypeError, "kg must be a torch.Tensor"),
        (dict(kg=kg[0]), ValueError, "kg must have 4 dims"),
        (dict(w=w[:, :69]), ValueError, "w must have shape"),
        (dict(w=w, w_head_first=True), ValueError, r"w must have shape \[B, HV, T, K\]"),
        (dict(u=u[:, :, :1]), ValueError, "u must have shape"),
        (dict(gc=gc[..., :32]), ValueError, "gc must have shape"),
        (dict(w=w.half()), TypeError, "w must have the dtype of kg"),
        (dict(kg=kg.double(), w=w.double(), u=u.double()), TypeError, "kg must have dtype"),
        (dict(gc=gc.long()), TypeError, "gc must have a floating dtype"),
        (dict(u=u.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "u must be contiguous in its last dim"),
        (dict(chunk_size=48), ValueError, "chunk_size must be one of"),
        (dict(output="all"), ValueError, "output must be one of"),
        (dict(head_start=2), ValueError, "head_start must be"),
        (dict(num_heads=2, head_start=1), ValueError, "num_heads must be"),
        (dict(segment=(10, 71)), ValueError, "segment must satisfy"),
        (dict(segment=(5, 10), cu_seqlens=torch.tensor([0, 70])), ValueError, "at most one of"),
        (dict(cu_seqlens=torch.tensor([0, 60])), ValueError, "cu_seqlens"),
        (dict(w=w.to("meta")), ValueError, "w is on meta"),
        (dict(kg=kg[..., :32].contiguous(), w=w[..., :32].contiguous(), gc=gc[..., :32].contiguous()), ValueError,
         "K .* must be one of"),
        (dict(kg=kg.new_zeros(1, 70, 2, 256), w=w.new_zeros(1, 70, 2, 256), gc=gc.new_zeros(1, 70, 2, 256)),
         NotImplementedError, "K=256"),
        (dict(u=u.new_zeros(1, 70, 2, 96)), ValueError, "value dim V"),
        (dict(gc=gc[..., 0, :]), ValueError, r"gc must have shape .* or, a scalar gate, \[B, T, HV\]"),
        (dict(gc=gc[0, :, 0]), ValueError, "gc must have 4 dims .* or 3 dims"),
        (dict(gc=torch.cat([gc, gc], -1)[..., ::2]), ValueError, "gc must be .* last-dim stride in"),
    ]


@pytest.mark.parametrize("case", range(24))
def test_bad_inputs_raise_before_running(case):
    low, _ = make(1, 70, 2, 64, 64, torch.float32)
    change, exc, match = _bad_cases()[case]
    args = dict(kg=low["kg"], w=low["w"], u=low["u"], gc=low["gc"])
    args.update(change)
    with pytest.raises(exc, match=match):
        kn.state_summary(**args, precision=PINNED)


def test_bad_gradient_inputs():
    low, _ = make(1, 70, 2, 64, 64, torch.float32)
    a = [low[n] for n in ("qg", "kg", "w", "gc", "do", "dv")]
    with pytest.raises(TypeError, match="scale must be a float"):
        kn.state_gradient_summary(*a, None, precision=PINNED)
    with pytest.raises(TypeError, match="do must have the dtype of qg"):
        kn.state_gradient_summary(*a[:4], a[4].half(), a[5], SCALE, precision=PINNED)
    with pytest.raises(ValueError, match="dv must have shape"):
        kn.state_gradient_summary(*a[:5], a[5][:, :10], SCALE, precision=PINNED)
    with pytest.raises(ValueError, match="w must have shape"):
        kn.state_gradient_summary(*a[:2], a[2][:, :, :1], *a[3:], SCALE, precision=PINNED)


# ------------------------------------------------------------------------------- scalar gate (GDN)
@functools.lru_cache(maxsize=None)
def _gdn_intermediates(B, T, H, HV, K, V, cu=None, seed=0, device=DEVICE):
    """Chunked-GDN intermediates in float64: the reference KDA form on a scalar gate broadcast over ``K``."""
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    args = make_kda_inputs(B, T, H, HV, K, V, dtype=torch.float64, requires_grad=False, seed=seed,
                           cu_seqlens=cu_seqlens, device=device)
    gen = torch.Generator().manual_seed(seed + 2)
    # natural-log decay per token and value head; heads decay at different rates
    bias = torch.linspace(1.0, 5.0, HV, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, generator=gen, dtype=torch.float64) + bias).to(device)
    args["g"] = ref.scalar_gate_as_kda(g, K)[0]
    it = ref.chunk_kda_intermediates(**args)
    out = {n: getattr(it, n) for n in FIELDS}
    assert torch.equal(out["gc"], out["gc"][..., :1].expand_as(out["gc"]))
    out["gc"] = out["gc"][..., 0].contiguous()  # [B, T, HV]: one log2 value per token and head
    out["do"] = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64).to(device)
    out["dv"] = ref.chunk_dv_local(out["Aqk"], out["do"], SCALE, cu_seqlens=args.get("cu_seqlens"))
    out["q"], out["k"] = args["q"], args["k"]  # [B, T, H, K], ungated: qg = q exp2(gc), kg = k exp2(gc_last - gc)
    return out


def make_gdn(B, T, H, HV, K, V, dtype, cu=None, seed=0):
    """GDN kernel inputs in ``dtype`` (scalar ``gc [B, T, HV]`` float32) and the same values in float64
    with the gate broadcast over ``K`` (the per-channel form the reference takes)."""
    x = _gdn_intermediates(B, T, H, HV, K, V, cu, seed)
    low = {n: x[n].to(torch.float32 if n in ("gc", "dv") else dtype) for n in x}
    wide = {n: t.double() for n, t in low.items()}
    wide["gc"] = wide["gc"].unsqueeze(-1).expand(B, T, HV, K)
    return low, wide


def gate_variant(gc: torch.Tensor, variant: str, K: int) -> torch.Tensor:
    """The scalar gate ``[B, T, HV]`` as the constexpr variant reads it, or as a zero-stride ``K`` view."""
    if variant == "scalar":
        return gc
    view = gc.unsqueeze(-1).expand(*gc.shape, K)
    assert view.stride(-1) == 0
    return view


GDN_CU = (0, 70, 200, 261)
# (B, T, H, HV, K, V, dtype, chunks per program, cu_seqlens): grouped value heads (HV = 2H), partial last
# chunks, sub-segments, packed sequences
GDN_CASES = [
    (2, 150, 1, 2, 64, 64, torch.float32, None, None),
    (1, 200, 2, 4, 64, 64, torch.float32, 1, None),
    (1, 130, 1, 2, 128, 64, torch.bfloat16, 2, None),
    (1, 37, 1, 2, 64, 128, torch.float16, None, None),
    (1, GDN_CU[-1], 1, 2, 64, 64, torch.float32, None, GDN_CU),
    (1, GDN_CU[-1], 1, 2, 64, 64, torch.float32, 1, GDN_CU),
]
# Each case with one of the gate's two layouts (the constexpr scalar, a zero-stride K view), alternating,
# and the first packed case with both: the interpreter takes seconds per case, and the layout is read at
# the gate's loads only, the same in every case.
GDN_VARIANT_CASES = [(*case, variant) for i, case in enumerate(GDN_CASES)
                     for variant in ("scalar", "zero_stride") if i == 4 or (variant == "scalar") == (i % 2 == 0)]


# the 200-token case (one chunk a program over four chunks) slow: the packed case with one chunk a program
# folds sub-segments too
@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,L,cu,variant", [
    pytest.param(*case, marks=pytest.mark.slow if case[1] == 200 else ()) for case in GDN_VARIANT_CASES])
def test_scalar_gate_summaries_match_reference(B, T, H, HV, K, V, dtype, L, cu, variant):
    low, x = make_gdn(B, T, H, HV, K, V, dtype, cu)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    gc = gate_variant(low["gc"], variant, K)
    kg, w, u = low["kg"], low["w"], low["u"]
    S_ref, M_ref = ref_summary(x, cu)
    S, M = kn.state_summary(kg, w, u, gc, cu_seqlens=cu, config=cfg(L), precision=PINNED)
    N = B if cu is None else len(cu) - 1
    assert S.shape == (N, HV, K, V) and M.shape == (N, HV, K, K)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    S_only, _ = kn.state_summary(kg, w, u, gc, output="state", cu_seqlens=cu, config=cfg(L), precision=PINNED)
    assert rel_err(S_only, S_ref) < TOL
    assert rel_err(kn.transition(kg, w, gc, cu_seqlens=cu, config=cfg(L), precision=PINNED), M_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], kg, w, gc, low["do"], low["dv"], SCALE, cu_seqlens=cu, config=cfg(L),
                                  precision=PINNED)
    G_ref = ref_grad(x, cu)
    assert G.shape == (N, HV, K, V) and rel_err(G, G_ref) < TOL
    # the gate is read: without it M is another, and so are S_ext and G past one chunk
    zero = torch.zeros_like(gc)
    S0, M0 = kn.state_summary(kg, w, u, zero, cu_seqlens=cu, config=cfg(L), precision=PINNED)
    G0 = kn.state_gradient_summary(low["qg"], kg, w, zero, low["do"], low["dv"], SCALE, cu_seqlens=cu, config=cfg(L),
                                   precision=PINNED)
    assert rel_err(M0, M_ref) > 1e-3
    if T > 64:
        assert rel_err(S0, S_ref) > 1e-3 and rel_err(G0, G_ref) > 1e-3


# the kernels never round a gated q, k (the gates scale the float32 operands), so against float64 gated
# from the same rounded raw q, k they keep float32 accuracy; 16-bit inputs on a GPU add the two-piece
# bf16 products' rounding of the float32 state (~1e-5, see kdacp.kernels.precision)
RAW_TOL = {torch.float32: TOL, torch.float16: 1e-4, torch.bfloat16: 1e-4}


def gated_from_raw(low, cu=None, chunk_size=64):
    """A copy of ``low`` in float64 with ``qg = q exp2(gc)``, ``kg = k exp2(gc_last - gc)`` ``[B, T, HV, K]``
    formed in float64 from the rounded raw ``q, k [B, T, H, K]`` and scalar ``gc`` the kernels read,
    and ``gc`` broadcast over ``K`` (the reference's per-channel form)."""
    wide = {n: t.double() for n, t in low.items()}
    q, k, gc = wide["q"], wide["k"], wide["gc"]
    B, T, H, K = k.shape
    HV = gc.shape[2]
    last = torch.empty_like(gc)
    bounds = [(0, T)] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for bos, eos in bounds:
        for s, e in ref.chunk_bounds(bos, eos, chunk_size):
            last[:, s:e] = gc[:, e - 1:e]
    wide["qg"] = q.repeat_interleave(HV // H, dim=2) * torch.exp2(gc)[..., None]
    wide["kg"] = k.repeat_interleave(HV // H, dim=2) * torch.exp2(last - gc)[..., None]
    wide["gc"] = gc.unsqueeze(-1).expand(B, T, HV, K)
    return wide


# the gating of raw keys on the cases of one variant each, both packed (the rest slow: its loads are the gate's)
RAW_KEY_CASES = [pytest.param(*case, marks=() if case[-1] == ("scalar" if case[-2] is None else "zero_stride")
                              else pytest.mark.slow) for case in GDN_VARIANT_CASES]


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype,L,cu,variant", RAW_KEY_CASES)
def test_raw_keys_are_gated_in_the_kernel(B, T, H, HV, K, V, dtype, L, cu, variant):
    """``raw_keys=True``: ungated ``q, k`` at their ``H`` heads (grouped value heads read key head
    ``i // (HV / H)``) give the summaries of the gated ones."""
    low, _ = make_gdn(B, T, H, HV, K, V, dtype, cu)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    x = gated_from_raw(low, cu)
    gc = gate_variant(low["gc"], variant, K)
    q, k, w, u = low["q"], low["k"], low["w"], low["u"]
    assert k.shape[2] == H < HV or H == HV
    tol = RAW_TOL[dtype]
    S, M = kn.state_summary(k, w, u, gc, cu_seqlens=cu, raw_keys=True, config=cfg(L), precision=PINNED)
    S_ref, M_ref = ref_summary(x, cu)
    assert rel_err(S, S_ref) < tol and rel_err(M, M_ref) < tol
    assert rel_err(kn.transition(k, w, gc, cu_seqlens=cu, raw_keys=True, config=cfg(L), precision=PINNED), M_ref) < tol
    G = kn.state_gradient_summary(q, k, w, gc, low["do"], low["dv"], SCALE, cu_seqlens=cu, raw_keys=True,
                                  config=cfg(L), precision=PINNED)
    G_ref = ref_grad(x, cu)
    assert rel_err(G, G_ref) < tol
    # not gated (the pre-gated path fed raw keys repeated over the value heads) is far off
    rep = {n: t.repeat_interleave(HV // H, dim=2) for n, t in (("q", q), ("k", k))}
    S_ungated, _ = kn.state_summary(rep["k"], w, u, gc, cu_seqlens=cu, config=cfg(L), precision=PINNED)
    G_ungated = kn.state_gradient_summary(rep["q"], rep["k"], w, gc, low["do"], low["dv"], SCALE, cu_seqlens=cu,
                                          config=cfg(L), precision=PINNED)
    assert rel_err(S_ungated, S_ref) > 10 * tol and rel_err(G_ungated, G_ref) > 10 * tol


@pytest.mark.parametrize("variant", ["scalar", "zero_stride"])
def test_raw_keys_v_first_head_range_and_segment(variant):
    """Raw keys with either tile order, a head range that starts inside a key head's group, a head-first
    ``w`` and one segment of a packed batch."""
    low, x = make_gdn(1, GDN_CU[-1], 2, 4, 64, 64, torch.float32, GDN_CU)
    gc = gate_variant(low["gc"], variant, 64)
    hs, nh, (s, e) = 1, 2, GDN_CU[1:3]
    seg = {n: t[:, s:e, hs:hs + nh] for n, t in x.items() if n not in ("q", "k")}
    w_hf = low["w"].transpose(1, 2).contiguous()
    S, M = kn.state_summary(low["k"], w_hf, low["u"], gc, head_start=hs, num_heads=nh, w_head_first=True,
                            segment=(s, e), raw_keys=True, config=kn.SummaryConfig(chunks_per_program=1, v_first=True),
                                                                                   precision=PINNED)
    S_ref, M_ref = ref_summary(seg)
    assert S.shape == (1, nh, 64, 64)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    G = kn.state_gradient_summary(low["q"], low["k"], w_hf, gc, low["do"], low["dv"], SCALE, head_start=hs,
                                  num_heads=nh, w_head_first=True, segment=(s, e), raw_keys=True,
                                  config=kn.SummaryConfig(v_first=True, block_v=16), precision=PINNED)
    assert rel_err(G, ref_grad(seg)) < TOL
    # the same with the [K, BV] tile, whose update reads q and the head-first w as one stacked tile
    G = kn.state_gradient_summary(low["q"], low["k"], w_hf, gc, low["do"], low["dv"], SCALE, head_start=hs,
                                  num_heads=nh, w_head_first=True, segment=(s, e), raw_keys=True,
                                  config=kn.SummaryConfig(chunks_per_program=1), precision=PINNED)
    assert rel_err(G, ref_grad(seg)) < TOL


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_raw_keys_gradient_other_chunk_sizes(chunk_size):
    """The raw-key ``G`` kernel's stacked ``[K, 2 BT]`` tile at every supported chunk size but the
    default, on packed sequences (any inputs: the reference takes the same ``chunk_size``)."""
    low, _ = make_gdn(1, GDN_CU[-1], 1, 2, 64, 64, torch.float32, GDN_CU)
    cu = torch.tensor(GDN_CU, dtype=torch.int64)
    x = gated_from_raw(low, cu, chunk_size)
    G = kn.state_gradient_summary(low["q"], low["k"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  chunk_size=chunk_size, cu_seqlens=cu, raw_keys=True, precision=PINNED)
    assert rel_err(G, ref_grad(x, cu, chunk_size)) < TOL


def test_raw_keys_checks_name_the_problem():
    low, _ = make_gdn(1, 150, 1, 2, 64, 64, torch.float32)
    k, w, u, gc = low["k"], low["w"], low["u"], low["gc"]
    with pytest.raises(ValueError, match="constant over K"):
        kn.state_summary(k, w, u, gc.unsqueeze(-1).expand(1, 150, 2, 64).contiguous(), raw_keys=True, precision=PINNED)
    with pytest.raises(ValueError, match="divides HV"):
        kn.state_summary(torch.cat([k, k, k], dim=2), w, u, gc, raw_keys=True, precision=PINNED)
    with pytest.raises(ValueError, match=r"must have shape \[B, T, HV, K\]"):
        kn.state_summary(k, w, u, gc, precision=PINNED)  # raw keys without raw_keys=True: the heads disagree
    with pytest.raises(TypeError, match="raw_keys must be a bool"):
        kn.state_gradient_summary(low["q"], k, w, gc, low["do"], low["dv"], SCALE, raw_keys=1, precision=PINNED)


@pytest.mark.parametrize("variant", ["scalar", "zero_stride"])
def test_scalar_gate_head_range_segment_and_v_first(variant):
    low, x = make_gdn(1, GDN_CU[-1], 2, 4, 64, 64, torch.float32, GDN_CU)
    gc = gate_variant(low["gc"], variant, 64)
    hs, nh, (s, e) = 1, 2, GDN_CU[1:3]
    seg = {n: t[:, s:e, hs:hs + nh] for n, t in x.items()}
    S_ref, M_ref = ref_summary(seg)
    w_hf = low["w"].transpose(1, 2).contiguous()
    S, M = kn.state_summary(low["kg"], w_hf, low["u"], gc, head_start=hs, num_heads=nh, w_head_first=True,
                            segment=(s, e), config=kn.SummaryConfig(chunks_per_program=1, v_first=False),
                                                                    precision=PINNED)
    assert S.shape == (1, nh, 64, 64)
    assert rel_err(S, S_ref) < TOL and rel_err(M, M_ref) < TOL
    G = kn.state_gradient_summary(low["qg"], low["kg"], w_hf, gc, low["do"], low["dv"], SCALE, head_start=hs,
                                  num_heads=nh, w_head_first=True, segment=(s, e),
                                  config=kn.SummaryConfig(v_first=True, block_v=16), precision=PINNED)
    assert rel_err(G, ref_grad(seg)) < TOL


# ----------------------------------------------------------------------------------------------- GPU
GPU_SHAPE = (1, 16384, 32, 128, 128)


@functools.lru_cache(maxsize=1)
def _gpu_inputs(chunk_size=64):
    B, T, HV, K, V = GPU_SHAPE
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    q = torch.nn.functional.normalize(rnd(B, T, HV, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, HV, K), dim=-1)
    # slowly decaying channels and a moderate beta keep M far from underflow over 16K tokens,
    # so that its relative error means something
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV, K) + torch.linspace(2.0, 12.0, K, device="cuda"))
    it = ref.chunk_kda_intermediates(q, k, rnd(B, T, HV, V), g, torch.sigmoid(rnd(B, T, HV) - 2.0),
                                     chunk_size=chunk_size)
    low = {n: getattr(it, n).to(torch.bfloat16) for n in ("qg", "kg", "w", "u")}
    low["gc"] = it.gc.float()
    low["do"] = rnd(B, T, HV, V).to(torch.bfloat16)
    low["dv"] = ref.chunk_dv_local(it.Aqk, low["do"].float(), SCALE, chunk_size=chunk_size).to(torch.bfloat16)
    x = {n: t.double() for n, t in low.items()}
    return low, x


@pytest.mark.gpu
def test_gpu_summaries_at_16k_bf16():
    low, x = _gpu_inputs()
    S_ref, M_ref = ref_summary(x)
    assert M_ref.norm() > 1e-20
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], precision=PINNED)
    # default: two bf16 pieces per state product (~16 bits; measured errors in benchmarks/RESULTS.md)
    assert rel_err(S, S_ref) < 5e-5 and rel_err(M, M_ref) < 2e-4
    S_only, _ = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], output="state", precision=PINNED)
    assert rel_err(S_only, S_ref) < 5e-5
    assert rel_err(kn.transition(low["kg"], low["w"], low["gc"], precision=PINNED), M_ref) < 2e-4
    dv_before = low["dv"].clone()
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  precision=PINNED)
    assert rel_err(G, ref_grad(x)) < 5e-5
    assert torch.equal(low["dv"], dv_before)


@pytest.mark.gpu
def test_gpu_head_range_segment_and_fp32():
    low, x = _gpu_inputs()
    n = 4096
    sub = {k: t[:, :n] for k, t in low.items()}
    subx = {k: t[:, :n] for k, t in x.items()}
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], head_start=8, num_heads=8, segment=(0, n),
                            precision=PINNED)
    S_ref, M_ref = ref_summary({k: t[:, :, 8:16] for k, t in subx.items()})
    assert rel_err(S, S_ref) < 1e-4 and rel_err(M, M_ref) < 1e-4
    f32 = {k: t.float() for k, t in sub.items()}
    S32, M32 = kn.state_summary(f32["kg"], f32["w"], f32["u"], f32["gc"], precision=PINNED)
    S_ref, M_ref = ref_summary(subx)
    assert rel_err(S32, S_ref) < 1e-4 and rel_err(M32, M_ref) < 1e-4
    G32 = kn.state_gradient_summary(f32["qg"], f32["kg"], f32["w"], f32["gc"], f32["do"], f32["dv"], SCALE,
                                    precision=PINNED)
    assert rel_err(G32, ref_grad(subx)) < 1e-4


@pytest.mark.gpu
def test_gpu_chunk_size_128_bf16():
    """128-token chunks need larger tiles: the launchers use fewer pipeline stages where the default
    ones do not fit in shared memory."""
    low, x = _gpu_inputs(128)
    S_ref, M_ref = ref_summary(x, chunk_size=128)
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], chunk_size=128, precision=PINNED)
    assert rel_err(S, S_ref) < 5e-5 and rel_err(M, M_ref) < 2e-4
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"], SCALE,
                                  chunk_size=128, precision=PINNED)
    assert rel_err(G, ref_grad(x, chunk_size=128)) < 5e-5


GDN_GPU_SHAPE = (1, 16384, 16, 32, 128, 128)  # Qwen3-Next: 16 q/k heads, 32 value heads, K = V = 128
GDN_GPU_CU = (0, 6000, 16384)


@functools.lru_cache(maxsize=1)
def _gdn_gpu_inputs():
    """Two packed sequences of real chunked-GDN intermediates in bf16 (scalar ``gc [1, T, HV]`` float32)."""
    B, T, H, HV, K, V = GDN_GPU_SHAPE
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    # one decay per token and head, slow enough that M stays far from underflow over 10K tokens
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV) + torch.linspace(6.0, 12.0, HV, device="cuda"))
    cu = torch.tensor(GDN_GPU_CU, dtype=torch.int64)
    it = ref.chunk_kda_intermediates(q, k, rnd(B, T, HV, V), ref.scalar_gate_as_kda(g, K)[0],
                                     torch.sigmoid(rnd(B, T, HV) - 2.0), cu_seqlens=cu.cuda())
    low = {n: getattr(it, n).to(torch.bfloat16) for n in ("qg", "kg", "w", "u")}
    low["gc"] = it.gc[..., 0].float().contiguous()
    low["do"] = rnd(B, T, HV, V).to(torch.bfloat16)
    low["dv"] = ref.chunk_dv_local(it.Aqk, low["do"].float(), SCALE, cu_seqlens=cu).to(torch.bfloat16)
    x = {n: t.double() for n, t in low.items()}
    x["gc"] = x["gc"].unsqueeze(-1).expand(B, T, HV, K)
    return low, x, cu


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["scalar", "zero_stride"])
def test_gpu_scalar_gate_qwen3_next_shapes_bf16(variant):
    low, x, cu = _gdn_gpu_inputs()
    K = GDN_GPU_SHAPE[4]
    gc = gate_variant(low["gc"], variant, K)
    S_ref, M_ref = ref_summary(x, cu)
    assert M_ref.norm() > 1e-20
    S, M = kn.state_summary(low["kg"], low["w"], low["u"], gc, cu_seqlens=cu, precision=PINNED)
    assert rel_err(S, S_ref) < 5e-5 and rel_err(M, M_ref) < 2e-4
    S_only, _ = kn.state_summary(low["kg"], low["w"], low["u"], gc, output="state", cu_seqlens=cu, precision=PINNED)
    assert rel_err(S_only, S_ref) < 5e-5
    assert rel_err(kn.transition(low["kg"], low["w"], gc, cu_seqlens=cu, precision=PINNED), M_ref) < 2e-4
    G = kn.state_gradient_summary(low["qg"], low["kg"], low["w"], gc, low["do"], low["dv"], SCALE, cu_seqlens=cu,
                                  precision=PINNED)
    assert rel_err(G, ref_grad(x, cu)) < 5e-5
    # one sequence of the batch, half the heads, no copies
    s, e = GDN_GPU_CU[1:]
    sub = {n: t[:, s:e, 8:24] for n, t in x.items()}
    S1, M1 = kn.state_summary(low["kg"], low["w"], low["u"], gc, head_start=8, num_heads=16, segment=(s, e),
                              precision=PINNED)
    S1_ref, M1_ref = ref_summary(sub)
    assert rel_err(S1, S1_ref) < 5e-5 and rel_err(M1, M1_ref) < 2e-4


@pytest.mark.gpu
def test_gpu_raw_keys_float32_accurate_qwen3_next_shapes_bf16():
    """Qwen3-Next shapes, bf16, 8K tokens: FLA's raw ``q, k [T, 16, K]`` with their gates applied inside
    the kernels in float32 keep float32-level accuracy against float64 (of the same inputs, gated in
    float64), a tenth or less of the pre-gated ``qg, kg [T, 32, K]`` path's bf16 rounding."""
    from kdacp.bench.kernels import make_gdn_inputs
    x, r = make_gdn_inputs(T=8192)
    K = x["k"].shape[-1]
    for gc in (x["gc"], x["gc"].unsqueeze(-1).expand(*x["gc"].shape, K)):
        raw = kn.state_summary(x["k"], x["w"], x["u"], gc, raw_keys=True, precision=PINNED)
        pre = kn.state_summary(x["kg"], x["w"], x["u"], gc, precision=PINNED)
        G_raw = kn.state_gradient_summary(x["q"], x["k"], x["w"], gc, x["do"], x["dv"], x["scale"], raw_keys=True,
                                          precision=PINNED)
        G_pre = kn.state_gradient_summary(x["qg"], x["kg"], x["w"], gc, x["do"], x["dv"], x["scale"], precision=PINNED)
        for got, pre_got, truth in ((raw.offset, pre.offset, r["S"]), (raw.transition, pre.transition, r["M"]),
                                    (G_raw, G_pre, r["G"])):
            assert torch.isfinite(got).all()
            # the pre-gated inputs carry bf16 rounding of the gated values (~1e-3); raw keys none
            assert rel_err(got, truth) < min(1e-4, 0.1 * rel_err(pre_got, truth)), (rel_err(got, truth),
                                                                                    rel_err(pre_got, truth))


GDN_GPU_PACKED_CU = (0, 1000, 2500, 4096)  # partial last chunks in every sequence


@pytest.mark.gpu
@pytest.mark.parametrize("config,precision,tol", [(None, "two_piece", 1e-4), (None, "exact", 1e-6),
                                                  (kn.SummaryConfig(chunks_per_program=4), "two_piece", 1e-4),
                                                  (kn.SummaryConfig(num_warps=8, num_stages=2), "two_piece", 1e-4)])
@pytest.mark.parametrize("w_head_first", [False, True])
def test_gpu_raw_keys_gradient_packed_bf16(config, precision, tol, w_head_first):
    """The raw-key ``G`` kernel on the GPU's bf16 path, where its update is one product of stacked
    ``q, w`` columns with both bf16 pieces side by side: packed sequences with partial chunks, grouped
    value heads, a head range starting inside a key head's group, sub-segments, three pieces."""
    cu = torch.tensor(GDN_GPU_PACKED_CU, dtype=torch.int64)
    low, _ = make_gdn(1, GDN_GPU_PACKED_CU[-1], 4, 8, 128, 128, torch.bfloat16, GDN_GPU_PACKED_CU)
    x = gated_from_raw(low, cu)
    w = low["w"].transpose(1, 2).contiguous() if w_head_first else low["w"]
    hs, nh = 1, 6
    G = kn.state_gradient_summary(low["q"], low["k"], w, low["gc"], low["do"], low["dv"], SCALE, cu_seqlens=cu,
                                  head_start=hs, num_heads=nh, w_head_first=w_head_first, raw_keys=True,
                                  config=config, precision=precision)
    G_ref = ref_grad({n: t[:, :, hs:hs + nh] for n, t in x.items() if n not in ("q", "k")}, cu)
    assert G.shape == (3, nh, 128, 128)
    assert rel_err(G, G_ref) < tol
