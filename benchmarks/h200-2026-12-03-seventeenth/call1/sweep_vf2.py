"""Summary kernel tilings: the transposed state (A operand in registers) with more pipeline stages."""
import sys
import torch
sys.path.insert(0, ".abwork")
import stacked  # noqa: F401  (pieces stacked along M)
from kdacp import kernels as kn
from kdacp.bench.kernels import make_inputs, reference_summaries, rel_err, median_ms
C = kn.SummaryConfig
x = make_inputs()
r = reference_summaries(x)
gargs = (x["qg"], x["kg"], x["w"], x["gc"], x["do"], x["dv"], x["scale"])
fwd = [C(v_first=True), C(v_first=True, num_stages=3), C(v_first=True, num_stages=4),
       C(v_first=True, num_stages=3, block_v=32), C(v_first=True, num_stages=3, chunks_per_program=64),
       C(v_first=True, num_stages=3, chunks_per_program=256), C(num_stages=3), C(v_first=True, num_stages=3, num_warps=8)]
grad = [C(), C(v_first=True, block_v=64), C(v_first=True, block_v=64, num_stages=4), C(v_first=True, block_v=32),
        C(v_first=True, block_v=32, num_stages=4), C(v_first=True, block_v=64, num_stages=2), C(v_first=True, block_v=16)]
for which, cases in (("both", fwd[:3]),):
    for cfg in cases:
        tag = "stacked " + which + " " + " ".join(f"{k}={v}" for k, v in cfg.__dict__.items() if v is not None)
        try:
            if which == "grad":
                fn = lambda: kn.state_gradient_summary(*gargs, chunk_size=64, config=cfg)
                G = fn(); torch.cuda.synchronize(); errs = {"G": rel_err(G, r["G"])}
            else:
                fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both", config=cfg)
                S, M = fn(); torch.cuda.synchronize(); errs = {"S": rel_err(S, r["S"]), "M": rel_err(M, r["M"])}
            ms = median_ms(fn)
            print(f"| {tag} | {ms:.3f} | " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()) + " |", flush=True)
        except Exception as e:
            print(f"| {tag} | {type(e).__name__}: {str(e)[:200]} |", flush=True)
            if "illegal" in str(e) or "CUDA error" in str(e):
                break
