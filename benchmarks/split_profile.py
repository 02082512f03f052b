#!/usr/bin/env python
"""Where the split's time goes: the device time of each kernel of one call of FLA's op and of kdacp's op under
each ``--splits`` setting (one family, head count, token count, one sequence, the inputs of
``benchmarks/split_heads.py``), per call, summed over ``--calls`` profiled calls after two warm-up calls.

    python benchmarks/split_profile.py --family kda --heads 4 --tokens 65536 --splits none,8 [--backward]

Prints, per contender, its kernels' total, its host time per call (:func:`host_ms`) and its ``--top`` kernels (ms
per call, launches per call), then one line per contender with both totals.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from kdacp.bench.timing import host_and_wall_times
from split_heads import op_inputs, split_setting, timed_call


def kernel_ms(call, calls: int) -> dict[str, tuple[float, float]]:
    """``{kernel name: (ms per call, launches per call)}`` of ``calls`` profiled calls of ``call``."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name][0] += event.device_time / 1e3
            per[event.name][1] += 1
    return {name: (ms / calls, n / calls) for name, (ms, n) in per.items()}


def host_ms(call, calls: int) -> float:
    """The host's milliseconds per call of ``call`` over ``calls`` calls back to back after two warm-up calls
    (:func:`kdacp.bench.timing.host_and_wall_times`). Where it exceeds the call's kernel time, the device idles
    waiting for the host."""
    for _ in range(2):
        call()
    return host_and_wall_times(call, calls, torch.device("cuda"))[0] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="kda", choices=("kda", "gdn"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--splits", default="none,8")
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()

    import kdacp  # first: it points FLA at its kernel configurations, which FLA reads at import
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda
    fla_op, ours = (fla_kda, kdacp.chunk_kda) if args.family == "kda" else (fla_gdn, kdacp.chunk_gated_delta_rule)
    tensors, options = op_inputs(args.family, args.tokens, args.heads, None)
    contenders = {"fla": timed_call(fla_op, tensors, options, args.backward)}
    for name in args.splits.split(","):
        contenders[f"split={name}"] = timed_call(ours, tensors, dict(options, split=split_setting(name)),
                                                 args.backward)
    mode = "forward + backward" if args.backward else "forward"
    print(f"# {torch.cuda.get_device_name()}: {args.family} {mode}, {args.heads} heads, {args.tokens} tokens")
    totals, hosts = {}, {}
    for name, call in contenders.items():
        per = kernel_ms(call, args.calls)
        totals[name], hosts[name] = sum(ms for ms, _ in per.values()), host_ms(call, args.calls)
        print(f"## {name}: {totals[name]:.3f} ms of kernels per call, {sum(n for _, n in per.values()):.0f} launches, "
              f"{hosts[name]:.3f} ms of host time")
        for kernel, (ms, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {ms:8.3f} ms  x{n:<4.0f} {kernel[:110]}")
    print("| family | heads | mode | contender | kernels ms | host ms |")
    for name, ms in totals.items():
        print(f"| {args.family} | {args.heads} | {mode} | {name} | {ms:.3f} | {hosts[name]:.3f} |")


if __name__ == "__main__":
    main()
