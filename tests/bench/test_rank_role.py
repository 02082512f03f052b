"""One rank's role run alone (:class:`~kdacp.bench.rank_role.RankRole` with a
:class:`~kdacp.bench.rank_role.StandInExchange`): given the state (forward) or state gradient (backward) that would
arrive, its outputs, gradients and the message it sends are those of the float64 reference on its tokens."""
from __future__ import annotations

import pytest
import torch

from kdacp import reference
from kdacp.bench.rank_role import RankRole, StandInExchange
from kdacp.cp.plan import CPPlan, rank_layouts
from tests.helpers import make_kda_inputs

LENGTHS = (40, 40, 40)  # one sequence over three ranks
OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def _plan(rank: int) -> CPPlan:
    return CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=LENGTHS, rank_layouts=rank_layouts(None, 1, LENGTHS))


def _rank_inputs(rank: int) -> dict:
    # a gate that keeps a state for a whole rank, so that what arrives weighs on every output
    x = make_kda_inputs(1, sum(LENGTHS), 2, 2, 16, 16, gate="default", gate_shift=-4.0, requires_grad=False, seed=3)
    mine = slice(sum(LENGTHS[:rank]), sum(LENGTHS[:rank + 1]))
    return {n: (x[n] if x[n].dim() == 1 else x[n][:, mine]).contiguous() for n in NAMES}


def _reference(x: dict, initial_state, do, dfinal):
    """Outputs, final state and the gradients (inputs, initial state) of the reference on ``x`` from ``initial_state``."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    h0 = None if initial_state is None else initial_state.detach().clone().requires_grad_()
    o, final = reference.chunk_kda(**leaves, initial_state=h0, output_final_state=True, **OPTIONS)
    ((o * do).sum() + (final * dfinal).sum()).backward()
    return o.detach(), final.detach(), {n: t.grad for n, t in leaves.items()}, None if h0 is None else h0.grad


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_role_given_what_arrives_is_the_reference_on_its_tokens(rank):
    x = _rank_inputs(rank)
    gen = torch.Generator().manual_seed(rank)
    arriving = torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64)  # the state from rank - 1
    arriving_grad = torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64)  # the gradient from rank + 1
    do = torch.randn(1, LENGTHS[rank], 2, 16, generator=gen, dtype=torch.float64)
    initial = None if rank == 0 else arriving
    dfinal = torch.zeros_like(arriving) if rank == 2 else arriving_grad
    o_ref, final_ref, grads_ref, dinitial_ref = _reference(x, initial, do, dfinal)

    role = RankRole.prepare(_plan(rank), **x, backend="torch", **OPTIONS)
    forward = StandInExchange(incoming=arriving)
    out = role.forward(forward)
    torch.testing.assert_close(out.o, o_ref)
    (sent,) = forward.sent.values()
    if rank < 2:  # the state it passes on: its final state, from what arrived (a through rank: M x + S)
        assert sent.constant == (rank == 0)
        torch.testing.assert_close(sent.apply(arriving), final_ref)
    else:
        assert sent is None

    backward = StandInExchange(incoming=arriving_grad)
    grads = role.backward(out, do, exchange=backward)
    for n in NAMES:
        torch.testing.assert_close(getattr(grads, f"d{n}"), grads_ref[n], msg=lambda m, n=n: f"d{n}: {m}")
    (sent,) = backward.sent.values()
    if rank > 0:  # the gradient it passes back: its incoming state's, from the gradient that arrived
        torch.testing.assert_close(sent.apply(arriving_grad), dinitial_ref)
    else:
        assert sent is None


def test_prepare_checks_the_rank_s_tokens_against_the_plan():
    x = _rank_inputs(1)
    x = {n: t if t.dim() == 1 else t[:, :30] for n, t in x.items()}
    with pytest.raises(ValueError, match=r"rank 1 holds 40 tokens .* T_local=30"):
        RankRole.prepare(_plan(1), **x, backend="torch", **OPTIONS)


def test_a_stand_in_refuses_an_incoming_state_of_another_shape():
    role = RankRole.prepare(_plan(1), **_rank_inputs(1), backend="torch", **OPTIONS)
    with pytest.raises(ValueError, match=r"incoming must have the route's message shape .* \(1, 2, 16, 16\)"):
        role.forward(StandInExchange(incoming=torch.zeros(1, 2, 16, 8, dtype=torch.float64)))
