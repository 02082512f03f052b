"""The ``fla`` backends hand the call's ``summary_precision`` to the summary kernels (CPU: the kernels run
under the Triton interpreter; FLA's own kernels are not called by these two stages)."""
from types import SimpleNamespace

import pytest
import torch

from kdacp import kernels as kn
from kdacp.backends.base import KDAOptions, Span
from kdacp.backends.fla_backend import FlaBackend
from kdacp.backends.fla_gdn_backend import FlaGDNBackend
from tests.kernels.test_summary_precision import SCALE, T, synthetic


def _backend(cls, precision):
    backend = cls.__new__(cls)  # without loading FLA: these stages only launch kdacp's kernels
    backend.options = KDAOptions(scale=SCALE, summary_precision=precision)
    return backend


@pytest.mark.parametrize("precision", ["one_piece", "exact", None])
def test_kda_backend_passes_the_policy(precision):
    low, _ = synthetic()
    span = Span(0, T, (0, T))
    backend = _backend(FlaBackend, precision)
    got = backend.state_summary(SimpleNamespace(**low), span, with_transition=True)
    want = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"], precision=precision)
    assert torch.equal(got.offset, want.offset) and torch.equal(got.transition, want.transition)
    local = SimpleNamespace(**low, dv_local=low["dv"], span=span)
    G = backend.state_gradient_summary(local)
    assert torch.equal(G, kn.state_gradient_summary(low["qg"], low["kg"], low["w"], low["gc"], low["do"], low["dv"],
                                                    SCALE, precision=precision))
    # the policy changes the result: the test would notice it being dropped
    other = kn.state_summary(low["kg"], low["w"], low["u"], low["gc"],
                             precision="exact" if precision in ("one_piece", None) else "one_piece")
    assert not torch.equal(got.offset, other.offset)


def test_gdn_backend_passes_the_policy():
    low, _ = synthetic(seed=1, H=1)
    span = Span(0, T, (0, T))
    backend = _backend(FlaGDNBackend, "one_piece")
    saved = SimpleNamespace(k=low["k"], q=low["q"], gc=low["gc"])
    got = backend.state_summary(SimpleNamespace(saved=saved, w=low["w"], u=low["u"]), span, with_transition=False)
    want = kn.state_summary(low["k"], low["w"], low["u"], low["gc"], output="state", raw_keys=True,
                            precision="one_piece")
    assert torch.equal(got.offset, want.offset)
    G = backend.state_gradient_summary(SimpleNamespace(saved=saved, w=low["w"], do=low["do"], dv=low["dv"], span=span))
    assert torch.equal(G, kn.state_gradient_summary(low["q"], low["k"], low["w"], low["gc"], low["do"], low["dv"],
                                                    SCALE, raw_keys=True, precision="one_piece"))
    assert not torch.equal(G, kn.state_gradient_summary(low["q"], low["k"], low["w"], low["gc"], low["do"], low["dv"],
                                                        SCALE, raw_keys=True, precision="two_piece"))
