"""``kdacp.bench.scaling_model``: FLA's scheme, whole-step predictions and ranks sharing cores, on the
hand-computed cases of ``tests/distributed/test_cost_model.py``."""
import random

import pytest

from kdacp.bench.scaling_model import fla_programs, predict, simulate, simulate_shared
from kdacp.distributed.cost_model import Link, RoleStages, StageTimes, chain_route, programs
from kdacp.distributed.cost_model import simulate as simulate_dedicated
from kdacp.distributed.plan import STRATEGIES
from tests.distributed.test_cost_model import LINK, TIMES


def test_fla_by_hand():
    # summaries end at 1 on ranks 0-2 (none on the last), gather ends at 1.6, rank i folds i x 0.1, then 5
    finish = simulate(fla_programs(4, "forward", TIMES), LINK)
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
    assert simulate([[("compute", 1.0)], [("compute", 3.0)]], link, cores=1) == pytest.approx([2.0, 4.0])
    assert simulate([[("compute", 1.0)], [("compute", 3.0)]], link, cores=None) == pytest.approx([1.0, 3.0])
    # a rank waiting for a message leaves its core to the others
    progs = [[("compute", 2.0), ("send", 1, 0)], [("recv", 0), ("compute", 1.0)], [("compute", 2.0)]]
    fast = Link(latency_s=0.0, bandwidth=1e30)
    assert simulate(progs, fast, cores=1) == pytest.approx([4.0, 5.0, 4.0])


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
