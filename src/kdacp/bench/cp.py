"""Context-parallel chunk KDA: kdacp's ``cp_chunk_kda`` (fla backend) and FLA 0.6.0's own CP, side by side.

Per-rank forward+backward time of a CP step (the slowest rank's, CUDA events, warm) over the time of
FLA ``chunk_kda`` on one GPU at the same ``T_local``. One sequence of ``world_size * T_local`` tokens,
B=1, bf16, gate and L2 norm in kernel.

    kdacp bench --suite cp [--seq-lens 8192,16384,32768]
    (or under torchrun: torchrun --nproc-per-node 2 -m kdacp.cli bench --suite cp)

``run(...)`` returns the rows; call it on every rank of an initialised NCCL group.
"""
from __future__ import annotations

import math
import sys
import time
import traceback

import torch
import torch.distributed as dist

from kdacp.backends.fla_adapter import load_fla
from kdacp.distributed import build_cp_plan, cp_chunk_kda, new_cp_group

from .harness import PlotSpec

MULTI_RANK = True
PLOTS = {
    "cp_vs_tokens": PlotSpec(x="T_local", y=("one_gpu_ms", "kdacp_cp_ms", "kdacp_allgather_ms", "fla_cp_ms"),
                             title="fwd+bwd per rank vs tokens per rank", ylabel="ms"),
    "cp_ratio_vs_tokens": PlotSpec(x="T_local", y=("kdacp_ratio", "kdacp_allgather_ratio", "fla_ratio"),
                                   title="per-rank time / one-GPU time", ylabel="ratio"),
    "cp_vs_ranks": PlotSpec(x="world_size", y=("kdacp_ratio", "kdacp_allgather_ratio", "fla_ratio"), panel="T_local",
                            title="per-rank time / one-GPU time", ylabel="ratio", logx=False),
}


def make_inputs(T: int, H: int, D: int, seed: int) -> dict:
    """This rank's ``[1, T, H, D]`` bf16 inputs (raw gate logits), float32 ``A_log``/``dt_bias``, all leaves."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x = dict(q=rnd(1, T, H, D), k=rnd(1, T, H, D), v=rnd(1, T, H, D), g=rnd(1, T, H, D),
             beta=torch.sigmoid(rnd(1, T, H, dtype=torch.float32)).bfloat16(),
             A_log=rnd(H, dtype=torch.float32) * 0.5, dt_bias=rnd(H * D, dtype=torch.float32) * 0.5)
    return {n: t.requires_grad_() for n, t in x.items()}


def _step(fn, x: dict, do: torch.Tensor):
    """One forward + backward; gradients returned, not accumulated."""
    o, _ = fn(**x)
    return o, torch.autograd.grad(o, list(x.values()), do)


def log(message: str) -> None:
    """Progress on rank 0's stderr, with wall time: FLA autotunes each kernel at first use (minutes, cold)."""
    if dist.get_rank() == 0:
        print(f"[kdacp bench cp {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def time_ms(fn, warmup: int, iters: int, group) -> float:
    """Milliseconds per call on this rank (CUDA events), the maximum over the group."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor(start.elapsed_time(end) / iters, device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return ms.item()


CONTENDERS = ("one_gpu", "kdacp_cp", "kdacp_allgather", "fla_cp")


def run(t_locals=(8192, 16384, 32768), heads: int = 32, head_dim: int = 128, warmup: int = 3, iters: int = 20,
        group=None, device: str = "cuda", report=None, contenders=CONTENDERS) -> list[dict]:
    """Rows ``T_local, world_size``, times ``one_gpu_ms, kdacp_cp_ms`` (p2p), ``kdacp_allgather_ms``,
    ``fla_cp_ms``, their ratios to ``one_gpu_ms``, and ``max_rel_diff_vs_fla_cp`` (the largest relative
    difference between kdacp's p2p and FLA's CP output and gradients); ``report(row)`` is called as
    each row completes. ``group``: default a new :func:`new_cp_group` (every contender uses it)."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the cp suite runs FLA's CUDA kernels; device must be cuda, got {device!r}")
    fla = load_fla()
    group = group or new_cp_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)
    rows = []
    for T in t_locals:
        x = make_inputs(T, heads, head_dim, seed=rank)
        do = torch.randn(1, T, heads, head_dim, device="cuda").bfloat16()
        plans = {name: build_cp_plan(batch_size=1, group=group, strategy=name) for name in ("p2p", "allgather")}
        context = fla.build_cp_context(cu_seqlens=torch.tensor([0, world_size * T], device="cuda"), group=group,
                                       cu_seqlens_cpu=torch.tensor([0, world_size * T]))
        runs = {
            "one_gpu": lambda **a: fla.chunk_kda(**a, **opts),
            "kdacp_cp": lambda **a: cp_chunk_kda(**a, **opts, backend="fla", cp=plans["p2p"]),
            "kdacp_allgather": lambda **a: cp_chunk_kda(**a, **opts, backend="fla", cp=plans["allgather"]),
            "fla_cp": lambda **a: fla.chunk_kda(**a, **opts, cp_context=context),
        }
        row = dict(T_local=T, world_size=world_size)
        for name in contenders:
            fn = runs[name]
            log(f"T_local={T} {name}")
            try:
                row[f"{name}_ms"] = time_ms(lambda: _step(fn, x, do), warmup, iters, group)
            except Exception:  # noqa: BLE001 - one failing contender must not lose the others' figures
                log(f"T_local={T} {name} failed:\n{traceback.format_exc()}")
                row[f"{name}_ms"] = float("nan")
        for name in CONTENDERS:
            row.setdefault(f"{name}_ms", float("nan"))  # not run
        row["kdacp_ratio"] = row["kdacp_cp_ms"] / row["one_gpu_ms"]
        row["kdacp_allgather_ratio"] = row["kdacp_allgather_ms"] / row["one_gpu_ms"]
        row["fla_ratio"] = row["fla_cp_ms"] / row["one_gpu_ms"]
        row["max_rel_diff_vs_fla_cp"] = float("nan")
        if math.isfinite(row["kdacp_cp_ms"] + row["fla_cp_ms"]):
            ours, theirs = _step(runs["kdacp_cp"], x, do), _step(runs["fla_cp"], x, do)
            pairs = [(ours[0], theirs[0])] + list(zip(ours[1], theirs[1]))
            diff = torch.stack([torch.stack([(a.float() - b.float()).norm() ** 2, b.float().norm() ** 2])
                                for a, b in pairs])
            dist.all_reduce(diff, group=group)  # A_log/dt_bias gradients are per-rank shares: summed over ranks
            row["max_rel_diff_vs_fla_cp"] = (diff[:, 0] / diff[:, 1]).sqrt().max().item()
        rows.append(row)
        if report is not None:
            report(row)
        del x, do
        torch.cuda.empty_cache()
    return rows
