"""``kdacp.bench.scaling_model``: FLA's scheme, whole-step predictions and ranks sharing cores, on the
hand-computed cases of ``tests/cp/test_cost_model.py``."""
import random

import pytest

from kdacp.bench.scaling_model import (chain_route, fla_programs, predict, predict_step, route_path, route_step_path,
                                       simulate_on_cores, simulate_shared, step_programs)
from kdacp.cp.cost_model import Link, RoleStages, StageTimes, programs
from kdacp.cp.cost_model import simulate as simulate_dedicated
from kdacp.cp.plan import STRATEGIES
from tests.cp.test_cost_model import LINK, TIMES


def test_fla_by_hand():
    # summaries end at 1 on ranks 0-2 (none on the last), gather ends at 1.6, rank i folds i x 0.1, then 5
    finish = simulate_on_cores(fla_programs(4, "forward", TIMES), LINK)
    assert finish == pytest.approx([6.6, 6.7, 6.8, 6.9])


def test_predict_adds_directions_and_divides_by_one_device():
    p = predict("scan", 4, TIMES, LINK)
    # backward, no local work: rank 1's round-1 payload leaves after its round-0 message (0.5) and an
    # apply (0.25), arrives at 1.25, and the last position applies it: 1.5
    assert (p.forward_s, p.backward_s) == pytest.approx((8.0, 1.5))
    assert p.ratio == pytest.approx((8.0 + 1.5) / 5.0)
    assert predict("fla", 4, TIMES, LINK).one_device_s == pytest.approx(5.0)


def test_shared_cores_serialise_compute():
    link = Link()
    assert simulate_on_cores([[("compute", 1.0)], [("compute", 3.0)]], link, cores=1) == pytest.approx([2.0, 4.0])
    assert simulate_on_cores([[("compute", 1.0)], [("compute", 3.0)]], link, cores=None) == pytest.approx([1.0, 3.0])
    # a rank waiting for a message leaves its core to the others
    progs = [[("compute", 2.0), ("send", 1, 0)], [("recv", 0), ("compute", 1.0)], [("compute", 2.0)]]
    fast = Link(latency_s=0.0, bandwidth=1e30)
    assert simulate_on_cores(progs, fast, cores=1) == pytest.approx([4.0, 5.0, 4.0])


@pytest.mark.parametrize("P", [2, 3, 5, 7, 8, 13])
def test_simulators_agree_with_a_core_each(P):
    rng = random.Random(P)
    times = StageTimes(apply_s=0.3, compose_s=0.7, copy_s_per_byte=1e-3, state_bytes=10, summary_bytes=30)
    link = Link(latency_s=0.2, bandwidth=50.0, gather_latency_s=0.1, gather_bandwidth=80.0)
    for strategy in STRATEGIES:
        emits, affine = chain_route(P)
        stages = [RoleStages(rng.random(), rng.random(), rng.random()) for _ in range(P)]
        progs = programs(strategy, emits, affine, stages, times)
        assert simulate_shared(progs, link, cores=P) == pytest.approx(simulate_dedicated(progs, link)), strategy


def test_bad_arguments():
    with pytest.raises(ValueError, match="P must be an int >= 2"):
        predict("p2p", 1, TIMES)
    with pytest.raises(ValueError, match="strategy must be one of"):
        predict("ring", 4, TIMES)


def test_route_path_of_a_packed_layout_by_hand():
    # a packed batch's route: position 0 sends its tail's state (no rank inside a chain), position 1 receives
    # it, position 2 neither; p2p: position 1 finishes at max(ready + between = 3, 1 + link 0.5) + after 2 = 5
    stages = [RoleStages(1.0, 3.0, 0.5), RoleStages(1.0, 2.0, 2.0), RoleStages(4.5, 0.0, 0.0)]
    assert route_path("p2p", (1, 0, 0), (False, False, False), stages, TIMES, LINK) == pytest.approx(5.0)
    # the receiver's own work ends (0.5) before the message arrives (1 + 0.5): it waits, then its after
    late = [RoleStages(1.0, 0.0, 0.0), RoleStages(0.25, 0.25, 1.0), RoleStages()]
    assert route_path("p2p", (1, 0, 0), (False,) * 3, late, TIMES, LINK) == pytest.approx(1.5 + 1.0)


def test_predict_is_route_path_on_the_chain():
    emits, affine = chain_route(4)
    stages = [TIMES.forward["first"], TIMES.forward["through"], TIMES.forward["through"], TIMES.forward["last"]]
    for strategy in STRATEGIES:
        if strategy != "auto":
            assert predict(strategy, 4, TIMES, LINK).forward_s == route_path(strategy, emits, affine, stages, TIMES, LINK)


# ---------------------------------------------------------------------------------------------
# the training step of several layers (predict_step): ranks go on to their next layer


def test_step_by_hand_ranks_fall_into_a_wavefront():
    # P = 2, p2p, no backward work. Rank 0's layers take 3 each (send at 1, 4, 7; done 9). Rank 1: layer 0 waits
    # for the state (1 + link 0.5) and ends at 5.5; layer 1's ready ends 6.0 after the state came (4.5): 10.0;
    # layer 2: 14.5. The loss meets at 14.5; the backward's messages arrive 0.5 later: 15.0. Layer by layer
    # the forward would be 5.5 each and the backward 0.5 each: 18.
    step = predict_step("p2p", 2, TIMES, layers=3, link=LINK)
    assert step.step_s == pytest.approx(15.0) and step.one_device_s == pytest.approx(15.0)
    assert 3 * predict("p2p", 2, TIMES, LINK).step_s == pytest.approx(18.0)


def _random_times(seed: int) -> StageTimes:
    rng = random.Random(seed)

    def role():
        return RoleStages(rng.random(), rng.random(), rng.random())
    return StageTimes(forward={r: role() for r in ("first", "through", "last")},
                      backward={r: role() for r in ("first", "through", "last")}, one_device=(1.5, 2.5),
                      apply_s=0.1, compose_s=0.2, copy_s_per_byte=1e-3, state_bytes=10, summary_bytes=30,
                      fla_summary=(0.4, 0.5), fla_one_device=(1.6, 2.7), fla_fold_s=0.05)


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_one_layer_step_and_a_barrier_every_layer_compose_layer_by_layer(P):
    times, link = _random_times(P), Link(latency_s=0.2, bandwidth=50.0, gather_latency_s=0.1, gather_bandwidth=80.0)
    for strategy in ("p2p", "allgather", "scan", "fla"):
        one = predict(strategy, P, times, link)
        assert predict_step(strategy, P, times, 1, link=link).step_s == pytest.approx(one.step_s), strategy
        # every rank meeting after each layer leaves nothing to overlap: layers times one layer
        assert predict_step(strategy, P, times, 4, 1, link).step_s == pytest.approx(4 * one.step_s), strategy
        free = predict_step(strategy, P, times, 4, 0, link).step_s
        assert free <= 4 * one.step_s + 1e-9, strategy
        hybrid = predict_step(strategy, P, times, 4, 2, link)
        assert free - 1e-9 <= hybrid.step_s <= 4 * one.step_s + 1e-9 and hybrid.one_device_s == pytest.approx(4 * one.one_device_s)


@pytest.mark.parametrize("P", [2, 5])
def test_step_simulators_agree_with_a_core_each(P):
    times, link = _random_times(10 + P), Link(latency_s=0.2, bandwidth=50.0, gather_latency_s=0.1, gather_bandwidth=80.0)
    for strategy in ("p2p", "allgather", "scan", "fla"):
        progs = step_programs(strategy, P, times, 3, 2)
        assert simulate_shared(progs, link, cores=P) == pytest.approx(simulate_dedicated(progs, link)), strategy


def test_step_bad_arguments():
    with pytest.raises(ValueError, match="layers must be an int >= 1"):
        predict_step("p2p", 2, TIMES, 0)
    with pytest.raises(ValueError, match="sync_every must be an int >= 0"):
        predict_step("p2p", 2, TIMES, 2, -1)
    with pytest.raises(ValueError, match="P must be an int >= 2"):
        predict_step("p2p", 1, TIMES, 2)


def test_route_step_path_is_predict_step_on_the_chain_and_route_path_for_one_layer():
    times, P = _random_times(3), 4
    emits, affine = chain_route(P)
    fwd = [times.forward["first"], times.forward["through"], times.forward["through"], times.forward["last"]]
    bwd = [times.backward["first"], times.backward["through"], times.backward["through"], times.backward["last"]][::-1]
    for strategy in STRATEGIES:
        if strategy == "auto":
            continue
        step = route_step_path(strategy, (emits, affine), (emits, affine), fwd, bwd, times, 5, 2, LINK)
        assert step == pytest.approx(predict_step(strategy, P, times, 5, 2, LINK).step_s), strategy
    # a packed layout (position 0 sends its tail's state to 1; 2 neither): one layer is route_path's two directions
    route, back = ((1, 0, 0), (False,) * 3), ((0, 1, 0), (False,) * 3)
    f3, b3 = fwd[:1] + fwd[2:], bwd[:1] + bwd[2:]
    one = route_path("p2p", *route, f3, times, LINK) + route_path("p2p", *back, b3, times, LINK)
    assert route_step_path("p2p", route, back, f3, b3, times, 1, 0, LINK) == pytest.approx(one)
    assert route_step_path("p2p", route, back, f3, b3, times, 6, 0, LINK) <= 6 * one + 1e-9


def test_zigzag_chain_and_its_p2p_path_by_hand():
    from kdacp.bench.scaling_model import zigzag_chain
    assert zigzag_chain(3) == ((0, 1, 2, 1, 0), (0.5, 0.5, 1.0, 0.5, 0.5))
    # P = 2: rank 0 holds positions 0 (first) and 2 (last), each half its tokens; rank 1 position 1 (through).
    # Rank 0: ready 0.5 + 0.25, sends position 0's state (arrives 1.25), between 1.0 (1.75), waits for rank 1's
    # message, after 0 + 2. Rank 1: ready 3, receives (3), applies (3.25), sends (arrives 3.75), after 2: 5.25.
    p = predict("p2p", 2, TIMES, LINK, layout="zigzag")
    assert p.forward_s == pytest.approx(5.75)
    # no local work, a second a message: the zigzag chain is 2P - 2 hops against P - 1
    hop = Link(latency_s=1.0, bandwidth=1e30, gather_latency_s=1.0, gather_bandwidth=1e30)
    for P in (2, 3, 8):
        assert predict("p2p", P, StageTimes(), hop, layout="zigzag").forward_s == pytest.approx(2 * P - 2)
        assert predict("p2p", P, StageTimes(), hop).forward_s == pytest.approx(P - 1)
    for strategy in STRATEGIES:
        step = predict_step(strategy, 8, TIMES, 4, 2, LINK, layout="zigzag")
        assert step.step_s >= predict_step(strategy, 8, TIMES, 4, 2, Link(0, 1e30, 0, 1e30), layout="zigzag").step_s
    with pytest.raises(ValueError, match="layout must be one of"):
        predict("p2p", 4, TIMES, layout="spiral")
    with pytest.raises(ValueError, match="strategy='fla'"):
        predict_step("fla", 4, TIMES, 2, layout="zigzag")


def _random_roles(seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    return tuple({role: RoleStages(rng.random(), rng.random(), rng.random()) for role in ("first", "through", "last")}
                 for _ in range(2))


def _sum(*parts: tuple[float, RoleStages]) -> RoleStages:
    return RoleStages(*(sum(f * getattr(s, n) for f, s in parts) for n in ("ready", "between", "after")))


@pytest.mark.parametrize("P", [2, 3, 8])
def test_layout_step_path_with_each_rank_doing_its_roles_work_is_the_layout_model(P):
    """Ranks given their role's stages reproduce :func:`predict_step`: contiguous (a rank a role), and zigzag
    where each rank does its positions' shares of the contiguous roles (rank 0 half of first and half of last,
    the others through), for every strategy and with attention barriers."""
    from kdacp.bench.scaling_model import layout_step_path
    from kdacp.cp.layout import contiguous_layout, zigzag_layout
    from kdacp.cp.plan import layout_rank_layouts

    forward, backward = _random_roles(P)
    times = StageTimes(forward=forward, backward=backward, apply_s=0.03, compose_s=0.05, copy_s_per_byte=1e-4,
                       state_bytes=10, summary_bytes=30)
    link = Link(latency_s=0.02, bandwidth=50.0, gather_latency_s=0.01, gather_bandwidth=80.0)

    def role(r):
        return "first" if r == 0 else "last" if r == P - 1 else "through"
    contiguous = [(forward[role(r)], backward[role(r)]) for r in range(P)]
    zigzag = [tuple(_sum((0.5, d["first"]), (0.5, d["last"])) if r == 0 else d["through"] for d in (forward, backward))
              for r in range(P)]
    for layout, stages, name in ((contiguous_layout(8 * P, P), contiguous, "contiguous"),
                                 (zigzag_layout(8 * P, P), zigzag, "zigzag")):
        layouts = layout_rank_layouts(None, 1, layout)
        for strategy in STRATEGIES:
            for sync_every in (0, 2):
                got = layout_step_path(strategy, layouts, stages, times, 5, sync_every, link)
                want = predict_step(strategy, P, times, 5, sync_every, link, layout=name).step_s
                assert got == pytest.approx(want, rel=1e-12), (name, strategy, sync_every)


def test_layout_step_path_bad_arguments():
    from kdacp.bench.scaling_model import layout_step_path
    from kdacp.cp.layout import zigzag_layout
    from kdacp.cp.plan import layout_rank_layouts

    layouts = layout_rank_layouts(None, 1, zigzag_layout(16, 2))
    stages = [(RoleStages(1.0), RoleStages(1.0))] * 2
    with pytest.raises(ValueError, match="strategy must be one of"):
        layout_step_path("fla", layouts, stages, TIMES, 2)
    with pytest.raises(ValueError, match="rank_stages must hold one"):
        layout_step_path("p2p", layouts, stages[:1], TIMES, 2)
    with pytest.raises(ValueError, match="layers must be"):
        layout_step_path("p2p", layouts, stages, TIMES, 0)
