"""Scaling model: each strategy's per-rank step at 2 to 1024 ranks, predicted from measurements on the
machine at hand by :mod:`kdacp.distributed.cost_model` (an event-level composition; read its docstring).

Measured here, on rank 0 alone (the other ranks wait), at ``t_local`` tokens per rank:

- each rank role's stages (``first``, ``through``, ``last``; forward and backward): the real
  orchestration (:func:`~kdacp.distributed.orchestration.cp_forward` / ``cp_backward``) runs one
  role of a 3-rank plan against a probe exchange that stamps the time (after a device sync) where
  the message is posted, where the rank blocks and where the incoming value is handed back;
- one device's forward and backward on the same tokens (a 1-rank plan), one ``M x + S`` (:mod:`kdacp.affine`'s rule),
  one composition of open maps, the all-gather's stack per byte; with the ``fla`` backend FLA
  0.6.0's own summary kernels (``chunk_cp_fwd_h`` / ``chunk_cp_bwd_dh``), its ``chunk_kda`` forward
  and backward, and one step of its merge (a float32 ``M x + S``); with ``torch`` kdacp's summary
  stages stand in for FLA's kernels;
- the link, with two or more ranks: one-way point-to-point time (ping-pong between ranks 0 and 1) of
  a 4-byte message (latency) and of a summary (bandwidth), all-gather of both sizes over the group
  (per ring step). Given figures (``link``) replace measured ones; with one rank and none given,
  :data:`~kdacp.distributed.cost_model.DEFAULT_LINK`.

Rows: ``source="setup"`` and ``"stages"`` (the calibration), ``"model"`` per ``P`` of ``world_sizes``:
each strategy's predicted step (forward + backward critical path) in ms and over one device's
(``<s>_ratio``), and the best of kdacp's three. With ``validate`` (two or more ranks):
``"measured"`` rows, ``cp_chunk_kda`` forward+backward steps of each strategy on the first ``P`` ranks
for ``P = 2 ..`` the group's size (round-robin, the slowest rank's time of each step, median over
steps) over a 1-rank group's step, beside ``"model, shared cores"`` rows: the model with the ranks
sharing ``cores`` cores (a CPU runs ``P`` processes on fewer cores: compute is then serialised,
which the dedicated-device model would not see). Other jobs on the machine slow calibration and
measurement by different, changing amounts; the measured rows carry the load average.
``sleep_check`` tests the composition where that does not reach: ranks whose stages sleep
(:class:`SleepBackend`), so they need no core, with real orchestration, exchanges and link
(``"sleep-stage measured"`` against ``"sleep-stage model"`` rows, a device per rank). ``measured``
(a ``cp`` suite JSON) adds its rows as ``"measured (cp suite)"``.

    kdacp bench --suite scaling [--seq-lens 16384] [--link-latency-us 20 --link-bandwidth-gbs 300 ...]
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kdacp.affine import StateSummary, compose_state_summaries
from kdacp.backends.base import BackwardStates, KDAInputs, LocalGrads, LocalStates
from kdacp.backends.call import prepare_call
from kdacp.distributed import build_cp_plan
from kdacp.kda import cp_chunk_kda
from kdacp.distributed.cost_model import (DEFAULT_LINK, MODEL_STRATEGIES, Link, RoleStages, StageTimes,
                                          predict)
from kdacp.distributed.orchestration import cp_backward, cp_forward
from kdacp.distributed.plan import STRATEGIES, CPPlan, rank_layouts
from kdacp.distributed.strategies import AffineMessage, Pending
from kdacp.reference.gates import compute_dtype

from .harness import PlotSpec, markdown_table
from .timing import queued_device_time

MULTI_RANK = True
PLOTS = {"scaling": PlotSpec(x="P", y=tuple(f"{s}_ratio" for s in MODEL_STRATEGIES), where=("source", "model"),
                             points=("source", "measured"), logy=True, title="per-rank step / one device (model "
                             "lines, measured points)", ylabel="ratio")}
WORLD_SIZES = tuple(2 ** i for i in range(1, 11))
# Kimi Linear's gate and norm settings
OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
ROLE_RANKS = {"first": 0, "through": 1, "last": 2}  # rank of each role in a 3-rank plan of one sequence


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls (device-synchronised), after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StageProbe:
    """A :class:`~kdacp.distributed.strategies.StateExchange` that moves nothing: it stamps the time
    (after a device sync) where the rank posts its message and where it blocks, and hands back zeros
    as the incoming value."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, {}

    def stamp(self, name: str) -> None:
        _sync(self.device)
        self.stamps[name] = time.perf_counter()

    def begin(self, route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, message) -> None:
        pending.message = message
        self.stamp("send")

    def receive(self, pending: Pending):
        self.stamp("receive")
        route = pending.route
        x = None if route.predecessor is None else torch.zeros(route.shape, dtype=route.dtype, device=route.device)
        self.stamp("received")
        return x

    def stages(self, start: float, end: float) -> RoleStages:
        s = self.stamps
        return RoleStages(s["send"] - start, s["receive"] - s["send"], end - s["received"])


def make_inputs(T: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """One row of ``T`` tokens: q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, raw gate logits ``g``, beta,
    float32 ``A_log``/``dt_bias`` (the gate is computed in the kernel)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=device).to(dt)

    return dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, HV, V), g=rnd(1, T, HV, K),
                beta=torch.sigmoid(rnd(1, T, HV, dt=torch.float32)).to(dtype),
                A_log=0.5 * rnd(HV, dt=torch.float32), dt_bias=0.5 * rnd(HV * K, dt=torch.float32))


def _plan(rank: int, world: int, T: int) -> CPPlan:
    lengths = (T,) * world
    return CPPlan(rank=rank, world_size=world, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=lengths, rank_layouts=rank_layouts(None, 1, lengths))


def _role_once(backend, inputs: KDAInputs, state_dtype: torch.dtype, plan: CPPlan, do: torch.Tensor,
               device: torch.device) -> tuple[RoleStages, RoleStages]:
    """``(forward, backward)`` :class:`RoleStages` of one call of one role's orchestration."""
    probe = StageProbe(device)
    probe.stamp("start")
    out = cp_forward(backend, plan, inputs, None, False, state_dtype, exchange=probe)
    probe.stamp("end")
    forward = probe.stages(probe.stamps["start"], probe.stamps["end"])
    probe = StageProbe(device)
    probe.stamp("start")
    cp_backward(backend, plan, out.saved, out.local_initial, out.transition, out.head_states, do, None, False, False,
                exchange=probe)
    probe.stamp("end")
    return forward, probe.stages(probe.stamps["start"], probe.stamps["end"])


def _time_roles(backend, inputs: KDAInputs, state_dtype: torch.dtype, device: torch.device, iters: int):
    """``({role: (forward, backward) RoleStages}, (forward, backward) seconds on one device)``: medians
    over ``iters`` calls after one, the roles taken in turn within each round so that a machine whose
    load changes slows them alike (``backend``: a :class:`~kdacp.backends.base.LocalBackend`)."""
    T = inputs.q.shape[1]
    plans = {role: _plan(rank, 3, T) for role, rank in ROLE_RANKS.items()}
    plans["one"] = _plan(0, 1, T)  # one device: no exchange
    do = torch.randn_like(inputs.v)
    got = {role: [] for role in plans}
    for i in range(iters + 1):  # the first round warms up
        for role, plan in plans.items():
            result = _role_once(backend, inputs, state_dtype, plan, do, device)
            if i:
                got[role].append(result)

    def median(stages: list[RoleStages]) -> RoleStages:
        return RoleStages(*(statistics.median(getattr(s, n) for s in stages) for n in ("ready", "between", "after")))
    medians = {role: (median([f for f, _ in runs]), median([b for _, b in runs])) for role, runs in got.items()}
    f, b = medians.pop("one")
    return medians, (f.total, b.total)


def _op_times(n: int, HV: int, K: int, V: int, state_dtype: torch.dtype, device: torch.device, iters: int) -> dict:
    """One ``M x + S`` by :mod:`kdacp.affine`'s rule (rounded to the wire dtype), one composition of open
    maps, the stack per byte. On CUDA the two products are timed as device time behind a busy queue
    (:func:`~kdacp.bench.timing.queued_device_time`): a rank reaches the exchange with its local
    kernels still running, so the host has queued the product before its input arrives, and the
    critical path holds only its device time (``benchmarks/affine_products.py`` shows the host's)."""
    wire = torch.finfo(state_dtype).bits // 8
    msg = AffineMessage(torch.randn(n, HV, K, V, device=device, dtype=state_dtype),
                        torch.randn(n, HV, K, K, device=device, dtype=state_dtype))
    x = torch.randn(n, HV, K, V, device=device, dtype=state_dtype)
    a, b = (msg.offset, msg.transition), (x, msg.transition)
    ops = dict(apply=lambda: msg.apply(x).to(state_dtype),
               compose=lambda: torch.cat(compose_state_summaries(a, b), -1).to(state_dtype))
    got = {name: queued_device_time(fn, iters=max(iters, 20))[0] if device.type == "cuda"
           else _median_time(fn, device, iters) for name, fn in ops.items()}
    parts = [torch.randn(n, HV, K, K + V, device=device, dtype=state_dtype) for _ in range(8)]
    copy_s = _median_time(lambda: torch.stack(parts), device, iters) / (8 * parts[0].numel() * wire)
    return dict(apply_s=got["apply"], compose_s=got["compose"], copy_s_per_byte=copy_s,
                state_bytes=n * HV * K * V * wire, summary_bytes=n * HV * K * (K + V) * wire)


def _time_summaries(backend_name: str, args: dict, device: torch.device, iters: int) -> tuple[float, float]:
    """kdacp's summary stages on all the tokens: ``(S_ext, M)`` forward, ``G`` backward (seconds)."""
    call = prepare_call(backend_name, **args, scale=None, **OPTIONS)
    backend, layout = call.backend, rank_layouts(None, 1, (args["q"].shape[1],) * 3)[1]
    chunks = backend.prepare(call.inputs, layout.whole)
    fwd = _median_time(lambda: backend.state_summary(chunks, layout.whole, with_transition=True), device, iters)
    saved = backend.to_saved(chunks)
    x0 = torch.zeros(1, args["v"].shape[2], args["q"].shape[3], args["v"].shape[3], dtype=compute_dtype(args["q"]),
                     device=device)
    local = backend.backward_local(saved, layout.whole, torch.randn_like(args["v"]), x0, None)
    bwd = _median_time(lambda: backend.state_gradient_summary(local), device, iters)
    return fwd, bwd


def _time_fla(args: dict, device: torch.device, iters: int) -> dict:
    """FLA 0.6.0's summary kernels, its ``chunk_kda`` forward and backward, and one merge step (seconds)."""
    from kdacp.backends.fla_adapter import load_fla
    fla = load_fla()
    call = prepare_call("fla", **args, scale=None, **OPTIONS)
    backend, T = call.backend, args["q"].shape[1]
    HV, K, V = args["v"].shape[2], args["q"].shape[3], args["v"].shape[3]
    whole = rank_layouts(None, 1, (T,))[0].whole
    chunks = backend.prepare(call.inputs, whole)
    cu = torch.tensor([0, T], dtype=torch.int64, device=device)
    hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=device)
    summary_f = _median_time(lambda: fla.chunk_cp_fwd_h(k=chunks.kg, w=chunks.w, u=chunks.u, hm=hm, gk=chunks.gc,
                                                        cu_seqlens=cu), device, iters)
    x0 = torch.zeros(1, HV, K, V, dtype=torch.float32, device=device)
    local = backend.backward_local(backend.to_saved(chunks), whole, torch.randn_like(args["v"]), x0, None)
    summary_b = _median_time(lambda: fla.chunk_cp_bwd_dh(q=local.qg, k=local.kg, w=local.w, do=local.do, dv=local.dv_local,
                                                         dhm=hm, gk=local.gc, scale=backend.options.scale,
                                                         cu_seqlens=cu), device, iters)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in args.items()}
    do = torch.randn_like(args["v"])
    fwd = _median_time(lambda: fla.chunk_kda(**leaves, **OPTIONS), device, iters)

    def step():
        o, _ = fla.chunk_kda(**leaves, **OPTIONS)
        torch.autograd.grad(o, list(leaves.values()), do)
    both = _median_time(step, device, iters)
    M = torch.randn(HV, K, K, device=device)
    S = torch.randn(HV, K, V, device=device)
    # device time behind a busy queue, as kdacp's own products (see _op_times)
    fold = queued_device_time(lambda: torch.baddbmm(S, M, S), iters=max(iters, 20))[0]
    return dict(fla_summary=(summary_f, summary_b), fla_one_device=(fwd, max(both - fwd, 0.0)), fla_fold_s=fold)


def measure_stages(t_local: int, heads: int, head_dim: int, backend: str, dtype: torch.dtype, device,
                   iters: int = 7) -> StageTimes:
    """Every :class:`~kdacp.distributed.cost_model.StageTimes` field on this device (one process):
    ``heads`` q/k and value heads (H = HV), K = V = ``head_dim``, ``t_local`` tokens, Kimi Linear's options."""
    device = torch.device(device)
    args = make_inputs(t_local, heads, heads, head_dim, head_dim, dtype, device)
    call = prepare_call(backend, **args, scale=None, **OPTIONS)
    state_dtype = compute_dtype(args["q"])
    roles, one = _time_roles(call.backend, call.inputs, state_dtype, device, iters)
    ops = _op_times(1, heads, head_dim, head_dim, state_dtype, device, iters)
    if backend == "fla":
        fla = _time_fla(args, device, iters)
    else:
        fla = dict(fla_summary=_time_summaries(backend, args, device, iters), fla_one_device=one,
                   fla_fold_s=ops["apply_s"])
    return StageTimes(forward={r: f for r, (f, _) in roles.items()}, backward={r: b for r, (_, b) in roles.items()},
                      one_device=one, **ops, **fla)


def measure_link(nbytes: int, device, group=None, iters: int = 10) -> Link:
    """The link between ranks 0 and 1 of ``group`` (point-to-point) and over the group (all-gather), from
    4-byte messages (latency) and ``nbytes`` ones (bandwidth). Call on every rank of the group."""
    device = torch.device(device)
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    peer = {0: 1, 1: 0}.get(rank)

    def p2p_seconds(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        times = []
        for i in range(iters + 1):
            dist.barrier(group)
            _sync(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dist.get_global_rank(group, 1) if group is not None else 1, group=group)
                dist.recv(buf, dist.get_global_rank(group, 1) if group is not None else 1, group=group)
            elif rank == 1:
                dist.recv(buf, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
                dist.send(buf, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            _sync(device)
            if i:
                times.append((time.perf_counter() - t0) / 2)
        return statistics.median(times) if peer is not None else 0.0

    def gather_seconds(numel: int) -> float:
        buf = torch.zeros(numel, device=device)
        out = [torch.empty_like(buf) for _ in range(P)]
        times = []
        for i in range(iters + 1):
            dist.barrier(group)
            _sync(device)
            t0 = time.perf_counter()
            dist.all_gather(out, buf, group=group)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    numel = max(nbytes // 4, 1)
    figures = torch.tensor([p2p_seconds(1), p2p_seconds(numel), gather_seconds(1), gather_seconds(numel)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)  # rank 0's p2p figures reach every rank
    small, big, g_small, g_big = figures.tolist()
    # A noisy pair can make the big message look no slower: floor the difference at 1% of its time.
    return Link(latency_s=small, bandwidth=nbytes / max(big - small, 0.01 * big), gather_latency_s=g_small / (P - 1),
                gather_bandwidth=(P - 1) * nbytes / max(g_big - g_small, 0.01 * g_big))


# Seconds each stage of SleepBackend sleeps for a whole rank's tokens, ten times an H200's at 16K
# tokens: the summaries and state passes from issue 3's figures, the other stages a rough split of
# the rest of the 10.45 ms one-GPU step (issue 4).
SLEEP_STAGES = dict(prepare=0.015, state_summary=0.004, state_pass=0.004, output=0.008, backward_local=0.020,
                    state_gradient_summary=0.004, backward_states=0.004, backward_inputs=0.035)


class SleepBackend:
    """A :class:`~kdacp.backends.base.LocalBackend` whose stages sleep (:data:`SLEEP_STAGES`, times the
    span's share of the rank's tokens) and return zeros of the right shapes. Ranks that sleep use no
    core, so on a CPU shared by more ranks than cores (and by other jobs) they behave as if each had
    its own device: the orchestration, the exchanges and the link are real, the compute is not."""

    name = "sleep"
    dtype = torch.float32

    def __init__(self, tokens: int):
        self.tokens = tokens

    def _sleep(self, stage: str, span) -> None:
        time.sleep(SLEEP_STAGES[stage] * (span.end - span.start) / self.tokens)

    def _zeros(self, n: int, *shape):
        return torch.zeros(n, *shape, dtype=self.dtype)

    def prepare(self, inputs: KDAInputs, span):
        self._sleep("prepare", span)
        self.H, self.K = inputs.q.shape[2:]
        self.HV, self.V = inputs.v.shape[2:]
        return None

    def state_summary(self, chunks, span, with_transition: bool) -> StateSummary:
        self._sleep("state_summary", span)
        n = span.num_segments
        return StateSummary(self._zeros(n, self.HV, self.K, self.V),
                            self._zeros(n, self.HV, self.K, self.K) if with_transition else None)

    def state_pass(self, chunks, span, initial_state, output_final_state: bool) -> LocalStates:
        self._sleep("state_pass", span)
        return LocalStates(self._zeros(span.num_segments, self.HV, self.K, self.V) if output_final_state else None)

    def output(self, chunks, span, initial_state, states) -> torch.Tensor:
        self._sleep("output", span)
        return self._zeros(1, span.end - span.start, self.HV, self.V)

    def to_saved(self, chunks):
        return None

    def backward_local(self, saved, span, do, initial_state, states=None):
        self._sleep("backward_local", span)
        return span

    def state_gradient_summary(self, local) -> torch.Tensor:
        self._sleep("state_gradient_summary", local)
        return self._zeros(local.num_segments, self.HV, self.K, self.V)

    def backward_states(self, local, dht) -> BackwardStates:
        self._sleep("backward_states", local)
        return BackwardStates(local, self._zeros(local.num_segments, self.HV, self.K, self.V))

    def backward_inputs(self, states: BackwardStates) -> LocalGrads:
        self._sleep("backward_inputs", states.span)
        T = states.span.end - states.span.start
        return LocalGrads(self._zeros(1, T, self.H, self.K), self._zeros(1, T, self.H, self.K),
                          self._zeros(1, T, self.HV, self.V), self._zeros(1, T, self.HV, self.K),
                          self._zeros(1, T, self.HV), None, None)


def _sleep_inputs(T: int) -> KDAInputs:
    """Inputs of ``T`` tokens for :class:`SleepBackend`: one head, K = V = 16 (small messages)."""
    return KDAInputs(*(torch.zeros(1, T, 1, 16) for _ in range(4)), torch.zeros(1, T, 1))


def _sleep_check(link: Link, group, iters: int, report) -> list[dict]:
    """The composition alone: :class:`SleepBackend` ranks, stages and one device measured by the probe,
    the link as calibrated; measured ``cp_forward`` + ``cp_backward`` steps (real exchanges, slowest
    rank, median) at ``P = 2 ..`` the group's size against the model with a device per rank."""
    rank, P_group = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P_group))
    T, dev = 64, torch.device("cpu")
    backend, inputs = SleepBackend(T), _sleep_inputs(T)
    roles, one = _time_roles(backend, inputs, torch.float32, dev, iters) if rank == 0 else (None, None)
    times = StageTimes(forward={r: f for r, (f, _) in roles.items()}, backward={r: b for r, (_, b) in roles.items()},
                       one_device=one, **_op_times(1, 1, 16, 16, torch.float32, dev, iters)) if rank == 0 else None
    from kdacp.distributed import new_cp_group
    subgroups = {P: new_cp_group(ranks[:P]) for P in range(2, P_group + 1)}
    rows = []
    for P in range(2, P_group + 1):
        if rank < P:
            plans = {s: build_cp_plan(batch_size=1, group=subgroups[P], strategy=s) for s in STRATEGIES}
            do = torch.zeros(1, T, 1, 16)

            def step(plan):
                out = cp_forward(backend, plan, inputs, None, False, torch.float32)
                cp_backward(backend, plan, out.saved, out.local_initial, out.transition, out.head_states, do, None,
                            False, False)
            ms = _median_steps({s: (lambda p=plans[s]: step(p)) for s in STRATEGIES}, subgroups[P], dev, iters)
            if rank == 0:
                pred = {s: predict(s, P, times, link) for s in STRATEGIES}
                rows += _compare("sleep-stage", P, T, ms, sum(one) * 1e3, pred)
                if report is not None:
                    report(rows[-2])
        dist.barrier(group)
    return rows


def _compare(kind: str, P: int, T: int, ms: dict, one_ms: float, pred: dict) -> list[dict]:
    """``[measured row, model row]`` of one ``P``: measured ``ms`` per strategy over ``one_ms``, and
    the model's :class:`~kdacp.distributed.cost_model.Prediction` per strategy. The measured row gets
    each ``<s>_model_err`` (model over measured, minus one) and whether both order the strategies
    alike. ``kind`` prefixes the sources (``"sleep-stage"``); ``""`` gives ``"measured"`` and
    ``"model, shared cores"``."""
    row = _ratios_row(f"{kind} measured".strip(), P, T, ms, dict.fromkeys(ms, one_ms))
    model_ms = {s: p.step_s * 1e3 for s, p in pred.items()}
    model_one = {s: p.one_device_s * 1e3 for s, p in pred.items()}
    model = _ratios_row(f"{kind} model" if kind else "model, shared cores", P, T, model_ms, model_one)
    for s in pred:
        row[f"{s}_model_err"] = model_ms[s] / ms[s] - 1
    row["order_matches"] = sorted(pred, key=ms.get) == sorted(pred, key=model_ms.get)
    return [row, model]


def _ratios_row(source: str, P: int, T: int, ms: dict, one_ms: dict) -> dict:
    row = dict(source=source, P=P, T_local=T)
    row.update({f"{s}_ratio": ms[s] / one_ms[s] for s in ms})
    row.update({f"{s}_ms": ms[s] for s in ms})
    kdacp = {s: ms[s] for s in ms if s in STRATEGIES}
    if kdacp:
        row["best"] = min(kdacp, key=kdacp.get)
    return row


def _median_steps(fns: dict, group, device: torch.device, rounds: int, warmup: int = 1) -> dict:
    """Milliseconds per call of each of ``fns``: round-robin, each call after a barrier, the slowest
    rank's time of each call, the median over ``rounds`` (a median, not a mean: on a shared CPU a
    few calls take several times the others)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _sync(device)
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    table = torch.tensor([times[n] for n in fns], dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return {n: statistics.median(row) * 1e3 for n, row in zip(fns, table.tolist())}


def _measure_steps(P: int, t_local: int, heads: int, head_dim: int, backend: str, dtype, device, group,
                   rounds: int) -> dict:
    """Milliseconds of one ``cp_chunk_kda`` forward+backward per strategy on ``group`` (``P`` ranks,
    one sequence of ``P * t_local`` tokens; with ``P == 1`` the one-device step, as ``"p2p"``)."""
    rank = dist.get_rank(group)
    args = make_inputs(t_local, heads, heads, head_dim, head_dim, dtype, device, seed=rank)
    leaves = {n: t.requires_grad_() for n, t in args.items()}
    do = torch.randn_like(args["v"])
    plans = {s: build_cp_plan(batch_size=1, group=group, strategy=s) for s in STRATEGIES}

    def step(plan):
        o, _ = cp_chunk_kda(**leaves, **OPTIONS, backend=backend, cp=plan)
        torch.autograd.grad(o, list(leaves.values()), do)
    fns = {s: (lambda p=plans[s]: step(p)) for s in (STRATEGIES if P > 1 else ("p2p",))}
    return _median_steps(fns, group, torch.device(device), rounds)


def _read_measured(path: str, t_local: int) -> list[dict]:
    """Rows of a ``cp`` suite JSON at ``t_local`` tokens per rank, one sequence, as ratios by strategy."""
    rows = json.loads(Path(path).read_text())["rows"]
    names = {"p2p": ("kdacp_cp_ratio", "kdacp_ratio"), "allgather": ("kdacp_allgather_ratio",),
             "scan": ("kdacp_scan_ratio",), "fla": ("fla_cp_ratio", "fla_ratio")}
    out = []
    for r in rows:
        if r.get("T_local") != t_local or r.get("batch", "one_sequence") != "one_sequence":
            continue
        row = dict(source="measured (cp suite)", P=r["world_size"], T_local=t_local)
        for s, keys in names.items():
            value = next((r[k] for k in keys if r.get(k) is not None), None)
            if value is not None and value == value:  # not NaN
                row[f"{s}_ratio"] = value
        out.append(row)
    return out


@dataclass(frozen=True)
class Calibration:
    """What the predictions were made from (written as the first rows)."""

    stages: StageTimes
    link: Link
    link_source: str


def run(t_local: int | None = None, heads: int | None = None, head_dim: int | None = None, backend: str | None = None,
        world_sizes=WORLD_SIZES, link: dict | None = None, validate: bool = True, sleep_check: bool = False,
        measured: str | None = None, iters: int = 7, cores: int | None = None, group=None, device: str = "cuda",
        report=None) -> list[dict]:
    """Calibrate on this machine and predict (see the module docstring); call on every rank.

    Args:
        t_local: tokens per rank (default 16384 on CUDA, 256 on CPU).
        heads, head_dim: H = HV and K = V (default 32 and 128 on CUDA, 2 and 32 on CPU).
        backend: ``"fla"`` or ``"torch"`` (default fla on CUDA, torch on CPU); bf16 on CUDA, float32 on CPU.
        world_sizes: the ``P`` to predict for (each >= 2).
        link: figures replacing measured or default ones: any of ``Link``'s fields
            (``latency_s``, ``bandwidth`` in bytes/s, ``gather_latency_s``, ``gather_bandwidth``).
        validate: with two or more ranks, measure each strategy at ``P = 2 ..`` the group's size.
        sleep_check: with two or more ranks, also check the composition alone with
            :class:`SleepBackend` ranks (``sleep-stage`` rows; CPU only).
        measured: a ``cp`` suite JSON whose rows at ``t_local`` are drawn as measured points.
        cores: cores the ranks share, for the ``shared cores`` model rows (default: this process's
            CPU affinity on CPU; on CUDA none, a device per rank).

    Raises:
        ValueError: a ``P`` below 2, or an unknown ``link`` field.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    t_local = t_local or (16384 if cuda else 256)
    heads, head_dim = heads or (32 if cuda else 2), head_dim or (128 if cuda else 32)
    backend = backend or ("fla" if cuda else "torch")
    dtype = torch.bfloat16 if cuda else torch.float32
    world_sizes = tuple(world_sizes)
    if any(isinstance(P, bool) or not isinstance(P, int) or P < 2 for P in world_sizes):
        raise ValueError(f"world_sizes must be ints >= 2, got {world_sizes}")
    unknown = set(link or {}) - set(Link.__dataclass_fields__)
    if unknown:
        raise ValueError(f"link fields must be among {tuple(Link.__dataclass_fields__)}, got {sorted(unknown)}")
    rank, P_group = dist.get_rank(group), dist.get_world_size(group)
    if cores is None and not cuda:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.manual_seed(0)

    stages = measure_stages(t_local, heads, head_dim, backend, dtype, dev, iters) if rank == 0 else None
    box = [stages]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    stages = box[0]
    if P_group > 1:
        measured_link, source = measure_link(stages.summary_bytes, dev, group), f"measured over {P_group} ranks"
    else:
        measured_link, source = DEFAULT_LINK, "default (cost_model.DEFAULT_LINK)"
    if link:
        measured_link, source = Link(**{**asdict(measured_link), **link}), f"{source}, with {sorted(link)} given"
    cal = Calibration(stages, measured_link, source)

    rows = _calibration_rows(cal, t_local, heads, head_dim, backend, dtype)
    for P in world_sizes:
        pred = {s: predict(s, P, stages, cal.link) for s in MODEL_STRATEGIES}
        rows.append(_ratios_row("model", P, t_local, {s: p.step_s * 1e3 for s, p in pred.items()},
                                {s: p.one_device_s * 1e3 for s, p in pred.items()}))
        if report is not None:
            report(rows[-1])
    if validate and P_group > 1:
        rows += _validate(cal, t_local, heads, head_dim, backend, dtype, dev, group, cores, iters, report)
    if sleep_check and P_group > 1:
        rows += _sleep_check(cal.link, group, iters, report)
    if measured:
        rows += _read_measured(measured, t_local)
    return rows


def _calibration_rows(cal: Calibration, t_local, heads, head_dim, backend, dtype) -> list[dict]:
    s, link = cal.stages, cal.link
    rows = [dict(source="setup", T_local=t_local, heads=heads, head_dim=head_dim, backend=backend, dtype=str(dtype),
                 link=cal.link_source, latency_us=link.latency_s * 1e6, bandwidth_GBs=link.bandwidth / 1e9,
                 gather_latency_us=link.gather_latency_s * 1e6, gather_bandwidth_GBs=link.gather_bandwidth / 1e9,
                 apply_us=s.apply_s * 1e6, compose_us=s.compose_s * 1e6, one_device_fwd_ms=s.one_device[0] * 1e3,
                 one_device_bwd_ms=s.one_device[1] * 1e3, fla_summary_fwd_ms=s.fla_summary[0] * 1e3,
                 fla_summary_bwd_ms=s.fla_summary[1] * 1e3, fla_one_device_ms=sum(s.fla_one_device) * 1e3)]
    for direction, per_role in (("forward", s.forward), ("backward", s.backward)):
        for role, st in per_role.items():
            rows.append(dict(source="stages", direction=direction, role=role, ready_ms=st.ready * 1e3,
                             between_ms=st.between * 1e3, after_ms=st.after * 1e3))
    return rows


def _validate(cal: Calibration, t_local, heads, head_dim, backend, dtype, dev, group, cores, iters,
              report) -> list[dict]:
    """Measured steps at ``P = 2 ..`` the group's size against the model with ``cores`` shared."""
    rank, P_group = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P_group))
    from kdacp.distributed import new_cp_group
    subgroups = {P: new_cp_group(ranks[:P]) for P in range(1, P_group + 1)}  # collective: every rank, same order
    one_ms = None
    if rank == 0:
        one_ms = _measure_steps(1, t_local, heads, head_dim, backend, dtype, dev, subgroups[1], iters)["p2p"]
    rows = []
    for P in range(2, P_group + 1):
        if rank < P:
            ms = _measure_steps(P, t_local, heads, head_dim, backend, dtype, dev, subgroups[P], iters)
            if rank == 0:
                pred = {s: predict(s, P, cal.stages, cal.link, cores) for s in STRATEGIES}
                row, model = _compare("", P, t_local, ms, one_ms, pred)
                model["cores"] = cores
                if hasattr(os, "getloadavg"):  # other processes on the machine slow every rank down
                    row["loadavg_1min"] = os.getloadavg()[0]
                rows += [row, model]
                if report is not None:
                    report(row)
        dist.barrier(group)
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per ``source`` (setup, stages, model, measured ...): measured and predicted apart."""
    parts = []
    for source in dict.fromkeys(r["source"] for r in rows):
        sel = [{k: v for k, v in r.items() if k != "source"} for r in rows if r["source"] == source]
        parts.append(f"### {source}\n\n{markdown_table(sel)}")
    return "\n\n".join(parts)
