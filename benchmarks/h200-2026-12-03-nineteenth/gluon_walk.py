"""Experiment: the forward summary walk (gated keys, transposed tile, two bf16 pieces) in Gluon, with
asynchronous wgmma so that each product's second piece is split while the first runs.

Same signature as kdacp.kernels.state_summary._state_summary_kernel, so launch_summary can run it.
Supports VF=True, SPLIT_BF16=True, NSPLIT=2, SCALAR_GATE=False, RAW_KEYS=False, BT=BV=64, K=128.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def _split(x, op_layout: gl.constexpr):
    hi = x.to(gl.bfloat16)
    lo = (x - hi.to(gl.float32)).to(gl.bfloat16)
    return gl.convert_layout(hi, op_layout), gl.convert_layout(lo, op_layout)


@gluon.jit
def _issue_loads(w_buf, kg_buf, p_w, p_kg, s_wt, s_kt, t0, end, rows_l, cols_l):
    rows = t0 + rows_l
    m = (rows < end)[:, None]
    async_copy.async_copy_global_to_shared(w_buf, p_w + rows[:, None] * s_wt + cols_l[None, :], mask=m)
    async_copy.async_copy_global_to_shared(kg_buf, p_kg + rows[:, None] * s_kt + cols_l[None, :], mask=m)


@gluon.jit
def _issue_u(u_buf, p_u, s_ut, t0, end, rows_v, cols_v, mu_v):
    rows = t0 + rows_v
    async_copy.async_copy_global_to_shared(u_buf, p_u + rows[:, None] * s_ut + cols_v[None, :],
                                           mask=(rows < end)[:, None] & mu_v[None, :])


@gluon.jit
def _load_gate(p_g, s_gt, s_gk, t0, end, o_k):
    last = gl.minimum(t0 + 64, end) - 1  # BT = 64
    return gl.load(p_g + last * s_gt + o_k * s_gk, mask=(o_k >= 0) & (t0 < end), other=0.0).to(gl.float32)


@gluon.jit
def _load_u(p_u, s_ut, t0, end, o_tu, o_cu, m_u):
    rows_u = t0 + o_tu
    return gl.load(p_u + rows_u[None, :] * s_ut + o_cu[:, None], mask=m_u & (rows_u < end)[None, :], other=0.0)


@gluon.jit
def gluon_summary_kernel(
    kg, w, u, gc, ws, work,
    s_kb, s_kt, s_kh, s_wb, s_wt, s_wh, s_ub, s_ut, s_uh, s_gb, s_gt, s_gh, s_gk,
    head_start, HV, key_group,
    K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, NCOL: gl.constexpr,
    MOFF: gl.constexpr, HAS_S: gl.constexpr, SPLIT_BF16: gl.constexpr, NSPLIT: gl.constexpr,
    VF: gl.constexpr, SCALAR_GATE: gl.constexpr, RAW_KEYS: gl.constexpr, PREFETCH: gl.constexpr = True,
    LO_FIRST: gl.constexpr = False, U_SMEM: gl.constexpr = False, U_BRANCH: gl.constexpr = False,
):
    gl.static_assert(VF and SPLIT_BF16 and NSPLIT == 2 and not SCALAR_GATE and not RAW_KEYS)
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    op_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t, k_width=2)  # S^T pieces [BV, K]
    op_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_k, k_width=2)  # v^T pieces [BV, BT]
    load_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                            order=[1, 0])
    tile_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, K], gl.bfloat16)

    i_c = gl.program_id(0)
    i_w = gl.program_id(1)
    i_h = gl.program_id(2)
    row = work + 4 * i_w
    b = gl.load(row)
    start = gl.load(row + 1)
    end = gl.load(row + 2)
    needs_t = gl.load(row + 3)
    n_chunks = gl.cdiv(end - start, BT)
    n_run = gl.where((i_c * BV >= MOFF) & (needs_t == 0), 0, n_chunks).to(gl.int32)
    h = (head_start + i_h).to(gl.int64)
    p_kg = kg + b * s_kb + (h // key_group) * s_kh
    p_w = w + b * s_wb + h * s_wh
    p_u = u + b * s_ub + h * s_uh
    p_g = gc + b * s_gb + h * s_gh

    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, mma_k))
    o_c = i_c * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, mma_k))
    st = gl.where((o_c - MOFF)[:, None] == o_k[None, :], 1.0, 0.0).to(gl.float32)

    o_cu = i_c * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, mma_t))
    o_tu = gl.arange(0, BT, layout=gl.SliceLayout(0, mma_t))
    m_u = (o_cu < MOFF)[:, None]
    rows_l = gl.arange(0, BT, layout=gl.SliceLayout(1, load_l))
    cols_l = gl.arange(0, K, layout=gl.SliceLayout(0, load_l))

    w_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], tile_sl)
    kg_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], tile_sl)
    u_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                         order=[1, 0])
    u_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], gl.bfloat16)
    u_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BV], u_sl)
    rows_v = gl.arange(0, BT, layout=gl.SliceLayout(1, u_l))
    cols_v = i_c * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, u_l))
    mu_v = cols_v < MOFF
    is_s = i_c * BV < MOFF

    if n_run > 0:
        _issue_loads(w_buf.index(0), kg_buf.index(0), p_w, p_kg, s_wt, s_kt, start, end, rows_l, cols_l)
        if U_SMEM:
            _issue_u(u_buf.index(0), p_u, s_ut, start, end, rows_v, cols_v, mu_v)
        async_copy.commit_group()
    u_next = _load_u(p_u, s_ut, start, end, o_tu, o_cu, m_u)
    for i in range(n_run):
        t0 = start + i * BT
        # the next chunk's tiles go into the other buffer while this one is used
        if i + 1 < n_run:
            _issue_loads(w_buf.index((i + 1) % 2), kg_buf.index((i + 1) % 2), p_w, p_kg, s_wt, s_kt, t0 + BT, end,
                         rows_l, cols_l)
            if U_SMEM:
                _issue_u(u_buf.index((i + 1) % 2), p_u, s_ut, t0 + BT, end, rows_v, cols_v, mu_v)
            async_copy.commit_group()
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
        gl.thread_barrier()
        fence_async_shared()
        # the gate row is needed only at the step's end: its load runs under the products
        g_row = _load_gate(p_g, s_gt, s_gk, t0, end, o_k)
        if U_SMEM:
            b_u = u_buf.index(i % 2).permute((1, 0)).load(mma_t).to(gl.float32)
        elif PREFETCH:  # this chunk's u was loaded during the previous step
            b_u = u_next.to(gl.float32)
            u_next = _load_u(p_u, s_ut, t0 + BT, end, o_tu, o_cu, m_u)
        else:
            b_u = _load_u(p_u, s_ut, t0, end, o_tu, o_cu, m_u).to(gl.float32)
        wt = w_buf.index(i % 2).permute((1, 0))  # [K, BT]
        kgt = kg_buf.index(i % 2)  # [BT, K]
        # v^T = u^T - S^T w^T, the state's high piece first; its low piece is split while that runs
        if LO_FIRST:
            s_hi = gl.convert_layout(st.to(gl.bfloat16), op_t)
            s_lo = gl.convert_layout((st - st.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_t)
            acc = warpgroup_mma(s_lo, wt, gl.zeros([BV, BT], gl.float32, mma_t), use_acc=False, is_async=True)
            acc = warpgroup_mma(s_hi, wt, acc, is_async=True)
        else:
            s_hi = gl.convert_layout(st.to(gl.bfloat16), op_t)
            acc = warpgroup_mma(s_hi, wt, gl.zeros([BV, BT], gl.float32, mma_t), use_acc=False, is_async=True)
            s_lo = gl.convert_layout((st - st.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_t)
            acc = warpgroup_mma(s_lo, wt, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_hi, s_lo))[0]
        if U_BRANCH:
            if is_s:
                v = b_u - acc
            else:
                v = -acc
        else:
            v = b_u - acc
        v_hi = gl.convert_layout(v.to(gl.bfloat16), op_k)
        if LO_FIRST:
            v_lo = gl.convert_layout((v - v.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_k)
            acc2 = warpgroup_mma(v_lo, kgt, gl.zeros([BV, K], gl.float32, mma_k), use_acc=False, is_async=True)
            acc2 = warpgroup_mma(v_hi, kgt, acc2, is_async=True)
        else:
            acc2 = warpgroup_mma(v_hi, kgt, gl.zeros([BV, K], gl.float32, mma_k), use_acc=False, is_async=True)
            v_lo = gl.convert_layout((v - v.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_k)
            acc2 = warpgroup_mma(v_lo, kgt, acc2, is_async=True)
        acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2, v_hi, v_lo))[0]
        st = st * gl.exp2(g_row)[None, :] + acc2
    base = (i_w * HV + i_h).to(gl.int64) * K
    gl.store(ws + (base + o_k[None, :]) * NCOL + o_c[:, None], st)


from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier


@gluon.jit
def gluon_summary_tma_kernel(
    kg_desc, w_desc, u_desc, gc, ws, work,
    T, s_gb, s_gt, s_gh, s_gk, head_start, HV, key_group,
    K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr, BV: gl.constexpr, NCOL: gl.constexpr,
    MOFF: gl.constexpr,
):
    """The walk with its tiles brought by TMA (w, kg as [B*T, HV*K] 2-d views, u as [B*T, HV*V]); rows past
    a sub-segment's end arrive with the next sequence's data, so v_new's columns there are zeroed."""
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    op_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t, k_width=2)
    op_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_k, k_width=2)

    i_c = gl.program_id(0)
    i_w = gl.program_id(1)
    i_h = gl.program_id(2)
    row = work + 4 * i_w
    b = gl.load(row)
    start = gl.load(row + 1)
    end = gl.load(row + 2)
    needs_t = gl.load(row + 3)
    n_chunks = gl.cdiv(end - start, BT)
    n_run = gl.where((i_c * BV >= MOFF) & (needs_t == 0), 0, n_chunks).to(gl.int32)
    h = head_start + i_h
    p_g = gc + b * s_gb + h.to(gl.int64) * s_gh
    is_s = i_c * BV < MOFF
    row0 = (b * T + start).to(gl.int32)
    kcol = ((h // key_group) * K).to(gl.int32)
    wcol = (h * K).to(gl.int32)
    ucol = (h * V + i_c * BV).to(gl.int32)

    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, mma_k))
    o_c = i_c * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, mma_k))
    st = gl.where((o_c - MOFF)[:, None] == o_k[None, :], 1.0, 0.0).to(gl.float32)
    o_tu = gl.arange(0, BT, layout=gl.SliceLayout(0, mma_t))

    w_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], w_desc.layout)
    kg_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], kg_desc.layout)
    u_buf = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BV], u_desc.layout)
    bar_wk = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    bar_u = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(bar_wk.index(s), count=1)
        mbarrier.init(bar_u.index(s), count=1)
    WK_BYTES: gl.constexpr = 2 * BT * K * 2
    U_BYTES: gl.constexpr = BT * BV * 2

    go = n_run > 0
    mbarrier.expect(bar_wk.index(0), WK_BYTES, pred=go)
    tma.async_copy_global_to_shared(w_desc, [row0, wcol], bar_wk.index(0), w_buf.index(0), pred=go)
    tma.async_copy_global_to_shared(kg_desc, [row0, kcol], bar_wk.index(0), kg_buf.index(0), pred=go)
    mbarrier.expect(bar_u.index(0), U_BYTES, pred=go & is_s)
    tma.async_copy_global_to_shared(u_desc, [row0, ucol], bar_u.index(0), u_buf.index(0), pred=go & is_s)
    for i in range(n_run):
        t0 = start + i * BT
        nxt = i + 1 < n_run
        sn = (i + 1) % 2
        rn = row0 + (i + 1) * BT
        mbarrier.expect(bar_wk.index(sn), WK_BYTES, pred=nxt)
        tma.async_copy_global_to_shared(w_desc, [rn, wcol], bar_wk.index(sn), w_buf.index(sn), pred=nxt)
        tma.async_copy_global_to_shared(kg_desc, [rn, kcol], bar_wk.index(sn), kg_buf.index(sn), pred=nxt)
        mbarrier.expect(bar_u.index(sn), U_BYTES, pred=nxt & is_s)
        tma.async_copy_global_to_shared(u_desc, [rn, ucol], bar_u.index(sn), u_buf.index(sn), pred=nxt & is_s)
        g_row = _load_gate(p_g, s_gt, s_gk, t0, end, o_k)
        valid = (t0 + o_tu) < end
        sc = i % 2
        ph = (i // 2) & 1
        mbarrier.wait(bar_wk.index(sc), ph)
        wt = w_buf.index(sc).permute((1, 0))
        kgt = kg_buf.index(sc)
        s_hi = gl.convert_layout(st.to(gl.bfloat16), op_t)
        s_lo = gl.convert_layout((st - st.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_t)
        acc = warpgroup_mma(s_lo, wt, gl.zeros([BV, BT], gl.float32, mma_t), use_acc=False, is_async=True)
        acc = warpgroup_mma(s_hi, wt, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_hi, s_lo))[0]
        if is_s:
            mbarrier.wait(bar_u.index(sc), ph)
            v = u_buf.index(sc).permute((1, 0)).load(mma_t).to(gl.float32) - acc
        else:
            v = -acc
        v = gl.where(valid[None, :], v, 0.0)
        v_hi = gl.convert_layout(v.to(gl.bfloat16), op_k)
        v_lo = gl.convert_layout((v - v.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16), op_k)
        acc2 = warpgroup_mma(v_lo, kgt, gl.zeros([BV, K], gl.float32, mma_k), use_acc=False, is_async=True)
        acc2 = warpgroup_mma(v_hi, kgt, acc2, is_async=True)
        acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2, v_hi, v_lo))[0]
        st = st * gl.exp2(g_row)[None, :] + acc2
    for s in gl.static_range(2):
        mbarrier.invalidate(bar_wk.index(s))
        mbarrier.invalidate(bar_u.index(s))
    base = (i_w * HV + i_h).to(gl.int64) * K
    gl.store(ws + (base + o_k[None, :]) * NCOL + o_c[:, None], st)
