"""The scaling benchmark's side of the cost model (:mod:`kdacp.cp.cost_model`): whole-step
predictions for one sequence over ``P`` ranks, FLA 0.6.0's scheme, and the simulation of ranks that
share fewer cores than there are ranks (a CPU running ``P`` processes). Kept out of the runtime
import path of ``strategy="auto"``, which needs neither.

Two compositions: :func:`predict` adds one layer's forward and backward critical paths (each rank
waits for every message of that layer as if nothing came after it); :func:`predict_step` runs a
training step of ``layers`` token-mixer layers, where a rank goes on to its next layer as soon as its
own work allows (kdacp's exchange posts each layer's receive at its start and never blocks a send),
so the ranks fall into a wavefront: a later rank lags an earlier one by one layer's chain excess, paid
once per stretch between points where every rank meets (the loss; the attention layers of a hybrid
model), not once per layer.

``layout`` (:data:`MODEL_LAYOUTS`): ``"contiguous"``, one range a rank; ``"zigzag"``, the sequence cut in
``2P`` chunks, rank ``r`` holding chunks ``r`` and ``2P-1-r``: a chain of ``2P - 1`` positions (rank
``P-1``'s two chunks are one range) through every rank but the last twice (:func:`zigzag_chain`). A
position does its role's work (first, through, last) scaled by its share of its rank's tokens; a rank of
two positions runs their work together (:func:`kdacp.cp.cost_model.programs`' ``holders``).
:func:`layout_step_path` takes any layout's chain with each rank's own measured work instead (the overhead
suite's roles of a rank holding several ranges, whose work is not its positions' shares of the contiguous
roles': rank 0 under zigzag runs a state pass over its first range besides its whole pass)."""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass

from kdacp.cp.cost_model import (DEFAULT_LINK, Link, RoleStages, StageTimes, deadlock_error,
                                 join_gather, programs)
from kdacp.cp.cost_model import simulate as simulate_dedicated
from kdacp.cp.plan import STRATEGIES, RankLayout, chain_routes

__all__ = ["chain_route", "layout_step_path", "predict", "route_path", "route_step_path"]

MODEL_STRATEGIES = ("p2p", "allgather", "scan", "fla")
MODEL_LAYOUTS = ("contiguous", "zigzag")

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


def chain_route(P: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``(emits, affine)`` by position of one sequence split over ``P`` ranks (either direction)."""
    emits = (1,) * (P - 1) + (0,)
    affine = tuple(0 < i < P - 1 for i in range(P))
    return emits, affine


def simulate_on_cores(programs: list[list[tuple]], link: Link, cores: float | None = None) -> list[float]:
    """The finish time of every position's program (ops as in the module docstring); ``cores``:
    ``None`` (or as many as positions) for a device per position (the runtime cost model's
    :func:`~kdacp.cp.cost_model.simulate`), else the positions share that many cores
    (:func:`simulate_shared`, a global clock).

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
    joined: dict = defaultdict(list)
    gather_end: dict = {}
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
                elif kind in ("gather", "barrier"):
                    gather_end.update(join_gather(joined, op[1], t, op[2] if kind == "gather" else None, P, link))
                elif kind == "wait":
                    if op[1] not in gather_end or gather_end[op[1]] > t + _EPS:
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
                elif op[0] == "wait" and op[1] in gather_end:
                    events.append(gather_end[op[1]])
        if not events:
            raise deadlock_error(finish)
        t_next = min(events)
        for i in computing:
            left[i] -= (t_next - t) * rate
        t = t_next


@dataclass(frozen=True)
class StepPrediction:
    """One training step of ``layers`` token-mixer layers (:func:`predict_step`): the slowest rank's
    finish and one device's step on the same tokens per rank, seconds."""

    strategy: str
    P: int
    layers: int
    sync_every: int
    step_s: float
    one_device_s: float

    @property
    def ratio(self) -> float:
        return self.step_s / self.one_device_s if self.one_device_s > 0 else math.inf


def fla_programs(P: int, direction: str, times: StageTimes, gather_key=0) -> list[list[tuple]]:
    """FLA 0.6.0's all-gather scheme for one sequence over ``P`` ranks, positions in flow order;
    ``gather_key`` names its all-gather."""
    k = 0 if direction == "forward" else 1
    nbytes = times.summary_bytes
    return [([("compute", times.fla_summary[k])] if i < P - 1 else [])
            + [("gather", gather_key, nbytes), ("wait", gather_key), ("compute", i * times.fla_fold_s),
               ("compute", times.fla_one_device[k])]
            for i in range(P)]


def _role(rank: int, P: int) -> str:
    return "first" if rank == 0 else "last" if rank == P - 1 else "through"


def route_path(strategy: str, emits, affine, stages: list[RoleStages], times: StageTimes, link: Link = DEFAULT_LINK,
               cores: float | None = None) -> float:
    """The critical path (seconds: the slowest position's finish) of ``strategy`` (``p2p``, ``allgather``,
    ``scan``) on any one route, ``emits``/``affine`` and ``stages`` by position in the direction states flow
    (a packed batch's layout, where :func:`predict` takes one sequence's chain)."""
    return max(simulate_on_cores(programs(strategy, emits, affine, stages, times), link, cores))


def _check(strategy: str, P: int, layout: str = "contiguous") -> None:
    if strategy not in MODEL_STRATEGIES:
        raise ValueError(f"strategy must be one of {MODEL_STRATEGIES}, got {strategy!r}")
    if isinstance(P, bool) or not isinstance(P, int) or P < 2:
        raise ValueError(f"P must be an int >= 2, got {P!r}")
    if layout not in MODEL_LAYOUTS:
        raise ValueError(f"layout must be one of {MODEL_LAYOUTS}, got {layout!r}")
    if strategy == "fla" and layout != "contiguous":
        raise ValueError("layout must be 'contiguous' with strategy='fla' (FLA 0.6.0's scheme has no other)")


def zigzag_chain(P: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``(holders, shares)`` of one sequence's chain under zigzag over ``P`` ranks, positions in token order:
    the rank holding each and its share of that rank's tokens."""
    holders = (*range(P), *reversed(range(P - 1)))
    return holders, tuple(1.0 if r == P - 1 else 0.5 for r in holders)


def _scaled(stages: RoleStages, share: float) -> RoleStages:
    return RoleStages(stages.ready * share, stages.between * share, stages.after * share)


def _zigzag_routes(times: StageTimes, P: int) -> dict:
    """``{direction: ((emits, affine, holders), stages)}`` of one sequence under zigzag, by position in the
    direction states flow."""
    holders, shares = zigzag_chain(P)
    L = len(holders)
    emits, affine = chain_route(L)
    routes = {}
    for direction in ("forward", "backward"):
        per_role = times.forward if direction == "forward" else times.backward
        chain = range(L) if direction == "forward" else reversed(range(L))
        stages = [_scaled(per_role[_role(c, L)], shares[c]) for c in chain]
        flow = holders if direction == "forward" else holders[::-1]
        routes[direction] = ((emits, affine, flow), stages)
    return routes


def _by_rank(progs: list[list[tuple]], direction: str) -> list[list[tuple]]:
    """Programs by position in flow order -> by rank: the backward's positions run from the last rank (their
    messages' peers mapped back to ranks)."""
    if direction == "forward":
        return progs
    P = len(progs)
    flip = [[(o[0], P - 1 - o[1], *o[2:]) if o[0] in ("send", "recv") else o for o in prog] for prog in progs]
    return flip[::-1]


def _assemble(layer_programs, P: int, layers: int, sync_every: int) -> list[list[tuple]]:
    """A training step by rank from ``layer_programs(direction, key)`` (one layer, by rank): see
    :func:`step_programs`."""
    progs = [[] for _ in range(P)]

    def barrier(key):
        for prog in progs:
            prog += [("barrier", key), ("wait", key)]

    def attention_after(layer: int) -> bool:
        return bool(sync_every) and (layer + 1) % sync_every == 0 and layer + 1 < layers

    for layer in range(layers):
        for prog, mine in zip(progs, layer_programs("forward", ("forward", layer))):
            prog += mine
        if attention_after(layer):
            barrier(("attention forward", layer))
    barrier("loss")
    for layer in reversed(range(layers)):
        if attention_after(layer):
            barrier(("attention backward", layer))
        for prog, mine in zip(progs, layer_programs("backward", ("backward", layer))):
            prog += mine
    return progs


def check_stack(layers: int, sync_every: int) -> None:
    """``ValueError`` naming the argument unless ``layers >= 1`` and ``sync_every >= 0`` are ints."""
    for name, value, low in (("layers", layers, 1), ("sync_every", sync_every, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _chain_stages(times: StageTimes, P: int, direction: str) -> list[RoleStages]:
    """Each position's stages of one sequence over ``P`` ranks, in the direction states flow."""
    per_role = times.forward if direction == "forward" else times.backward
    ranks = range(P) if direction == "forward" else reversed(range(P))
    return [per_role[_role(r, P)] for r in ranks]


def _route_layer(strategy: str, routes: dict, times: StageTimes):
    """``layer(direction, key)``: one layer's programs by rank, ``routes[direction] = ((emits, affine),
    stages)`` by position in the direction states flow (position ``i`` on rank ``i`` forward, ``P-1-i``
    backward), or ``((emits, affine, holders), stages)`` with the rank holding each position."""
    def layer(direction, key):
        route, stages = routes[direction]
        if len(route) == 3:
            return programs(strategy, route[0], route[1], stages, times, key, holders=route[2])
        return _by_rank(programs(strategy, *route, stages, times, key), direction)
    return layer


def _layer(strategy: str, P: int, times: StageTimes, layout: str):
    """:func:`_route_layer`'s ``layer`` for one sequence over ``P`` ranks under ``layout``."""
    if strategy == "fla":
        return lambda direction, key: _by_rank(fla_programs(P, direction, times, key), direction)
    if layout == "zigzag":
        return _route_layer(strategy, _zigzag_routes(times, P), times)
    routes = {d: (chain_route(P), _chain_stages(times, P, d)) for d in ("forward", "backward")}
    return _route_layer(strategy, routes, times)


def step_programs(strategy: str, P: int, times: StageTimes, layers: int, sync_every: int = 0,
                  layout: str = "contiguous") -> list[list[tuple]]:
    """Every rank's program of one training step (rank order), one sequence over ``P`` ranks: the
    ``layers`` token-mixer layers' forwards in order, a barrier for the loss (every rank joins it: the
    global token count, as :func:`kdacp.cp.sharding.global_token_mean_loss` all-reduces), the backwards in
    reverse order. With ``sync_every``: a barrier after every ``sync_every``-th mixer layer (before it,
    backward), for a hybrid model's softmax-attention layer, whose exchange every rank joins (Kimi Linear
    and Qwen3-Next: 3 mixer layers to 1 attention layer, ``sync_every=3``); its work is not modelled.
    ``layout``: one of :data:`MODEL_LAYOUTS` (see the module docstring)."""
    _check(strategy, P, layout)
    return _assemble(_layer(strategy, P, times, layout), P, layers, sync_every)


def route_step_path(strategy: str, forward, backward, forward_stages: list[RoleStages],
                    backward_stages: list[RoleStages], times: StageTimes, layers: int, sync_every: int = 0,
                    link: Link = DEFAULT_LINK, cores: float | None = None) -> float:
    """The step of :func:`step_programs` (seconds: the slowest rank's finish) on any one layout's routes:
    ``forward``/``backward`` ``(emits, affine)`` and ``*_stages`` by position in the direction states
    flow, as :func:`route_path` takes them (a packed batch's layout)."""
    check_stack(layers, sync_every)
    layer = _route_layer(strategy, {"forward": (forward, forward_stages), "backward": (backward, backward_stages)},
                         times)
    return max(simulate_on_cores(_assemble(layer, len(forward[0]), layers, sync_every), link, cores))


def layout_step_path(strategy: str, layouts: tuple[RankLayout, ...], rank_stages, times: StageTimes, layers: int,
                     sync_every: int = 0, link: Link = DEFAULT_LINK, cores: float | None = None) -> float:
    """The step of :func:`step_programs` (seconds: the slowest rank's finish) over any layout's chain
    (``layouts``: every rank's :class:`~kdacp.cp.plan.RankLayout`; its routes as the orchestration
    runs them, :func:`~kdacp.cp.plan.chain_routes`), ``strategy`` one of ``p2p``, ``allgather``,
    ``scan``. ``rank_stages[r]``: ``(forward, backward)`` :class:`RoleStages` of all of rank ``r``'s local work,
    as the stage probe measures a rank whatever the positions it holds; they sit on its first position in
    flow order (:func:`~kdacp.cp.cost_model.programs` runs a rank's positions' work together)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if len(rank_stages) != len(layouts):
        raise ValueError(f"rank_stages must hold one (forward, backward) pair per rank ({len(layouts)}), "
                         f"got {len(rank_stages)}")
    check_stack(layers, sync_every)
    routes = {}
    for k, (direction, (emits, affine, holders)) in enumerate(zip(("forward", "backward"), chain_routes(layouts))):
        first = {}
        for i, r in enumerate(holders):
            first.setdefault(r, i)
        stages = [rank_stages[r][k] if first[r] == i else RoleStages() for i, r in enumerate(holders)]
        routes[direction] = ((emits, affine, holders), stages)
    progs = _assemble(_route_layer(strategy, routes, times), len(layouts), layers, sync_every)
    return max(simulate_on_cores(progs, link, cores))


def predict_step(strategy: str, P: int, times: StageTimes, layers: int, sync_every: int = 0,
                 link: Link = DEFAULT_LINK, cores: float | None = None, layout: str = "contiguous") -> StepPrediction:
    """One sequence split evenly over ``P >= 2`` ranks under ``layout``, a training step of ``layers >= 1``
    token-mixer layers (:func:`step_programs`): the slowest rank's finish against ``layers`` one-device steps."""
    _check(strategy, P, layout)
    check_stack(layers, sync_every)
    finish = simulate_on_cores(step_programs(strategy, P, times, layers, sync_every, layout), link, cores)
    one = times.fla_one_device if strategy == "fla" else times.one_device
    return StepPrediction(strategy, P, layers, sync_every, max(finish), layers * sum(one))


def predict(strategy: str, P: int, times: StageTimes, link: Link = DEFAULT_LINK, cores: float | None = None,
            layout: str = "contiguous") -> Prediction:
    """One sequence split evenly over ``P >= 2`` ranks under ``layout``: ``strategy``'s (one of
    :data:`MODEL_STRATEGIES`) forward and backward critical paths, and one device's step on the same tokens
    per rank."""
    _check(strategy, P, layout)
    layer = _layer(strategy, P, times, layout)
    paths = [max(simulate_on_cores(layer(direction, 0), link, cores)) for direction in ("forward", "backward")]
    one = times.fla_one_device if strategy == "fla" else times.one_device
    return Prediction(strategy, P, paths[0], paths[1], sum(one))
