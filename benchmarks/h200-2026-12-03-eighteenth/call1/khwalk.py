import triton
import triton.language as tl
from kdacp.kernels.precision import chunk_decay, dot_state_left
from kdacp.kernels.tiles import locate_program, load_last_gate


@triton.jit
def _kh_kernel(kg, w, u, gc, ws, work,
               s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_ub, s_ut, s_uh, s_gb, s_gt, s_gh, s_gk,
               head_start, HV, key_group,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NCOL: tl.constexpr,
               MOFF: tl.constexpr, HAS_S: tl.constexpr, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr,
               VF: tl.constexpr, SCALAR_GATE: tl.constexpr, RAW_KEYS: tl.constexpr):
    b, h, start, end, _, n_run, o_k, o_c = locate_program(work, head_start, MOFF, K, BT, BV)
    KH: tl.constexpr = K // 2
    o_a = tl.arange(0, KH)
    o_b = KH + tl.arange(0, KH)
    m_u = o_c < MOFF
    p_kg = kg + b * s_kb + (h // key_group) * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_u = u + b * s_ub + h * s_uh
    p_g = gc + b * s_gb + h * s_gh
    st_a = tl.where((o_c - MOFF)[:, None] == o_a[None, :], 1.0, 0.0).to(tl.float32)
    st_b = tl.where((o_c - MOFF)[:, None] == o_b[None, :], 1.0, 0.0).to(tl.float32)
    o_t = tl.arange(0, BT)
    for i in range(n_run):
        t0 = start + i * BT
        rows = t0 + o_t
        m_t = rows < end
        last = tl.minimum(t0 + BT, end) - 1
        d_a = chunk_decay(tl.load(p_g + last * s_gt + o_a * s_gk), SPLIT_BF16, NSPLIT)
        d_b = chunk_decay(tl.load(p_g + last * s_gt + o_b * s_gk), SPLIT_BF16, NSPLIT)
        w_a = tl.load(p_w + rows[None, :] * s_wt + o_a[:, None], mask=m_t[None, :], other=0.0)
        w_b = tl.load(p_w + rows[None, :] * s_wt + o_b[:, None], mask=m_t[None, :], other=0.0)
        b_u = tl.load(p_u + rows[None, :] * s_ut + o_c[:, None], mask=m_t[None, :] & m_u[:, None],
                      other=0.0).to(tl.float32)
        b_v = b_u - dot_state_left(st_a, w_a, SPLIT_BF16, NSPLIT) - dot_state_left(st_b, w_b, SPLIT_BF16, NSPLIT)
        k_a = tl.load(p_kg + rows[:, None] * s_kt + o_a[None, :], mask=m_t[:, None], other=0.0)
        st_a = st_a * d_a[None, :] + dot_state_left(b_v, k_a, SPLIT_BF16, NSPLIT)
        k_b = tl.load(p_kg + rows[:, None] * s_kt + o_b[None, :], mask=m_t[:, None], other=0.0)
        st_b = st_b * d_b[None, :] + dot_state_left(b_v, k_b, SPLIT_BF16, NSPLIT)
    base = (tl.program_id(1) * HV + tl.program_id(2)).to(tl.int64) * K
    tl.store(ws + (base + o_a[None, :]) * NCOL + o_c[:, None], st_a)
    tl.store(ws + (base + o_b[None, :]) * NCOL + o_c[:, None], st_b)
