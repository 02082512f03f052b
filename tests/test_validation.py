"""Bad input raises a clear error naming the argument, before anything is computed."""
import pytest
import torch

import kdacp
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


def _cast(args, dtype, *names):
    return _with(args, **{n: args[n].to(dtype) for n in names})


MIXED = [
    ("q wider", lambda a: _cast(a, torch.float32, "k", "v", "g", "beta"),
     "k has dtype torch.float32 but q has torch.float64; q, k and v must share one dtype"),
    ("v", lambda a: _cast(a, torch.float32, "v"), "v has dtype torch.float32 but q has torch.float64"),
    ("g", lambda a: _cast(a, torch.bfloat16, "g"), "g has dtype torch.bfloat16 but q has torch.float64"),
    ("g float32 with float64", lambda a: _cast(a, torch.float32, "g"),
     "g has dtype torch.float32 but q has torch.float64; g must have q's dtype, or float32 with bfloat16 or float16 q"),
    ("g float16 with bfloat16", lambda a: _cast(_cast(a, torch.bfloat16, "q", "k", "v", "beta"), torch.float16, "g"),
     "g has dtype torch.float16 but q has torch.bfloat16"),
    ("beta narrower", lambda a: _cast(a, torch.float32, "beta"),
     "beta has dtype torch.float32 but q has torch.float64; beta must have q's dtype, or float32 or wider"),
    ("beta half", lambda a: _cast(_cast(a, torch.bfloat16, "q", "k", "v", "g"), torch.float16, "beta"),
     "beta has dtype torch.float16 but q has torch.bfloat16"),
]


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda, kdacp.chunk_kda])
@pytest.mark.parametrize("case,mutate,msg", MIXED, ids=[m[0] for m in MIXED])
def test_mixed_dtypes_are_named(fn, case, mutate, msg):
    with pytest.raises(TypeError, match=msg):
        fn(**mutate(_args()))


def test_float32_companions_of_bfloat16_inputs_are_accepted():
    """FLA's layer passes float32 beta (and float32 A_log, dt_bias, initial_state) with bfloat16 inputs."""
    args = make_kda_inputs(1, 16, 1, 2, 8, 8, gate="default", initial_state=True, requires_grad=False, seed=0,
                           dtype=torch.bfloat16)
    args = _cast(args, torch.float32, "beta", "A_log", "dt_bias", "initial_state")
    o, final = kdacp.chunk_kda(**args, output_final_state=True, backend="torch")
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32


@pytest.mark.parametrize("op", ["chunk_kda", "chunk_gated_delta_rule"])
def test_fla_options_taken_by_name_and_refused_when_set(op):
    """FLA's use_beta_sigmoid_in_kernel and allow_neg_eigval: False (FLA's default, what kdacp runs) is taken,
    True is refused by name."""
    args = _args()
    if op == "chunk_gated_delta_rule":
        args["g"] = args["g"][..., 0]
    fn = getattr(kdacp, op)
    o, _ = fn(**args, backend="torch", use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)
    assert torch.equal(o, fn(**args, backend="torch")[0])
    with pytest.raises(ValueError, match=r"^allow_neg_eigval=True \(beta in \[0, 2\)\) is not supported"):
        fn(**args, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"^use_beta_sigmoid_in_kernel=True is not supported: pass beta = sigmoid"):
        fn(**args, use_beta_sigmoid_in_kernel=True)
    with pytest.raises(TypeError, match="^allow_neg_eigval must be a bool, got 'no'"):
        fn(**args, allow_neg_eigval="no")
