"""Stage probes of the scaling model: one rank role's real orchestration against an exchange that moves
nothing and stamps the time where the rank posts its message, blocks, and gets the incoming value back.

Each role (``first``, ``through``, ``last``) of a 3-rank plan of one sequence runs
:func:`~kdacp.distributed.orchestration.cp_forward` / ``cp_backward`` in one process; a one-rank plan
gives one device's forward and backward on the same tokens.
"""
from __future__ import annotations

import statistics
import time

import torch

from kdacp.backends.base import KDAInputs
from kdacp.distributed.cost_model import RoleStages
from kdacp.distributed.orchestration import cp_backward, cp_forward
from kdacp.distributed.plan import CPPlan, one_rank_plan, rank_layouts
from kdacp.distributed.strategies import Pending

__all__ = ["ROLE_RANKS", "StageProbe", "median_time", "probe_role", "sync", "time_roles"]

ROLE_RANKS = {"first": 0, "through": 1, "last": 2}  # rank of each role in a 3-rank plan of one sequence


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queue (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls (device-synchronised), after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StageProbe:
    """A :class:`~kdacp.distributed.strategies.StateExchange` that moves nothing: it stamps the time
    (after a device sync) where the rank posts its message and where it blocks, and hands back zeros
    as the incoming value."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, {}

    def stamp(self, name: str) -> None:
        sync(self.device)
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


def _plan(rank: int, world: int, T: int) -> CPPlan:
    lengths = (T,) * world
    return CPPlan(rank=rank, world_size=world, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=lengths, rank_layouts=rank_layouts(None, 1, lengths))


def probe_role(backend, inputs: KDAInputs, state_dtype: torch.dtype, plan: CPPlan, do: torch.Tensor,
               device: torch.device) -> tuple[RoleStages, RoleStages]:
    """``(forward, backward)`` :class:`RoleStages` (seconds) of one call of the role ``plan`` gives this
    process: its orchestration against a :class:`StageProbe`, ``do`` the output gradient."""
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


def time_roles(backend, inputs: KDAInputs, state_dtype: torch.dtype, device: torch.device, iters: int):
    """``({role: (forward, backward) RoleStages}, (forward, backward) seconds on one device)``: medians
    over ``iters`` calls after one, the roles taken in turn within each round so that a machine whose
    load changes slows them alike (``backend``: a :class:`~kdacp.backends.base.LocalBackend`)."""
    T = inputs.q.shape[1]
    plans = {role: _plan(rank, 3, T) for role, rank in ROLE_RANKS.items()}
    plans["one"] = one_rank_plan(None, 1, T)  # one device: no exchange
    do = torch.randn_like(inputs.v)
    got = {role: [] for role in plans}
    for i in range(iters + 1):  # the first round warms up
        for role, plan in plans.items():
            result = probe_role(backend, inputs, state_dtype, plan, do, device)
            if i:
                got[role].append(result)

    def median(stages: list[RoleStages]) -> RoleStages:
        return RoleStages(*(statistics.median(getattr(s, n) for s in stages) for n in ("ready", "between", "after")))
    medians = {role: (median([f for f, _ in runs]), median([b for _, b in runs])) for role, runs in got.items()}
    f, b = medians.pop("one")
    return medians, (f.total, b.total)
