"""Calibration of the scaling model on the machine at hand: every
:class:`~kdacp.cp.cost_model.StageTimes` field (rank roles' stages, one device, the exchange's
products, FLA's kernels or kdacp's stand-ins) and the rows that record what predictions were made from."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdacp.affine import AffineMap, compose_state_summaries
from kdacp.bench.rank_role import RankRole
from kdacp.cp.cost_model import Link, RoleStages, StageTimes
from kdacp.cp.plan import one_rank_plan, rank_layouts
from kdacp.reference.gates import compute_dtype

from .inputs import random_inputs
from .stage_probe import time_roles
from .timing import median_time, queued_device_time

# Kimi Linear's gate and norm settings
OPTIONS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)


def op_times(n: int, HV: int, K: int, V: int, state_dtype: torch.dtype, device: torch.device, iters: int) -> dict:
    """One ``M x + S`` by :mod:`kdacp.affine`'s rule (rounded to the wire dtype), one composition of open
    maps, the stack per byte. On CUDA the two products are timed as device time behind a busy queue
    (:func:`~kdacp.bench.timing.queued_device_time`): a rank reaches the exchange with its local
    kernels still running, so the host has queued the product before its input arrives, and the
    critical path holds only its device time (the host's time per product is larger and hidden)."""
    wire = torch.finfo(state_dtype).bits // 8
    msg = AffineMap(torch.randn(n, HV, K, V, device=device, dtype=state_dtype),
                    torch.randn(n, HV, K, K, device=device, dtype=state_dtype))
    x = torch.randn(n, HV, K, V, device=device, dtype=state_dtype)
    a, b = (msg.offset, msg.transition), (x, msg.transition)
    ops = dict(apply=lambda: msg.apply(x).to(state_dtype),
               compose=lambda: torch.cat(compose_state_summaries(a, b), -1).to(state_dtype))
    got = {name: queued_device_time(fn, iters=max(iters, 20))[0] if device.type == "cuda"
           else median_time(fn, device, iters) for name, fn in ops.items()}
    parts = [torch.randn(n, HV, K, K + V, device=device, dtype=state_dtype) for _ in range(8)]
    copy_s = median_time(lambda: torch.stack(parts), device, iters) / (8 * parts[0].numel() * wire)
    return dict(apply_s=got["apply"], compose_s=got["compose"], copy_s_per_byte=copy_s,
                state_bytes=n * HV * K * V * wire, summary_bytes=n * HV * K * (K + V) * wire)


def _one_device(backend: str, args: dict) -> RankRole:
    """The :class:`~kdacp.bench.rank_role.RankRole` of :func:`~kdacp.bench.inputs.random_inputs`' ``args`` on one
    device with Kimi Linear's options (its ``backend`` and ``inputs`` run the stages timed here)."""
    return RankRole.prepare(one_rank_plan(None, 1, args["q"].shape[1]), **args, backend=backend, **OPTIONS)


def _time_summaries(backend_name: str, args: dict, device: torch.device, iters: int) -> tuple[float, float]:
    """kdacp's summary stages on all the tokens: ``(S_ext, M)`` forward, ``G`` backward (seconds)."""
    call = _one_device(backend_name, args)
    backend, layout = call.backend, rank_layouts(None, 1, (args["q"].shape[1],) * 3)[1]
    chunks = backend.prepare(call.inputs, layout.whole)
    fwd = median_time(lambda: backend.state_summary(chunks, layout.whole, with_transition=True), device, iters)
    saved = backend.to_saved(chunks)
    x0 = torch.zeros(1, args["v"].shape[2], args["q"].shape[3], args["v"].shape[3], dtype=compute_dtype(args["q"]),
                     device=device)
    local = backend.backward_local(saved, layout.whole, torch.randn_like(args["v"]), x0, None)
    bwd = median_time(lambda: backend.state_gradient_summary(local), device, iters)
    return fwd, bwd


def _time_fla(args: dict, device: torch.device, iters: int) -> dict:
    """FLA 0.6.0's summary kernels, its ``chunk_kda`` forward and backward, and one merge step (seconds)."""
    from kdacp.backends.fla_adapter import load_fla
    fla = load_fla()
    call = _one_device("fla", args)
    backend, T = call.backend, args["q"].shape[1]
    HV, K, V = args["v"].shape[2], args["q"].shape[3], args["v"].shape[3]
    whole = rank_layouts(None, 1, (T,))[0].whole
    chunks = backend.prepare(call.inputs, whole)
    cu = torch.tensor([0, T], dtype=torch.int64, device=device)
    hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=device)
    summary_f = median_time(lambda: fla.chunk_cp_fwd_h(k=chunks.kg, w=chunks.w, u=chunks.u, hm=hm, gk=chunks.gc,
                                                        cu_seqlens=cu), device, iters)
    x0 = torch.zeros(1, HV, K, V, dtype=torch.float32, device=device)
    local = backend.backward_local(backend.to_saved(chunks), whole, torch.randn_like(args["v"]), x0, None)
    summary_b = median_time(lambda: fla.chunk_cp_bwd_dh(q=local.qg, k=local.kg, w=local.w, do=local.do, dv=local.dv_local,
                                                         dhm=hm, gk=local.gc, scale=backend.options.scale,
                                                         cu_seqlens=cu), device, iters)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in args.items()}
    do = torch.randn_like(args["v"])
    fwd = median_time(lambda: fla.chunk_kda(**leaves, **OPTIONS), device, iters)

    def step():
        o, _ = fla.chunk_kda(**leaves, **OPTIONS)
        torch.autograd.grad(o, list(leaves.values()), do)
    both = median_time(step, device, iters)
    M = torch.randn(HV, K, K, device=device)
    S = torch.randn(HV, K, V, device=device)
    # device time behind a busy queue, as kdacp's own products (see op_times)
    fold = queued_device_time(lambda: torch.baddbmm(S, M, S), iters=max(iters, 20))[0]
    return dict(fla_summary=(summary_f, summary_b), fla_one_device=(fwd, max(both - fwd, 0.0)), fla_fold_s=fold)


def measure_stages(t_local: int, heads: int, head_dim: int, backend: str, dtype: torch.dtype, device,
                   iters: int = 7) -> StageTimes:
    """Every :class:`~kdacp.cp.cost_model.StageTimes` field on this device (one process):
    ``heads`` q/k and value heads (H = HV), K = V = ``head_dim``, ``t_local`` tokens, Kimi Linear's options."""
    device = torch.device(device)
    args = random_inputs(t_local, heads, heads, head_dim, head_dim, dtype=dtype, device=device)
    call = _one_device(backend, args)
    state_dtype = compute_dtype(args["q"])
    roles, one = time_roles(call.backend, call.inputs, state_dtype, device, iters)
    ops = op_times(1, heads, head_dim, head_dim, state_dtype, device, iters)
    if backend == "fla":
        fla = _time_fla(args, device, iters)
    else:
        fla = dict(fla_summary=_time_summaries(backend, args, device, iters), fla_one_device=one,
                   fla_fold_s=ops["apply_s"])
    return StageTimes(forward={r: f for r, (f, _) in roles.items()}, backward={r: b for r, (_, b) in roles.items()},
                      one_device=one, **ops, **fla)


@dataclass(frozen=True)
class Calibration:
    """What the predictions were made from (written as the first rows)."""

    stages: StageTimes
    link: Link
    link_source: str


def calibration_rows(cal: Calibration, t_local, heads, head_dim, backend, dtype) -> list[dict]:
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


# The all-gather's stack where a recorded calibration does not carry it (the copy of gathered summaries: an
# order of magnitude, a terabyte per second of device memory bandwidth).
_COPY_S_PER_BYTE = 1 / 1e12


def read_calibration(rows: list[dict]) -> tuple[Calibration, dict]:
    """The inverse of :func:`calibration_rows`: the :class:`Calibration` and the setup (``T_local``, ``heads``,
    ``head_dim``, ...) of a scaling suite's recorded rows (its JSON's ``rows``).

    Raises:
        ValueError: rows without the setup row or without every direction's and role's stages.
    """
    setup = next((r for r in rows if r.get("source") == "setup"), None)
    stages = {(r["direction"], r["role"]): r for r in rows if r.get("source") == "stages"}
    missing = [(d, role) for d in ("forward", "backward") for role in ("first", "through", "last")
               if (d, role) not in stages]
    if setup is None or missing:
        raise ValueError(f"rows must hold a scaling suite's setup row and every stage row; missing "
                         f"{'the setup row' if setup is None else missing}")

    def role_stages(direction):
        return {role: RoleStages(stages[(direction, role)]["ready_ms"] / 1e3, stages[(direction, role)]["between_ms"] / 1e3,
                                 stages[(direction, role)]["after_ms"] / 1e3) for role in ("first", "through", "last")}
    times = StageTimes(forward=role_stages("forward"), backward=role_stages("backward"),
                       one_device=(setup["one_device_fwd_ms"] / 1e3, setup["one_device_bwd_ms"] / 1e3),
                       apply_s=setup["apply_us"] / 1e6, compose_s=setup["compose_us"] / 1e6,
                       copy_s_per_byte=_COPY_S_PER_BYTE)
    link = Link(setup["latency_us"] / 1e6, setup["bandwidth_GBs"] * 1e9, setup["gather_latency_us"] / 1e6,
                setup["gather_bandwidth_GBs"] * 1e9)
    return Calibration(times, link, setup["link"]), setup
