"""Context-parallel chunk KDA (or GDN): kdacp's op (fla backend) beside FLA 0.6.0's own CP and one GPU.

Each rank holds ``T_local`` tokens of a global batch: one sequence, or packed documents cut at the
rank edges (:mod:`kdacp.bench.batches`). ``family="kda"``: Kimi Linear's settings (32 heads of 128,
gate in kernel with ``safe_gate=True, lower_bound=-5``, L2 norm in kernel); ``family="gdn"``:
Qwen3-Next's (16 q/k and 32 value heads of 128, gate in kernel, L2 norm in kernel; the inputs of
:func:`kdacp.bench.inputs.random_inputs`). B=1, bf16. Contenders, round-robin in one run (the slowest
rank's CUDA-event time per forward+backward step, warm; forward only for GDN where FLA refuses its GDN
backward, as :mod:`kdacp.bench.gdn` explains):

- ``one_gpu``: FLA's op (``chunk_kda`` / ``chunk_gated_delta_rule``) on this rank's own tokens alone
  (its own ``cu_seqlens``);
- ``kdacp_cp`` / ``kdacp_allgather`` / ``kdacp_scan``: ``chunk_kda`` / ``chunk_gated_delta_rule``
  with the ``p2p`` / ``allgather`` / ``scan`` strategy;
- ``fla_cp``: FLA's op with ``cp_context=build_cp_context(...)``.

Ratios are over ``one_gpu``; ``peak_ratio``: kdacp p2p's peak memory over one GPU's.

    kdacp bench --suite cp [--family gdn] [--seq-lens 16384,32768] [--trace DIR]
    (or under torchrun: torchrun --nproc-per-node 2 -m kdacp.cli bench --suite cp)

``run(...)`` returns the rows; call it on every rank of an initialised NCCL group.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported, load_fla
from kdacp.cp import build_cp_plan, new_cp_group
from kdacp.ops.kda import chunk_kda
from kdacp.ops.gdn import chunk_gated_delta_rule

from . import gdn
from .batches import BATCHES, cu_seqlens_of, document_lengths, local_cu_seqlens
from .harness import PlotSpec
from .inputs import random_inputs
from .steps import log, max_rel_diff, record_row, step_functions
from .timing import peak_gb, timed_columns

MULTI_RANK = True
PLOTS = {"cp_ratio": PlotSpec(x="label", y="kdacp_cp_ratio", bars=True, title="kdacp p2p step / one-GPU step",
                              ylabel="ratio")}

CONTENDERS = ("one_gpu", "kdacp_cp", "kdacp_allgather", "kdacp_scan", "fla_cp")
# Kimi Linear's gate and norm settings
OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)


def _family(fla, family: str, T: int, seed: int):
    """``(inputs, do, FLA's op, kdacp's CP op, options, backward)`` of one rank for ``family`` (``"kda"``
    or ``"gdn"``, checked by :func:`run`)."""
    if family == "kda":
        x = random_inputs(T, 32, 32, 128, 128, seed=seed, leaves=True)
        return x, torch.randn(1, T, 32, 128, device="cuda").bfloat16(), fla.chunk_kda, chunk_kda, OPTIONS, True
    # Qwen3-Next's shapes
    x = random_inputs(T, 16, 32, 128, 128, gate="gdn", seed=seed, leaves=True)
    do = torch.randn(1, T, 32, 128, device="cuda").bfloat16()
    return x, do, fla.chunk_gated_delta_rule, chunk_gated_delta_rule, gdn.OPTIONS, fla_gated_gdn_backward_supported()


def run(t_locals=(16384, 32768), batches=BATCHES, family: str = "kda", warmup: int = 2, rounds: int = 3,
        iters: int = 5, group=None, device: str = "cuda", report=None, contenders=CONTENDERS,
        trace_dir: str | None = None, seed: int = 0) -> list[dict]:
    """Rows ``batch, docs, T_local, world_size, pass``, each contender's ``<name>_ms`` and ``<name>_ratio``
    (over ``one_gpu``), ``peak_ratio`` and ``max_rel_diff_vs_fla_cp`` (kdacp p2p against FLA's CP,
    output and gradients). ``trace_dir``: also write one Chrome trace per rank and contender and add
    its breakdown (:mod:`kdacp.bench.trace`) as ``<name>_trace``. ``report(row)`` is called as each
    row completes. ``group``: default a new :func:`new_cp_group` (every contender uses it)."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the cp suite runs FLA's CUDA kernels; device must be cuda, got {device!r}")
    if family not in ("kda", "gdn"):
        raise ValueError(f"family must be 'kda' or 'gdn', got {family!r}")
    fla = load_fla()
    group = group or new_cp_group()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rows = []
    for T in t_locals:
        for batch in batches:
            lengths = document_lengths(batch, T * world_size, seed=seed)
            cu = cu_seqlens_of(lengths)
            packed = len(lengths) > 1
            own = local_cu_seqlens(cu, rank * T, (rank + 1) * T)
            cu_own = torch.tensor(own, device="cuda") if len(own) > 2 else None
            x, do, fla_op, kdacp_op, options, backward = _family(fla, family, T, seed=rank)
            plans = {s: build_cp_plan(cu if packed else None, batch_size=None if packed else 1, group=group,
                                      strategy=s) for s in ("p2p", "allgather", "scan")}
            context = fla.build_cp_context(cu_seqlens=torch.tensor(cu, device="cuda"), group=group,
                                           cu_seqlens_cpu=torch.tensor(cu))
            runs = {
                "one_gpu": lambda **a: fla_op(**a, **options, cu_seqlens=cu_own),
                "kdacp_cp": lambda **a: kdacp_op(**a, **options, backend="fla", cp=plans["p2p"]),
                "kdacp_allgather": lambda **a: kdacp_op(**a, **options, backend="fla", cp=plans["allgather"]),
                "kdacp_scan": lambda **a: kdacp_op(**a, **options, backend="fla", cp=plans["scan"]),
                "fla_cp": lambda **a: fla_op(**a, **options, cp_context=context),
            }
            fns = step_functions(runs, contenders, x, do, backward)
            log(f"cp {family} T_local={T} {batch} ({len(lengths)} documents)")
            row = dict(batch=batch, docs=len(lengths), T_local=T, world_size=world_size, label=f"{batch} {T}",
                       family=family, **{"pass": "forward+backward" if backward else "forward"})
            row.update(timed_columns(fns, CONTENDERS, "one_gpu", warmup, rounds, iters, group, torch.device("cuda"),
                                     lambda tb: log(f"T_local={T} {batch} failed:\n{tb}", logging.WARNING)))
            if "kdacp_cp" in fns and "one_gpu" in fns:
                row["peak_ratio"] = peak_gb(fns["kdacp_cp"], group, torch.device("cuda")) / \
                    peak_gb(fns["one_gpu"], group, torch.device("cuda"))
            if "kdacp_cp" in fns and "fla_cp" in fns:
                row["max_rel_diff_vs_fla_cp"] = max_rel_diff(fns["kdacp_cp"](), fns["fla_cp"](), group)
            if trace_dir is not None:
                from .trace import trace_step
                for name, fn in fns.items():
                    path = Path(trace_dir) / f"cp_{batch}_{T}_{name}_rank{rank}.json"
                    parts = [None] * world_size
                    dist.all_gather_object(parts, trace_step(fn, path), group=group)
                    row[f"{name}_trace"] = parts
            del x, do
            record_row(rows, row, report)
    return rows
