"""Per-rank compute overhead of context parallelism, measured on one device.

Each rank role runs its real schedule (:class:`~kdacp.bench.rank_role.RankRole`) against an exchange that moves
nothing and hands back ready-made incoming messages (zeros; a position strictly inside a chain still forms its
outgoing ``M x + S``, as ``p2p`` does). Its forward and backward times are divided by one device's forward and
backward on the same tokens (a one-rank plan of the rank's own segments, the documents cut at its edges as
sequences of their own), all contenders round-robin in one run (:func:`~kdacp.bench.timing.time_queued`: on a
GPU device time, each contender's calls queued behind a
sleep, as the host runs ahead in a training step; wall clock on the CPU).

Roles, by token layout (:mod:`kdacp.cp.layout`):

- ``contiguous``: ``first``, ``through``, ``last``, ranks 0, 1, 2 of a 3-rank plan of ``3 * t_local`` tokens
  (at any ``P >= 3`` the ranks are of these three kinds, for one sequence).
- ``zigzag`` (one sequence) and ``document_zigzag`` (each document of a packed batch) at each virtual ``P`` of
  ``world_sizes``, a batch of ``P * t_local`` tokens: ``ends`` (rank 0: the chain's first and last chunks),
  ``middle`` (rank 1, standing for ranks 1 .. P-2: two chunks inside the chain), ``turn`` (rank P-1: chunks
  P-1 and P, one range, the contiguous through rank's work); see :func:`layout_role_ranks`.

Rows ``source="overhead"``: ``family, batch, layout, P, role``, the local ``backend`` (its name) and the summaries'
``policy``, the rank's layout (``receives``, ``sends``:
segments; ``affine``: the rank needs ``M``; ``rank``, ``positions``: its ranges in the state chain),
``<rank|one>_<fwd|bwd>_ms``, ``fwd_ratio``, ``bwd_ratio`` and ``ratio`` (forward + backward over one
device's), ``base_<fwd|bwd>_ms`` and ``base_ratio``: over one device's on as many tokens of the batch uncut
by the layout (:func:`base_plan`; one sequence: ``t_local`` tokens of one sequence), the figure comparable
across layouts.
Rows ``source="breakdown"``: per role and stage (the backend's stages and the exchange's ``M x + S``),
``calls`` and ``ms`` on the rank beside ``one_calls`` / ``one_ms`` on one device and ``extra_ms``
(their difference): which work a CP rank does that one device does not. Stage times are device
time between CUDA events around each stage on a GPU (wall clock on the CPU), medians over rounds.
Rows ``source="stages"``: per role and direction, the scaling model's ``ready_ms`` (until the rank
posts its message), ``between_ms`` (until it blocks) and ``after_ms`` (after the incoming message),
stamped by :class:`~kdacp.bench.stage_probe.StageProbe` (device time on a GPU), medians over rounds: the
critical path's pieces for every batch (the scaling suite stamps one sequence only).
Rows ``source="step model"`` (one sequence): a training step of ``STEP_LAYERS`` mixer layers (an attention
layer after every ``sync_every``) over ``STEP_LAYERS`` one-device steps on ``t_local`` tokens, per strategy
and the best, for every layout and ``P``: each rank doing its role's measured stages
(:func:`~kdacp.bench.scaling_model.layout_step_path`; contiguous from the 3-rank roles at every ``P`` of
``world_sizes``), and ``stages="contiguous by share"``: the zigzag model the hybrid suite runs, whose
positions do their shares of the contiguous roles' stages. The exchange's products are timed here
(:func:`~kdacp.bench.calibration.op_times`), the link is the model's default.

Families: ``kda`` (Kimi Linear's gate: in kernel, ``safe_gate``, ``lower_bound=-5``, L2 norm in
kernel; ``H = HV = heads``) and ``gdn`` (gate in kernel, L2 norm in kernel; Qwen3-Next's shape
``H = heads / 2``, ``HV = heads``; the backend a training call would take, see
:meth:`~kdacp.bench.rank_role.RankRole.prepare`). Batches: :mod:`kdacp.bench.batches`; ``lognormal`` with median
``min(2048, t_local / 4)``.

    kdacp bench --suite overhead [--seq-lens 16384] [--family kda] [--batches one_sequence,docs7]
                                 [--layouts contiguous,zigzag,document_zigzag --ranks 2,8,64]
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from dataclasses import replace

import torch

from kdacp.kernels.precision import resolve_precision
from kdacp.bench.rank_role import RankRole, StandInExchange
from kdacp.cp.cost_model import RoleStages, StageTimes
from kdacp.cp.layout import LAYOUTS, make_layout
from kdacp.cp.plan import STRATEGIES, CPPlan, RankLayout, layout_rank_layouts, one_rank_plan, rank_layouts
from kdacp.ops.gdn import gdn_gate_arguments
from kdacp.reference.gates import compute_dtype

from .batches import cu_seqlens_of, document_lengths, local_cu_seqlens
from .calibration import OPTIONS as KDA_OPTIONS
from .calibration import op_times
from .inputs import random_inputs
from .harness import PlotSpec, markdown_table
from .scaling import STEP_LAYERS, SYNC_EVERY
from .scaling_model import layout_step_path, predict_step
from .stage_probe import ROLE_RANKS, probe_rounds
from .timing import Clock, check_queued_ahead, queue_ahead_for, sleep_then_mark, sync, time_queued

FAMILIES = ("kda", "gdn")
WORLD_SIZES = (2, 8, 64)  # the virtual ranks of the layouts other than contiguous
GDN_OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=None, safe_gate=False)
PLOTS = {"overhead": PlotSpec(x="label", y="ratio", bars=True, where=("source", "overhead"),
                              title="CP rank forward+backward / one device, same tokens", ylabel="ratio")}


class ReadyExchange(StandInExchange):
    """A :class:`~kdacp.bench.rank_role.StandInExchange` for timing: each of the rank's positions that has a source
    gets a ready-made value, ``incoming(route, i)`` for position ``i`` of ``route`` (default: the stand-in's
    zero state), and a position whose message is affine and goes on forms ``M x + S`` from it as ``p2p`` does
    (the products of one exchange timed together as one call of stage ``apply`` by ``timer``: a rank of many
    positions records few events). ``passed``: the value each of the rank's positions passed on in the last
    exchange (position -> ``[n, HV, K, V]``)."""

    def __init__(self, timer=None, incoming=None):
        super().__init__()
        self.timer, self.incoming_at, self.passed = timer, incoming, {}

    def receive(self, pending) -> list:
        route, self.passed = pending.route, {}
        incoming = [None if route.source(i) is None else
                    self.incoming_at(route, i) if self.incoming_at is not None else self._incoming(route)
                    for i in route.positions]
        affine = []
        for i, x in zip(route.positions, incoming):
            message = pending.messages[i]
            if route.target(i) is not None and message is not None:
                if message.transition is None:
                    self.passed[i] = message.offset
                else:
                    affine.append((i, message, x))

        def apply():
            self.passed.update({i: self.pass_on(message, x, route) for i, message, x in affine})
        if affine:
            self.timer.run("apply", apply) if self.timer else apply()
        return incoming


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
    """``(RankRole, do)`` of one rank's ``T`` tokens for ``family`` (``summary_precision`` as
    :func:`kdacp.chunk_kda`'s), on one device's plan (:func:`rank_step` runs it on another)."""
    x = random_inputs(T, heads if family == "kda" else max(heads // 2, 1), heads, head_dim, head_dim, gate=family,
                      dtype=dtype, device=device)
    one = one_rank_plan(None, 1, T)
    if family == "kda":
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        with torch.enable_grad():  # the backend a training call takes
            call = RankRole.prepare(one, **leaves, backend=backend, summary_precision=summary_precision,
                                    **KDA_OPTIONS)
        return call, torch.randn_like(x["v"])
    # GDN: one gate logit per value head and token, dt_bias [HV]
    gate = gdn_gate_arguments(x["g"], True, x["A_log"], x["dt_bias"])
    gate.pop("use_gate_in_kernel")
    leaves = {n: t.detach().requires_grad_() for n, t in dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"]).items()}
    with torch.enable_grad():  # the backend a training call takes (FLA's GDN backward may be refused)
        call = RankRole.prepare(one, **leaves, **gate, backend=backend, summary_precision=summary_precision,
                                **GDN_OPTIONS)
    return call, torch.randn_like(x["v"])


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


def layout_role_ranks(P: int) -> dict:
    """``{role: rank}`` of the ranks that differ under a zigzag layout over ``P >= 2`` ranks (2P chunks, rank
    ``r`` holding chunks ``r`` and ``2P-1-r``; a packed batch's documents each so under ``document_zigzag``):

    - ``ends``: rank 0, the chain's first chunk (it only sends: a state pass before its message) and its last
      (it waits for the state that has crossed every other chunk);
    - ``middle``: rank 1, standing for ranks 1 .. P-2 (none at P = 2): two chunks strictly inside the chain,
      both through (``(S_ext, M)`` forward, ``G`` backward, ``M x + S`` per chunk);
    - ``turn``: rank P-1, chunks P-1 and P as one range through which the chain turns back: the contiguous
      layout's through rank on the same tokens.

    A rank's work depends on what it holds, not on ``P``: at any ``P`` with a middle rank these are all the
    rank kinds there are (one sequence, or documents whose lengths are multiples of ``2P``:
    :func:`layout_batch`); under plain ``zigzag`` of a packed batch the middle ranks differ in where the
    documents fall, and rank 1 is one of them."""
    roles = {"ends": 0, "middle": 1, "turn": P - 1}
    if P == 2:
        del roles["middle"]
    return roles


def layout_batch(layout: str, batch: str, T: int, P: int):
    """``(cu_seqlens or None, TokenLayout)``: the global batch of ``P * T`` tokens over ``P`` ranks under
    ``layout`` (one of :data:`~kdacp.cp.layout.LAYOUTS`), its documents ``batch``'s
    (:func:`~kdacp.bench.batches.document_lengths`, the log-normal median as :func:`role_plans`'). Under
    ``document_zigzag`` each document's length is rounded to a multiple of ``2P`` (the last one takes the
    rest), as Megatron-Core's packed format pads them, so that every rank holds ``T`` tokens.

    Raises:
        ValueError: ``P < 2``, an unknown layout, or (zigzag layouts) an odd ``T``: ``T / 2`` tokens a chunk.
    """
    if isinstance(P, bool) or not isinstance(P, int) or P < 2:
        raise ValueError(f"world sizes must be ints >= 2, got {P!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layouts must be from {LAYOUTS}, got {layout!r}")
    if layout != "contiguous" and T % 2:
        raise ValueError(f"t_local must be even under {layout} (a rank holds two chunks of t_local / 2), got {T}")
    total = P * T
    lengths = document_lengths(batch, total, median=min(2048, max(T // 4, 1)))
    if layout == "document_zigzag" and len(lengths) > 1:
        lengths = _multiples(lengths, 2 * P, total)
    cu = tuple(cu_seqlens_of(lengths)) if len(lengths) > 1 else None
    return cu, make_layout(layout, P, total, cu)


def _multiples(lengths, m: int, total: int) -> list[int]:
    """``lengths`` each rounded to a multiple of ``m`` (at least ``m``), cut where they reach ``total`` (a
    multiple of ``m``): the last takes the rest."""
    out = []
    for n in lengths:
        n = max(m, m * round(n / m))
        if sum(out) + n >= total:
            break
        out.append(n)
    return out + [total - sum(out)]


def layout_role_plans(layout: str, batch: str, T: int, P: int) -> dict:
    """``{role: (plan of its rank in a P-rank plan under layout, one-rank plan of the same tokens)}``: the roles
    of :func:`layout_role_ranks` under a zigzag ``layout`` over :func:`layout_batch`'s batch; under
    ``balanced_documents`` of a packed batch, whose ranks each hold a different mix, one role, ``busiest``: the
    rank of the most chain positions (the lowest of those). The one-rank plan holds the rank's segments as
    sequences of their own."""
    cu, token_layout = layout_batch(layout, batch, T, P)
    layouts = layout_rank_layouts(cu, 1, token_layout)
    plans = {}
    roles = layout_role_ranks(P)
    if layout == "balanced_documents" and cu is not None:
        roles = {"busiest": max(range(P), key=lambda r: (len(layouts[r].positions), -r))}
    for role, rank in roles.items():
        plan = CPPlan(rank=rank, world_size=P, group=None, strategy="p2p", batch_size=1, cu_seqlens=cu,
                      local_lengths=token_layout.local_lengths, rank_layouts=layouts, layout=token_layout,
                      layout_name=layout)
        own = layouts[rank].whole.cu_seqlens
        plans[role] = (plan, one_rank_plan(own if len(own) > 2 else None, 1, T))
    return plans


def base_plan(plans: dict, T: int) -> CPPlan:
    """The one-rank plan of ``T`` tokens of ``plans``' global batch as no layout cuts them (its first ``T``
    tokens: one sequence of ``T`` for one sequence): one GPU's work on as many tokens, whatever the layout."""
    cu = next(iter(plans.values()))[0].cu_seqlens
    own = None if cu is None else tuple(local_cu_seqlens(cu, 0, T))
    return one_rank_plan(own if own is not None and len(own) > 2 else None, 1, T)


def _cases(batches, layouts, world_sizes, T: int):
    """``(batch, layout, P, {role: (plan, one)})`` of every case, layout by layout: the contiguous roles of a
    3-rank plan (:func:`role_plans`), the other layouts' at every ``P`` (:func:`layout_role_plans`). Where both
    zigzag layouts are asked for, each batch runs the one Megatron-Core gives it: one sequence ``zigzag`` (its
    ``document_zigzag`` is the same), a packed batch ``document_zigzag``; every other layout runs every batch."""
    both = {"zigzag", "document_zigzag"} <= set(layouts)
    for layout in layouts:
        for batch in batches:
            if layout == "contiguous":
                yield batch, layout, 3, role_plans(batch, T)
            elif not both or layout not in ("zigzag", "document_zigzag") or \
                    layout == ("zigzag" if batch == "one_sequence" else "document_zigzag"):
                for P in world_sizes:
                    yield batch, layout, P, layout_role_plans(layout, batch, T, P)


def _queued_calls(plans: dict, rounds: int, iters: int) -> tuple[int, int]:
    """``(rounds, calls per round)`` of a case: ``iters`` calls back to back, or, where a role holds more than
    two positions (a packed batch under a zigzag layout), one call in each of ``rounds * iters`` rounds: its
    launches grow with its positions (a message and an ``M x + S`` each), and calls queued behind one sleep
    must stay within the device's launch queue (about 1,000 kernels) for device time to be read."""
    many = any(len(plan.rank_layouts[plan.rank].positions) > 2 for plan, _ in plans.values())
    return (rounds * iters, 1) if many else (rounds, iters)


def rank_step(backend, plan: CPPlan, call: RankRole, do, state_dtype, exchange):
    """``(forward, backward)`` callables of ``call`` on ``plan``'s rank with ``backend``: the forward runs once
    here, the backward reuses it."""
    role = replace(call, plan=plan, backend=backend, state_dtype=state_dtype)
    out = role.forward(exchange)
    return lambda: role.forward(exchange), lambda: role.backward(out, do, exchange=exchange)


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


def through_ranks(layouts: tuple[RankLayout, ...]) -> tuple[bool, ...]:
    """Per rank of a contiguous layout: strictly inside a chain, so its message is affine in what it
    receives (it sends ``M``, forward, and ``M^T``, backward)."""
    return tuple(lay.through and len(layouts) > 1 and lay.num_receive > 0 for lay in layouts)


def _rows_of(family: str, batch: str, T: int, plans: dict, ms: dict, stages: dict, critical: dict,
             policy: str, backend: str) -> list[dict]:
    rows = []
    for role, (plan, _) in plans.items():
        layout = plan.rank_layouts[plan.rank]
        r = dict(source="overhead", family=family, batch=batch, T_local=T, backend=backend, policy=policy, role=role,
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


def _with_layout(rows: list[dict], layout: str, P: int, plans: dict, base_ms: tuple[float, float]) -> list[dict]:
    """``rows`` of one case with its ``layout`` and ``P`` after the batch; overhead rows also with the ``rank``,
    its chain ``positions`` and ``base_fwd_ms``, ``base_bwd_ms``, ``base_ratio`` (forward + backward over one
    device's on as many tokens uncut, :func:`base_plan`), labelled with the layout and ``P`` where not
    contiguous."""
    out = []
    for r in rows:
        r = dict(source=r.pop("source"), family=r.pop("family"), batch=r.pop("batch"), layout=layout, P=P, **r)
        if r["source"] == "overhead":
            plan = plans[r["role"]][0]
            if layout != "contiguous":
                r["label"] = f"{r['family']} {r['batch']} {layout} P={P} {r['role']}"
            r.update(rank=plan.rank, positions=len(plan.rank_layouts[plan.rank].positions), base_fwd_ms=base_ms[0],
                     base_bwd_ms=base_ms[1], base_ratio=(r["rank_fwd_ms"] + r["rank_bwd_ms"]) / sum(base_ms))
        out.append(r)
    return out


def _rank_roles(layout: str, P: int) -> list[str]:
    """The role standing for each of ``P`` ranks under ``layout`` (one sequence)."""
    if layout == "contiguous":
        return ["first" if r == 0 else "last" if r == P - 1 else "through" for r in range(P)]
    ranks = {rank: role for role, rank in layout_role_ranks(P).items()}
    return [ranks.get(r, "middle") for r in range(P)]


def _step_rows(family: str, call, do, state_dtype, measured: list, world_sizes, T: int, device: torch.device,
               warmup: bool, rounds: int, iters: int) -> list[dict]:
    """Rows ``source="step model"`` of one sequence (module docstring): every layout's ranks each doing its
    role's measured critical-path stages, composed by :func:`~kdacp.bench.scaling_model.layout_step_path`, and
    (``stages="contiguous by share"``) the zigzag model the hybrid suite runs, its positions doing their shares of
    the contiguous roles' stages (:func:`~kdacp.bench.scaling_model.predict_step`); each strategy's step over
    ``layers`` one-device steps on ``T`` tokens (one sequence, probed as the roles are: ``one_ms``, forward +
    backward)."""
    cases = [(layout, P, plans, critical) for batch, layout, P, plans, critical in measured if batch == "one_sequence"]
    if not cases:
        return []
    one = one_rank_plan(None, 1, T)
    probed = _critical_stages(call, do, state_dtype, {"one": (one, one)}, device, warmup, rounds)
    one_s = sum(sum(probed["one", d]) for d in ("forward", "backward")) / 1e3
    HV, K, V = call.inputs.v.shape[2], call.inputs.q.shape[3], call.inputs.v.shape[3]
    times = StageTimes(**op_times(1, HV, K, V, state_dtype, device, iters))

    def role_stages(critical: dict, role: str) -> tuple[RoleStages, RoleStages]:
        return tuple(RoleStages(*(ms / 1e3 for ms in critical[role, d])) for d in ("forward", "backward"))

    rows = []

    def add(layout: str, P: int, how: str, step) -> None:  # step(strategy, sync_every) -> seconds
        for sync_every in SYNC_EVERY:
            ratios = {s: step(s, sync_every) / (STEP_LAYERS * one_s) for s in STRATEGIES}
            best = min(ratios, key=ratios.get)
            rows.append(dict(source="step model", family=family, batch="one_sequence", layout=layout, P=P, stages=how,
                             layers=STEP_LAYERS, sync_every=sync_every, one_ms=one_s * 1e3,
                             **{f"{s}_ratio": x for s, x in ratios.items()}, best_ratio=ratios[best],
                             best_strategy=best))
    for layout, P, plans, critical in cases:
        if layout == "contiguous":  # a 3-rank plan's roles stand for every P's
            by_role = [{role: role_stages(critical, role)[k] for role in ROLE_RANKS} for k in range(2)]
            shares = dataclasses.replace(times, forward=by_role[0], backward=by_role[1])
            for P_ in world_sizes:
                layouts = layout_rank_layouts(None, 1, layout_batch(layout, "one_sequence", T, P_)[1])
                stages = [role_stages(critical, role) for role in _rank_roles(layout, P_)]
                add(layout, P_, "measured", lambda s, e: layout_step_path(s, layouts, stages, times, STEP_LAYERS, e))
                add("zigzag", P_, "contiguous by share",
                    lambda s, e: predict_step(s, P_, shares, STEP_LAYERS, e, layout="zigzag").step_s)
        else:
            layouts = next(iter(plans.values()))[0].rank_layouts
            stages = [role_stages(critical, role) for role in _rank_roles(layout, P)]
            add(layout, P, "measured", lambda s, e: layout_step_path(s, layouts, stages, times, STEP_LAYERS, e))
    return sorted(rows, key=lambda r: (r["P"], r["layout"], r["stages"], r["sync_every"]))


def run(t_local: int | None = None, families=FAMILIES, batches=("one_sequence", "docs7"), heads: int | None = None,
        head_dim: int | None = None, backend: str | None = None, dtype: torch.dtype | None = None,
        warmup: int | None = None, rounds: int | None = None, iters: int | None = None, device: str = "cuda",
        summary_precision=None, layouts=("contiguous",), world_sizes=WORLD_SIZES, report=None) -> list[dict]:
    """The rows of the module docstring, per family, batch, layout and ``P``. Defaults: on CUDA 16384 tokens per
    rank, 32 heads of 128, bf16, the ``fla`` backend, 2 warm-up calls, 10 rounds of 5 calls; on the CPU (a
    check of the suite, not a measurement) 64 tokens, 2 heads of 8, float32, ``torch``, 1 round of 1 call.
    ``summary_precision``: the summary kernels' policy (:class:`kdacp.kernels.SummaryPrecision`; ``None``:
    the dtype's default), named in every overhead row's ``policy``. ``layouts``: from
    :data:`~kdacp.cp.layout.LAYOUTS`, the others than ``contiguous`` at every ``P`` of
    ``world_sizes``. ``report(row)`` is called as each row completes.

    Raises:
        ValueError: an unknown family or layout, a ``P`` below 2, an odd ``t_local`` under a zigzag layout.
    """
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
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise ValueError(f"layouts must be from {LAYOUTS}, got {unknown[0]!r}")
    cases = list(_cases(batches, layouts, world_sizes, t_local))  # the plans, checked before anything runs
    rows = []
    for family in families:
        call, do = role_call(family, backend, t_local, heads, head_dim, dtype, dev, summary_precision)
        policy = resolve_precision(summary_precision, dtype, name="summary_precision").value
        state_dtype = compute_dtype(call.inputs.q)
        with torch.no_grad():
            measured = []  # (batch, layout, P, plans, critical) of every case, for the step model
            for batch, layout, P, plans in cases:
                fns, first_of = {}, {}  # one device timed once per distinct plan (one sequence: one plan)
                for role, (plan, one) in plans.items():
                    fns[f"rank:{role}:fwd"], fns[f"rank:{role}:bwd"] = rank_step(call.backend, plan, call, do,
                                                                             state_dtype, ReadyExchange())
                    key = first_of.setdefault(one.cu_seqlens, f"one:{role}")
                    if key == f"one:{role}":
                        fns[f"{key}:fwd"], fns[f"{key}:bwd"] = rank_step(call.backend, one, call, do, state_dtype,
                                                                     ReadyExchange())
                base = base_plan(plans, t_local)  # one device on as many tokens, uncut by the layout
                if base.cu_seqlens not in first_of:
                    fns["base:fwd"], fns["base:bwd"] = rank_step(call.backend, base, call, do, state_dtype,
                                                                 ReadyExchange())
                # device time, however slow the host
                ms = time_queued(fns, warmup, *_queued_calls(plans, rounds, iters), dev)
                for role, (_, one) in plans.items():
                    for d in ("fwd", "bwd"):
                        ms[f"one:{role}:{d}"] = ms[f"{first_of[one.cu_seqlens]}:{d}"]
                base_key = first_of.get(base.cu_seqlens, "base")
                stages = _breakdown(call, do, state_dtype, plans, dev, warmup > 0, rounds)
                critical = _critical_stages(call, do, state_dtype, plans, dev, warmup > 0, rounds)
                measured.append((batch, layout, P, plans, critical))
                rows_of = _rows_of(family, batch, t_local, plans, ms, stages, critical, policy, call.backend.name)
                for row in _with_layout(rows_of, layout, P, plans, (ms[f"{base_key}:fwd"], ms[f"{base_key}:bwd"])):
                    rows.append(row)
                    if report is not None:
                        report(row)
            for row in _step_rows(family, call, do, state_dtype, measured, world_sizes, t_local, dev, warmup > 0,
                                  rounds, iters):
                rows.append(row)
                if report is not None:
                    report(row)
        del call, do
        if cuda:
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    """A summary (each role's ratios; the step model's best strategy per case), the overhead table, the
    breakdown (stages a rank runs that one device does not, or more often), then the stages of the critical
    path."""
    def table(source, columns=None, drop=()):
        return markdown_table([{k: v for k, v in r.items() if k != "source" and k not in drop
                                and (columns is None or k in columns)} for r in rows if r["source"] == source])
    summary = ("family", "batch", "layout", "P", "backend", "policy", "role", "rank", "positions", "fwd_ratio",
               "bwd_ratio", "ratio", "base_ratio")
    step = ("family", "layout", "P", "stages", "sync_every", "best_ratio", "best_strategy")
    extra = [{k: v for k, v in r.items() if k != "source"} for r in rows
             if r["source"] == "breakdown" and (r["calls"] != r["one_calls"] or r["one_calls"] == 0)]
    parts = ["### per-rank forward + backward over one device (ratio: on the rank's own segments; base_ratio: on "
             f"as many tokens uncut)\n\n{table('overhead', summary)}"]
    if any(r["source"] == "step model" for r in rows):
        parts.append(f"### step model, one sequence ({STEP_LAYERS} mixer layers, an attention layer after every "
                     f"sync_every; a CP step over one device's on a rank's tokens)\n\n{table('step model', step)}")
    parts += [f"### per-rank overhead (rank / one device, same tokens)\n\n{table('overhead', drop=('label',))}",
              "### breakdown: stages a rank runs that one device does not, or runs more often\n\n"
              f"{markdown_table(extra)}",
              f"### critical-path stages (ms: until the send, until the wait, after the incoming message)\n\n"
              f"{table('stages')}"]
    return "\n\n".join(parts)
