"""Per-rank compute overhead of context parallelism, measured on one device.

Each rank role of a 3-rank plan (``first``, ``through``, ``last``: ranks 0, 1, 2) runs its real
orchestration (:func:`~kdacp.distributed.orchestration.cp_forward` / ``cp_backward``) against an
exchange that moves nothing and hands back ready-made incoming messages (zeros; a through rank still
forms its outgoing ``M x + S``, as ``p2p`` does). Its forward and backward times are divided by one
device's forward and backward on the same tokens (a one-rank plan of the rank's own segments, the
documents cut at its edges as sequences of their own), all contenders round-robin in one run
(:func:`~kdacp.bench.timing.time_queued`: on a GPU device time, each contender's calls queued behind a
sleep, as the host runs ahead in a training step; wall clock on the CPU).

Rows ``source="overhead"``: ``family, batch, role``, the rank's layout (``receives``, ``sends``:
segments; ``affine``: the rank needs ``M``), ``<rank|one>_<fwd|bwd>_ms``, ``fwd_ratio``, ``bwd_ratio``
and ``ratio`` (forward + backward over one device's).
Rows ``source="breakdown"``: per role and stage (the backend's stages and the exchange's ``M x + S``),
``calls`` and ``ms`` on the rank beside ``one_calls`` / ``one_ms`` on one device and ``extra_ms``
(their difference): which work a CP rank does that one device does not. Stage times are device
time between CUDA events around each stage on a GPU (wall clock on the CPU), medians over rounds.
Rows ``source="stages"``: per role and direction, the scaling model's ``ready_ms`` (until the rank
posts its message), ``between_ms`` (until it blocks) and ``after_ms`` (after the incoming message),
stamped by :class:`~kdacp.bench.stage_probe.StageProbe` (device time on a GPU), medians over rounds: the
critical path's pieces for every batch (the scaling suite stamps one sequence only).

Families: ``kda`` (Kimi Linear's gate: in kernel, ``safe_gate``, ``lower_bound=-5``, L2 norm in
kernel; ``H = HV = heads``) and ``gdn`` (gate in kernel, L2 norm in kernel; Qwen3-Next's shape
``H = heads / 2``, ``HV = heads``; the backend a training call would take, see
:func:`~kdacp.backends.call.prepare_call`). Batches (:mod:`kdacp.bench.batches`) of ``3 * t_local``
tokens; ``lognormal`` with median ``min(2048, t_local / 4)``.

    kdacp bench --suite overhead [--seq-lens 16384] [--family kda] [--batches one_sequence,docs7]
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from kdacp.backends.call import prepare_call
from kdacp.kernels.precision import resolve_precision
from kdacp.distributed.orchestration import cp_backward, cp_forward
from kdacp.distributed.plan import CPPlan, one_rank_plan, rank_layouts, through_ranks
from kdacp.distributed.strategies import Pending
from kdacp.gdn import gdn_as_kda_arguments
from kdacp.reference.gates import compute_dtype

from .batches import cu_seqlens_of, document_lengths
from .calibration import OPTIONS as KDA_OPTIONS
from .inputs import random_inputs
from .harness import PlotSpec, markdown_table
from .stage_probe import ROLE_RANKS, probe_rounds
from .timing import Clock, check_queued_ahead, queue_ahead_for, sleep_then_mark, sync, time_queued

FAMILIES = ("kda", "gdn")
GDN_OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=None, safe_gate=False)
PLOTS = {"overhead": PlotSpec(x="label", y="ratio", bars=True, where=("source", "overhead"),
                              title="CP rank forward+backward / one device, same tokens", ylabel="ratio")}


class ReadyExchange:
    """A :class:`~kdacp.distributed.strategies.StateExchange` that moves nothing: the incoming value is a
    ready-made zero state (allocated once per shape), and a rank whose message is affine forms
    ``M x + S`` from it as ``p2p`` does before sending (timed as stage ``apply`` by ``timer``)."""

    def __init__(self, timer=None):
        self.timer, self._ready = timer, {}

    def begin(self, route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, messages) -> None:
        pending.messages = dict(zip(pending.route.positions, messages))

    def receive(self, pending: Pending) -> list:
        route = pending.route
        (message,) = pending.messages.values()  # a rank of the contiguous layout: one position
        if route.predecessor is None:
            return [None]
        key = (route.shape, route.dtype, route.device)
        if key not in self._ready:
            self._ready[key] = torch.zeros(route.shape, dtype=route.dtype, device=route.device)
        x = self._ready[key]
        if route.successor is not None and message is not None and message.transition is not None:
            apply = lambda: message.apply(x).to(route.dtype)  # noqa: E731
            self.timer.run("apply", apply) if self.timer else apply()
        return [x]


class StageTimer:
    """Times calls by stage name on the device clock (:class:`~kdacp.bench.timing.Clock`: CUDA events around
    each on a GPU, read in :meth:`totals`; the wall clock on the CPU)."""

    def __init__(self, device: torch.device):
        self.clock, self.records = Clock(device), []

    def run(self, name: str, fn):
        start = self.clock.stamp()
        out = fn()
        self.records.append((name, start, self.clock.stamp()))
        return out

    def totals(self) -> dict:
        """``{stage: (calls, ms)}`` of the calls recorded so far; clears them."""
        got = defaultdict(lambda: [0, 0.0])
        for name, start, end in self.records:
            got[name][0] += 1
            got[name][1] += self.clock.seconds(start, end) * 1e3
        self.records.clear()
        return {name: tuple(v) for name, v in got.items()}


class _TimedBackend:
    """A backend whose stage calls :class:`StageTimer` times (attributes other than calls pass through)."""

    def __init__(self, inner, timer: StageTimer):
        self._inner, self._timer = inner, timer

    def __getattr__(self, stage):
        fn = getattr(self._inner, stage)
        if not callable(fn):
            return fn
        return lambda *args, **kwargs: self._timer.run(stage, lambda: fn(*args, **kwargs))


def role_call(family: str, backend: str, T: int, heads: int, head_dim: int, dtype: torch.dtype, device,
              summary_precision=None):
    """``(PreparedCall, do)`` of one rank's ``T`` tokens for ``family`` (``summary_precision`` as
    :func:`kdacp.chunk_kda`'s)."""
    x = random_inputs(T, heads if family == "kda" else max(heads // 2, 1), heads, head_dim, head_dim, gate=family,
                      dtype=dtype, device=device)
    if family == "kda":
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        with torch.enable_grad():  # the backend a training call takes
            call = prepare_call(backend, **leaves, scale=None, summary_precision=summary_precision, **KDA_OPTIONS)
        return call, torch.randn_like(x["v"])
    # GDN: one gate logit per value head and token, dt_bias [HV]
    gate = gdn_as_kda_arguments(x["q"], x["v"], x["g"], True, x["A_log"], x["dt_bias"])
    gate.pop("use_gate_in_kernel")
    leaves = {n: t.detach().requires_grad_() for n, t in dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"]).items()}
    with torch.enable_grad():  # the backend a training call takes (FLA's GDN backward may be refused)
        call = prepare_call(backend, **leaves, **gate, scale=None, summary_precision=summary_precision, **GDN_OPTIONS)
    return call, torch.randn_like(x["v"])


def device_role_call(family: str, device: torch.device, T: int | None = None):
    """``(T, PreparedCall, do)`` of :func:`role_call` at the benchmark scripts' size for ``device``: on a GPU
    ``T`` tokens (default 16384), 32 heads of 128, bf16, the ``fla`` backend; on the CPU (a check that a
    script runs) ``T`` tokens (default 256), 2 heads of 16, float32, the ``torch`` backend."""
    cuda = device.type == "cuda"
    T = T or (16384 if cuda else 256)
    call, do = role_call(family, "fla" if cuda else "torch", T, *((32, 128) if cuda else (2, 16)),
                         torch.bfloat16 if cuda else torch.float32, device)
    return T, call, do


def role_plans(batch: str, T: int) -> dict:
    """``{role: (plan of its rank in a 3-rank plan, one-rank plan of the same tokens)}``."""
    lengths = document_lengths(batch, 3 * T, median=min(2048, max(T // 4, 1)))
    cu = tuple(cu_seqlens_of(lengths)) if len(lengths) > 1 else None
    layouts = rank_layouts(cu, 1, (T,) * 3)
    plans = {}
    for role, rank in ROLE_RANKS.items():
        plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=cu,
                      local_lengths=(T,) * 3, rank_layouts=layouts)
        own = layouts[rank].whole.cu_seqlens
        plans[role] = (plan, one_rank_plan(own if len(own) > 2 else None, 1, T))
    return plans


def rank_step(backend, plan: CPPlan, call, do, state_dtype, exchange):
    """``(forward, backward)`` callables of one rank: the forward runs once here, the backward reuses it."""
    fwd = lambda: cp_forward(backend, plan, call.inputs, None, False, state_dtype, exchange=exchange)  # noqa: E731
    out = fwd()
    return fwd, lambda: cp_backward(backend, plan, out.saved, out.local_initial, out.transition, out.head_states,
                                    do, None, False, False, exchange=exchange)


def _breakdown(call, do, state_dtype, plans: dict, device: torch.device, warmup: bool, rounds: int) -> dict:
    """``{role: {stage: (calls, median ms)}}`` and ``{("one", role): ...}``: one forward and backward per
    round (after one that warms up, with ``warmup``), every stage timed (:class:`StageTimer`); one device
    once per distinct plan. On a GPU each round's forward and backward are queued behind a device sleep
    (:func:`~kdacp.bench.timing.queue_ahead_for`), so a stage's events time its device work, not the host's
    launch of it where the device would otherwise have run dry (``RuntimeError`` if the device caught up)."""
    timer = StageTimer(device)
    backend, exchange = _TimedBackend(call.backend, timer), ReadyExchange(timer)
    runs = {role: plan for role, (plan, _) in plans.items()}
    for _, one in plans.values():
        runs.setdefault(("one", one.cu_seqlens), one)

    def step(plan):
        _, bwd = rank_step(backend, plan, call, do, state_dtype, exchange)  # one forward inside
        bwd()
    for _ in range(int(warmup)):
        for plan in runs.values():
            step(plan)
    ahead = {key: queue_ahead_for([lambda p=plan: step(p)], 1, device) for key, plan in runs.items()}
    timer.totals()  # drop the warm-up's and the sizing's records
    got = {key: [] for key in runs}
    for _ in range(rounds):
        for key, plan in runs.items():
            sync(device)
            mark = sleep_then_mark(ahead[key]) if device.type == "cuda" else None
            step(plan)
            if mark is not None:
                check_queued_ahead(mark, ahead[key], f"overhead breakdown of {key!r}")
            got[key].append(timer.totals())
    medians = {key: {stage: (runs_[0][stage][0], statistics.median(r[stage][1] for r in runs_)) for stage in runs_[0]}
               for key, runs_ in got.items()}
    return {**{role: medians[role] for role in plans},
            **{("one", role): medians[("one", one.cu_seqlens)] for role, (_, one) in plans.items()}}


def _critical_stages(call, do, state_dtype, plans: dict, device: torch.device, warmup: bool, rounds: int) -> dict:
    """``{(role, "forward" | "backward"): [ready, between, after] ms}``, medians over ``rounds``."""
    got = probe_rounds(call.backend, call.inputs, state_dtype, {role: plan for role, (plan, _) in plans.items()},
                       do, device, rounds, warmup=int(warmup))
    return {(role, direction): [statistics.median(getattr(runs[k], n) for runs in got[role]) * 1e3
                                for n in ("ready", "between", "after")]
            for role in plans for k, direction in enumerate(("forward", "backward"))}


def _rows_of(family: str, batch: str, T: int, plans: dict, ms: dict, stages: dict, critical: dict,
             policy: str) -> list[dict]:
    rows = []
    for role, (plan, _) in plans.items():
        layout = plan.rank_layouts[plan.rank]
        r = dict(source="overhead", family=family, batch=batch, T_local=T, policy=policy, role=role,
                 label=f"{family} {batch} {role}",
                 receives=layout.num_receive, sends=layout.num_send,
                 affine=through_ranks(plan.rank_layouts)[plan.rank])
        for who in ("rank", "one"):
            for d in ("fwd", "bwd"):
                r[f"{who}_{d}_ms"] = ms[f"{who}:{role}:{d}"]
        r["fwd_ratio"], r["bwd_ratio"] = r["rank_fwd_ms"] / r["one_fwd_ms"], r["rank_bwd_ms"] / r["one_bwd_ms"]
        r["ratio"] = (r["rank_fwd_ms"] + r["rank_bwd_ms"]) / (r["one_fwd_ms"] + r["one_bwd_ms"])
        rows.append(r)
        mine, one = stages[role], stages[("one", role)]
        for stage in dict.fromkeys([*one, *mine]):
            calls, t = mine.get(stage, (0, 0.0))
            one_calls, one_t = one.get(stage, (0, 0.0))
            rows.append(dict(source="breakdown", family=family, batch=batch, role=role, stage=stage, calls=calls,
                             ms=t, one_calls=one_calls, one_ms=one_t, extra_ms=t - one_t))
    for (role, direction), (ready, between, after) in critical.items():
        rows.append(dict(source="stages", family=family, batch=batch, role=role, direction=direction,
                         ready_ms=ready, between_ms=between, after_ms=after))
    return rows


def run(t_local: int | None = None, families=FAMILIES, batches=("one_sequence", "docs7"), heads: int | None = None,
        head_dim: int | None = None, backend: str | None = None, dtype: torch.dtype | None = None,
        warmup: int | None = None, rounds: int | None = None, iters: int | None = None, device: str = "cuda",
        summary_precision=None, report=None) -> list[dict]:
    """The rows of the module docstring, per family and batch. Defaults: on CUDA 16384 tokens per rank, 32
    heads of 128, bf16, the ``fla`` backend, 2 warm-up calls, 10 rounds of 5 calls; on the CPU (a check
    of the suite, not a measurement) 64 tokens, 2 heads of 8, float32, ``torch``, 1 round of 1 call.
    ``summary_precision``: the summary kernels' policy (:class:`kdacp.kernels.SummaryPrecision`; ``None``:
    the dtype's default), named in every overhead row's ``policy``. ``report(row)`` is called as each row
    completes."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    warmup, rounds, iters = (2 if cuda else 0) if warmup is None else warmup, \
        (10 if cuda else 1) if rounds is None else rounds, (5 if cuda else 1) if iters is None else iters
    t_local = t_local or (16384 if cuda else 64)
    heads, head_dim = heads or (32 if cuda else 2), head_dim or (128 if cuda else 8)
    backend = backend or ("fla" if cuda else "torch")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families must be from {FAMILIES}, got {unknown[0]!r}")
    rows = []
    for family in families:
        call, do = role_call(family, backend, t_local, heads, head_dim, dtype, dev, summary_precision)
        policy = resolve_precision(summary_precision, dtype, name="summary_precision").value
        state_dtype = compute_dtype(call.inputs.q)
        with torch.no_grad():
            for batch in batches:
                plans = role_plans(batch, t_local)
                fns, first_of = {}, {}  # one device timed once per distinct plan (one sequence: one plan)
                for role, (plan, one) in plans.items():
                    fns[f"rank:{role}:fwd"], fns[f"rank:{role}:bwd"] = rank_step(call.backend, plan, call, do,
                                                                             state_dtype, ReadyExchange())
                    key = first_of.setdefault(one.cu_seqlens, f"one:{role}")
                    if key == f"one:{role}":
                        fns[f"{key}:fwd"], fns[f"{key}:bwd"] = rank_step(call.backend, one, call, do, state_dtype,
                                                                     ReadyExchange())
                ms = time_queued(fns, warmup, rounds, iters, dev)  # device time, however slow the host
                for role, (_, one) in plans.items():
                    for d in ("fwd", "bwd"):
                        ms[f"one:{role}:{d}"] = ms[f"{first_of[one.cu_seqlens]}:{d}"]
                stages = _breakdown(call, do, state_dtype, plans, dev, warmup > 0, rounds)
                critical = _critical_stages(call, do, state_dtype, plans, dev, warmup > 0, rounds)
                for row in _rows_of(family, batch, t_local, plans, ms, stages, critical, policy):
                    rows.append(row)
                    if report is not None:
                        report(row)
        del call, do
        if cuda:
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    """The overhead table, the breakdown (stages a rank runs that one device does not, or more often),
    then the stages of the critical path."""
    overhead = [{k: v for k, v in r.items() if k not in ("source", "label")} for r in rows if r["source"] == "overhead"]
    extra = [{k: v for k, v in r.items() if k != "source"} for r in rows
             if r["source"] == "breakdown" and (r["calls"] != r["one_calls"] or r["one_calls"] == 0)]
    stages = [{k: v for k, v in r.items() if k != "source"} for r in rows if r["source"] == "stages"]
    return (f"### per-rank overhead (rank / one device, same tokens)\n\n{markdown_table(overhead)}\n\n"
            f"### breakdown: stages a rank runs that one device does not, or runs more often\n\n"
            f"{markdown_table(extra)}\n\n"
            f"### critical-path stages (ms: until the send, until the wait, after the incoming message)\n\n"
            f"{markdown_table(stages)}")
