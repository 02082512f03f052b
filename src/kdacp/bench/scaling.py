"""Scaling model: each strategy's per-rank step at 2 to 1024 ranks, predicted from measurements on the
machine at hand by :mod:`kdacp.cp.cost_model` (an event-level composition; read its docstring).

Measured here, on rank 0 alone (the other ranks wait), at ``t_local`` tokens per rank:

- each rank role's stages (``first``, ``through``, ``last``; forward and backward): the real
  schedule runs one role of a 3-rank plan (:class:`~kdacp.bench.rank_role.RankRole`) against a probe exchange that stamps where the message is posted, where the
  rank blocks and where the incoming value is handed back (on a GPU device time, the whole call queued
  before the device runs it, as the host runs ahead in a training step: see
  :class:`~kdacp.bench.stage_probe.StageProbe`);
- one device's forward and backward on the same tokens (a 1-rank plan), one ``M x + S`` (:mod:`kdacp.affine`'s rule),
  one composition of open maps, the all-gather's stack per byte; with the ``fla`` backend FLA
  0.6.0's own summary kernels (``chunk_cp_fwd_h`` / ``chunk_cp_bwd_dh``), its ``chunk_kda`` forward
  and backward, and one step of its merge (a float32 ``M x + S``); with ``torch`` kdacp's summary
  stages stand in for FLA's kernels;
- the link, with two or more ranks: one-way point-to-point time (ping-pong between ranks 0 and 1) of
  a 4-byte message (latency) and of a summary (bandwidth), all-gather of both sizes over the group
  (per ring step). Given figures (``link``) replace measured ones; with one rank and none given,
  :data:`~kdacp.cp.cost_model.DEFAULT_LINK`.

Rows: ``source="setup"`` and ``"stages"`` (the calibration), ``"model"`` per ``P`` of ``world_sizes``:
each strategy's predicted step (forward + backward critical path) in ms and over one device's
(``<s>_ratio``), and the best of kdacp's three: one layer, each rank waiting for that layer's messages
as if nothing came after it. ``"step model"`` per ``P`` and ``sync_every``: a training step of
``step_layers`` token-mixer layers (:func:`~kdacp.bench.scaling_model.predict_step`: a rank goes on to
its next layer as soon as its own work allows; every rank meets at the loss and, with ``sync_every``,
at an attention layer after every ``sync_every`` mixer layers), over ``step_layers`` one-device steps.
With ``validate`` (two or more ranks):
``"measured"`` rows, ``chunk_kda`` forward+backward steps of each strategy on the first ``P`` ranks
for ``P = 2 ..`` the group's size (round-robin, the slowest rank's time of each step, median over
steps) over a 1-rank group's step, beside ``"model, shared cores"`` rows: the model with the ranks
sharing ``cores`` cores (a CPU runs ``P`` processes on fewer cores: compute is then serialised,
which the dedicated-device model would not see). Other jobs on the machine slow calibration and
measurement by different, changing amounts; the measured rows carry the load average.
``sleep_check`` tests the composition where that does not reach: ranks whose stages sleep
(:class:`SleepBackend`), so they need no core, with the real schedule, exchanges and link
(``"sleep-stage measured"`` against ``"sleep-stage model"`` rows, a device per rank), and the step
composition (:func:`sleep_step_check`): ``SLEEP_STEP_LAYERS`` layers of ranks sleeping
:data:`CHAIN_STAGES`, forwards, the loss's all-reduce, backwards (``"sleep-stage step measured"``, with
each strategy's error of the step model and of the layer-by-layer one, against ``"sleep-stage step
model"``). ``measured`` (a ``cp`` suite JSON) adds its rows as ``"measured (cp suite)"``.

    kdacp bench --suite scaling [--seq-lens 16384] [--link-latency-us 20 --link-bandwidth-gbs 300 ...]
                                [--step-layers 36 --sync-every 0,3]
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from kdacp.bench.rank_role import RankRole
from kdacp.cp import build_cp_plan, new_cp_group
from kdacp.cp.cost_model import DEFAULT_LINK, Link, StageTimes
from kdacp.cp.plan import STRATEGIES
from kdacp.ops.kda import chunk_kda

from .calibration import OPTIONS, Calibration, calibration_rows, measure_stages, op_times
from .harness import PlotSpec, markdown_table
from .inputs import random_inputs
from .link import measure_link
from .scaling_model import MODEL_STRATEGIES, check_stack, predict, predict_step
from .sleep_backend import CHAIN_STAGES, SleepBackend, sleep_inputs
from .stage_probe import time_roles
from .timing import median_times

MULTI_RANK = True

PLOTS = {"scaling": PlotSpec(x="P", y=tuple(f"{s}_ratio" for s in MODEL_STRATEGIES), where=("source", "model"),
                             points=("source", "measured"), logy=True,
                             title="per-rank step / one device\n(lines: model, crosses: measured)", ylabel="ratio")}

WORLD_SIZES = tuple(2 ** i for i in range(1, 11))
# Qwen3-Next-80B-A3B's default config: 48 layers, an attention layer after every 3 Gated DeltaNet layers.
STEP_LAYERS, SYNC_EVERY = 36, (0, 3)
SLEEP_STEP_LAYERS = 4


def run(t_local: int | None = None, heads: int | None = None, head_dim: int | None = None, backend: str | None = None,
        world_sizes=WORLD_SIZES, link: dict | None = None, validate: bool = True, sleep_check: bool = False,
        measured: str | None = None, iters: int = 7, cores: int | None = None, group=None, device: str = "cuda",
        step_layers: int = STEP_LAYERS, sync_every=SYNC_EVERY, report=None) -> list[dict]:
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
        step_layers, sync_every: the ``step model`` rows' token-mixer layers per step, and the mixer
            layers between attention layers (each value a row per ``P``; 0: none).

    Raises:
        ValueError: a ``P`` below 2, an unknown ``link`` field, ``step_layers`` below 1 or a
            ``sync_every`` value below 0.
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
    sync_every = tuple(sync_every)
    for every in sync_every:
        check_stack(step_layers, every)
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

    rows = calibration_rows(cal, t_local, heads, head_dim, backend, dtype)
    for P in world_sizes:
        pred = {s: predict(s, P, stages, cal.link) for s in MODEL_STRATEGIES}
        rows.append(_ratios_row("model", P, t_local, {s: p.step_s * 1e3 for s, p in pred.items()},
                                {s: p.one_device_s * 1e3 for s, p in pred.items()}))
        if report is not None:
            report(rows[-1])
    for P in world_sizes:
        for every in sync_every:
            pred = {s: predict_step(s, P, stages, step_layers, every, cal.link) for s in MODEL_STRATEGIES}
            rows.append(_step_row("step model", P, t_local, pred))
            if report is not None:
                report(rows[-1])
    if validate and P_group > 1:
        rows += _validate(cal, t_local, heads, head_dim, backend, dtype, dev, group, cores, iters, report)
    if sleep_check and P_group > 1:
        rows += _sleep_check(cal.link, group, iters, report)
    if measured:
        rows += read_measured(measured, t_local)
    return rows


def _validate(cal: Calibration, t_local, heads, head_dim, backend, dtype, dev, group, cores, iters,
              report) -> list[dict]:
    """Measured steps at ``P = 2 ..`` the group's size against the model with ``cores`` shared."""
    rank, P_group = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P_group))
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


def _prefix_groups(group) -> dict:
    """``{P: process group of the group's first P ranks}`` for ``P = 2 ..`` the group's size; a collective:
    call on every rank of ``group``, in the same order."""
    P_group = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P_group))
    return {P: new_cp_group(ranks[:P]) for P in range(2, P_group + 1)}


def _sleep_check(link: Link, group, iters: int, report) -> list[dict]:
    """The composition alone: :class:`SleepBackend` ranks, stages and one device measured by the probe,
    the link as calibrated; measured forward + backward steps (real exchanges, slowest
    rank, median) at ``P = 2 ..`` the group's size against the model with a device per rank."""
    rank = dist.get_rank(group)
    T, dev = 64, torch.device("cpu")
    backend, inputs = SleepBackend(T), sleep_inputs(T)
    times = _sleeper_times(backend, inputs, iters) if rank == 0 else None
    subgroups = _prefix_groups(group)
    rows = []
    for P in subgroups:
        if rank < P:
            plans = {s: build_cp_plan(batch_size=1, group=subgroups[P], strategy=s) for s in STRATEGIES}
            do = torch.zeros(1, T, 1, 16)

            def step(plan):
                role = RankRole(plan, backend, inputs)
                role.backward(role.forward(), do)
            ms = _median_steps({s: (lambda p=plans[s]: step(p)) for s in STRATEGIES}, subgroups[P], dev, iters)
            if rank == 0:
                pred = {s: predict(s, P, times, link) for s in STRATEGIES}
                rows += _compare("sleep-stage", P, T, ms, sum(times.one_device) * 1e3, pred)
                if report is not None:
                    report(rows[-2])
        dist.barrier(group)
    return rows + sleep_step_check(link, group, iters, report, subgroups=subgroups)


def sleep_step_check(link: Link = DEFAULT_LINK, group=None, iters: int = 7, report=None,
                     layers: int = SLEEP_STEP_LAYERS, subgroups: dict | None = None) -> list[dict]:
    """Training steps of ``layers`` layers of :data:`CHAIN_STAGES` sleepers (forwards, the loss's
    all-reduce, backwards; real exchanges, slowest rank, median) at ``P = 2 ..`` the group's size,
    against the step model and the layer-by-layer composition times ``layers``; call on every rank
    (``subgroups``: the groups of the first ``P`` ranks, if already made). Rank 0 returns the rows
    (``<s>_model_err``: the step model over measured, minus one; ``<s>_layer_model_err``: ``layers``
    times the one-layer model's), the others none."""
    rank = dist.get_rank(group)
    subgroups = subgroups or _prefix_groups(group)
    T, dev = 64, torch.device("cpu")
    backend, inputs = SleepBackend(T, CHAIN_STAGES), sleep_inputs(T)
    times = _sleeper_times(backend, inputs, iters) if rank == 0 else None
    rows = []
    for P in subgroups:
        if rank < P:
            sub = subgroups[P]
            plans = {s: build_cp_plan(batch_size=1, group=sub, strategy=s) for s in STRATEGIES}
            do = torch.zeros(1, T, 1, 16)

            def step(plan):
                role = RankRole(plan, backend, inputs)
                outs = [role.forward() for _ in range(layers)]
                dist.all_reduce(torch.zeros(1), group=sub)  # the loss: every rank meets
                for out in reversed(outs):
                    role.backward(out, do)
            ms = _median_steps({s: (lambda p=plans[s]: step(p)) for s in STRATEGIES}, sub, dev, iters)
            if rank == 0:
                one_ms = layers * sum(times.one_device) * 1e3
                row = _ratios_row("sleep-stage step measured", P, T, ms, dict.fromkeys(ms, one_ms))
                pred = {s: predict_step(s, P, times, layers, 0, link) for s in STRATEGIES}
                row["layers"] = layers
                for s in STRATEGIES:
                    row[f"{s}_model_err"] = pred[s].step_s * 1e3 / ms[s] - 1
                    row[f"{s}_layer_model_err"] = layers * predict(s, P, times, link).step_s * 1e3 / ms[s] - 1
                rows += [row, _step_row("sleep-stage step model", P, T, pred)]
                if report is not None:
                    report(row)
        dist.barrier(group)
    return rows


def _sleeper_times(backend: SleepBackend, inputs, iters: int) -> StageTimes:
    """:class:`StageTimes` of sleeping ranks: each role's stages and one device measured by the probe,
    on this process alone (CPU), with the exchange's own products of one small message."""
    dev = torch.device("cpu")
    roles, one = time_roles(backend, inputs, torch.float32, dev, iters)
    return StageTimes(forward={r: f for r, (f, _) in roles.items()}, backward={r: b for r, (_, b) in roles.items()},
                      one_device=one, **op_times(1, 1, 16, 16, torch.float32, dev, iters))


def _step_row(source: str, P: int, T: int, pred: dict) -> dict:
    """A row of :class:`~kdacp.bench.scaling_model.StepPrediction` per strategy (one ``P``, one stack)."""
    first = next(iter(pred.values()))
    ratios = _ratios_row(source, P, T, {s: p.step_s * 1e3 for s, p in pred.items()},
                         {s: p.one_device_s * 1e3 for s, p in pred.items()})
    return dict(source=source, P=P, T_local=T, layers=first.layers, sync_every=first.sync_every, **{
        k: v for k, v in ratios.items() if k not in ("source", "P", "T_local")})


def _compare(kind: str, P: int, T: int, ms: dict, one_ms: float, pred: dict) -> list[dict]:
    """``[measured row, model row]`` of one ``P``: measured ``ms`` per strategy over ``one_ms``, and
    the model's :class:`~kdacp.bench.scaling_model.Prediction` per strategy. The measured row gets
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


def _median_steps(fns: dict, group, device: torch.device, rounds: int) -> dict:
    """Milliseconds per call of each of ``fns``: :func:`~kdacp.bench.timing.median_times` over ``group``."""
    return {name: s * 1e3 for name, s in median_times(fns, device, rounds, group=group).items()}


def _measure_steps(P: int, t_local: int, heads: int, head_dim: int, backend: str, dtype, device, group,
                   rounds: int) -> dict:
    """Milliseconds of one ``chunk_kda`` forward+backward per strategy on ``group`` (``P`` ranks,
    one sequence of ``P * t_local`` tokens; with ``P == 1`` the one-device step, as ``"p2p"``)."""
    rank = dist.get_rank(group)
    args = random_inputs(t_local, heads, heads, head_dim, head_dim, dtype=dtype, device=device, seed=rank)
    leaves = {n: t.requires_grad_() for n, t in args.items()}
    do = torch.randn_like(args["v"])
    plans = {s: build_cp_plan(batch_size=1, group=group, strategy=s) for s in STRATEGIES}

    def step(plan):
        o, _ = chunk_kda(**leaves, **OPTIONS, backend=backend, cp=plan)
        torch.autograd.grad(o, list(leaves.values()), do)
    fns = {s: (lambda p=plans[s]: step(p)) for s in (STRATEGIES if P > 1 else ("p2p",))}
    return _median_steps(fns, group, torch.device(device), rounds)


def read_measured(path: str, t_local: int) -> list[dict]:
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


def markdown(rows: list[dict]) -> str:
    """One table per ``source`` (setup, stages, model, measured ...): measured and predicted apart."""
    parts = []
    for source in dict.fromkeys(r["source"] for r in rows):
        sel = [{k: v for k, v in r.items() if k != "source"} for r in rows if r["source"] == source]
        parts.append(f"### {source}\n\n{markdown_table(sel)}")
    return "\n\n".join(parts)
