"""The ``scan`` exchange strategy: its segmented recursive-doubling schedule in one process (against a
sequential fold), and ``chunk_kda`` with ``strategy="scan"`` on real gloo ranks against the
float64 reference, for world sizes that are and are not powers of two."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from kdacp.cp.plan import STRATEGIES, rank_layouts
from kdacp.affine import AffineMap
from kdacp.bench.virtual import simulate_scan
from kdacp.cp.exchanges import ScanExchange, make_exchange, scan_schedule
from tests.cp.test_cp_chunk_kda import _cases, _check_case
from tests.multiprocess import run_ranks


# ---------------------------------------------------------------------------------------------
# the schedule and its algebra, no processes


def _random_route(P: int, rng: random.Random) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """``emits`` / ``affine`` of a consistent route: a state crosses boundary ``i`` (position ``i`` to
    ``i + 1``) or not; a position is affine only if states cross both its boundaries (and even then it
    may hold a chain's end and the next chain's start instead)."""
    rows = rng.choice([1, 1, 2])
    p_cross = rng.choice([0.0, 0.3, 0.7, 0.9, 1.0])
    cross = [rng.random() < p_cross for _ in range(P - 1)] + [False]
    emits = tuple(rows if c else 0 for c in cross)
    affine = tuple(i > 0 and cross[i - 1] and cross[i] and rng.random() < 0.8 for i in range(P))
    return emits, affine


def _random_messages(emits, affine, gen: torch.Generator, shape=(2, 3, 4)) -> list[AffineMap | None]:
    HV, K, V = shape
    out = []
    for e, a in zip(emits, affine):
        if not e:
            out.append(None)
            continue
        offset = torch.randn(e, HV, K, V, generator=gen, dtype=torch.float64)
        transition = 0.6 * torch.randn(e, HV, K, K, generator=gen, dtype=torch.float64) if a else None
        out.append(AffineMap(offset, transition))
    return out


def _sequential(messages, emits) -> list[torch.Tensor | None]:
    """What ``p2p`` computes: each position applies its message to what its predecessor sent."""
    result, x = [None], None
    for m, e in zip(messages[:-1], emits[:-1]):
        x = m.apply(x) if e else None
        result.append(x)
    return result


@pytest.mark.parametrize("P", list(range(1, 18)) + [31, 32, 33])
def test_scan_schedule_matches_sequential_fold(P):
    rng, gen = random.Random(P), torch.Generator().manual_seed(P)
    for _ in range(40):
        emits, affine = _random_route(P, rng)
        messages = _random_messages(emits, affine, gen)
        want = _sequential(messages, emits)
        got = simulate_scan(messages, emits, affine)
        for i, (g, w) in enumerate(zip(got, want)):
            where = f"P={P} emits={emits} affine={affine} position {i}"
            assert (g is None) == (w is None), where
            if w is not None:
                assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), f"{where}: {(g - w).abs().max():.2e}"
        # float32 transport: payloads rounded once per round, compositions in float64
        got32 = simulate_scan(messages, emits, affine, dtype=torch.float32)
        for g, w in zip(got32, want):
            if w is not None:
                assert g.dtype == torch.float32 and torch.allclose(g.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("P", list(range(1, 18)) + [64, 100])
def test_scan_schedule_shape(P):
    """At most ``ceil(log2 P)`` rounds; round ``d`` pairs ``i -> i + 2**d``; each position sends and
    receives at most once per round; a transfer is open only while neither end's chain has started;
    chains of one hop need one round, a chain over every rank needs all of them."""
    rng = random.Random(1000 + P)
    rounds = (P - 1).bit_length()
    for _ in range(30):
        emits, affine = _random_route(P, rng)
        schedule = scan_schedule(emits, affine)
        assert len(schedule.rounds) == rounds
        for d, transfers in enumerate(schedule.rounds):
            srcs, dsts = [t[0] for t in transfers], [t[1] for t in transfers]
            assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
            assert all(dst - src == 1 << d for src, dst, _ in transfers)
            assert all(not is_open or affine[src] for src, _, is_open in transfers)
    # no affine rank: every value is known outright and travels one hop
    emits = (1,) * (P - 1) + (0,)
    starts = scan_schedule(emits, (False,) * P)
    assert [len(r) for r in starts.rounds] == ([P - 1] + [0] * (rounds - 1) if P > 1 else [])
    assert all(not is_open for r in starts.rounds for _, _, is_open in r)
    # one chain through every rank: the last position receives once per round
    through = scan_schedule(emits, (False,) + (True,) * (P - 2) + (False,) if P > 1 else (False,))
    assert len(through.receives(P - 1)) == rounds
    # no state crosses any boundary: nothing moves
    assert not any(scan_schedule((0,) * P, (False,) * P).rounds)


class _Mailbox:
    """In-process stand-in for ``collectives.post_recv`` / ``collectives.send``: ``group`` is ``("fake", rank)``; a
    receive whose message was not sent yet fails instead of blocking."""

    class _Work:
        def __init__(self, fn=None):
            self.fn = fn

        def wait(self):
            if self.fn is not None:
                self.fn()

    def __init__(self):
        self.mail = {}

    def post_recv(self, buffer, src, group):
        key = (src, group[1])

        def deliver():
            assert key in self.mail, f"rank {key[1]} waits for rank {key[0]}, which has not sent"
            buffer.copy_(self.mail.pop(key))
        return self._Work(deliver)

    def send(self, tensor, dst, group):
        key = (group[1], dst)
        assert key not in self.mail, f"two messages {key} in flight"
        self.mail[key] = tensor.clone()
        return self._Work()


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("P", [2, 3, 5, 7, 8, 13])
def test_scan_exchange_in_one_process(P, backward, monkeypatch):
    """:class:`ScanExchange` itself (begin / send / receive on every rank, the orchestration's calls)
    over an in-process mailbox, in both directions (the backward route runs ranks in descending
    order; ``Route.emits`` / ``affine`` are indexed by position), against the sequential fold. Receives
    run in route order, so a rank that needed a message from a later position would fail here."""
    from kdacp.cp import exchanges as strategies
    from kdacp.cp.exchanges import scan
    rng, gen = random.Random(7 * P + backward), torch.Generator().manual_seed(P)
    for _ in range(25):
        box = _Mailbox()
        monkeypatch.setattr(scan.collectives, "post_recv", box.post_recv)
        monkeypatch.setattr(scan.collectives, "send", box.send)
        emits, affine = _random_route(P, rng)  # by position
        messages = _random_messages(emits, affine, gen)
        want = _sequential(messages, emits)
        order = tuple(reversed(range(P))) if backward else tuple(range(P))
        by_rank = {r: i for i, r in enumerate(order)}
        n = max(max(emits), 1)
        routes = [strategies.Route(r, ("fake", r), order, tuple(emits), tuple(affine), (n, 2, 3, 4), torch.float64,
                                   torch.device("cpu")) for r in range(P)]
        exchange = make_exchange("scan")
        pendings = [exchange.begin(route) for route in routes]
        for r in range(P):
            exchange.send(pendings[r], [messages[by_rank[r]]])
        got = {r: exchange.receive(pendings[r])[0] for r in order}
        for pending in pendings:
            pending.finish_sends()
        assert not box.mail, "messages nobody received"
        for r in range(P):
            g, w = got[r], want[by_rank[r]]
            assert (g is None) == (w is None), (emits, affine, r)
            if w is not None:
                assert g.shape == (n, 2, 3, 4) and g.is_contiguous()
                assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (emits, affine, r)


def test_scan_simulation_detects_a_missing_round():
    """The fold comparison can fail: drop the last round of a chain over 8 ranks and the last
    positions get wrong values."""
    gen = torch.Generator().manual_seed(0)
    emits, affine = (1,) * 7 + (0,), (False,) + (True,) * 6 + (False,)
    messages = _random_messages(emits, affine, gen)
    want = _sequential(messages, emits)
    schedule = scan_schedule(emits, affine)
    from kdacp.cp.exchanges import scan as strategies
    broken = strategies.ScanSchedule(schedule.rounds[:-1] + ((),), schedule.absolute, schedule.incoming)
    real = strategies.scan_schedule
    strategies.scan_schedule = lambda *a: broken
    try:
        got = simulate_scan(messages, emits, affine)
    finally:
        strategies.scan_schedule = real
    assert not torch.allclose(got[-1], want[-1])


def test_scan_is_registered():
    assert "scan" in STRATEGIES
    assert isinstance(make_exchange("scan"), ScanExchange)
    with pytest.raises(ValueError, match="scan"):
        make_exchange("ring")


# ---------------------------------------------------------------------------------------------
# chunk_kda on real ranks


def _chains_case(P: int, tokens: int, pattern: tuple[int, ...], name: str) -> dict:
    """Packed sequences cut by ``pattern`` (repeated): chains that start and end on many ranks,
    through ranks here and there, some cuts exactly on rank boundaries."""
    total, lengths = tokens * P, itertools.cycle(pattern)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + next(lengths)))
    return dict(name=name, B=1, cu=cu, uneven=False, gate="default", init=True, final=True)


def _scan_cases(P: int) -> list[dict]:
    # P = 7 and 8 ranks share 2 cores: fewer cases (spawning the ranks is most of the time)
    keep = {7: ("batch-rows-uneven", "packed-long-middle-uneven"), 8: ("packed-long-middle-uneven", "packed-many-short")}
    cases = [c for c in _cases(P) if P not in keep or c["name"] in keep[P]]
    cases.append(_chains_case(P, 24, (55, 4, 30, 2, 75, 9, 1, 50, 3, 20), "packed-chains-everywhere"))
    # 8 tokens per rank, cuts on rank boundaries (24, 48, 56 or 64) between chains of 1 to 3 hops
    cases.append(_chains_case(P, 8, (19, 5, 24, 3, 13, 8, 1, 30), "packed-cuts-on-boundaries"))
    return cases


def _route_patterns(P: int) -> set:
    patterns = set()
    for case in _scan_cases(P):
        if case["cu"] is not None and not case["uneven"]:
            lays = rank_layouts(tuple(case["cu"]), 1, (case["cu"][-1] // P,) * P)
            patterns.add(tuple((lay.num_send, lay.through and lay.num_receive > 0) for lay in lays))
    return patterns


def test_scan_cases_cover_many_chain_shapes():
    """The packed cases hold chains that start and end inside the route and through ranks."""
    for P in (4, 5, 7, 8):
        patterns = _route_patterns(P)
        assert sum(a for p in patterns for _, a in p) >= 2, P  # through ranks in packed batches
        assert any(any(e == 0 for e, _ in p[:-1]) for p in patterns), P  # a chain ends on a boundary


def _scan_all(rank: int, world_size: int) -> None:
    for i, case in enumerate(_scan_cases(world_size)):
        _check_case(rank, world_size, case, "scan", seed=500 + 100 * world_size + i)


@pytest.mark.parametrize("world_size", [3, *(pytest.param(p, marks=pytest.mark.slow) for p in (2, 4, 5, 7, 8))])
def test_cp_chunk_kda_scan_matches_reference(world_size):
    run_ranks(_scan_all, world_size, timeout_s=300)
