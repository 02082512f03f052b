"""Forward summary's time per chunk step at 1, 2 programs per SM (grid sized by heads), default config."""
import sys
import torch
from kdacp import kernels as kn
from kdacp.bench.kernels import make_inputs, median_ms
C = kn.SummaryConfig
for HV in ([int(a) for a in sys.argv[1:]] or [2, 4, 8, 16, 32]):
    x = make_inputs(HV=HV)
    for L in (128, 256):
        cfg = C(chunks_per_program=L)
        fn = lambda: kn.state_summary(x["kg"], x["w"], x["u"], x["gc"], chunk_size=64, output="both", config=cfg)
        fn(); torch.cuda.synchronize()
        ms = median_ms(fn)
        progs = 4 * HV * (256 // L)
        print(f"| HV={HV} L={L} | programs {progs} | {ms:.3f} ms | {1000 * ms / L:.2f} us/step |", flush=True)
