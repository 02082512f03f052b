"""attention-gym's context-parallel stages beside kdacp's, on one GPU: summaries and a through rank.

attention-gym (``attn-gym`` with its ``[linear]`` extra) runs KDA and GDN context parallelism on its own
chunked cores, split into stages around an affine state boundary (``chunk_kda_prepare`` /
``chunk_gdn_prepare``: ``state_summaries``, ``run``; their ``prepare_backward``: ``state_grad_summaries``,
``run``). Its state is value-major, ``H [V, K]`` with ``H_out = H_in @ A + B``, so its packed summary
``[B; A]`` is kdacp's ``(S_ext, M)`` transposed.

Rows ``source="attn_gym_rank"``, per family and batch, for the *through* rank of a 3-rank contiguous plan
(``3 * T`` tokens; the rank receives a state into its first local sequence and sends one out of its last,
in both directions), with the incoming state and cotangent stood in by random values, as
:mod:`kdacp.bench.overhead` does for kdacp:

- ``one_ms``: attention-gym's one-GPU ``chunk_*`` forward + backward (autograd) of the rank's tokens, its
  documents cut at the rank's edges;
- ``rank_ms``: the through rank's stages: prepare, the forward summary of its last local sequence, ``run``
  from the incoming state, the backward's prepare, the reverse summary of its first local sequence, and
  its ``run`` from the incoming cotangent; ``ratio = rank_ms / one_ms``;
- ``fwd_summary_ms`` / ``bwd_summary_ms``: the two summary launches alone (on the prepared handles);
- ``kdacp_ratio``: kdacp's through rank over one device in the same round robin (the overhead suite's
  contenders: FLA's kernels under kdacp's orchestration, over FLA's one device);
- ``o_err``: the through rank's output against FLA's ``chunk_*`` on the same gate values and incoming
  state (relative Frobenius error; bf16 noise is about 1e-3), ``summary_err``: the forward summary
  applied to a random state against FLA's final state of the same sequence from that state.

Gates: KDA with Kimi Linear's (``safe_gate``, ``lower_bound=-5``: ``-5 sigmoid(exp(A_log)(g + dt_bias))``),
GDN with Qwen3-Next's (``-exp(A_log) softplus(g + dt_bias)``), both formed in float32 before the call, since
attention-gym takes the per-token log decay; q, k L2-normalised beforehand. Times are device times of
calls queued ahead (:func:`~kdacp.bench.timing.time_queued`), or (column ``timing``) medians of single calls
where a contender syncs the host.
"""
from __future__ import annotations

import importlib.util

import torch

from kdacp.reference.gates import kda_gate, l2norm
from kdacp.reference.gdn import gdn_gate

from .batches import cu_seqlens_of, document_lengths
from .errors import rel_err
from .inputs import random_inputs
from .overhead import ReadyExchange, rank_step, role_call, role_plans
from .timing import median_times, time_queued

FAMILIES = ("kda", "gdn")
KIMI_LOWER_BOUND = -5.0


def unavailable(device: torch.device) -> str | None:
    """Why attention-gym's fused stages cannot run on ``device`` here, or ``None``."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "attention-gym's fused stages need a CUDA GPU"
    if importlib.util.find_spec("attn_gym") is None:
        return "attention-gym is not installed (pip install 'attn-gym[linear]')"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "attention-gym's fused stages need a Hopper or newer GPU"
    return None


def _ops(family: str):
    """``(chunk, prepare, prepare_backward)`` of attention-gym for ``family``."""
    if family == "kda":
        from attn_gym.linear.kda import chunk_kda, chunk_kda_prepare, chunk_kda_prepare_backward
        return chunk_kda, chunk_kda_prepare, chunk_kda_prepare_backward
    from attn_gym.linear.gdn import chunk_gdn, chunk_gdn_prepare, chunk_gdn_prepare_backward
    return chunk_gdn, chunk_gdn_prepare, chunk_gdn_prepare_backward


def gated_inputs(family: str, T: int, heads: int, head_dim: int, device, seed: int = 0) -> dict:
    """``q, k`` (L2-normalised) ``v, beta`` in bf16 and the per-token natural-log decay ``gate`` in float32
    (``[1, T, HV, K]`` KDA, ``[1, T, HV]`` GDN), from :func:`~kdacp.bench.inputs.random_inputs`."""
    x = random_inputs(T, heads if family == "kda" else max(heads // 2, 1), heads, head_dim, head_dim, gate=family,
                      dtype=torch.bfloat16, device=device, seed=seed)
    if family == "kda":
        gate = kda_gate(x["g"], x["A_log"], x["dt_bias"], lower_bound=KIMI_LOWER_BOUND)
    else:
        gate = gdn_gate(x["g"].float(), x["A_log"], x["dt_bias"])
    return dict(q=l2norm(x["q"].float()).to(torch.bfloat16), k=l2norm(x["k"].float()).to(torch.bfloat16),
                v=x["v"], gate=gate.float().contiguous(), beta=x["beta"])


def _fla_reference(family: str, x: dict, initial_state, cu_seqlens):
    """FLA's ``chunk_*`` output and final states on the same gate values (value-major states in and out)."""
    from kdacp.backends.fla_adapter import require_fla
    require_fla()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    q, k = x["q"], x["k"]
    kwargs = dict(initial_state=initial_state.transpose(-1, -2).contiguous(), output_final_state=True,
                  cu_seqlens=cu_seqlens)
    if family == "kda":
        o, final = chunk_kda(q, k, x["v"], x["gate"], x["beta"], **kwargs)
    else:
        group = x["v"].shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        o, final = chunk_gated_delta_rule(q, k, x["v"], x["gate"], x["beta"], **kwargs)
    return o, final.transpose(-1, -2)


def _times(fns: dict, warmup: int, rounds: int, iters: int, device: torch.device) -> tuple[dict, str]:
    """``(ms per call, how)``: device time of calls queued ahead (``"queued"``); where a contender syncs the
    host (the device catches up), the median of single calls each started on an idle device
    (``"median"``: host time included where it exceeds the device's), for every contender alike."""
    try:
        return time_queued(fns, warmup, rounds, iters, device), "queued"
    except RuntimeError:
        return {n: s * 1e3 for n, s in median_times(fns, device, rounds * iters).items()}, "median"


def through_rank_rows(family: str, batch: str, T: int, heads: int, head_dim: int, device: torch.device,
                      warmup: int, rounds: int, iters: int) -> list[dict]:
    """The module docstring's rows for one family and batch."""
    chunk, prepare, prepare_backward = _ops(family)
    x = gated_inputs(family, T, heads, head_dim, device)
    lengths = document_lengths(batch, 3 * T, median=min(2048, max(T // 4, 1)))
    cu = cu_seqlens_of(lengths)
    # the through rank's tokens [T, 2T): its local sequences, the documents cut at its edges
    local = sorted({0, T, *(c - T for c in cu if T < c < 2 * T)})
    cu_local = torch.tensor(local, dtype=torch.int32, device=device)
    # GDN always on attention-gym's packed kernels: its dense GDN path returns NaN on an H200 (as the backend's)
    packed = cu_local if len(local) > 2 or family == "gdn" else None
    N, HV, V, K = len(local) - 1, heads, head_dim, head_dim
    receives, sends = T not in cu, 2 * T not in cu
    gen = torch.Generator(device=device).manual_seed(1)
    incoming = torch.zeros(N, HV, V, K, device=device)
    if receives:
        incoming[0] = torch.randn(HV, V, K, generator=gen, device=device) * 0.1
    d_exit = torch.zeros(N, HV, V, K, device=device)
    if sends:
        d_exit[-1] = torch.randn(HV, V, K, generator=gen, device=device) * 0.1
    fwd_bounds = torch.tensor([[local[-2] if sends else T, T]], dtype=torch.int32, device=device)
    bwd_bounds = torch.tensor([[0, local[1] if receives else 0]], dtype=torch.int32, device=device)
    do = torch.randn_like(x["v"])
    args = (x["q"], x["k"], x["v"], x["gate"], x["beta"])
    leaves = [t.detach().requires_grad_() for t in args]

    def one():
        with torch.enable_grad():
            o, _ = chunk(*leaves, cu_seqlens=packed)
            o.backward(do)

    def rank():
        prepared = prepare(*args, cu_seqlens=packed)
        prepared.state_summaries(fwd_bounds)
        o, _ = prepared.run(incoming, output_final_state=True)
        grads = prepare_backward(prepared.saved, do, incoming, scale=prepared.scale)
        grads.state_grad_summaries(bwd_bounds)
        grads.run(d_exit)
        return o

    prepared = prepare(*args, cu_seqlens=packed)
    prepared.run(incoming, output_final_state=True)
    grads = prepare_backward(prepared.saved, do, incoming, scale=prepared.scale)
    fns = {"one": one, "rank": rank,
           "fwd_summary": lambda: prepared.state_summaries(fwd_bounds),
           "bwd_summary": lambda: grads.state_grad_summaries(bwd_bounds)}
    # kdacp's through rank and its one device, the overhead suite's contenders, in the same round robin
    call, kdacp_do = role_call(family, "fla", T, heads, head_dim, torch.bfloat16, device)
    plan, one_plan = role_plans(batch, T)["through"]
    state_dtype = torch.float32
    for who, p in (("kdacp_rank", plan), ("kdacp_one", one_plan)):
        f, b = rank_step(call.backend, p, call, kdacp_do, state_dtype, ReadyExchange())
        fns[who] = lambda f=f, b=b: (f(), b())
    with torch.no_grad():
        ms, timing = _times(fns, warmup, rounds, iters, device)

    with torch.no_grad():
        o = rank()
        o_fla, _ = _fla_reference(family, x, incoming, cu_local)
        summary = prepare(*args, cu_seqlens=packed).state_summaries(fwd_bounds)[0]  # [HV, V + K, K]
        start = int(fwd_bounds[0, 0])
        state = torch.randn(1, HV, V, K, generator=gen, device=device) * 0.1
        applied = state[0] @ summary[:, V:] + summary[:, :V]
        last = {n: t[:, start:] for n, t in x.items()}
        _, final = _fla_reference(family, last, state, None)
    return [dict(source="attn_gym_rank", family=family, batch=batch, T_local=T, role="through",
                 receives=receives, sends=sends, one_ms=ms["one"], rank_ms=ms["rank"],
                 ratio=ms["rank"] / ms["one"], fwd_summary_ms=ms["fwd_summary"], bwd_summary_ms=ms["bwd_summary"],
                 kdacp_one_ms=ms["kdacp_one"], kdacp_rank_ms=ms["kdacp_rank"],
                 kdacp_ratio=ms["kdacp_rank"] / ms["kdacp_one"], timing=timing, o_err=rel_err(o, o_fla),
                 summary_err=rel_err(applied, final[0]))]


def run(t_local: int | None = None, families=FAMILIES, batches=("one_sequence", "lognormal"), heads: int = 32,
        head_dim: int = 128, warmup: int = 2, rounds: int = 10, iters: int = 3, device: str = "cuda",
        report=None) -> list[dict]:
    """The module docstring's rows (16384 tokens per rank by default, 32 heads of 128, bf16).

    Raises:
        RuntimeError: attention-gym cannot run here (:func:`unavailable` says why).
    """
    dev = torch.device(device)
    reason = unavailable(dev)
    if reason is not None:
        raise RuntimeError(reason)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families must be from {FAMILIES}, got {unknown[0]!r}")
    rows = []
    for family in families:
        for batch in batches:
            for row in through_rank_rows(family, batch, t_local or 16384, heads, head_dim, dev, warmup, rounds,
                                         iters):
                rows.append(row)
                if report is not None:
                    report(row)
            torch.cuda.empty_cache()
    return rows
