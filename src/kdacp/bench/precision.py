"""End-to-end error of each summary precision policy under context parallelism, ranks simulated on one GPU.

One sequence of ``T`` tokens (bf16) is cut into ``P`` equal segments, as ``P`` ranks would hold it. Each
segment runs the ``fla`` backend's stages: its summaries ``S_ext, M`` (forward) and ``G`` (backward)
under the policy; the incoming states are chained hop by hop (``x_{r+1} = M_r x_r + S_r``, float32, as
the ``p2p`` strategy), the outgoing state gradients likewise (``dS_in = M^T dS_out + G``). Each segment's
outputs and input gradients come from kdacp's one-device op on its tokens with that incoming state and
outgoing state gradient (what a rank computes once its messages arrived). Errors (``||x - x64|| /
||x64||``) are against one float64 reference pass over the whole sequence (:mod:`kdacp.reference`) for
the outputs ``o``, the final state and every input gradient, with FLA's own one-GPU op
(``chunk_kda`` / ``chunk_gated_delta_rule``, bf16) beside: policy ``fla``, ``P = 1``.

    python -m kdacp.bench.precision [T] > rows.md
"""
from __future__ import annotations

import sys

import torch

from kdacp import reference
from kdacp.affine import apply_state_gradient_summary, apply_state_summary
from kdacp.backends.base import Span
from kdacp.bench.rank_role import RankRole
from kdacp.cp.plan import one_rank_plan
from kdacp.ops.gdn import chunk_gated_delta_rule, gdn_gate_arguments
from kdacp.ops.kda import chunk_kda
from kdacp.kernels import SummaryPrecision

QUANTITIES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")
LEAVES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
# Kimi Linear's gate (safe gate, lower bound -5) and Qwen3-Next's GDN shapes
FAMILIES = {"kda": dict(H=32, HV=32, options=dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                                   lower_bound=-5.0, safe_gate=True)),
            "gdn": dict(H=16, HV=32, options=dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True))}


def make_inputs(family: str, T: int, K: int = 128, V: int = 128, seed: int = 0, device="cuda") -> dict:
    """Leaves in float64 (``q, k [1, T, H, K]``, ``v``, gate logits ``g`` (KDA ``[1, T, HV, K]``, GDN
    ``[1, T, HV]``), ``beta``, ``A_log [HV]``, ``dt_bias``), the output gradient ``do`` and ``dfinal``."""
    H, HV = FAMILIES[family]["H"], FAMILIES[family]["HV"]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(device)

    g = rnd(1, T, HV, K) if family == "kda" else rnd(1, T, HV)
    return dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V), g=g, beta=torch.sigmoid(rnd(1, T, HV)),
                A_log=0.5 * rnd(HV), dt_bias=0.5 * rnd(HV * K if family == "kda" else HV),
                do=rnd(1, T, HV, V), dfinal=rnd(1, HV, K, V))


def _leaves(x: dict, dtype) -> dict:
    """Fresh leaves requiring grad: q, k, v, the gate logits and beta in ``dtype`` (as a model's projections give
    them; kdacp's op takes q, k, v and g in one dtype); A_log, dt_bias float32 (float64 with float64)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return {n: x[n].to(dtype if n in ("q", "k", "v", "g", "beta") else wide).detach().requires_grad_() for n in LEAVES}


def _errors(o, final, leaves, truth) -> dict:
    got = dict(o=o, final=final, **{f"d{n}": leaves[n].grad for n in LEAVES})
    return {name: ((got[name].double() - truth[name]).norm() / truth[name].norm()).item() for name in QUANTITIES}


def _loss(o, final, x):
    return (o.double() * x["do"]).sum() + (final.double() * x["dfinal"]).sum()


def truth(family: str, x: dict) -> dict:
    """Outputs, final state and input gradients of one float64 reference pass."""
    leaves = _leaves(x, torch.float64)
    op = reference.chunk_kda if family == "kda" else reference.chunk_gated_delta_rule
    options = dict(FAMILIES[family]["options"])
    options.pop("safe_gate", None)  # a kernel option: the reference computes the same gate without it
    o, final = op(**leaves, output_final_state=True, **options)
    _loss(o, final, x).backward()
    return dict(o=o.detach(), final=final.detach(), **{f"d{n}": leaves[n].grad for n in LEAVES})


def fla_one_gpu(family: str, x: dict, want: dict) -> dict:
    """FLA's own op on the whole sequence in bf16: its errors."""
    if family == "kda":
        from fla.ops.kda import chunk_kda as op
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
    leaves = _leaves(x, torch.bfloat16)
    o, final = op(**leaves, output_final_state=True, **FAMILIES[family]["options"])
    _loss(o, final, x).backward()
    return _errors(o, final, leaves, want)


def _segment_call(family: str, xs: dict, policy: str, backend: str) -> RankRole:
    """``backend``'s :class:`~kdacp.bench.rank_role.RankRole` of one segment's leaves ``xs`` on one device (its
    ``backend`` and ``inputs`` run the stages)."""
    options = dict(FAMILIES[family]["options"])
    one = one_rank_plan(None, 1, xs["q"].shape[1])
    if family == "kda":
        return RankRole.prepare(one, **{n: xs[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")},
                                backend=backend, summary_precision=policy, **options)
    gate = gdn_gate_arguments(xs["g"], True, xs["A_log"], xs["dt_bias"])
    options.pop("use_gate_in_kernel")
    with torch.enable_grad():  # the backend a training call takes
        return RankRole.prepare(one, q=xs["q"], k=xs["k"], v=xs["v"], beta=xs["beta"], **gate, backend=backend,
                                summary_precision=policy, **options)


def virtual_cp(family: str, x: dict, P: int, policy: str, want: dict, backend: str = "fla",
               dtype=torch.bfloat16) -> dict:
    """Errors of the context-parallel op over ``P`` virtual ranks (equal segments) under ``policy``
    (``backend`` and ``dtype``: another backend and input dtype, to check this module on a CPU)."""
    T = x["q"].shape[1]
    leaves = _leaves(x, dtype)
    edges = [T * r // P for r in range(P + 1)]
    segs = [{n: (t if n in ("A_log", "dt_bias") else t[:, a:b]) for n, t in leaves.items()}
            for a, b in zip(edges, edges[1:])]
    do = x["do"].to(dtype)
    # summaries and the two chains, from the backend's stages (no autograd)
    states, stages = [None], []
    with torch.no_grad():
        for r, xs in enumerate(segs):
            n = edges[r + 1] - edges[r]
            call = _segment_call(family, {k: v.detach() for k, v in xs.items()}, policy, backend)
            span = Span(0, n, (0, n))
            chunks = call.backend.prepare(call.inputs, span)
            summary = call.backend.state_summary(chunks, span, with_transition=True)
            stages.append((call, span, chunks, summary))
            if r < P - 1:
                states.append(summary.offset if r == 0 else apply_state_summary(summary.offset, summary.transition,
                                                                               states[-1]))
        douts = [None] * P
        douts[-1] = x["dfinal"].to(torch.float64 if dtype == torch.float64 else torch.float32)
        for r in range(P - 1, 0, -1):
            call, span, chunks, summary = stages[r]
            a, b = edges[r], edges[r + 1]
            local = call.backend.backward_local(call.backend.to_saved(chunks), span, do[:, a:b],
                                                states[r] if states[r] is not None else None)
            G = call.backend.state_gradient_summary(local)
            douts[r - 1] = apply_state_gradient_summary(G, summary.transition, douts[r])
    del stages
    # every segment's outputs and gradients from its incoming state and outgoing state gradient
    op = chunk_kda if family == "kda" else chunk_gated_delta_rule
    options = dict(FAMILIES[family]["options"])
    if family == "gdn":
        options.pop("use_gate_in_kernel")
    outs, loss, final = [], 0.0, None
    for r, xs in enumerate(segs):
        a, b = edges[r], edges[r + 1]
        kw = dict(xs) if family == "kda" else dict(xs, use_gate_in_kernel=True)
        o, f = op(**kw, initial_state=states[r], output_final_state=True, backend=backend, **options)
        loss = loss + (o.double() * x["do"][:, a:b]).sum() + (f.double() * douts[r].double()).sum()
        outs.append(o.detach())
        final = f.detach()
    loss.backward()
    return _errors(torch.cat(outs, 1), final, leaves, want)


def run(T: int = 16384, world_sizes=(2, 8, 64, 1024), policies=None, families=("kda", "gdn"), report=None) -> list:
    """Rows ``family, policy, P`` and the relative error of every quantity in :data:`QUANTITIES`."""
    policies = policies or [p.value for p in SummaryPrecision]
    rows = []
    for family in families:
        x = make_inputs(family, T)
        want = truth(family, x)
        cases = [("fla", 1)] + [(p, P) for P in world_sizes for p in policies]
        for policy, P in cases:
            errs = fla_one_gpu(family, x, want) if policy == "fla" else virtual_cp(family, x, P, policy, want)
            row = dict(family=family, policy=policy, P=P, T=T, **errs)
            rows.append(row)
            if report is not None:
                report(row)
        del x, want
        torch.cuda.empty_cache()
    return rows


def _print(row: dict) -> None:
    print("| " + " | ".join(f"{v:.2e}" if isinstance(v, float) else str(v) for v in row.values()) + " |", flush=True)


if __name__ == "__main__":
    print("| family | policy | P | T | " + " | ".join(QUANTITIES) + " |", flush=True)
    run(int(sys.argv[1]) if len(sys.argv) > 1 else 16384, report=_print)
