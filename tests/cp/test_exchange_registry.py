"""The exchange registry: an exchange added in a test as one module and one registry line
(:mod:`tests.cp.hub_exchange`: every summary to rank 0, folded there, each rank's incoming values sent
back) runs ``chunk_kda`` and ``chunk_gated_delta_rule`` under context parallelism on gloo ranks against the
float64 reference, and its cost-model program runs in the cost model beside kdacp's own."""
from __future__ import annotations

import pytest

from kdacp.bench.scaling_model import chain_route
from kdacp.cp import STRATEGIES, cost_model
from kdacp.cp.exchanges import AUTO_PRIORITY, EXCHANGES, auto_candidates, make_exchange, register_exchange
from kdacp.cp.plan import resolve_strategy, strategy_choices
from tests.cp import hub_exchange
from tests.multiprocess import run_ranks


def test_the_new_exchange_is_one_registry_line():
    assert EXCHANGES["hub"] is hub_exchange.HubExchange
    assert isinstance(make_exchange("hub"), hub_exchange.HubExchange)
    assert STRATEGIES == ("p2p", "allgather", "scan")  # kdacp's own; the plan takes any registered name
    assert "hub" in strategy_choices() and resolve_strategy("hub", ()) == ("hub", "given")
    assert auto_candidates() == ("p2p", "scan", "allgather")  # registered without a priority: not auto's
    with pytest.raises(ValueError, match="already registered"):
        register_exchange("hub")(hub_exchange.HubExchange)


def test_the_cost_model_runs_every_registered_exchanges_program(monkeypatch):
    P = 6
    emits, affine = chain_route(P)
    times = cost_model.exchange_stage_times(1, 32, 128, 128)
    zero = [cost_model.RoleStages()] * P
    paths = {s: max(cost_model.simulate(cost_model.programs(s, emits, affine, zero, times), cost_model.DEFAULT_LINK))
             for s in EXCHANGES}
    assert set(paths) >= {"p2p", "allgather", "scan", "hub"} and all(t > 0 for t in paths.values())
    # given a place among auto's candidates, the cost model compares it too
    monkeypatch.setitem(AUTO_PRIORITY, "hub", 3)
    route = (emits, affine)
    chosen, reason = cost_model.choose_strategy(route, route, times)
    assert chosen == "hub" and "p2p" in reason, reason  # two latencies against p2p's five hops


def _run(rank: int, world_size: int) -> None:
    from tests.cp.test_cp_chunk_kda import _cases, _check_case
    from tests.cp.test_cp_gdn import _check
    for i, case in enumerate(_cases(world_size)):
        _check_case(rank, world_size, case, "hub", seed=700 + i)
    _check(rank, world_size, ("hub",))


# P = 3 holds a through rank (every kind of message); P = 2 with -m slow
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_cp_on_a_registered_exchange_matches_reference(world_size):
    run_ranks(_run, world_size, timeout_s=300)


def test_the_command_lines_lists_name_kdacps_own_registrations():
    """The torch-free lists the parser offers (:mod:`kdacp.choices`) are the exchanges and backends kdacp itself
    registers (a test module may register more)."""
    import kdacp.backends.registry as backend_registry
    from kdacp.choices import BACKENDS, STRATEGIES
    from kdacp.cp.exchanges import EXCHANGES
    assert set(STRATEGIES) <= set(EXCHANGES)
    assert {"p2p", "allgather", "scan"} == set(STRATEGIES)
    assert set(BACKENDS) - {"auto"} <= set(backend_registry.BACKEND_SPECS)
