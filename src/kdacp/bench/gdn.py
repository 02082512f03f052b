"""Gated DeltaNet on one GPU: kdacp's GDN ``fla`` backend beside FLA 0.6.0's own op and kdacp's former
broadcast-gate path.

Qwen3-Next's GDN settings: 16 q/k heads, 32 value heads, K = V = 128, gate in kernel (``A_log``,
``dt_bias [HV]``), L2 norm in kernel, B=1, bf16; one sequence or packed documents
(:mod:`kdacp.bench.batches`). Contenders, round-robin in one run (CUDA-event time per forward+backward
step, warm):

- ``fla``: FLA's ``chunk_gated_delta_rule``;
- ``kdacp``: ``kdacp.chunk_gated_delta_rule(backend="fla")`` (FLA's GDN kernels, scalar gate);
- ``kdacp_cp1``: ``kdacp.chunk_gated_delta_rule`` on a one-rank plan (the state pass only);
- ``kdacp_broadcast``: ``kdacp.chunk_kda(backend="fla")`` on the gate broadcast over ``K`` (FLA's KDA
  kernels; what ``kdacp.chunk_gated_delta_rule`` ran before the GDN backend).

Ratios are over ``fla``; ``max_rel_diff_vs_fla``: ``kdacp`` against ``fla``, output and every gradient;
``fla_device_ms`` / ``kdacp_device_ms`` (``kdacp_device_ratio``): the same two steps' device time, their calls
queued ahead of the device (the back-to-back columns time the host where a call is host-bound, as at 16K tokens).
Where FLA refuses its GDN backward (Hopper with Triton >= 3.4 and < 3.7.1 without tilelang, as on the
H200 with Triton 3.6: :func:`kdacp.backends.fla_adapter.fla_gated_gdn_backward_supported`), neither
FLA's op nor kdacp's GDN kernels can train there, so every contender is timed forward only and the
rows say ``pass: forward``; each such row is followed by a training row (``pass: forward+backward, KDA
kernels``): ``kdacp`` (which trains there on FLA's KDA kernels with the gate broadcast over ``K``) against
``fla_kda``, FLA's own ``chunk_kda`` on the same broadcast gate (the one path FLA trains GDN on there), the
ratio and ``max_rel_diff_vs_fla`` over ``fla_kda``; where attention-gym is usable (Hopper, ``kdacp[attn-gym]``),
the training row also times ``kdacp_attn_gym``, ``kdacp.chunk_gated_delta_rule(backend="attn_gym")``
(attention-gym's GDN core), with its ``attn_gym_max_rel_diff_vs_fla``.

    kdacp bench --suite gdn --world-size 1 [--seq-lens 16384,32768] [--batches one_sequence,docs7]

``run(...)`` returns the rows; call it on the one rank of an initialised NCCL group.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from kdacp.backends import backend_usable
from kdacp.backends.fla_adapter import fla_gated_gdn_backward_supported, load_fla
from kdacp.cp import build_cp_plan, new_cp_group
from kdacp.ops.gdn import chunk_gated_delta_rule
from kdacp.ops.kda import chunk_kda
from kdacp.reference.gdn import scalar_gate_as_kda

from .batches import cu_seqlens_of, document_lengths
from .steps import log, max_rel_diff, record_row, step_functions
from .harness import PlotSpec
from .inputs import random_inputs
from .timing import timed_columns

MULTI_RANK = True
PLOTS = {"gdn_ratio": PlotSpec(x="label", y="kdacp_ratio", bars=True,
                               title="kdacp GDN fwd+bwd step / FLA's chunk_gated_delta_rule", ylabel="ratio")}

CONTENDERS = ("fla", "kdacp", "kdacp_cp1", "kdacp_broadcast")
OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True)


def _broadcast(varlen: dict, **x):
    """The former path: KDA with the GDN gate (and ``dt_bias``) broadcast over ``K``."""
    g, dt_bias = scalar_gate_as_kda(x.pop("g"), x["q"].shape[-1], x.pop("dt_bias"))
    return chunk_kda(**x, g=g, dt_bias=dt_bias, **OPTIONS, **varlen, backend="fla")


def _fla_kda_broadcast(fla, varlen: dict, **x):
    """FLA's own ``chunk_kda`` on the GDN gate (and ``dt_bias``) broadcast over ``K``."""
    g, dt_bias = scalar_gate_as_kda(x.pop("g"), x["q"].shape[-1], x.pop("dt_bias"))
    return fla.chunk_kda(**x, g=g, dt_bias=dt_bias, **OPTIONS, **varlen)


def run(t_locals=(16384, 32768), batches=("one_sequence", "docs7"), heads: int = 16, v_heads: int = 32,
        head_dim: int = 128, warmup: int = 2, rounds: int = 3, iters: int = 5, group=None, device: str = "cuda",
        report=None, contenders=CONTENDERS, seed: int = 0) -> list[dict]:
    """Rows ``batch, docs, T``, each contender's ``<name>_ms`` and ``<name>_ratio`` (over ``fla``) and
    ``max_rel_diff_vs_fla``. ``report(row)`` is called as each row completes."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the gdn suite runs FLA's CUDA kernels; device must be cuda, got {device!r}")
    fla = load_fla()
    group = group or new_cp_group()
    if dist.get_world_size(group) != 1:
        raise ValueError("the gdn suite compares on one GPU; run it with --world-size 1")
    backward = fla_gated_gdn_backward_supported()
    attn_gym = backend_usable("attn_gym", torch.device("cuda"))
    training = ("fla_kda", "kdacp") + (("kdacp_attn_gym",) if attn_gym else ())
    rows = []
    for T in t_locals:
        for batch in batches:
            lengths = document_lengths(batch, T, seed=seed)
            cu_list = cu_seqlens_of(lengths)
            packed = len(lengths) > 1
            # the boundaries also on the host, so that no contender syncs to read them
            varlen = dict(cu_seqlens=torch.tensor(cu_list, device="cuda"), cu_seqlens_cpu=torch.tensor(cu_list)) \
                if packed else {}
            plan = build_cp_plan(cu_list if packed else None, batch_size=None if packed else 1, group=group)
            x = random_inputs(T, heads, v_heads, head_dim, head_dim, gate="gdn", seed=seed, leaves=True)
            do = torch.randn(1, T, v_heads, head_dim, device="cuda").bfloat16()
            runs = {
                "fla": lambda **a: fla.chunk_gated_delta_rule(**a, **OPTIONS, **varlen),
                "kdacp": lambda **a: chunk_gated_delta_rule(**a, **OPTIONS, **varlen, backend="fla"),
                "kdacp_cp1": lambda **a: chunk_gated_delta_rule(**a, **OPTIONS, backend="fla", cp=plan),
                "kdacp_broadcast": lambda **a: _broadcast(varlen, **a),
            }
            fns = step_functions(runs, contenders, x, do, backward)
            log(f"gdn T={T} {batch} ({len(lengths)} documents)")
            row = dict(batch=batch, docs=len(lengths), T=T, label=f"{batch} {T}",
                       **{"pass": "forward+backward" if backward else "forward"})
            row.update(timed_columns(fns, CONTENDERS, "fla", warmup, rounds, iters, group, torch.device("cuda"),
                                     lambda tb: log(f"gdn T={T} {batch} failed:\n{tb}", logging.WARNING)))
            if "kdacp" in fns and "fla" in fns:
                row["max_rel_diff_vs_fla"] = max_rel_diff(fns["kdacp"](), fns["fla"](), group)
                row.update(timed_columns({n: fns[n] for n in ("fla", "kdacp")}, ("fla", "kdacp"), "fla", warmup, rounds,
                                         iters, None, torch.device("cuda"),
                                         lambda tb: log(f"gdn T={T} {batch} device time failed:\n{tb}", logging.WARNING), queued=True))
            rows_here = [row]
            if not backward and "kdacp" in contenders:
                train = step_functions({"fla_kda": lambda **a: _fla_kda_broadcast(fla, varlen, **a),
                                        "kdacp": runs["kdacp"],
                                        "kdacp_attn_gym": lambda **a: chunk_gated_delta_rule(
                                            **a, **OPTIONS, **varlen, backend="attn_gym")}, training, x, do, True)
                log(f"gdn T={T} {batch}: training, against FLA's chunk_kda on the broadcast gate")
                trow = dict(batch=batch, docs=len(lengths), T=T, label=f"{batch} {T} train",
                            **{"pass": "forward+backward, KDA kernels"})
                trow.update(timed_columns(train, training, "fla_kda", warmup, rounds, iters, group,
                                          torch.device("cuda"),
                                          lambda tb: log(f"gdn T={T} {batch} training failed:\n{tb}", logging.WARNING)))
                if not math.isnan(trow["kdacp_ms"]):  # timed: both steps run
                    trow["max_rel_diff_vs_fla"] = max_rel_diff(train["kdacp"](), train["fla_kda"](), group)
                if attn_gym and not math.isnan(trow["kdacp_attn_gym_ms"]):
                    trow["attn_gym_max_rel_diff_vs_fla"] = max_rel_diff(train["kdacp_attn_gym"](), train["fla_kda"](),
                                                                        group)
                rows_here.append(trow)
            del x, do
            for r in rows_here:
                record_row(rows, r, report)
    return rows
