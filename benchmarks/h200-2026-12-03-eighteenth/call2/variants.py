"""Forward summary, gated keys, transposed tile: timing variants that leave one stage out (scratch)."""
import importlib, sys
import torch
import triton
import triton.language as tl
from kdacp import kernels as kn
from kdacp.kernels.precision import chunk_decay, dot_state_left
from kdacp.kernels.tiles import locate_program, initial_tile, store_tile, load_last_gate
from kdacp.bench.kernels import make_inputs, reference_summaries, rel_err, median_ms
ssm = importlib.import_module("kdacp.kernels.state_summary")


@triton.jit
def _var_kernel(kg, w, u, gc, ws, work,
                s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_ub, s_ut, s_uh, s_gb, s_gt, s_gh, s_gk,
                head_start, HV, key_group,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NCOL: tl.constexpr,
                MOFF: tl.constexpr, HAS_S: tl.constexpr, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr,
                VF: tl.constexpr, SCALAR_GATE: tl.constexpr, RAW_KEYS: tl.constexpr,
                U_MODE: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, DECAY: tl.constexpr):
    b, h, start, end, _, n_run, o_k, o_c = locate_program(work, head_start, MOFF, K, BT, BV)
    m_u = o_c < MOFF
    p_kg = kg + b * s_kb + h * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_u = u + b * s_ub + h * s_uh
    p_g = gc + b * s_gb + h * s_gh
    st = initial_tile(o_k, o_c, MOFF, True)
    o_t = tl.arange(0, BT)
    g_next = load_last_gate(p_g, s_gt, s_gk, start, end, 0, o_k, n_run > 0, BT, False)
    for i in range(n_run):
        t0 = start + i * BT
        rows = t0 + o_t
        m_t = rows < end
        b_decay = chunk_decay(g_next, SPLIT_BF16, NSPLIT)
        g_next = load_last_gate(p_g, s_gt, s_gk, start, end, i + 1, o_k, i + 1 < n_run, BT, False)
        b_wt = tl.load(p_w + rows[None, :] * s_wt + o_k[:, None], mask=m_t[None, :], other=0.0)
        b_kg = tl.load(p_kg + rows[:, None] * s_kt + o_k[None, :], mask=m_t[:, None], other=0.0)
        if P1 == 2:
            b_v = -dot_state_left(st, b_wt, SPLIT_BF16, NSPLIT)
        else:
            b_v = -tl.dot(st.to(tl.bfloat16), b_wt)
        if U_MODE == 1:  # u subtracted before the second product (as shipped)
            b_u = tl.load(p_u + rows[None, :] * s_ut + o_c[:, None], mask=m_t[None, :] & m_u[:, None],
                          other=0.0).to(tl.float32)
            b_v = b_v + b_u
        if DECAY:
            st = st * b_decay[None, :]
        if P2 == 2:
            st = st + dot_state_left(b_v, b_kg, SPLIT_BF16, NSPLIT)
        else:
            st = st + tl.dot(b_v.to(tl.bfloat16), b_kg)
        if U_MODE == 2:  # u^T kg as a product of its own, off the state's chain
            b_ut = tl.load(p_u + rows[None, :] * s_ut + o_c[:, None], mask=m_t[None, :] & m_u[:, None], other=0.0)
            st = st + tl.dot(b_ut, b_kg)
    store_tile(ws, HV, st, o_k, o_c, K, NCOL, True)


VARIANTS = {"shipped-copy": dict(U_MODE=1, P1=2, P2=2, DECAY=True),
            "no u": dict(U_MODE=0, P1=2, P2=2, DECAY=True),
            "u product apart": dict(U_MODE=2, P1=2, P2=2, DECAY=True),
            "one piece p1": dict(U_MODE=1, P1=1, P2=2, DECAY=True),
            "one piece p2": dict(U_MODE=1, P1=2, P2=1, DECAY=True),
            "one piece both": dict(U_MODE=1, P1=1, P2=1, DECAY=True),
            "no decay": dict(U_MODE=1, P1=2, P2=2, DECAY=False)}
orig = ssm._state_summary_kernel
dev = "cuda" if torch.cuda.is_available() else "cpu"
for HV in ((32, 16) if dev == "cuda" else (2,)):
    x = make_inputs(HV=HV, T=16384 if dev == "cuda" else 200, device=dev,
                    dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    r = reference_summaries(x)
    for L in ((128,) if dev == "cuda" else (2,)):
        cfg = kn.SummaryConfig(chunks_per_program=L)
        rows = [("shipped", None)] + list(VARIANTS.items())
        for name, flags in rows:
            if flags is None:
                ssm._state_summary_kernel = orig
            else:
                ssm._state_summary_kernel = lambda *a, _f=flags: None
                class K:
                    def __getitem__(self, grid, _f=flags):
                        return lambda *args, **kw: _var_kernel[grid](*args, **kw, **_f)
                ssm._state_summary_kernel = K()
            fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both", config=cfg)
            try:
                S, M = fn()
                ms = median_ms(fn) if dev == "cuda" else float("nan")
                print(f"| HV={HV} L={L} | {name} | {ms:.3f} | {1000 * ms / L:.2f} us/step | S {rel_err(S, r['S']):.1e} M {rel_err(M, r['M']):.1e} |", flush=True)
            except Exception as e:
                print(f"| HV={HV} L={L} | {name} | {type(e).__name__}: {str(e)[:200]} |", flush=True)
ssm._state_summary_kernel = orig
