"""The backend registry: a backend added in a test as one module and one registry line
(:mod:`tests.backends.recording_backend`, the ``torch`` backend's stages counted) runs ``chunk_kda`` and
``chunk_gated_delta_rule`` under context parallelism on gloo ranks against the float64 reference; the
choice is made once per call, in one place, and a backend that cannot run says why."""
from __future__ import annotations

import pytest
import torch

from kdacp.backends import BACKEND_SPECS, BackendSpec, backend_choices, choose_backend, register_backend
from kdacp.backends.registry import CallFacts
from tests.backends import recording_backend
from tests.multiprocess import run_ranks

CPU = torch.device("cpu")


def test_the_new_backend_is_one_registry_line():
    assert "recording" in BACKEND_SPECS and "recording" in backend_choices()
    assert choose_backend("recording", CPU).name == "recording"
    assert choose_backend("auto", CPU).name == "torch"  # no auto priority: auto never picks it
    with pytest.raises(ValueError, match="already registered"):
        register_backend(BackendSpec("recording", BACKEND_SPECS["recording"].build))


def test_kdacps_own_backends_and_their_specs():
    assert tuple(BACKEND_SPECS)[:3] == ("torch", "fla", "attn_gym")
    fla, attn_gym = BACKEND_SPECS["fla"], BACKEND_SPECS["attn_gym"]
    assert fla.fuses == attn_gym.fuses == {"short_conv", "gated_norm"} and not BACKEND_SPECS["torch"].fuses
    assert attn_gym.inference == "fla"
    from kdacp.backends.attn_gym_backend import AttnGymBackend
    from kdacp.backends.fla_backend import FlaBackend
    from kdacp.backends.torch_backend import TorchBackend
    # the split reads the backend's own summary_pieces: attention-gym summarises whole segments only
    assert TorchBackend.summary_pieces and FlaBackend.summary_pieces and not AttnGymBackend.summary_pieces
    ok, reason = fla.availability(CPU)
    assert not ok and reason == "backend='fla' needs CUDA tensors, got device cpu"
    with pytest.raises(ValueError, match="backend must be one of \\('auto', 'torch', 'fla', 'attn_gym'"):
        choose_backend("cuda", CPU)


def test_refusals_and_inference_only_specs(monkeypatch):
    facts = CallFacts(*(torch.empty(1, 64, 2, 8, device="meta") for _ in range(3)), training=True)
    spec = BackendSpec("inference_only", BACKEND_SPECS["torch"].build, training=False,
                       refusal=lambda family, call: "K must be 128" if call.q.shape[-1] != 128 else None)
    monkeypatch.setitem(BACKEND_SPECS, spec.name, spec)
    with pytest.raises(ValueError, match="backend='inference_only' cannot run this call: it serves inference only"):
        choose_backend("inference_only", CPU, call=facts)
    with pytest.raises(ValueError, match="backend='inference_only' cannot run this call: K must be 128"):
        choose_backend("inference_only", CPU, call=CallFacts(facts.q, facts.k, facts.v))
    # as auto's first candidate, a refused call goes on to the next
    monkeypatch.setitem(BACKEND_SPECS, spec.name, BackendSpec(**{**vars(spec), "auto_priority": {"kda": -1}}))
    assert choose_backend("auto", CPU, call=facts).name == "torch"


def _run(rank: int, world_size: int) -> None:
    from tests.cp.test_cp_chunk_kda import _cases, _check_case
    from tests.cp.test_cp_gdn import _check
    cases = {c["name"]: c for c in _cases(world_size)}
    for i, name in enumerate(("packed-long-middle-uneven", "batch-rows-uneven")):
        _check_case(rank, world_size, cases[name], "p2p", seed=500 + i, backend="recording")
    _check(rank, world_size, ("p2p",), "recording")
    calls = recording_backend.CALLS
    assert calls["prepare"] and calls["output"] and calls["backward_inputs"], dict(calls)
    if 0 < rank < world_size - 1:  # a through rank summarises its span, forward and backward
        assert calls["state_summary"] and calls["state_gradient_summary"], dict(calls)


@pytest.mark.parametrize("world_size", [3])
def test_cp_on_a_registered_backend_matches_reference(world_size):
    run_ranks(_run, world_size, timeout_s=300)
