"""The ``torch`` backend's stages compose like the distributed op uses them."""
import dataclasses

import pytest
import torch

from kdacp.backends import make_backend, resolve_backend
from kdacp.backends.base import BackwardStates, KDAInputs, KDAOptions, Span
from tests.helpers import make_kda_inputs, rel_err

T, CUT, HV, K, V = 150, 70, 2, 16, 16


def _setup(gate):
    args = make_kda_inputs(1, T, 1, HV, K, V, gate=gate, requires_grad=False, seed=5)
    options = KDAOptions(scale=K ** -0.5, use_qk_l2norm_in_kernel=gate != "plain",
                         use_gate_in_kernel=gate != "plain", lower_bound=args.get("lower_bound"))
    x = KDAInputs(*(args.get(n) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")))
    backend = make_backend("torch", options)
    return backend, backend.prepare(x, Span(0, T, (0, T)))


@pytest.mark.parametrize("gate", ["plain", "safe"])
def test_summary_then_state_pass_equals_whole(gate):
    backend, chunks = _setup(gate)
    h0 = torch.randn(1, HV, K, V, dtype=torch.float64)
    span, second = Span(0, T, (0, T)), Span(CUT, T, (0, T - CUT))
    whole = backend.state_pass(chunks, span, h0, True)
    # one sequence cut in two: the second part starts from the first part's summary applied to h0
    first = backend.state_summary(chunks, Span(0, CUT, (0, CUT)), with_transition=True)
    S_mid = first.transition @ h0 + first.offset
    assert rel_err(backend.state_pass(chunks, second, S_mid, True).final_state, whole.final_state) < 1e-10
    o_second = backend.output(chunks, second, S_mid, None)
    assert rel_err(o_second, backend.output(chunks, span, h0, whole)[:, CUT:]) < 1e-10
    assert backend.state_summary(chunks, Span(0, CUT, (0, CUT)), with_transition=False).transition is None


@pytest.mark.parametrize("gate", ["plain", "default"])
def test_gradient_summary_and_transition_give_the_input_gradient(gate):
    backend, chunks = _setup(gate)
    span = Span(0, T, (0, T))
    gen = torch.Generator().manual_seed(6)
    h0 = torch.randn(1, HV, K, V, dtype=torch.float64, generator=gen)
    do = torch.randn(1, T, HV, V, dtype=torch.float64, generator=gen)
    dht = torch.randn(1, HV, K, V, dtype=torch.float64, generator=gen)
    local = backend.backward_local(chunks, span, do, h0)
    G = backend.state_gradient_summary(local)
    dh0 = backend.backward_states(local, dht).dinitial_state
    M = backend.state_summary(chunks, span, with_transition=True).transition
    assert rel_err(M.transpose(-1, -2) @ dht + G, dh0) < 1e-10


@pytest.mark.parametrize("initial", [True, False])
def test_a_pass_over_the_first_segments_equals_the_pass_over_their_span(initial):
    """``backward_states(local, dht, segments=n)``: the pass of ``local``'s first ``n`` segments alone, as if
    ``local`` had been made over their span."""
    backend, chunks = _setup("safe")
    span, head = Span(0, T, (0, CUT, T)), Span(0, CUT, (0, CUT))
    gen = torch.Generator().manual_seed(8)
    h0 = torch.randn(2, HV, K, V, dtype=torch.float64, generator=gen) if initial else None
    do = torch.randn(1, T, HV, V, dtype=torch.float64, generator=gen)
    dht = torch.randn(2, HV, K, V, dtype=torch.float64, generator=gen)
    got = backend.backward_states(backend.backward_local(chunks, span, do, h0), dht[:1], segments=1)
    want = backend.backward_states(backend.backward_local(chunks, head, do[:, :CUT], h0 if h0 is None else h0[:1]),
                                   dht[:1])
    assert got.span == head
    for a, b in zip((got.dinitial_state, *vars(got.grads).values()), (want.dinitial_state, *vars(want.grads).values())):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    whole = backend.backward_states(backend.backward_local(chunks, span, do, h0), dht)
    if initial:  # the prefix's dht alone reaches its initial state, not the later segment's
        assert rel_err(got.dinitial_state, whole.dinitial_state[:1]) < 1e-12


def test_backward_stages_hand_on_values():
    """``backward_states`` returns a new, immutable record that ``backward_inputs`` takes; no stage
    changes an earlier stage's result (for FLA's records too, checked without a GPU)."""
    from kdacp.backends.fla_backend import FlaBackward, FlaBackwardStates
    backend, chunks = _setup("plain")
    span = Span(0, T, (0, T))
    do = torch.randn(1, T, HV, V, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    local = backend.backward_local(chunks, span, do, torch.zeros(1, HV, K, V, dtype=torch.float64))
    before = dict(vars(local))
    states = backend.backward_states(local, None)
    assert isinstance(states, BackwardStates) and states.span == span and states.dinitial_state.shape == (1, HV, K, V)
    assert vars(local) == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        states.dinitial_state = None
    assert backend.backward_inputs(states).dq.shape == (1, T, 1, K)
    for record in (type(local), type(states), FlaBackward, FlaBackwardStates):
        assert record.__dataclass_params__.frozen, record


def test_resolve_backend_names():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch" and resolve_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", cpu)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("fla", cpu)


@pytest.mark.parametrize("first, last", [(1, 3), (0, 2), (2, 3)])
def test_gradient_summary_of_some_segments_equals_their_rows(first, last):
    """``state_gradient_summary(local, segments=(first, last))``: the rows of those segments of the summary over
    every segment, from a local made over the whole span (a tail, a prefix, one segment in the middle's place)."""
    backend, chunks = _setup("safe")
    span = Span(0, T, (0, 40, CUT, T))
    gen = torch.Generator().manual_seed(9)
    h0 = torch.randn(3, HV, K, V, dtype=torch.float64, generator=gen)
    do = torch.randn(1, T, HV, V, dtype=torch.float64, generator=gen)
    local = backend.backward_local(chunks, span, do, h0)
    G = backend.state_gradient_summary(local)
    assert G.shape[0] == 3
    assert rel_err(backend.state_gradient_summary(local, segments=(first, last)), G[first:last]) < 1e-12
