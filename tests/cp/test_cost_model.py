"""The exchange's cost model on cases worked out by hand (fixed stage times and link figures give a
known critical path), and ``strategy="auto"``: the model's pick for a few plans, and on real gloo ranks
the same results as the strategy it picked."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kdacp.cp import build_cp_plan
from kdacp.ops.kda import chunk_kda
from kdacp.cp.cost_model import (Link, RoleStages, StageTimes, choose_strategy,
                                 exchange_stage_times, programs, simulate)
from kdacp.cp.plan import AUTO_STATE_SHAPE, STRATEGIES, rank_layouts, resolve_strategy
from kdacp.bench.scaling_model import chain_route
from tests.multiprocess import run_ranks

# ---------------------------------------------------------------------------------------------
# hand-computed critical paths, P = 4, one sequence: stage times in seconds, free bytes

FIRST, THROUGH, LAST = RoleStages(1, 2, 0), RoleStages(3, 0, 2), RoleStages(0.5, 0, 4)
TIMES = StageTimes(forward={"first": FIRST, "through": THROUGH, "last": LAST},
                   backward={"first": RoleStages(), "through": RoleStages(), "last": RoleStages()},
                   one_device=(4.0, 1.0), apply_s=0.25, compose_s=0.75, fla_summary=(1.0, 0.0),
                   fla_one_device=(5.0, 0.0), fla_fold_s=0.1)
LINK = Link(latency_s=0.5, bandwidth=1e30, gather_latency_s=0.2, gather_bandwidth=1e30)


def _forward(strategy: str, P: int = 4, times=TIMES, link=LINK, idle: bool = False) -> list[float]:
    emits, affine = chain_route(P)
    stages = [RoleStages()] * P if idle else [FIRST] + [THROUGH] * (P - 2) + [LAST]
    return simulate(programs(strategy, emits, affine, stages, times), link)


def test_p2p_by_hand():
    # rank 0 sends at 1 (arrives 1.5); rank 1 ready at 3, applies (3.25), sends (arrives 3.75), finishes
    # 5.25; rank 2 waits until 3.75, applies (4.0), sends (4.5), finishes 6.0; rank 3 waits until 4.5: 8.5
    assert _forward("p2p") == pytest.approx([3.0, 5.25, 6.0, 8.5])


def test_allgather_by_hand():
    # ranks join at 1, 3, 3, 0.5: the gather ends at 3 + 3 * 0.2 = 3.6; rank i folds i - 1 applies
    assert _forward("allgather") == pytest.approx([3.6, 5.6, 5.85, 8.1])


def test_scan_by_hand():
    # round 0: 0->1 (closed, sent at 1), 1->2 and 2->3 (open, sent at 3); round 1: 0->2 (closed, at 1),
    # 1->3 (closed: rank 1 applies what came from 0 to its own map, sends at 3.25, arrives 3.75).
    # rank 2: 3.5 (from 1), then applies 0's closed state: 3.75, + 2; rank 3: 3.5, then 3.75 + 0.25 + 4
    assert _forward("scan") == pytest.approx([3.0, 5.25, 5.75, 8.0])


def test_link_bytes_and_ring():
    link = Link(latency_s=1e-5, bandwidth=1e9, gather_latency_s=2e-5, gather_bandwidth=2e9)
    assert link.p2p(10**6) == pytest.approx(1e-5 + 1e-3)
    assert link.all_gather(5, 10**6) == pytest.approx(4 * (2e-5 + 5e-4))
    assert link.all_gather(1, 10**6) == 0


def test_message_sizes_reach_the_link():
    times = StageTimes(state_bytes=100, summary_bytes=300)
    link = Link(latency_s=0.0, bandwidth=100.0, gather_latency_s=0.0, gather_bandwidth=100.0)
    # P = 3, no local work: p2p two state hops (1 s each); allgather: 2 ring steps of a summary (3 s each)
    assert max(_forward("p2p", 3, times, link, idle=True)) == pytest.approx(2.0)
    assert max(_forward("allgather", 3, times, link, idle=True)) == pytest.approx(6.0)
    # scan: rank 2 gets rank 1's open map (3 s) and rank 0's state (1 s) in parallel
    assert max(_forward("scan", 3, times, link, idle=True)) == pytest.approx(3.0)


def test_deadlock_and_a_bad_link():
    with pytest.raises(RuntimeError, match="wait for messages nobody sends"):
        simulate([[("recv", 1)], []], Link())
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth=0)


# ---------------------------------------------------------------------------------------------
# strategy="auto"


def _chain_layouts(P: int):
    return rank_layouts(None, 1, (64,) * P)


def test_auto_without_a_through_rank_is_p2p():
    assert resolve_strategy("auto", _chain_layouts(2))[0] == "p2p"
    # packed: no sequence covers a whole rank (4 ranks of 32 tokens)
    strategy, reason = resolve_strategy("auto", rank_layouts((0, 40, 80, 128), 1, (32,) * 4))
    assert strategy == "p2p" and "no rank inside a chain" in reason


def test_auto_at_64_ranks_is_scan():
    # default link: p2p pays 62 hops of >= 20 us each way, scan 6 rounds
    strategy, reason = resolve_strategy("auto", _chain_layouts(64))
    assert strategy == "scan" and reason.startswith("auto: 62 of 64 ranks inside a chain")


def test_auto_with_a_free_all_gather_is_allgather():
    link = Link(latency_s=1.0, bandwidth=1e30, gather_latency_s=0.0, gather_bandwidth=1e30)
    assert resolve_strategy("auto", _chain_layouts(8), link=link)[0] == "allgather"


@pytest.mark.parametrize("P", [3, 4, 8, 16, 33])
def test_auto_is_the_models_fastest(P):
    times = exchange_stage_times(1, *AUTO_STATE_SHAPE)
    emits, affine = chain_route(P)
    costs = {s: sum(max(simulate(programs(s, emits, affine, [RoleStages()] * P, times), Link()))
                    for _ in range(2)) for s in STRATEGIES}
    strategy, reason = resolve_strategy("auto", _chain_layouts(P))
    assert costs[strategy] == min(costs.values())
    assert reason == "auto: " + choose_strategy((emits, affine), (emits, affine), times)[1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_holders_of_one_position_each_give_the_same_programs(strategy):
    emits, affine = chain_route(5)
    stages = [RoleStages(0.1 * i, 0.2, 0.3 * i) for i in range(5)]
    assert programs(strategy, emits, affine, stages, TIMES, holders=range(5)) == \
        programs(strategy, emits, affine, stages, TIMES)


def test_ranks_of_several_positions_by_hand():
    # positions 0, 1 on rank 0 and 2 on rank 1, one chain: 0 hands its state to 1 in memory, 1 applies and
    # sends. Rank 0: ready 1 + 3, between 2 + 0 (6), apply (6.25), send (arrives 6.75), after 0 + 2: 8.25;
    # rank 1: ready 0.5, waits until 6.75, after 4: 10.75
    emits, affine = chain_route(3)
    progs = programs("p2p", emits, affine, [FIRST, THROUGH, LAST], TIMES, holders=(0, 0, 1))
    assert [op for op in progs[0] if op[0] in ("send", "recv")] == [("send", 1, 0)]
    assert simulate(progs, LINK) == pytest.approx([8.25, 10.75])
    # allgather: one gather of two slots a rank; scan: no message between a rank's own positions
    for strategy in ("allgather", "scan"):
        assert len(simulate(programs(strategy, emits, affine, [FIRST, THROUGH, LAST], TIMES, holders=(0, 0, 1)),
                            LINK)) == 2


def test_auto_under_zigzag_counts_positions():
    from kdacp.cp.layout import zigzag_layout
    from kdacp.cp.plan import layout_rank_layouts
    strategy, reason = resolve_strategy("auto", layout_rank_layouts(None, 1, zigzag_layout(64 * 8, 8)))
    assert strategy in STRATEGIES and "13 of 15 positions (the ranges of 8 ranks) inside a chain" in reason
    # the zigzag chain is twice as long: at 32 ranks the default link favours scan over p2p
    assert resolve_strategy("auto", layout_rank_layouts(None, 1, zigzag_layout(64 * 32, 32)))[0] == "scan"


def test_auto_bad_arguments():
    with pytest.raises(ValueError, match="strategy must be one of"):
        resolve_strategy("fastest", _chain_layouts(3))
    with pytest.raises(ValueError, match="state_shape must be"):
        resolve_strategy("auto", _chain_layouts(3), state_shape=(32, 128))


def _auto_ranks(rank: int, world_size: int) -> None:
    from tests.helpers import make_kda_inputs
    cases = [(None, "scan"), ((0, 20, 40, 64, 96), "p2p")]  # one sequence over 3 ranks; packed, no through rank
    for cu, expected in cases:
        T = 96
        args = make_kda_inputs(1, T, 1, 2, 16, 16, gate="safe", requires_grad=False, seed=7)
        lo, hi = rank * T // world_size, (rank + 1) * T // world_size
        options = {n: x for n, x in args.items() if not isinstance(x, torch.Tensor)}
        local = {n: (x[:, lo:hi] if x.dim() > 1 else x).clone().requires_grad_() for n, x in args.items()
                 if isinstance(x, torch.Tensor)}
        do = torch.randn(1, hi - lo, 2, 16, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        auto = build_cp_plan(cu, batch_size=None if cu else 1, strategy="auto")
        assert auto.strategy == expected and auto.strategy_reason.startswith("auto: "), repr(auto)
        assert "strategy_reason='auto: " in repr(auto)
        given = build_cp_plan(cu, batch_size=None if cu else 1, strategy=auto.strategy)
        results = []
        for plan in (auto, given):
            o, _ = chunk_kda(**local, **options, safe_gate=True, backend="torch", cp=plan)
            results.append([o, *torch.autograd.grad(o, list(local.values()), do)])
        for a, b in zip(*results):
            assert torch.equal(a, b)
        dist.barrier()


def test_auto_matches_the_chosen_strategy_on_gloo():
    run_ranks(_auto_ranks, 3)


@pytest.mark.parametrize("P, docs", ((3, 4), (8, 10)))
def test_p2p_model_advances_side_by_side_chains_together(P, docs):
    """The model's ``p2p`` handles a rank's positions as the exchange does: under ``document_zigzag`` with free
    compute and a link of unit latency, the exchange takes one document's chain (``2P - 2`` hops), not one
    chain after another (122 hops at P = 8 over 10 documents in flow order)."""
    from kdacp.cp.layout import document_zigzag_layout
    from kdacp.cp.plan import chain_links, layout_rank_layouts
    cu = [0]
    for d in range(docs):
        cu.append(cu[-1] + 2 * P * (d % 3 + 1))
    links = chain_links(layout_rank_layouts(tuple(cu), 1, document_zigzag_layout(cu, P)))
    holders = tuple(link.rank for link in links)
    emits, affine = tuple(link.num_send for link in links), tuple(link.through for link in links)
    times = StageTimes(forward={}, backward={}, apply_s=0.0)
    link = Link(latency_s=1.0, bandwidth=1e30, gather_latency_s=1.0, gather_bandwidth=1e30)
    finish = simulate(programs("p2p", emits, affine, [RoleStages()] * len(holders), times, holders=holders), link)
    assert max(finish) == 2 * P - 2
