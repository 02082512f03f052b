"""The ``p2p``, ``allgather`` and ``scan`` exchanges over routes whose ranks hold several positions of the
chain (a zigzag or any caller's ranges), in one process: threads stand for ranks, and a wire matches the
messages between two ranks in the order they were posted, as NCCL and gloo do. Every position's incoming
value against the sequential fold of the messages; a receive left waiting fails the test instead of hanging."""
from __future__ import annotations

import itertools
import random
import threading
from collections import defaultdict, deque

import pytest
import torch

from kdacp import affine as affine_module
from kdacp.cp import collectives, exchanges
from kdacp.cp.layout import document_zigzag_layout, zigzag_layout
from kdacp.cp.plan import chain_links, layout_rank_layouts
from tests.cp.test_scan import _random_messages, _random_route, _sequential

TIMEOUT_S = 20.0


class _Work:
    def __init__(self, on_wait=None):
        self.done, self.on_wait, self.hops = threading.Event(), on_wait, 0

    def wait(self):
        assert self.done.wait(TIMEOUT_S), "a receive never matched a send (deadlock or a lost message)"
        if self.on_wait is not None:
            self.on_wait(self.hops)


class _GatherWork:
    def __init__(self, wire, call: int, parts: list):
        self.wire, self.call, self.parts = wire, call, parts

    def wait(self):
        wire = self.wire
        with wire.joined:
            ok = wire.joined.wait_for(lambda: len(wire.gathers[self.call]) == wire.world_size, TIMEOUT_S)
            assert ok, "an all-gather some rank never joined"
            for r, t in wire.gathers[self.call].items():
                self.parts[r].copy_(t)


class _Wire:
    """``collectives.post_recv`` / ``collectives.send`` / ``collectives.post_all_gather`` between threads; ``group`` is
    ``("wire", rank)``. Per ordered pair of ranks the n-th send fills the n-th posted receive.

    ``hops``: the longest run of point-to-point messages each waiting on the one before, as the ranks ran: a
    message counts one more than the most any message its sender had waited for before sending it (one for a
    message sent before any wait). Fixed by each rank's order of waits and sends, not by the threads' timing."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.joined = threading.Condition()
        self.posted, self.early = defaultdict(deque), defaultdict(deque)
        self.gathers, self.gather_calls = defaultdict(dict), defaultdict(int)
        self.waited = [0] * world_size  # per rank: the most hops of a message it has waited for

    @property
    def hops(self) -> int:
        return max(self.waited)

    @staticmethod
    def _deliver(buffer, tensor, hops, work):
        assert buffer.shape == tensor.shape, f"a message of {tuple(tensor.shape)} met a receive of {tuple(buffer.shape)}"
        buffer.copy_(tensor)
        work.hops = hops
        work.done.set()

    def post_recv(self, buffer, src, group):
        rank = group[1]

        def on_wait(hops):
            self.waited[rank] = max(self.waited[rank], hops)
        work = _Work(on_wait)
        with self.joined:
            if self.early[(src, rank)]:
                self._deliver(buffer, *self.early[(src, rank)].popleft(), work)
            else:
                self.posted[(src, rank)].append((buffer, work))
        return work

    def send(self, tensor, dst, group):
        hops = self.waited[group[1]] + 1
        with self.joined:
            if self.posted[(group[1], dst)]:
                buffer, work = self.posted[(group[1], dst)].popleft()
                self._deliver(buffer, tensor, hops, work)
            else:
                self.early[(group[1], dst)].append((tensor.clone(), hops))
        done = _Work()
        done.done.set()
        return done

    def post_all_gather(self, tensor, group):
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.joined:
            call = self.gather_calls[group[1]]
            self.gather_calls[group[1]] += 1
            self.gathers[call][group[1]] = tensor.clone()
            self.joined.notify_all()
        return _GatherWork(self, call, parts), parts

    def unread(self) -> list:
        return [k for k, q in self.early.items() if q] + [k for k, q in self.posted.items() if q]


def _random_holders(L: int, P: int, rng: random.Random) -> tuple[int, ...]:
    """Rank of each of ``L`` positions: every rank at least one, the rest at random (runs of one rank too,
    which the layout would merge: the exchange must not care)."""
    holders = list(range(P)) + [rng.randrange(P) for _ in range(L - P)]
    rng.shuffle(holders)
    return tuple(holders)


def run_exchange(strategy: str, holders, emits, affine, messages, monkeypatch, wire=None) -> list:
    """Every position's incoming value, each rank a thread calling begin, send and receive on its positions
    (over ``wire``, default a new :class:`_Wire`)."""
    P = max(holders) + 1
    wire = _Wire(P) if wire is None else wire
    monkeypatch.setattr(collectives, "post_recv", wire.post_recv)
    monkeypatch.setattr(collectives, "send", wire.send)
    monkeypatch.setattr(collectives, "post_all_gather", wire.post_all_gather)
    n = max(max(emits), 1)
    got, errors = {}, []

    def rank_main(r):
        try:
            route = exchanges.Route(r, ("wire", r), tuple(holders), tuple(emits), tuple(affine), (n, 2, 3, 4),
                                     torch.float64, torch.device("cpu"))
            exchange = exchanges.make_exchange(strategy)
            pending = exchange.begin(route)
            exchange.send(pending, [messages[i] for i in route.positions])
            got.update(zip(route.positions, exchange.receive(pending)))
            pending.finish_sends()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    if errors:
        raise errors[0]
    assert not wire.unread(), f"messages nobody read, or receives nobody filled: {wire.unread()}"
    return [got[i] for i in range(len(holders))]


def _check(strategy, holders, emits, affine, gen, monkeypatch):
    messages = _random_messages(emits, affine, gen)
    want = _sequential(messages, emits)
    got = run_exchange(strategy, holders, emits, affine, messages, monkeypatch)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), (strategy, holders, emits, affine, i)
        if w is not None:
            assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (strategy, holders, emits, affine, i)


@pytest.mark.parametrize("strategy", ("p2p", "allgather", "scan"))
def test_exchanges_over_ranks_of_several_positions(strategy, monkeypatch):
    """Random chains of 2 to 12 positions over 2 to 4 ranks, many messages between one pair of ranks,
    constant messages of later positions known before affine ones of earlier positions."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    for _ in range(30):
        P = rng.randrange(2, 5)
        L = rng.randrange(P, 13)
        emits, affine = _random_route(L, rng)
        _check(strategy, _random_holders(L, P, rng), emits, affine, gen, monkeypatch)


@pytest.mark.parametrize("strategy", ("p2p", "allgather", "scan"))
@pytest.mark.parametrize("P", (2, 3, 4))
def test_exchanges_over_the_zigzag_chain(strategy, P, monkeypatch):
    """One sequence under zigzag: the chain 0 -> 1 -> ... -> P-1 -> ... -> 0 (rank P-1's two chunks are one
    range), every position but the ends affine, both directions."""
    links = chain_links(layout_rank_layouts(None, 1, zigzag_layout(8 * P, P)))
    holders = tuple(link.rank for link in links)
    assert holders == (*range(P), *reversed(range(P - 1)))
    emits, affine = tuple(link.num_send for link in links), tuple(link.through for link in links)
    assert affine == (False, *(True,) * (2 * P - 3), False)
    gen = torch.Generator().manual_seed(P)
    _check(strategy, holders, emits, affine, gen, monkeypatch)
    _check(strategy, holders[::-1], tuple(link.num_receive for link in links)[::-1], affine[::-1], gen, monkeypatch)


def _document_zigzag_route(P: int, lengths) -> tuple:
    """``(holders, sends, receives, affine)`` of a packed batch of documents of ``lengths`` (multiples of ``2P``)
    under ``document_zigzag`` over ``P`` ranks, by position in token order (``sends``: the forward's ``emits``,
    ``receives``: the backward's, before reversing)."""
    cu = (0, *itertools.accumulate(lengths))
    links = chain_links(layout_rank_layouts(cu, 1, document_zigzag_layout(cu, P)))
    return (tuple(link.rank for link in links), tuple(link.num_send for link in links),
            tuple(link.num_receive for link in links), tuple(link.through for link in links))


@pytest.mark.parametrize("strategy", ("p2p", "allgather", "scan"))
def test_exchanges_over_documents_cut_per_document(strategy, monkeypatch):
    """A packed batch under ``document_zigzag`` (P = 4, six documents): a rank holds a piece of every document,
    rank 0 one range across each pair of neighbouring documents; both directions."""
    holders, sends, receives, affine = _document_zigzag_route(4, (8, 16, 24, 8, 40, 16))
    gen = torch.Generator().manual_seed(11)
    _check(strategy, holders, sends, affine, gen, monkeypatch)
    _check(strategy, holders[::-1], receives[::-1], affine[::-1], gen, monkeypatch)


@pytest.mark.parametrize("P, docs", ((3, 4), (4, 7)))
def test_p2p_advances_side_by_side_chains_together(P, docs, monkeypatch):
    """Under ``document_zigzag`` every document's chain crosses ranks ``2P - 2`` times (rank ``P - 1`` holds its
    middle two pieces as one range). ``p2p``'s longest run of messages each waiting on the one before is one
    chain's, whatever the number of documents: a rank passes every document's piece on before it waits for any
    chain to come back (handled in flow order, a rank waited for each document's chain to return before passing
    the next document on: 10 and 30 messages here)."""
    holders, sends, receives, affine = _document_zigzag_route(P, [2 * P * (d % 3 + 1) for d in range(docs)])
    gen = torch.Generator().manual_seed(P)
    for h, e, a in ((holders, sends, affine), (holders[::-1], receives[::-1], affine[::-1])):
        wire = _Wire(P)
        run_exchange("p2p", h, e, a, _random_messages(e, a, gen), monkeypatch, wire=wire)
        assert wire.hops == 2 * P - 2


_PRODUCTS = affine_module._products  # the real product, which the counting below wraps


def _documents_products(strategy: str, seed: int, monkeypatch) -> tuple[tuple, list[int]]:
    """Run ``strategy`` over the P = 4 six-document ``document_zigzag`` route (forward), every value checked against
    the sequential fold; ``((holders, sends, affine), rows)``: ``rows`` the leading size of each ``M x + S``
    product formed (:func:`kdacp.affine._products`), in order."""
    holders, sends, _, affine_flags = _document_zigzag_route(4, (8, 16, 24, 8, 40, 16))
    messages = _random_messages(sends, affine_flags, torch.Generator().manual_seed(seed))
    want = _sequential(messages, sends)  # before the count begins
    rows = []
    monkeypatch.setattr(affine_module, "_products",
                        lambda A, x, *rest: (rows.append(x.shape[0]), _PRODUCTS(A, x, *rest))[1])
    got = run_exchange(strategy, holders, sends, affine_flags, messages, monkeypatch)
    for g, w in zip(got, want):
        assert (g is None) == (w is None) and (w is None or torch.allclose(g, w, rtol=1e-12, atol=1e-12))
    return (holders, sends, affine_flags), rows


def test_allgather_folds_a_rank_s_chains_together(monkeypatch):
    """``allgather`` folds every chain a rank needs in steps, each one ``M x + S`` over all chains still going: a
    rank's products follow its longest chain, not the sum of its chains (a per-document rank holds a position per
    document piece), with every value as the sequential fold's."""
    (holders, sends, affine_flags), products = _documents_products("allgather", 5, monkeypatch)
    lengths = dict(enumerate(exchanges.chain_depths(sends, affine_flags)))  # the messages each value folds
    per_position = sum(max(n - 1, 0) for n in lengths.values())
    longest = sum(max(max(lengths[i] for i in range(len(holders)) if holders[i] == r) - 1, 0)
                  for r in set(holders))
    assert len(products) == longest < per_position, (products, longest, per_position)
    assert max(products) > 1  # several chains in one product


def test_scan_composes_a_rank_s_round_in_one_product_per_kind(monkeypatch):
    """``scan`` composes what a rank's positions send in a round, and what they receive in it, in one product per
    kind of pair (open after open, open after closed), the maps stacked along their rows: a per-document rank's
    launches follow the rounds, not its positions (every value as the sequential fold's); maps over
    ``STACK_MAX_BYTES`` a product a pair."""
    (holders, sends, affine_flags), rows = _documents_products("scan", 7, monkeypatch)
    n = max(sends)
    pairs = sum(rows) // n  # the compositions formed, one per pair of maps
    rounds = len(exchanges.scan.scan_schedule(sends, affine_flags).rounds)
    assert len(rows) <= len(set(holders)) * rounds * 4 and len(rows) < pairs, (len(rows), rounds, pairs)
    assert max(rows) > n  # several pairs in one product
    # maps too large to stack (STACK_MAX_BYTES): a product a pair, the same values
    monkeypatch.setattr(exchanges.scan, "STACK_MAX_BYTES", 0)
    _, rows = _documents_products("scan", 7, monkeypatch)
    assert len(rows) == pairs and max(rows) == n
