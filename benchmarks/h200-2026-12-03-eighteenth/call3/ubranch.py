"""Forward summary: the M-column programs walk without u (a runtime branch around two instances of the walk)."""
import importlib
import torch
import triton
import triton.language as tl
from kdacp import kernels as kn
from kdacp.kernels.tiles import locate_program, initial_tile, store_tile
from kdacp.bench.kernels import make_inputs, reference_summaries, rel_err, median_ms
ssm = importlib.import_module("kdacp.kernels.state_summary")
_walk = ssm._walk


@triton.jit
def _branch_kernel(kg, w, u, gc, ws, work,
                   s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_ub, s_ut, s_uh, s_gb, s_gt, s_gh, s_gk,
                   head_start, HV, key_group,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NCOL: tl.constexpr,
                   MOFF: tl.constexpr, HAS_S: tl.constexpr, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr,
                   VF: tl.constexpr, SCALAR_GATE: tl.constexpr, RAW_KEYS: tl.constexpr):
    b, h, start, end, _, n_run, o_k, o_c = locate_program(work, head_start, MOFF, K, BT, BV)
    m_u = o_c < MOFF
    p_kg = kg + b * s_kb + (h // key_group) * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_u = u + b * s_ub + h * s_uh
    p_g = gc + b * s_gb + h * s_gh
    st = initial_tile(o_k, o_c, MOFF, VF)
    if HAS_S and tl.program_id(0) * BV < MOFF:
        st = _walk(st, p_kg, p_w, p_u, p_g, s_kt, s_wt, s_ut, s_gt, s_gk, start, end, n_run, o_k, o_c, m_u,
                   BT, BV, True, SPLIT_BF16, NSPLIT, VF, SCALAR_GATE, RAW_KEYS)
    else:
        st = _walk(st, p_kg, p_w, p_u, p_g, s_kt, s_wt, s_ut, s_gt, s_gk, start, end, n_run, o_k, o_c, m_u,
                   BT, BV, False, SPLIT_BF16, NSPLIT, VF, SCALAR_GATE, RAW_KEYS)
    store_tile(ws, HV, st, o_k, o_c, K, NCOL, VF)


orig = ssm._state_summary_kernel
dev = "cuda" if torch.cuda.is_available() else "cpu"
x = make_inputs(HV=32 if dev == "cuda" else 2, T=16384 if dev == "cuda" else 200, device=dev,
                dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
r = reference_summaries(x)
for name, kern in (("shipped", orig), ("u only on S tiles", _branch_kernel), ("shipped again", orig)):
    ssm._state_summary_kernel = kern
    for L in ((None, 86) if dev == "cuda" else (2,)):
        cfg = kn.SummaryConfig(chunks_per_program=L)
        fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both", config=cfg)
        S, M = fn()
        ms = median_ms(fn) if dev == "cuda" else float("nan")
        print(f"| {name} L={L} | {ms:.3f} | S {rel_err(S, r['S']):.1e} M {rel_err(M, r['M']):.1e} |", flush=True)
ssm._state_summary_kernel = orig
