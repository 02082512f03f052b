"""Where a CUDA-graph capture of the split op fails: KDA (8,192 tokens, 4 heads of 128, one sequence, Kimi Linear's
gate, bf16, ``backend="fla"``) captured by :func:`kdacp.bench.timing.capture` after two warm-up calls on a side
stream, as ``tests/cp/test_split_gpu.py::test_split_replays_from_a_cuda_graph`` captures it, in one of these modes:

- ``fb8``: forward + backward cut into 8 pieces, an eager call on the default stream first (the test's order);
- ``fb8_noeager``: the same without the eager call (``benchmarks/cuda_graph.py``'s order for the layer);
- ``fb8_loss``: the backward from a scalar formed inside the capture instead of a gradient made outside it;
- ``fb_none``: forward + backward uncut; ``fwd8``: the forward alone, cut.

Prints ``MODE OK largest-difference-from-eager`` or ``MODE FAILED error`` followed by the last kdacp functions and C
calls entered during the capture, on every thread (the autograd engine runs the backward on its own), the culprit
among the last, then the failure's last frames. One mode a process: a failed capture leaves the CUDA context unusable.

    python benchmarks/split_graph_probe.py MODE
"""
from __future__ import annotations

import argparse
import collections
import sys
import threading
import traceback

import torch

from kdacp.bench.inputs import random_inputs
from kdacp.bench.timing import capture
from kdacp.ops.kda import chunk_kda

MODES = ("fb8", "fb8_noeager", "fb8_loss", "fb_none", "fwd8")
# Python 3.12 reaches the threads already running (the autograd engine's); before it, this thread only
every_thread = getattr(threading, "setprofile_all_threads", lambda fn: None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    mode = parser.parse_args().mode
    T, H = 8192, 4
    x = random_inputs(T, H, H, 128, 128, gate="kda", seed=3)
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0,
                   A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(), backend="fla",
                   split=None if mode == "fb_none" else 8)
    tensors = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    tensors["initial_state"] = torch.randn(1, H, 128, 128, device="cuda") * 0.1
    leaves = {n: t.detach().requires_grad_() for n, t in tensors.items()}
    do = torch.randn(tensors["v"].shape, device="cuda", dtype=torch.bfloat16)

    def step():
        o, final = chunk_kda(**leaves, **options)
        if mode == "fwd8":
            return o, final
        if mode == "fb8_loss":
            return (o, final, *torch.autograd.grad((o.float() * do.float()).sum(), list(leaves.values())))
        return (o, final, *torch.autograd.grad(o, list(leaves.values()), do))

    trail: collections.deque = collections.deque(maxlen=60)

    def profile(frame, event, arg):
        if event == "call" and "/kdacp/" in frame.f_code.co_filename:
            trail.append(f"{frame.f_code.co_filename.split('/kdacp/')[-1]}:{frame.f_code.co_name}")
        elif event == "c_call":
            trail.append(f"  c: {getattr(arg, '__qualname__', arg)}")

    def traced():  # the calls entered are recorded inside the capture only
        if not torch.cuda.is_current_stream_capturing():
            return step()
        sys.setprofile(profile)
        every_thread(profile)
        try:
            return step()
        finally:
            sys.setprofile(None)
            every_thread(None)

    eager = None if mode == "fb8_noeager" else [t.clone() for t in step()]
    try:
        graph, out = capture(traced, warmup=2)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the probe's answer
        print(mode, "FAILED", type(error).__name__, str(error).splitlines()[0])
        print("\n".join(trail))
        traceback.print_exc(limit=-12, file=sys.stdout)  # where it was raised: the last frames
        return 1
    worst = None if eager is None else max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, eager))
    print(mode, "OK", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
