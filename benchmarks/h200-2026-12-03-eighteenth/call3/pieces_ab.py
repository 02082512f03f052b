"""Forward only, through role, one sequence 16K: the pass in pieces against along the whole rank (scratch)."""
import torch, triton
from kdacp.affine import entry_states
from kdacp.backends.base import Span
from kdacp.backends.call import prepare_call
from kdacp.bench.harness import load_module_file
from kdacp.bench.overhead import ReadyExchange, role_plans, make_inputs, KDA_OPTIONS, GDN_OPTIONS
from kdacp.bench.timing import time_queued
from kdacp.distributed import orchestration as new
from kdacp.gdn import gdn_as_kda_arguments
old = load_module_file(".abwork/orchestration_before_pieces.py", "kdacp.distributed._orchestration_old")
dev = torch.device("cuda")
T, heads = 16384, 32

def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

for family in ("gdn", "kda"):
    x = make_inputs(T, heads if family == "kda" else heads // 2, heads, 128, 128, torch.bfloat16, dev)
    if family == "kda":
        call = prepare_call("fla", **x, scale=None, **KDA_OPTIONS)
    else:
        gate = gdn_as_kda_arguments(x["q"], x["v"], x["g"][..., 0], True, x["A_log"], x["dt_bias"][:heads])
        gate.pop("use_gate_in_kernel")
        call = prepare_call("fla", q=x["q"], k=x["k"], v=x["v"], beta=x["beta"], **gate, scale=None, **GDN_OPTIONS)
    backend = call.backend
    backend.parallel_pieces = True
    print(f"{family}: backend {type(backend).__name__}")
    plan, one = role_plans("one_sequence", T)["through"]
    ex = ReadyExchange()
    fns = {m: (lambda m=m, p=p: m.cp_forward(backend, p, call.inputs, None, False, torch.float32, exchange=ex).o)
           for m, p in ((old, plan), (new, plan))}
    fns = {"old": fns[old], "new": fns[new],
           "one": lambda: new.cp_forward(backend, one, call.inputs, None, False, torch.float32, exchange=ex).o}
    o_old, o_new, o_one = fns["old"](), fns["new"](), fns["one"]()
    ms = time_queued(fns, 1, 7, 3, dev)
    print(f"| {family} through fwd | o new vs old {rel(o_new, o_old):.2e} | old {ms['old']:.3f} | new {ms['new']:.3f} | "
          f"new/old {ms['new'] / ms['old']:.3f} | one device {ms['one']:.3f} |", flush=True)
    # the stage alone: the pass along the rank against the pass over the summary's pieces
    span = Span(0, T, (0, T))
    chunks = backend.prepare(call.inputs, span)
    pieces = backend.state_summary(chunks, span, True, parts=True)
    h0 = torch.randn(1, heads, 128, 128, device=dev)
    init = entry_states(pieces, h0)
    cut = span.cut(pieces.starts)
    whole_ms = triton.testing.do_bench(lambda: backend.state_pass(chunks, span, h0, False), return_mode="median")
    cut_ms = triton.testing.do_bench(lambda: backend.state_pass(chunks, cut, init, False), return_mode="median")
    entry_ms = triton.testing.do_bench(lambda: entry_states(pieces, h0), return_mode="median")
    print(f"| {family} state pass | whole {whole_ms:.3f} | {len(pieces.starts)} pieces {cut_ms:.3f} | entry states {entry_ms:.3f} |", flush=True)
