#!/usr/bin/env python
"""The Python time of one GDN forward call outside FLA's kernels: kdacp's op against FLA's own, on the CPU.

Where a call is host-bound (the GPU machine's host at 16K tokens: `kdacp bench --suite gdn` times calls back
to back, and both FLA's op and kdacp's take longer on the host than on the device), the ratio of the two
calls is the ratio of their host times. FLA's stage functions here return empty tensors of the right
shapes instead of launching kernels (the same stubs for both contenders: kdacp calls FLA's stage
functions, FLA's op calls them too), ``backend="fla"`` is let through on CPU tensors, and ``torch.zeros``
allocates without filling (a launch on a GPU, a memset here); what is left is each library's own Python:
argument checks, plans, autograd wrappers, views and allocations.

    PYTHONPATH=/path/to/fla-core python benchmarks/host_overhead.py [--seq-len 16384] [--docs 7] [--profile]

Prints microseconds per call (best and median of rounds, contenders alternating) and, with ``--profile``, kdacp's
cProfile top functions by own time. Needs fla-core 0.6.0 importable (no GPU).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib
import pstats
import statistics
import time

import torch

import kdacp
from kdacp.backends.fla_adapter import load_fla

H, HV, K = 16, 32, 128


def _empty_like(x, dtype=None):
    return torch.empty(x.shape, dtype=dtype or x.dtype)


def _stubs() -> dict:
    """name -> stub of FLA's stage functions on the GDN forward path, returning empty tensors shaped as FLA's."""
    def l2norm_fwd(x, *a, **k):
        return _empty_like(x), torch.empty(x.shape[:-1], dtype=torch.float32)

    def gate_cumsum(g, *a, **k):
        return _empty_like(g, torch.float32)

    def fwd_intra(k, v, g, beta, chunk_size=64, **kw):
        B, T, Hk, Kd = k.shape
        HVv = v.shape[2]
        return (torch.empty(B, T, HVv, Kd, dtype=k.dtype), _empty_like(v),
                torch.empty(B, T, HVv, chunk_size, dtype=k.dtype))

    def fwd_h(k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64, **kw):
        B, T, HVv, V = u.shape
        N = 1 if kw.get("cu_seqlens") is None else len(kw["cu_seqlens"]) - 1
        h = torch.empty(B, -(-T // chunk_size), HVv, k.shape[-1], V, dtype=k.dtype)
        final = torch.empty(N, HVv, k.shape[-1], V, dtype=torch.float32) if output_final_state else None
        return h, _empty_like(u), final

    def fwd_o(q, k, v, h, g=None, scale=None, **kw):
        return _empty_like(v)

    return dict(l2norm_fwd=l2norm_fwd, gdn_gate_chunk_cumsum=gate_cumsum, chunk_local_cumsum=gate_cumsum,
                chunk_gated_delta_rule_fwd_intra=fwd_intra, chunk_gated_delta_rule_fwd_h=fwd_h, chunk_fwd_o=fwd_o)


def install_stubs() -> None:
    """FLA's stage functions replaced in kdacp's FLA namespace and in FLA's GDN op module; fla on CPU allowed."""
    fla = load_fla()
    chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
    for name, stub in _stubs().items():
        setattr(fla, name, stub)
        if hasattr(chunk, name):
            setattr(chunk, name, stub)
    registry = importlib.import_module("kdacp.backends.registry")
    registry.BACKEND_SPECS["fla"] = dataclasses.replace(registry.BACKEND_SPECS["fla"], devices=None, require=None)
    # On a GPU a zero fill is one kernel launch; on the CPU it would be a memset of the whole tensor (2 MB
    # of initial states), which is not host overhead: allocations stay unfilled here, for both contenders.
    torch.zeros = torch.empty


def make_call(T: int, docs: int):
    """``{contender: no-argument callable}`` on bf16 CPU inputs of Qwen3-Next's shapes, gate in kernel."""
    g = torch.Generator().manual_seed(0)
    x = dict(q=torch.randn(1, T, H, K, generator=g).bfloat16(), k=torch.randn(1, T, H, K, generator=g).bfloat16(),
             v=torch.randn(1, T, HV, K, generator=g).bfloat16(), g=torch.randn(1, T, HV, generator=g).bfloat16(),
             beta=torch.rand(1, T, HV, generator=g).bfloat16(), A_log=torch.rand(HV, generator=g),
             dt_bias=torch.rand(HV, generator=g))
    varlen = {}
    if docs > 1:
        cuts = sorted(torch.randperm(T - 1, generator=g)[:docs - 1].add(1).tolist())
        cu = torch.tensor([0, *cuts, T])
        varlen = dict(cu_seqlens=cu, cu_seqlens_cpu=cu)
    options = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, **varlen)
    fla = load_fla()
    return {"fla": lambda: fla.chunk_gated_delta_rule(**x, **options),
            "kdacp": lambda: kdacp.chunk_gated_delta_rule(**x, **options, backend="fla")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--docs", type=int, default=1, help="packed documents (1: one sequence)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="cProfile kdacp's call, top 25 by own time")
    a = p.parse_args()
    install_stubs()
    calls = make_call(a.seq_len, a.docs)
    times = {n: [] for n in calls}
    with torch.no_grad():
        for fn in calls.values():
            for _ in range(20):
                fn()
        for _ in range(a.rounds):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    fn()
                times[name].append((time.perf_counter() - t0) / a.iters * 1e6)
        best = {n: min(t) for n, t in times.items()}  # the least disturbed round: this is a noisy host's figure
        print(f"T={a.seq_len} docs={a.docs}: host us per call outside FLA's kernels (best of {a.rounds} rounds; "
              "median): " + ", ".join(f"{n} {v:.1f} ({statistics.median(times[n]):.1f})" for n, v in best.items())
              + f"; kdacp - fla {best['kdacp'] - best['fla']:.1f} us")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                calls["kdacp"]()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
