"""Stage probes of the scaling model: one rank role's real schedule against an exchange that moves
nothing and stamps the time where the rank posts its message, blocks, and gets the incoming value back
(device time on a GPU: see :class:`StageProbe`).

Each role (``first``, ``through``, ``last``) of a 3-rank plan of one sequence runs as a
:class:`~kdacp.bench.rank_role.RankRole` in one process; a one-rank plan gives one device's forward and
backward on the same tokens.
"""
from __future__ import annotations

import statistics

import torch

from kdacp.backends.base import KDAInputs
from kdacp.bench.rank_role import RankRole, StandInExchange
from kdacp.cp.cost_model import RoleStages
from kdacp.cp.plan import CPPlan, one_rank_plan, rank_layouts

from .timing import Clock, check_queued_ahead, queue_ahead_for, sleep_then_mark, sync

ROLE_RANKS = {"first": 0, "through": 1, "last": 2}  # rank of each role in a 3-rank plan of one sequence


class StageProbe(StandInExchange):
    """A :class:`~kdacp.bench.rank_role.StandInExchange` (it moves nothing) that stamps where the rank posts its
    message (``send``), where it blocks (``receive``) and where it gets the incoming value back
    (``received``: zeros; a through rank's ``M x + S`` runs between the last two, outside every stage: the
    cost model adds the exchange's products itself), between :meth:`start` and :meth:`finish`.

    On a GPU the stamps are CUDA events in stream order and the device sleeps ``queue_ahead_s`` at
    :meth:`start`, so the host queues the whole call before the device runs it, as in a training step,
    where the host runs ahead of the device and an NCCL receive makes the stream wait, not the host
    (the same footing as the exchange's products, :func:`~kdacp.bench.calibration.op_times`): each
    stage is device time. Were the stamps taken after device syncs instead, a stage starting after the
    receive would also count the host's launch latency of its first kernels, which a real run hides
    (FLA's state pass on an H200 machine: 0.42 ms of device time, 0.75 ms from launch to done after a
    sync). On the CPU the stamps are the wall clock. ``queue_ahead_s=0``: no sleep and no check (for
    warm-up calls, whose compiling outlasts any sleep; :func:`queue_ahead` sizes it for the others)."""

    def __init__(self, device: torch.device, queue_ahead_s: float = 0.0):
        super().__init__()
        self.device, self.stamps, self.queue_ahead_s = device, {}, queue_ahead_s
        self.clock = Clock(device)

    def stamp(self, name: str) -> None:
        self.stamps[name] = self.clock.stamp()

    def start(self) -> None:
        sync(self.device)
        if self.clock.cuda:
            self.stamps["start"] = sleep_then_mark(self.queue_ahead_s * 1e3)
        else:
            self.stamp("start")

    def finish(self) -> RoleStages:
        """The stages (seconds) of the call between :meth:`start` and now.

        Raises:
            RuntimeError: on a GPU, the device started the call before the host had queued all of it (a
                host sync inside the call, or a host slower than the sleep): the stages would count host time.
        """
        self.stamp("end")
        if self.clock.cuda:
            check_queued_ahead(self.stamps["start"], self.queue_ahead_s * 1e3, "StageProbe, the probed call")

        def between(a, b):
            return self.clock.seconds(self.stamps[a], self.stamps[b])
        return RoleStages(between("start", "send"), between("send", "receive"), between("received", "end"))

    def send(self, pending, messages) -> None:
        super().send(pending, messages)
        self.stamp("send")

    def receive(self, pending) -> list:
        self.stamp("receive")
        incoming = super().receive(pending)
        self.stamp("received")
        return incoming


def _plan(rank: int, world: int, T: int) -> CPPlan:
    lengths = (T,) * world
    return CPPlan(rank=rank, world_size=world, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=lengths, rank_layouts=rank_layouts(None, 1, lengths))


def probe_role(backend, inputs: KDAInputs, state_dtype: torch.dtype, plan: CPPlan, do: torch.Tensor,
               device: torch.device, queue_ahead_s: float = 0.0) -> tuple[RoleStages, RoleStages]:
    """``(forward, backward)`` :class:`RoleStages` (seconds) of one call of the role ``plan`` gives this
    process: its :class:`~kdacp.bench.rank_role.RankRole` against a :class:`StageProbe` (``queue_ahead_s`` its sleep on a GPU, from
    :func:`queue_ahead`; 0 for warm-up calls), ``do`` the output gradient."""
    role = RankRole(plan, backend, inputs, state_dtype=state_dtype)
    probe = StageProbe(device, queue_ahead_s)
    probe.start()
    out = role.forward(probe)
    forward = probe.finish()
    probe = StageProbe(device, queue_ahead_s)
    probe.start()
    role.backward(out, do, exchange=probe)
    return forward, probe.finish()


def queue_ahead(backend, inputs: KDAInputs, state_dtype: torch.dtype, plan: CPPlan, do: torch.Tensor,
                device: torch.device) -> float:
    """The :class:`StageProbe` sleep (seconds) that lets the host queue a whole direction of ``plan``'s role
    before the device runs it: :func:`~kdacp.bench.timing.queue_ahead_for` of one warm call (both
    directions, device included); 0 on the CPU."""
    return queue_ahead_for([lambda: probe_role(backend, inputs, state_dtype, plan, do, device)], 1, device) / 1e3


def probe_rounds(backend, inputs: KDAInputs, state_dtype: torch.dtype, plans: dict, do: torch.Tensor,
                 device: torch.device, rounds: int, warmup: int = 1) -> dict:
    """``{role: [(forward, backward) RoleStages] * rounds}`` of the roles ``plans`` (role -> plan) gives this
    process: ``warmup`` calls of each (compiling), one on a GPU that sizes each role's probe sleep
    (:func:`queue_ahead`), then ``rounds`` rounds, the roles taken in turn within each so that a machine
    whose load changes slows them alike."""
    for _ in range(warmup):
        for plan in plans.values():
            probe_role(backend, inputs, state_dtype, plan, do, device)
    ahead = {role: queue_ahead(backend, inputs, state_dtype, plan, do, device) for role, plan in plans.items()}
    got = {role: [] for role in plans}
    for _ in range(rounds):
        for role, plan in plans.items():
            got[role].append(probe_role(backend, inputs, state_dtype, plan, do, device, ahead[role]))
    return got


def time_roles(backend, inputs: KDAInputs, state_dtype: torch.dtype, device: torch.device, iters: int):
    """``({role: (forward, backward) RoleStages}, (forward, backward) seconds on one device)``: medians
    over ``iters`` rounds of :func:`probe_rounds` (``backend``: a :class:`~kdacp.backends.base.LocalBackend`)."""
    T = inputs.q.shape[1]
    plans = {role: _plan(rank, 3, T) for role, rank in ROLE_RANKS.items()}
    plans["one"] = one_rank_plan(None, 1, T)  # one device: no exchange
    got = probe_rounds(backend, inputs, state_dtype, plans, torch.randn_like(inputs.v), device, iters)

    def median(stages: list[RoleStages]) -> RoleStages:
        return RoleStages(*(statistics.median(getattr(s, n) for s in stages) for n in ("ready", "between", "after")))
    medians = {role: (median([f for f, _ in runs]), median([b for _, b in runs])) for role, runs in got.items()}
    f, b = medians.pop("one")
    return medians, (f.total, b.total)
