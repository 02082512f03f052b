"""Bad input raises a clear error naming the argument, before anything is computed."""
import pytest
import torch

from kdacp.reference import chunk_kda, recurrent_kda
from tests.helpers import make_kda_inputs


def _args(**kw):
    return make_kda_inputs(1, 20, 2, 4, 8, 8, requires_grad=False, seed=0, **kw)


def _with(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


BAD = [
    ("q", lambda a: _with(a, q=a["q"][0]), ValueError, "q must have 4 dims"),
    ("k shape", lambda a: _with(a, k=a["k"][:, :, :1]), ValueError, "k must have the shape of q"),
    ("v", lambda a: _with(a, v=a["v"][:, :10]), ValueError, "v must have shape"),
    ("HV % H", lambda a: _with(a, v=torch.randn(1, 20, 3, 8), g=torch.randn(1, 20, 3, 8), beta=torch.rand(1, 20, 3)),
     ValueError, "multiple of the q/k heads"),
    ("g", lambda a: _with(a, g=a["g"][..., :4]), ValueError, "g must have shape"),
    ("beta", lambda a: _with(a, beta=a["beta"][..., None]), ValueError, "beta must have 3 dims"),
    ("beta type", lambda a: _with(a, beta=[0.5]), TypeError, "beta must be a torch.Tensor"),
    ("q dtype", lambda a: _with(a, q=a["q"].long()), TypeError, "q must have a floating dtype"),
    ("initial_state", lambda a: _with(a, initial_state=torch.randn(2, 4, 8, 8)), ValueError, "initial_state must have shape"),
    ("B>1 varlen", lambda a: _with(a, q=a["q"].expand(2, -1, -1, -1), k=a["k"].expand(2, -1, -1, -1),
                                   v=a["v"].expand(2, -1, -1, -1), g=a["g"].expand(2, -1, -1, -1),
                                   beta=a["beta"].expand(2, -1, -1), cu_seqlens=torch.tensor([0, 20])),
     ValueError, "batch size B must be 1"),
    ("cu order", lambda a: _with(a, cu_seqlens=torch.tensor([0, 12, 12, 20])), ValueError, "strictly increasing"),
    ("cu start", lambda a: _with(a, cu_seqlens=torch.tensor([1, 20])), ValueError, "must start at 0"),
    ("cu end", lambda a: _with(a, cu_seqlens=torch.tensor([0, 5, 19])), ValueError, r"cu_seqlens\[-1\] must equal T=20"),
    ("cu dtype", lambda a: _with(a, cu_seqlens=torch.tensor([0.0, 20.0])), TypeError, "cu_seqlens must have dtype int64"),
]


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
@pytest.mark.parametrize("case,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named(fn, case, mutate, exc, msg):
    with pytest.raises(exc, match=msg):
        fn(**mutate(_args()))


@pytest.mark.parametrize("lb", [-6.0, 0.0, 0.5])
def test_lower_bound_range(lb):
    args = make_kda_inputs(1, 10, 1, 1, 8, 8, gate="safe", requires_grad=False, seed=0)
    with pytest.raises(ValueError, match=r"lower_bound must be a float in \[-5, 0\)"):
        chunk_kda(**_with(args, lower_bound=lb))


@pytest.mark.parametrize("chunk_size", [0, -64, 1.5])
def test_chunk_size_must_be_positive(chunk_size):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_kda(**_args(), chunk_size=chunk_size)


def test_gate_parameter_shapes():
    args = make_kda_inputs(1, 10, 1, 2, 8, 8, gate="default", requires_grad=False, seed=0)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\]"):
        chunk_kda(**_with(args, A_log=torch.zeros(3, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[HV\*K\]"):
        chunk_kda(**_with(args, dt_bias=torch.zeros(8, dtype=torch.float64)))
