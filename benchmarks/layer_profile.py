#!/usr/bin/env python
"""Where a layer step's time goes: kdacp's KDA and GDN layers (forward + backward), per local backend, split into
the projections' matmuls and everything else, beside the matmuls' floor.

A layer's time is its token mixer's core passes plus its projections (and the convolution, norms and gates). A
goal for the layer on a faster core is reachable only if the core's time plus the projections' floor fits in it:
``floor_ms`` is the projections' FLOPs (``6 T`` times their weights: forward and both backward products) at the
GPU's dense bf16 peak (:data:`kdacp.bench.kernels.PEAK_FLOPS`, the H200's). Times are the profiler's device time of
each kernel over ``--steps`` profiled steps after ``--warmup`` (on the CPU: each op's own CPU time), per step;
``matmul_ms`` counts the kernels of cuBLAS (on the CPU: ``aten::mm``, ``addmm``, ``bmm``).

    python benchmarks/layer_profile.py [--tokens 16384] [--families kda,gdn] [--backends fla,attn_gym] [--top 12]

Prints one row per family and backend (backends not usable here are skipped, said on stderr), then each one's
``--top`` kernels by time.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kdacp.backends import backend_usable
from kdacp.bench.harness import markdown_table
from kdacp.bench.kernels import PEAK_FLOPS
from kdacp.bench.layer import LAYERS, layer_step
from kdacp.bench.timing import sync

# substrings of cuBLAS / CUTLASS matmul kernel names (lower case), and the CPU's matmul ops
GPU_MATMULS = ("gemm", "xmma", "cutlass", "nvjet", "cublas")
# kernels compiled by the CUTLASS DSL (attention-gym's core): the recurrence's, not the projections'
GPU_CORE_KERNELS = ("cutlass_dsl",)
CPU_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def is_matmul(name: str, device: torch.device) -> bool:
    """Whether the kernel or op ``name`` is a projection's matmul (cuBLAS's or CUTLASS's library kernels)."""
    if device.type == "cuda":
        lower = name.lower()
        return any(part in lower for part in GPU_MATMULS) and not any(part in lower for part in GPU_CORE_KERNELS)
    return name in CPU_MATMULS


def linear_weights(layer: torch.nn.Module) -> int:
    """The weights of the layer's ``nn.Linear`` projections (each applied once per token)."""
    return sum(m.in_features * m.out_features for m in layer.modules() if isinstance(m, torch.nn.Linear))


def kernel_times(layer, x, dy, device: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """``{kernel or op name: ms per step}`` of ``steps`` profiled forward + backward steps."""
    for _ in range(warmup):
        layer_step(layer, x, dy, None)
    sync(device)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            layer_step(layer, x, dy, None)
        sync(device)
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    per: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == kind:
            own = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
            per[event.name] += own / 1e3 / steps
    return dict(per)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens of one sequence (GPU: 16384, CPU: 64)")
    parser.add_argument("--hidden", type=int, default=None, help="GPU: 2048 (Kimi Linear / Qwen3-Next), CPU: 64")
    parser.add_argument("--heads", type=int, default=None, help="value heads (GPU: 32, CPU: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="GPU: 128, CPU: 16")
    parser.add_argument("--families", default="kda,gdn", help=f"comma-separated, from {tuple(LAYERS)}")
    parser.add_argument("--backends", default="fla,attn_gym", help="comma-separated local backends")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="kernels listed per family and backend")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    T = args.tokens or (16384 if gpu else 64)
    hidden, heads, head_dim = args.hidden or (2048 if gpu else 64), args.heads or (32 if gpu else 2), \
        args.head_dim or (128 if gpu else 16)
    families = args.families.split(",")
    if unknown := [f for f in families if f not in LAYERS]:
        parser.error(f"--families must be from {tuple(LAYERS)}, got {unknown}")
    dtype = torch.bfloat16 if gpu else torch.float32
    rows, tops = [], []
    for family in families:
        for backend in args.backends.split(","):
            if not backend_usable(backend, device):
                print(f"layer_profile: backend {backend!r} is not usable on {device}; skipped", file=sys.stderr)
                continue
            torch.manual_seed(0)
            layer = LAYERS[family](hidden, heads, head_dim, backend, device, dtype)
            gen = torch.Generator(device=device).manual_seed(1)
            x = torch.randn(1, T, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
            dy = torch.randn(1, T, hidden, device=device, dtype=dtype, generator=gen)
            times = kernel_times(layer, x, dy, device, args.warmup, args.steps)
            total = sum(times.values())
            matmul = sum(ms for name, ms in times.items() if is_matmul(name, device))
            rows.append(dict(family=family, backend=backend, tokens=T, total_ms=round(total, 3),
                             matmul_ms=round(matmul, 3), rest_ms=round(total - matmul, 3),
                             floor_ms=round(6 * T * linear_weights(layer) / PEAK_FLOPS * 1e3, 5)))
            for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
                tops.append(dict(family=family, backend=backend, kernel=name[:100], ms=round(ms, 3),
                                 matmul=is_matmul(name, device)))
    if not rows:
        print("layer_profile: no usable backend", file=sys.stderr)
        return 1
    print(markdown_table(rows))
    print()
    print(markdown_table(tops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
