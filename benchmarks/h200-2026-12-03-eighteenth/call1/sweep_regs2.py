"""Forward summary: register limits for three programs per SM, and the K-halves variant (scratch)."""
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
from kdacp import kernels as kn
import importlib; ssm = importlib.import_module("kdacp.kernels.state_summary")
from kdacp.bench.kernels import make_inputs, reference_summaries, rel_err, median_ms
import khwalk
C = kn.SummaryConfig
dev = "cuda" if torch.cuda.is_available() else "cpu"
T = 16384 if dev == "cuda" else 300
x = make_inputs(T=T, HV=32 if dev == "cuda" else 2, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
r = reference_summaries(x)
orig = ssm._state_summary_kernel
cases = [("orig", C()), ("orig", C(chunks_per_program=86)),
         ("orig", C(max_registers=168, chunks_per_program=86)), ("orig", C(max_registers=168, chunks_per_program=64)),
         ("orig", C(max_registers=160, chunks_per_program=86)), ("orig", C(max_registers=168)),
         ("orig", C(max_registers=168, chunks_per_program=86, num_stages=3)),
         ("kh", C()), ("kh", C(max_registers=168, chunks_per_program=86)), ("kh", C(max_registers=168, chunks_per_program=64)),
         ("kh", C(max_registers=168, chunks_per_program=86, num_stages=3))]
if dev == "cpu":
    cases = [("orig", C(chunks_per_program=2)), ("kh", C(chunks_per_program=2)), ("kh", C())]
for which, cfg in cases:
    ssm._state_summary_kernel = orig if which == "orig" else khwalk._kh_kernel
    tag = which + " " + (" ".join(f"{k}={v}" for k, v in cfg.__dict__.items() if v is not None) or "default")
    try:
        fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both", config=cfg)
        S, M = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        ms = median_ms(fn) if dev == "cuda" else float("nan")
        print(f"| {tag} | {ms:.3f} | S {rel_err(S, r['S']):.2e} M {rel_err(M, r['M']):.2e} |", flush=True)
    except Exception as e:
        print(f"| {tag} | {type(e).__name__}: {str(e)[:200]} |", flush=True)
        if "illegal" in str(e) or "CUDA error" in str(e):
            break
ssm._state_summary_kernel = orig
