"""Does the transition walk overlap FLA's state pass on a second stream? (scratch timing)"""
import torch
from kdacp import kernels as kn
from kdacp.backends.fla_adapter import load_fla
from kdacp.bench.kernels import make_inputs, median_ms
fla = load_fla()
x = make_inputs()
kg, w, u, gc = x["kg"], x["w"], x["u"], x["gc"]
side = torch.cuda.Stream()
def fwd_h():
    return fla.chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=gc, initial_state=None, output_final_state=True, chunk_size=64)
def walk(L, out="transition"):
    return kn.state_summary(kg, w, u, gc, chunk_size=64, output=out, config=kn.SummaryConfig(chunks_per_program=L))
def both(L, out="transition"):
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        walk(L, out)
    fwd_h()
    main.wait_stream(side)
print(f"| fwd_h alone | {median_ms(fwd_h):.3f} |")
for out in ("transition", "both"):
    for L in (64, 128, 256):
        a = median_ms(lambda: walk(L, out))
        b = median_ms(lambda: both(L, out))
        print(f"| {out} L={L} alone | {a:.3f} | with fwd_h on two streams | {b:.3f} |", flush=True)
