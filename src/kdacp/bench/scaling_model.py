"""The scaling benchmark's side of the cost model (:mod:`kdacp.distributed.cost_model`): whole-step
predictions for one sequence over ``P`` ranks, FLA 0.6.0's scheme, and the simulation of ranks that
share fewer cores than there are ranks (a CPU running ``P`` processes). Kept out of the runtime
import path of ``strategy="auto"``, which needs neither."""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from kdacp.distributed.cost_model import (DEFAULT_LINK, Link, RoleStages, StageTimes, chain_route, deadlock_error,
                                         programs)
from kdacp.distributed.cost_model import simulate as simulate_dedicated

__all__ = ["MODEL_STRATEGIES", "Prediction", "fla_programs", "predict", "route_path", "simulate", "simulate_shared"]

MODEL_STRATEGIES = ("p2p", "allgather", "scan", "fla")

_EPS = 1e-12  # seconds: a compute op with less left than this is done


@dataclass(frozen=True)
class Prediction:
    """Critical paths (slowest position's finish) in seconds, and the step over one device's."""

    strategy: str
    P: int
    forward_s: float
    backward_s: float
    one_device_s: float

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def ratio(self) -> float:
        return self.step_s / self.one_device_s if self.one_device_s > 0 else math.inf


def simulate(programs: list[list[tuple]], link: Link, cores: float | None = None) -> list[float]:
    """The finish time of every position's program (ops as in the module docstring); ``cores``:
    ``None`` for a device per position, else the positions share that many cores.

    Raises:
        RuntimeError: a program waits for a message nobody sends (or an all-gather not all join).
    """
    if cores is None or cores >= len(programs):
        return simulate_dedicated(programs, link)
    return simulate_shared(programs, link, cores)


def simulate_shared(programs: list[list[tuple]], link: Link, cores: float) -> list[float]:
    """Positions share ``cores``: one global clock, every position computing at ``min(1, cores / computing)``."""
    P = len(programs)
    pc, left = [0] * P, [None] * P
    finish: list[float | None] = [None] * P
    arrivals: dict = defaultdict(deque)
    joined: list[tuple[float, int]] = []
    gather_end: float | None = None
    t = 0.0
    while True:
        for i in range(P):  # run every position up to its next compute or blocking op
            ops = programs[i]
            while finish[i] is None:
                if pc[i] == len(ops):
                    finish[i] = t
                    break
                op = ops[pc[i]]
                kind = op[0]
                if kind == "compute":
                    if left[i] is None:
                        left[i] = op[1]
                    if left[i] > _EPS:
                        break
                    left[i] = None
                elif kind == "send":
                    arrivals[(i, op[1])].append(t + link.p2p(op[2]))
                elif kind == "recv":
                    queue = arrivals[(op[1], i)]
                    if not queue or queue[0] > t + _EPS:
                        break
                    queue.popleft()
                elif kind == "gather":
                    joined.append((t, op[1]))
                    if len(joined) == P:
                        gather_end = max(s for s, _ in joined) + link.all_gather(P, max(b for _, b in joined))
                elif kind == "wait":
                    if gather_end is None or gather_end > t + _EPS:
                        break
                else:
                    raise ValueError(f"unknown op {op!r}")
                pc[i] += 1
        if all(f is not None for f in finish):
            return finish
        computing = [i for i in range(P) if finish[i] is None and left[i] is not None]
        rate = min(1.0, cores / len(computing)) if computing else 1.0
        events = [t + left[i] / rate for i in computing]
        for i in range(P):
            if finish[i] is None and left[i] is None:
                op = programs[i][pc[i]]
                if op[0] == "recv" and arrivals[(op[1], i)]:
                    events.append(arrivals[(op[1], i)][0])
                elif op[0] == "wait" and gather_end is not None:
                    events.append(gather_end)
        if not events:
            raise deadlock_error(finish)
        t_next = min(events)
        for i in computing:
            left[i] -= (t_next - t) * rate
        t = t_next


def fla_programs(P: int, direction: str, times: StageTimes) -> list[list[tuple]]:
    """FLA 0.6.0's all-gather scheme for one sequence over ``P`` ranks, positions in flow order."""
    k = 0 if direction == "forward" else 1
    nbytes = times.summary_bytes
    return [([("compute", times.fla_summary[k])] if i < P - 1 else [])
            + [("gather", nbytes), ("wait",), ("compute", i * times.fla_fold_s), ("compute", times.fla_one_device[k])]
            for i in range(P)]


def _role(rank: int, P: int) -> str:
    return "first" if rank == 0 else "last" if rank == P - 1 else "through"


def route_path(strategy: str, emits, affine, stages: list[RoleStages], times: StageTimes, link: Link = DEFAULT_LINK,
               cores: float | None = None) -> float:
    """The critical path (seconds: the slowest position's finish) of ``strategy`` (``p2p``, ``allgather``,
    ``scan``) on any one route, ``emits``/``affine`` and ``stages`` by position in the direction states flow
    (a packed batch's layout, where :func:`predict` takes one sequence's chain)."""
    return max(simulate(programs(strategy, emits, affine, stages, times), link, cores))


def predict(strategy: str, P: int, times: StageTimes, link: Link = DEFAULT_LINK, cores: float | None = None
            ) -> Prediction:
    """One sequence split evenly over ``P >= 2`` ranks: ``strategy``'s (one of :data:`MODEL_STRATEGIES`)
    forward and backward critical paths, and one device's step on the same tokens per rank."""
    if strategy not in MODEL_STRATEGIES:
        raise ValueError(f"strategy must be one of {MODEL_STRATEGIES}, got {strategy!r}")
    if isinstance(P, bool) or not isinstance(P, int) or P < 2:
        raise ValueError(f"P must be an int >= 2, got {P!r}")
    emits, affine = chain_route(P)
    paths = []
    for direction, per_role in (("forward", times.forward), ("backward", times.backward)):
        if strategy == "fla":
            paths.append(max(simulate(fla_programs(P, direction, times), link, cores)))
        else:
            ranks = range(P) if direction == "forward" else reversed(range(P))
            paths.append(route_path(strategy, emits, affine, [per_role[_role(r, P)] for r in ranks], times, link,
                                    cores))
    one = times.fla_one_device if strategy == "fla" else times.one_device
    return Prediction(strategy, P, paths[0], paths[1], sum(one))
