"""Causal softmax attention per rank under each token layout, measured on one device with real kernels.

Every rank of a ``P``-rank group is played in turn on this device: its query ranges of the layout (the
rank's share of one sequence of ``T`` tokens, or of a packed batch) against the keys they attend, under the
causal and document mask, with no ``T x T`` mask: one ``scaled_dot_product_attention`` call per piece of a
query range inside one document, over that document's key prefix up to the piece's end, causal aligned to
the lower right (:func:`rank_attention`); PyTorch picks its flash, cuDNN or memory-efficient kernel on a GPU.
The keys and values of the whole sequence are there, as after the K/V all-gather. Forward and forward +
backward (gradients of q, k and v) are timed per rank.

Rows: per ``(P, layout, rank)`` the rank's key-query pairs and milliseconds; per ``(P, layout)`` the max over
mean of the ranks' pairs and of their measured times (``balance`` rows) and the achieved throughput
(``2 * pairs * H * (Dqk + Dv)`` FLOPs forward, :data:`~kdacp.bench.hybrid_model.BACKWARD_FLOP_RATIO` times that
backward, over the summed time of all ranks), which the ``hybrid`` suite takes as ``--attention-tflops``.

    kdacp bench --suite balance [--seq-lens 131072] [--predict-ranks 8,16,64] [--heads 32 --head-dim 128]
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kdacp.cp.layout import make_layout

from .harness import PlotSpec, markdown_table
from .hybrid_model import BACKWARD_FLOP_RATIO, causal_pairs
from .timing import median_time

__all__ = ["LAYOUTS", "PLOTS", "markdown", "rank_attention", "run"]

LAYOUTS = ("contiguous", "zigzag")
PLOTS = {"balance": PlotSpec(x="P", y="time_max_over_mean", series="layout", where=("source", "balance"),
                             title="causal attention: slowest rank over the mean", ylabel="max / mean")}


def rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, cu_seqlens=None) -> torch.Tensor:
    """Causal attention of one rank's queries: ``q [B, H, L, Dqk]`` its local tokens (its global ``ranges``,
    ascending, concatenated), ``k [B, H, T, Dqk]`` and ``v [B, H, T, Dv]`` the whole sequence's; global document
    boundaries ``cu_seqlens`` (ints; None: one sequence). Returns ``[B, H, L, Dv]``: query ``t`` attends the keys
    ``start(document of t) .. t``. One call per piece of a range inside one document (module docstring)."""
    T = k.shape[2]
    bounds = [0, T] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    outs, local = [], 0
    for s, e in ranges:
        for d0, d1 in zip(bounds[:-1], bounds[1:]):
            a, b = max(s, d0), min(e, d1)
            if a >= b:
                continue
            qa = q[:, :, local + a - s:local + b - s]
            outs.append(F.scaled_dot_product_attention(qa, k[:, :, d0:b], v[:, :, d0:b],
                                                       attn_mask=causal_lower_right(b - a, b - d0)))
        local += e - s
    return torch.cat(outs, dim=2)


def run(tokens: int | None = None, world_sizes=(8, 16, 64), heads: int | None = None, head_dim: int | None = None,
        v_head_dim: int | None = None, layouts=LAYOUTS, iters: int = 3, device: str = "cuda", report=None) -> list[dict]:
    """Time every rank of every layout of ``layouts`` at each ``P`` of ``world_sizes`` (module docstring).

    Args:
        tokens: the sequence's ``T`` (default 131072 on CUDA, 256 on CPU); a multiple of ``2P`` for each ``P``.
        heads, head_dim, v_head_dim: ``H`` query = key/value heads of ``Dqk`` and ``Dv`` (default 32 heads of
            128 on CUDA, 2 of 16 on CPU; ``Dv`` default ``Dqk``); bf16 on CUDA, float32 on CPU.
        iters: timed calls per rank and direction (the median is kept).

    Raises:
        ValueError: a ``P`` below 2, or ``tokens`` not a multiple of ``2P``, or an unknown layout.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    T = tokens or (131072 if cuda else 256)
    H, D = heads or (32 if cuda else 2), head_dim or (128 if cuda else 16)
    Dv = v_head_dim or D
    dtype = torch.bfloat16 if cuda else torch.float32
    for P in world_sizes:
        if isinstance(P, bool) or not isinstance(P, int) or P < 2 or T % (2 * P):
            raise ValueError(f"world_sizes must be ints >= 2 with tokens={T} a multiple of 2P, got {P!r}")
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"layouts must be among {LAYOUTS}, got {sorted(unknown)}")
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(1, H, T, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(1, H, T, Dv, device=dev, dtype=dtype, generator=gen)
    rows = [dict(source="setup", T=T, heads=H, head_dim=D, v_head_dim=Dv, dtype=str(dtype), iters=iters,
                 device=torch.cuda.get_device_name(dev) if cuda else "cpu")]
    flops_per_pair = 2 * H * (D + Dv)
    for P in world_sizes:
        for name in layouts:
            layout = make_layout(name, P, T)
            per_rank = []
            for r in range(P):
                q = torch.randn(1, H, layout.local_lengths[r], D, device=dev, dtype=dtype, generator=gen)
                per_rank.append(_time_rank(q, k, v, layout.ranges[r], iters, dev))
                row = dict(source="rank", P=P, layout=name, rank=r, pairs=causal_pairs(layout, r),
                           forward_ms=per_rank[-1][0] * 1e3, step_ms=per_rank[-1][1] * 1e3)
                rows.append(row)
            pairs = [causal_pairs(layout, r) for r in range(P)]
            fwd = [t[0] for t in per_rank]
            step = [t[1] for t in per_rank]
            rows.append(dict(source="balance", P=P, layout=name, pairs_max_over_mean=max(pairs) / statistics.mean(pairs),
                             time_max_over_mean=max(step) / statistics.mean(step),
                             forward_max_over_mean=max(fwd) / statistics.mean(fwd),
                             slowest_step_ms=max(step) * 1e3, mean_step_ms=statistics.mean(step) * 1e3,
                             forward_tflops=sum(pairs) * flops_per_pair / sum(fwd) / 1e12,
                             step_tflops=sum(pairs) * flops_per_pair * (1 + BACKWARD_FLOP_RATIO) / sum(step) / 1e12))
            if report is not None:
                report(rows[-1])
    return rows


def _time_rank(q, k, v, ranges, iters: int, dev: torch.device) -> tuple[float, float]:
    """``(forward, forward + backward)`` median seconds of :func:`rank_attention` for one rank."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    do = torch.randn(*q.shape[:-1], v.shape[-1], device=q.device, dtype=q.dtype)

    def forward():
        with torch.no_grad():
            rank_attention(q, k, v, ranges)

    def step():
        o = rank_attention(*leaves, ranges)
        torch.autograd.grad(o, leaves, do)
    return median_time(forward, dev, iters), median_time(step, dev, iters)


def markdown(rows: list[dict]) -> str:
    """The setup, then the balance rows, then every rank's."""
    parts = []
    for source in ("setup", "balance", "rank"):
        sel = [{k: v for k, v in r.items() if k != "source"} for r in rows if r["source"] == source]
        if sel:
            parts.append(f"### {source}\n\n{markdown_table(sel)}")
    return "\n\n".join(parts)
