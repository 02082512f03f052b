"""A rank's head cut into pieces on the GPU (the ``fla`` backend, Kimi Linear's gate, bf16, 8K tokens
a rank, 32 heads of 128): the through and last roles of a 3-rank chain run in this process against an
exchange that hands them a given incoming state, with the head cut (the device's choice, 4 pieces
here) and uncut (``head_pieces=1``). Both are held to the float64 reference of the rank's own tokens
from the same incoming state (outputs, the through rank's outgoing state, every input gradient): the cut
run may be at most 10% further from it than the uncut one. Decays near 0 keep the whole history, so
every piece's start state matters."""
from __future__ import annotations

import pytest
import torch

from kdacp import reference
from kdacp.backends.call import prepare_call
from kdacp.bench.calibration import OPTIONS, make_inputs
from kdacp.distributed.orchestration import _head_pieces, cp_backward, cp_forward
from kdacp.distributed.plan import CPPlan, rank_layouts
from kdacp.distributed.strategies import Pending
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

T, H, D = 8192, 32, 128
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


class GivenExchange:
    """Moves nothing: hands ``state`` to a rank that receives and keeps what the rank sends."""

    def __init__(self, state: torch.Tensor):
        self.state, self.sent = state, None

    def begin(self, route) -> Pending:
        return Pending(route)

    def send(self, pending: Pending, message) -> None:
        pending.message, self.sent = message, message

    def receive(self, pending: Pending):
        return None if pending.route.predecessor is None else self.state


def _inputs() -> dict:
    x = make_inputs(T, H, H, D, D, torch.bfloat16, "cuda", seed=5)
    x["g"] = (x["g"].float() - 8.0).to(torch.bfloat16)  # decays near 0: a long memory
    return x


def _run(x: dict, rank: int, pieces: int | None, incoming: torch.Tensor, do: torch.Tensor):
    """``(o, outgoing state or None, {name: gradient})`` of one role, the head cut into ``pieces``."""
    leaves = {n: t.detach().clone().requires_grad_(n in TOKEN_INPUTS) for n, t in x.items()}
    call = prepare_call("fla", **leaves, scale=None, **OPTIONS)
    lengths = (T,) * 3
    plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=lengths, rank_layouts=rank_layouts(None, 1, lengths), head_pieces=pieces)
    exchange = GivenExchange(incoming)
    fwd = cp_forward(call.backend, plan, call.inputs, None, False, torch.float32, exchange=exchange)
    state = exchange.sent.apply(incoming) if exchange.sent is not None else None
    grads = cp_backward(call.backend, plan, fwd.saved, fwd.local_initial, fwd.transition, fwd.head_states, do,
                        None, False, False, exchange=GivenExchange(torch.zeros_like(incoming)))
    return fwd.o, state, {n: getattr(grads, "d" + n) for n in TOKEN_INPUTS}


def _reference(x: dict, incoming: torch.Tensor, do: torch.Tensor):
    leaves = {n: t.detach().double().requires_grad_(n in TOKEN_INPUTS) for n, t in x.items()}
    options = {k: v for k, v in OPTIONS.items() if k != "safe_gate"}
    o, final = reference.chunk_kda(*(leaves[n] for n in TOKEN_INPUTS), A_log=leaves["A_log"],
                                   dt_bias=leaves["dt_bias"], initial_state=incoming.double(),
                                   output_final_state=True, **options)
    grads = torch.autograd.grad((o * do.double()).sum(), [leaves[n] for n in TOKEN_INPUTS])
    return o.detach(), final.detach(), dict(zip(TOKEN_INPUTS, grads))


@pytest.mark.parametrize("rank", [1, 2], ids=["through", "last"])
def test_cut_head_as_close_to_float64_as_the_uncut_one(rank):
    x = _inputs()
    gen = torch.Generator("cuda").manual_seed(rank)
    incoming = 0.5 * torch.randn(1, H, D, D, generator=gen, device="cuda")
    do = torch.randn(1, T, H, D, generator=gen, device="cuda").to(torch.bfloat16)
    head = rank_layouts(None, 1, (T,) * 3)[rank].head
    plan = CPPlan(rank=rank, world_size=3, group=None, strategy="p2p", batch_size=1, cu_seqlens=None,
                  local_lengths=(T,) * 3)
    cut = _head_pieces(plan, head, H, D, 64, torch.device("cuda"))
    assert cut is not None and cut.num_segments == 4, cut  # the device's choice on an H200's 132 SMs
    want_o, want_state, want_grads = _reference(x, incoming, do)
    uncut, pieces = _run(x, rank, 1, incoming, do), _run(x, rank, None, incoming, do)
    checks = [("o", want_o, uncut[0], pieces[0])]
    if rank == 1:  # the through rank's outgoing state M S_in + S_ext
        checks.append(("state", want_state, uncut[1], pieces[1]))
    for what, want, got_uncut, got_cut in [*checks, *[("d" + n, want_grads[n], uncut[2][n], pieces[2][n])
                                             for n in TOKEN_INPUTS]]:
        e_uncut, e_cut = rel_err(got_uncut, want), rel_err(got_cut, want)
        assert e_cut <= 1.1 * e_uncut + 1e-6, f"{what}: cut {e_cut:.3e}, uncut {e_uncut:.3e}"
        assert e_uncut < 2e-2, f"{what}: uncut {e_uncut:.3e}"
