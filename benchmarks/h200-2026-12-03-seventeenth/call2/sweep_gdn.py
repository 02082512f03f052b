"""GDN summary (raw keys, scalar gate) with the state held transposed."""
import torch
from kdacp import kernels as kn
from kdacp.bench.kernels import make_gdn_inputs, rel_err, median_ms
C = kn.SummaryConfig
x, r = make_gdn_inputs()
for gate in ("scalar", "zero-stride"):
    gc = x["gc"] if gate == "scalar" else x["gc"].unsqueeze(-1).expand(*x["gc"].shape, 128)
    for cfg in (C(v_first=False), C(v_first=True), C(v_first=True, num_stages=3)):
        fn = lambda: kn.state_summary(x["k"], x["w"], x["u"], gc, chunk_size=64, raw_keys=True, config=cfg)
        S, M = fn(); torch.cuda.synchronize()
        print(f"| gdn raw k {gate} v_first={cfg.v_first} stages={cfg.num_stages} | {median_ms(fn):.3f} | S {rel_err(S, r['S']):.2e} M {rel_err(M, r['M']):.2e} |", flush=True)
    for cfg in (C(v_first=False), C(v_first=True)):
        fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], gc, chunk_size=64, config=cfg)
        S, M = fn(); torch.cuda.synchronize()
        print(f"| gdn gated k {gate} v_first={cfg.v_first} | {median_ms(fn):.3f} | S {rel_err(S, r['S']):.2e} M {rel_err(M, r['M']):.2e} |", flush=True)
