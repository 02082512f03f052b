#!/usr/bin/env python
"""A rank's schedule of this tree against an earlier version's (``kdacp.distributed.orchestration``), in one
process: each rank role of the overhead suite's 3-rank plan, forward + backward with ready-made incoming
messages, outputs compared and device time alternating.

    git show REV:src/kdacp/distributed/orchestration.py > OLD.py
    python benchmarks/schedule_ab.py OLD.py [--batch docs7] [--family kda] [--rounds 7]

Prints per role: the largest relative difference between the versions' ``o`` and input gradients (both run
the same backend kernels on the same tokens; with ``--detail`` each gradient's, and each version's against one
device on the same tokens, which for the first role of a packed batch, whose incoming value is zero, is the
same computation), and each version's device ms per forward + backward
(:func:`kdacp.bench.timing.time_queued`: calls queued behind a device sleep), with one device's beside.
``--device cpu`` (kdacp's torch backend, tiny sizes) only checks that the script runs. The old file runs
against this tree's other modules: a version before 8bd3dac reads ``RankLayout.before_tail`` (removed after
it), so compare those at 8bd3dac's tree, as RESULTS.md's fifteenth session did.
"""
from __future__ import annotations

import argparse

import torch

from kdacp.bench.harness import load_module_file
from kdacp.bench.overhead import ReadyExchange, device_role_call, role_plans
from kdacp.bench.timing import time_queued
from kdacp.distributed import orchestration as new


def step(module, backend, plan, call, do):
    """Callable of one forward + backward of ``plan``'s rank by ``module``'s schedule; returns ``(o, grads)``."""
    exchange = ReadyExchange()

    def run():
        out = module.cp_forward(backend, plan, call.inputs, None, False, torch.float32, exchange=exchange)
        grads = module.cp_backward(backend, plan, out.saved, out.local_initial, out.transition, out.head_states, do,
                                   None, False, False, exchange=exchange)
        return out.o, grads
    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("--batch", default="docs7")
    p.add_argument("--family", default="kda", choices=("kda", "gdn"))
    p.add_argument("--seq-len", type=int, default=None, help="tokens per rank (default 16384; 256 on CPU)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cuda")
    p.add_argument("--detail", action="store_true", help="each gradient's difference, and against one device")
    a = p.parse_args()
    old = load_module_file(a.old, "kdacp.distributed._orchestration_old")
    device = torch.device(a.device)
    T, call, do = device_role_call(a.family, device, a.seq_len)
    print(f"| {a.family} {a.batch} role | o rel diff | max grad rel diff | old ms | new ms | new / old | one device ms |")
    print("|---|---|---|---|---|---|---|")
    for role, (plan, one) in role_plans(a.batch, T).items():
        fns = {"old": step(old, call.backend, plan, call, do), "new": step(new, call.backend, plan, call, do),
               "one": step(new, call.backend, one, call, do)}
        (o_old, g_old), (o_new, g_new) = fns["old"](), fns["new"]()
        grad_diff = max(rel(getattr(g_new, n), getattr(g_old, n)) for n in ("dq", "dk", "dv", "dg", "dbeta"))
        if a.detail:
            o_one, g_one = fns["one"]()
            for n in ("o", "dq", "dk", "dv", "dg", "dbeta"):
                x = {"old": o_old if n == "o" else getattr(g_old, n), "new": o_new if n == "o" else getattr(g_new, n),
                     "one": o_one if n == "o" else getattr(g_one, n)}
                print(f"{role} {n}: new vs old {rel(x['new'], x['old']):.2e}, new vs one device "
                      f"{rel(x['new'], x['one']):.2e}, old vs one device {rel(x['old'], x['one']):.2e}")
            continue
        ms = time_queued(fns, 1, a.rounds, 3, device)
        print(f"| {role} | {rel(o_new, o_old):.2e} | {grad_diff:.2e} | {ms['old']:.3f} | {ms['new']:.3f} | "
              f"{ms['new'] / ms['old']:.3f} | {ms['one']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
