"""Cost model of the state exchange: each strategy's forward and backward critical path, composed
event by event from stage times and link parameters (measured by :mod:`kdacp.bench.scaling`; not a
curve fitted to step times). ``strategy="auto"`` (:func:`choose_strategy`) uses it with the
exchange's costs alone, a device per rank. What only the scaling benchmark needs (ranks sharing
cores, FLA's scheme, whole-step predictions) is in :mod:`kdacp.bench.scaling_model`, off the import
path of ``"auto"``.

Positions ``i = 0 .. P-1`` follow the direction states flow (forward: rank ``i``; backward: rank
``P-1-i``). Each position runs one program, its ops in order (under a layout whose ranks hold several
ranges, the chain has more positions than ranks: each rank runs one program over its positions, see
:func:`programs`' ``holders``):

- ``compute(s)``: ``s`` seconds of work on the position's own device (with ``cores``: all positions
  computing at once share that many cores, each at rate ``min(1, cores / computing)``);
- ``send(j, bytes)``: does not block; the message arrives at ``j`` ``link.p2p(bytes)`` later;
- ``recv(j)``: blocks until the next message from ``j`` has arrived;
- ``gather(key, bytes)``: joins the all-gather named ``key`` and goes on; it starts when every position
  has joined it and ends ``link.all_gather(P, bytes)`` later, for all; ``wait(key)``: blocks until it
  has ended. A program may join several, each under its own key (one per layer of a whole step).
  ``barrier(key)``: as ``gather`` with no link time (it ends when the last position joins): a point
  where every rank meets, whatever it costs (a training step's loss, a hybrid model's attention).

Each exchange's program lives beside it (:meth:`~.exchanges.StateExchange.program`): :func:`programs`
runs whichever is registered, and ``"auto"`` compares every registered candidate
(:func:`~.exchanges.auto_candidates`). Stage times come per rank role (``first``: rank 0, ``through``: strictly inside the chain, ``last``:
rank P-1) and direction, as the schedule (:mod:`.schedule`) runs them: ``ready`` (local
work before the message is posted: forward ``prepare`` and the summary ``(S_ext, M)`` or the state
pass; backward the local backward and ``G`` or the gradient state pass), ``between`` (work after
posting that needs no incoming value) and ``after`` (work on the incoming value). ``apply``: one
``M x + S`` (:mod:`kdacp.affine`'s rule); ``compose``: one ``(A2 A1, A2 b1 + b2)``; ``stack``: copying the gathered
summaries. The programs (``[...]``: only where it applies):

``p2p`` (wavefront)::

    compute(ready); [map constant: send(i+1, state)]; compute(between);
    [i > 0: recv(i-1)]; [through: compute(apply); send(i+1, state)]; compute(after)

so after the through ranks' ``ready`` the chain is one hop (link + apply) per through rank.

``allgather``::

    compute(ready); gather(key, summary, with M when any rank is through); compute(between); wait(key);
    compute(stack of P summaries + (chain before i - 1) x apply); compute(after)

``scan`` (the rounds of :func:`~.exchanges.scan_schedule`, ``ceil(log2 P)`` of them)::

    compute(ready); send own payloads (every round's if the map is constant, else round 0's);
    compute(between); for each round d:
        [affine, sends in round d > 0: compute(compose, once anything has arrived); send(i + 2**d, payload)]
        [receives in round d: recv(i - 2**d); compute(compose or apply; nothing for the first)]
    compute(after)

``fla`` (FLA 0.6.0's scheme; ``P`` and the direction alone fix it)::

    [not the last position: compute(FLA's summary kernel)]; gather(summary [HV, K, K+V]); wait;
    compute(i x fold); compute(FLA's one-device pass)

The one-device work is put after the all-gather: every rank runs the same, so where it sits does not
change the critical path. Not modelled: contention between the messages of one rank (its sends and
receives overlap freely) or on shared links (one link parameter set for every pair), and the cores
that handling a message takes on a CPU (on gloo with the cores busy a rank's messages queue, which
costs ``scan`` more than the model says: benchmarks/RESULTS.md, issue 15).
"""
from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

from .exchanges import EXCHANGES, ModelRoute, auto_candidates, make_exchange

__all__ = ["Link", "RoleStages", "StageTimes", "DEFAULT_LINK", "exchange_stage_times"]

ROLES = ("first", "through", "last")


@dataclass(frozen=True)
class Link:
    """One link between any two ranks: a point-to-point message of ``b`` bytes takes
    ``latency_s + b / bandwidth`` seconds; an all-gather of ``b`` bytes per rank over ``P`` ranks is a
    ring of ``P - 1`` steps of ``gather_latency_s + b / gather_bandwidth`` each.

    The defaults are an order of magnitude for one node's NVLink (H100/H200 class: tens of
    microseconds per NCCL call, a few hundred GB/s), not a measurement; pass measured figures.
    Across nodes both bandwidths are lower and latencies higher: pass those for large ``P``."""

    latency_s: float = 20e-6
    bandwidth: float = 300e9
    gather_latency_s: float = 20e-6
    gather_bandwidth: float = 300e9

    def __post_init__(self):
        for name in ("latency_s", "bandwidth", "gather_latency_s", "gather_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.bandwidth <= 0 or self.gather_bandwidth <= 0:
            raise ValueError(f"bandwidths must be > 0, got {self.bandwidth} and {self.gather_bandwidth}")

    def p2p(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def all_gather(self, P: int, nbytes: int) -> float:
        return (P - 1) * (self.gather_latency_s + nbytes / self.gather_bandwidth)

DEFAULT_LINK = Link()


@dataclass(frozen=True)
class RoleStages:
    """One rank role's local work in one direction, seconds (see the module docstring)."""

    ready: float = 0.0
    between: float = 0.0
    after: float = 0.0

    @property
    def total(self) -> float:
        return self.ready + self.between + self.after


@dataclass(frozen=True)
class StageTimes:
    """Everything the model needs from the device, seconds (bytes where said).

    ``forward``/``backward``: role (``first``, ``through``, ``last``) -> :class:`RoleStages`;
    ``one_device``: ``(forward, backward)`` of the same tokens unsplit on one device; ``apply_s``,
    ``compose_s``: one ``M x + S`` and one composition of open maps; ``copy_s_per_byte``: the
    all-gather's stack; ``state_bytes``: one message ``n * HV * K * V`` on the wire and
    ``summary_bytes`` one with its transition ``n * HV * K * (K + V)``; ``fla_summary``: FLA's summary
    kernel ``(forward, backward)``, ``fla_one_device`` its unsplit op, ``fla_fold_s`` one step of its
    merge.
    """

    forward: dict = field(default_factory=lambda: {r: RoleStages() for r in ROLES})
    backward: dict = field(default_factory=lambda: {r: RoleStages() for r in ROLES})
    one_device: tuple[float, float] = (0.0, 0.0)
    apply_s: float = 0.0
    compose_s: float = 0.0
    copy_s_per_byte: float = 0.0
    state_bytes: int = 0
    summary_bytes: int = 0
    fla_summary: tuple[float, float] = (0.0, 0.0)
    fla_one_device: tuple[float, float] = (0.0, 0.0)
    fla_fold_s: float = 0.0


def deadlock_error(finish) -> RuntimeError:
    """The error of programs that wait for what nobody sends (``finish``: None where stuck)."""
    stuck = [i for i, f in enumerate(finish) if f is None]
    return RuntimeError(f"positions {stuck} wait for messages nobody sends (a bug in the programs)")


def simulate(programs: list[list[tuple]], link: Link) -> list[float]:
    """The finish time of every position's program (ops as in the module docstring), a device per
    position: each runs on its own clock, woken when what it waits for is sent.

    Raises:
        RuntimeError: a program waits for a message nobody sends (or an all-gather not all join).
    """
    P = len(programs)
    clock, pc = [0.0] * P, [0] * P
    finish: list[float | None] = [None] * P
    arrivals: dict = defaultdict(deque)
    joined: dict = defaultdict(list)  # gather key -> [(clock, bytes)] of the positions that joined
    gather_end: dict = {}
    work = deque(range(P))
    while work:
        i = work.popleft()
        ops = programs[i]
        while pc[i] < len(ops):
            op = ops[pc[i]]
            kind = op[0]
            if kind == "compute":
                clock[i] += op[1]
            elif kind == "send":
                arrivals[(i, op[1])].append(clock[i] + link.p2p(op[2]))
                work.append(op[1])  # it may be waiting for this
            elif kind == "recv":
                queue = arrivals[(op[1], i)]
                if not queue:
                    break
                clock[i] = max(clock[i], queue.popleft())
            elif kind in ("gather", "barrier"):
                gather_end.update(join_gather(joined, op[1], clock[i], op[2] if kind == "gather" else None, P, link))
                if op[1] in gather_end:
                    work.extend(range(P))
            elif kind == "wait":
                if op[1] not in gather_end:
                    break
                clock[i] = max(clock[i], gather_end[op[1]])
            else:
                raise ValueError(f"unknown op {op!r}")
            pc[i] += 1
        if pc[i] == len(ops):
            finish[i] = clock[i]
    if any(f is None for f in finish):
        raise deadlock_error(finish)
    return finish


def join_gather(joined: dict, key, t: float, nbytes: int | None, P: int, link: Link) -> dict:
    """Record a position joining the all-gather ``key`` at ``t`` (``nbytes`` None: a barrier, no link
    time); ``{key: end}`` once all ``P`` have joined, else ``{}``."""
    joined[key].append((t, nbytes))
    if len(joined[key]) < P:
        return {}
    last = max(s for s, _ in joined[key])
    sizes = [b for _, b in joined[key] if b is not None]
    return {key: last + (link.all_gather(P, max(sizes)) if sizes else 0.0)}


def programs(strategy: str, emits, affine, stages: list[RoleStages], times: StageTimes, gather_key=0,
             holders=None) -> list[list[tuple]]:
    """Every rank's program for the registered exchange ``strategy`` (:data:`~.exchanges.EXCHANGES`) on one
    route: ``emits``/``affine`` by position (as :class:`~.exchanges.Route`'s, in its order), ``stages[i]``
    position ``i``'s local work; ``holders[i]``: the rank holding position ``i`` (default: position ``i``
    is rank ``i``'s only one); ``gather_key`` names a collective the exchange joins. A rank of several
    positions runs their local work together (its stages added up): ``compute(ready)``, the exchange's own
    program (:meth:`~.exchanges.StateExchange.program`, holding ``compute(between)``), ``compute(after)``.

    Raises:
        ValueError: no exchange registered as ``strategy``.
    """
    if strategy not in EXCHANGES:
        raise ValueError(f"strategy must be one of {tuple(EXCHANGES)} here, got {strategy!r}")
    L = len(emits)
    holders = tuple(range(L)) if holders is None else tuple(holders)
    ranks = max(holders) + 1
    own = [[i for i in range(L) if holders[i] == r] for r in range(ranks)]
    total = [tuple(sum(getattr(stages[i], f) for i in mine) for f in ("ready", "between", "after")) for mine in own]
    route = ModelRoute(tuple(emits), tuple(affine), holders, times, tuple(t[1] for t in total), gather_key)
    middles = make_exchange(strategy).program(route)
    return [[("compute", ready)] + middle + [("compute", after)] for (ready, _, after), middle in zip(total, middles)]

# The exchange's own compute where nothing was measured: kdacp.affine's float32 product kernel on a
# GPU, a small fixed cost plus the flops at its rate (one H200, 32 heads of 128: 8.5 us per apply,
# 16.8 us per composition, device time; benchmarks/RESULTS.md). An order of magnitude, used by auto.
_LAUNCH_S, _FLOPS = 2e-6, 2e13


def exchange_stage_times(n: int, HV: int, K: int, V: int, wire_bytes: int = 4) -> StageTimes:
    """:class:`StageTimes` with no local work, for comparing exchanges alone: message sizes of ``n``
    rows of ``[HV, K, V]`` states, and estimated costs of one apply and one composition."""
    apply_s = _LAUNCH_S + 2 * n * HV * K * K * V / _FLOPS
    compose_s = _LAUNCH_S + 2 * n * HV * K * K * (K + V) / _FLOPS
    return StageTimes(apply_s=apply_s, compose_s=compose_s, copy_s_per_byte=1 / 1e12,
                      state_bytes=n * HV * K * V * wire_bytes, summary_bytes=n * HV * K * (K + V) * wire_bytes)

# a chain as the cost model reads it (not :class:`~.exchanges.Route`, the exchanges' dataclass): (emits, affine) by
# position, or (emits, affine, holders): the rank holding each position
ChainShape = tuple


def choose_strategy(forward: ChainShape, backward: ChainShape, times: StageTimes,
                    link: Link = DEFAULT_LINK) -> tuple[str, str]:
    """``(strategy, reason)``: the candidate exchange (:func:`~.exchanges.auto_candidates`: kdacp's ``p2p``,
    ``scan``, ``allgather``) whose exchange the model predicts fastest (forward plus backward, local work left
    out: it is the same for all but for what overlaps), for routes ``forward``/``backward`` given as
    ``(emits, affine)`` by position (position ``i`` on rank ``i``) or ``(emits, affine, holders)`` (a layout
    whose ranks hold several positions: the chain is longer than the group). Without a position strictly
    inside a chain every strategy is one hop: ``p2p``. Deterministic: the same arguments give the same
    answer on every rank (ties go to the earlier candidate: p2p, scan, allgather)."""
    L = len(forward[0])
    P = max(forward[2]) + 1 if len(forward) > 2 else L
    inside = sum(forward[1])
    what = f"{inside} of {P} ranks" if L == P else f"{inside} of {L} positions (the ranges of {P} ranks)"
    if inside == 0:
        where = f"P={P}" if L == P else f"{L} positions over P={P}"
        return "p2p", f"no {'rank' if L == P else 'position'} inside a chain ({where}): one hop"
    candidates = auto_candidates()
    cost = {}
    for s in candidates:
        total = 0.0
        for emits, affine, *holders in (forward, backward):
            zero = [RoleStages()] * len(emits)
            total += max(simulate(programs(s, emits, affine, zero, times, holders=holders[0] if holders else None),
                                  link))
        cost[s] = total
    best = min(cost, key=lambda s: (cost[s], candidates.index(s)))
    others = ", ".join(f"{s} {cost[s] * 1e3:.3g}" for s in cost if s != best)
    return best, f"{what} inside a chain; model exchange {cost[best] * 1e3:.3g} ms vs {others} ms"
