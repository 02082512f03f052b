"""One device call: the Gluon walk against the Triton kernel (errors vs float64, device time)."""
import sys, time, json
sys.path.insert(0, '.abwork')
import torch, triton
import kdacp.kernels as kn
import importlib; ss = importlib.import_module("kdacp.kernels.state_summary")
from kdacp.kernels.config import SummaryConfig
from kdacp.bench.kernels import make_inputs, reference_summaries, rel_err, median_ms
import gluon_walk

TRITON = ss._state_summary_kernel


class Variant:
    def __init__(self, **consts):
        self.consts = consts

    def __getitem__(self, grid):
        return lambda *a, **kw: gluon_walk.gluon_summary_kernel[grid](*a, **self.consts, **kw)


class TmaVariant:
    """The TMA kernel behind the Triton kernel's call signature (2-d views of contiguous kg, w, u)."""

    def __getitem__(self, grid):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        def launch(kg, w, u, gc, ws, work, *scalars, K, V, BT, BV, NCOL, MOFF, num_warps, **_):
            B, T = w.shape[0], w.shape[1]

            def desc(x, cols):
                x2 = x.reshape(B * T, -1)
                assert x2.data_ptr() == x.data_ptr()
                return TensorDescriptor.from_tensor(x2, [BT, cols], gl.NVMMASharedLayout.get_default_for([BT, cols], gl.bfloat16))
            s_gb, s_gt, s_gh, s_gk, head_start, HV, key_group = scalars[9:16]
            gluon_walk.gluon_summary_tma_kernel[grid](desc(kg, K), desc(w, K), desc(u, BV), gc, ws, work, T, s_gb, s_gt,
                                                       s_gh, s_gk, head_start, HV, key_group, K=K, V=V, BT=BT, BV=BV,
                                                       NCOL=NCOL, MOFF=MOFF, num_warps=num_warps)
        return launch


variants = {"triton": TRITON, "g_lo_usmem": Variant(LO_FIRST=True, U_SMEM=True),
            "g_lo_usmem_branch": Variant(LO_FIRST=True, U_SMEM=True, U_BRANCH=True), "g_tma": TmaVariant()}


def run(name, *a, **kw):
    ss._state_summary_kernel = variants[name]
    try:
        return kn.state_summary(*a, **kw)
    finally:
        ss._state_summary_kernel = TRITON


x = make_inputs(T=16384)
import os
if os.environ.get("NCU_ONLY"):
    for name in variants:
        run(name, x["kg"], x["w"], x["u"], x["gc"])
    torch.cuda.synchronize()
    sys.exit(0)
ref = reference_summaries(x)
out = {}
args = (x["kg"], x["w"], x["u"], x["gc"])
for name in variants:
    t = time.time()
    try:
        r = run(name, *args)
        torch.cuda.synchronize()
    except Exception as e:
        print(name, "FAILED", repr(e)[:2000]); continue
    print(f"{name}: first call {time.time()-t:.1f}s  S err {rel_err(r.state, ref['S']):.2e}  M err {rel_err(r.transition, ref['M']):.2e}", flush=True)
    out[name] = r
# packed, partial chunks, against the Triton kernel
cu = torch.tensor([0, 1000, 5003, 9000, 16384 - 37], dtype=torch.int64)
xs = {n: (t[:, :16384 - 37] if t.dim() == 4 else t) for n, t in x.items() if isinstance(t, torch.Tensor)}
pk = (xs["kg"], xs["w"], xs["u"], xs["gc"])
base = run("triton", *pk, cu_seqlens=cu)
for name in variants:
    if name == "triton" or name not in out: continue
    r = run(name, *pk, cu_seqlens=cu)
    print(f"{name} packed vs triton: S {rel_err(r.state, base.state):.2e} M {rel_err(r.transition, base.transition):.2e}", flush=True)
    for L in (32, 256):
        r = run(name, *args, config=SummaryConfig(chunks_per_program=L))
        print(f"  L={L}: S err {rel_err(r.state, ref['S']):.2e} M err {rel_err(r.transition, ref['M']):.2e}")
# timing, contenders alternating
rows = []
for L in (None, 256):
    cfg = None if L is None else SummaryConfig(chunks_per_program=L)
    for rep in range(2):
        for name in variants:
            if name not in out: continue
            for output in ("both", "transition"):
                ms = median_ms(lambda: run(name, *args, output=output, config=cfg))
                rows.append((L, rep, name, output, ms))
                print(f"L={L} rep={rep} {name:18s} {output:10s} {ms:.4f} ms", flush=True)
print("\n| chunks/program | kernel | output | ms (2 reps) |\n|---|---|---|---|")
for L in (None, 256):
    for name in variants:
        for output in ("both", "transition"):
            v = [r[4] for r in rows if r[0] == L and r[2] == name and r[3] == output]
            if v: print(f"| {L or 'planner'} | {name} | {output} | {' / '.join(f'{t:.3f}' for t in v)} |")
