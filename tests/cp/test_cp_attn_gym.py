"""``chunk_kda`` with the ``attn_gym`` backend over gloo ranks, its staged cores replaced by the plain-PyTorch
stand-in (:mod:`tests.backends.stand_in_attn_gym`): the context-parallel schedule on that backend (a tail's pass
over the segments after the head, cut from the rank's prepared handle; the head's gradient pass over a prefix;
a through rank's summaries) against the float64 reference, as ``test_cp_chunk_kda`` checks the ``torch`` backend."""
from __future__ import annotations

import pytest

from tests.cp.test_cp_chunk_kda import _cases, _check_case
from tests.multiprocess import run_ranks


def _use_stand_in() -> None:
    """This rank's ``attn_gym`` backend on the stand-in, and ``backend="attn_gym"`` resolved to it on the CPU."""
    import kdacp.ops.kda
    from kdacp.backends import attn_gym_backend, fla_backend
    from tests.backends import stand_in_attn_gym
    attn_gym_backend.load_attn_gym = stand_in_attn_gym.attn_gym
    fla_backend.load_fla = stand_in_attn_gym.fla
    from kdacp.backends import BACKEND_SPECS
    kdacp.ops.kda.choose_call_backend = lambda backend, device, **call: BACKEND_SPECS[backend]


def _run(rank: int, world_size: int) -> None:
    _use_stand_in()
    cases = {c["name"]: c for c in _cases(world_size)}
    for i, name in enumerate(("packed-long-middle-uneven", "packed-many-short", "batch-rows-uneven")):
        _check_case(rank, world_size, cases[name], "p2p", seed=300 + i, backend="attn_gym")


@pytest.mark.parametrize("world_size", [3])
def test_cp_on_the_attn_gym_backend_matches_reference(world_size):
    run_ranks(_run, world_size, timeout_s=300)
