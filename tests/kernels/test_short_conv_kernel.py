"""The short-convolution Triton kernels against the PyTorch reference (CPU: Triton interpreter, small
sizes; GPU: `gpu` marker, real sizes, and beside FLA's ``causal_conv1d``).

The reference (:func:`kdacp.kernels.short_conv.causal_conv1d`'s PyTorch path) runs in float64 on exactly
the inputs the kernels get (rounded to their dtype), so any gap is the kernels' own rounding.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kdacp.kernels import short_conv as sc
from kdacp.layers.short_conv import causal_conv1d as reference
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: the kernels' float32 sums against float64 (measured <= 2e-7); bf16: one rounding of the output,
# at most 2^-8 relative on the GPU (round to nearest), 2^-7 under the interpreter (it truncates float32 -> bf16)
TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3 if DEVICE == "cuda" else 8e-3}
# small tiles (the interpreter's cost is per row step): several programs of 6 rows (not a multiple of the 4 rows
# a step loads), their rows cut by sequence starts, each program's walk crossing them; two column blocks, the
# second partial, in the first case
SMALL = sc.ConvTiles(rows=6, BD=32, num_warps=1)
# two groups of four rows per step, 10 rows per program (not a multiple of 8): the second group's rows run past a
# program's end and, walking backward, below its first row and the halo's
SMALL_PAIRS = sc.ConvTiles(rows=10, BD=32, num_warps=1, groups=2)
# the backward loading each step's rows one step ahead: the last step's look-ahead lies below the program's rows
# (and below row 0 and the halo in the first program)
SMALL_AHEAD = sc.ConvTiles(rows=6, BD=32, num_warps=1, ahead=True)
# the backward's row loop software-pipelined by Triton (on a GPU; the interpreter runs the loop as written)
SMALL_STAGES = sc.ConvTiles(rows=6, BD=32, num_warps=1, stages=3)


def make(B, T, D, W, *, bias=True, halo=False, dtype=torch.float32, seed=0, device=DEVICE):
    """Inputs in ``dtype`` (the weight and bias too) and the upstream gradient ``dy``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return dict(x=rnd(B, T, D), weight=rnd(D, W), bias=rnd(D) if bias else None,
                halo=rnd(B, W - 1, D) if halo else None), rnd(B, T, D)


def truth(inputs, dy, cu, activation):
    """Float64 reference output and gradients of ``inputs`` (dict order), for the upstream ``dy``."""
    hi = {n: None if t is None else t.detach().double().requires_grad_() for n, t in inputs.items()}
    y = reference(hi["x"], hi["weight"], hi["bias"], halo=hi["halo"], cu_seqlens=cu, activation=activation)
    leaves = [t for t in hi.values() if t is not None]
    return y, dict(zip([n for n, t in hi.items() if t is not None], torch.autograd.grad(y, leaves, dy.double())))


def check(inputs, dy, cu, activation, y, grads):
    y_ref, g_ref = truth(inputs, dy, cu, activation)
    tol = TOL[inputs["x"].dtype]
    assert y.dtype == inputs["x"].dtype and y.shape == y_ref.shape
    assert rel_err(y, y_ref) < tol, "y"
    for name, g in grads.items():
        assert g.dtype == inputs[name].dtype and g.shape == inputs[name].shape, name
        assert rel_err(g, g_ref[name]) < tol, name


# (B, T, D, W, cu_seqlens, halo): one sequence per row, packed documents with some shorter than W (and a
# one-token one), a halo, a halo before packed documents whose first one is shorter than W
CASES = [
    (2, 23, 40, 4, None, True),
    (1, 37, 20, 4, [0, 1, 3, 20, 21, 37], False),
    (1, 37, 20, 4, [0, 2, 9, 37], True),
    (1, 30, 16, 3, [0, 11, 12, 30], True),
    (1, 19, 16, 2, [0, 1, 19], True),
]


# Every case with the plain tiling; the other tilings (row pairs, a step loaded ahead, pipeline stages) on the
# packed case with short documents and a halo, the rest of their cross with the cases marked slow.
LAUNCH_CASES = [pytest.param(*case, tiles, id=f"{i}-{name}",
                             marks=() if tiles is SMALL or i == 2 else pytest.mark.slow)
                for name, tiles in (("groups1", SMALL), ("groups2", SMALL_PAIRS), ("ahead", SMALL_AHEAD),
                                    ("stages3", SMALL_STAGES))
                for i, case in enumerate(CASES)]


@pytest.mark.parametrize("B,T,D,W,cu,halo,tiles", LAUNCH_CASES)
def test_launchers_match_reference(B, T, D, W, cu, halo, tiles):
    inputs, dy = make(B, T, D, W, halo=halo)
    cu_t = None if cu is None else torch.tensor(cu, device=DEVICE)
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["halo"], cu_t, "silu")
    y = sc.short_conv_fwd(*args, tiles=replace(tiles, ahead=False, stages=1))
    g = sc.short_conv_bwd(*args, dy, tiles=tiles)
    grads = {"x": g.dx, "weight": g.dweight, "bias": g.dbias} | ({"halo": g.dhalo} if halo else {})
    check(inputs, dy, cu_t, "silu", y, grads)


@pytest.mark.parametrize("dtype, bias, activation", [(torch.float32, True, "silu"), (torch.float32, False, None),
                                                     (torch.bfloat16, True, None), (torch.bfloat16, False, "silu")])
def test_autograd_dtypes_bias_activation(dtype, bias, activation):
    # the default tiles: a 70-token shard after a halo (several forward programs), packed documents
    inputs, dy = make(1, 70, 48, 4, bias=bias, halo=True, dtype=dtype, seed=1)
    cu = torch.tensor([0, 2, 40, 70], device=DEVICE)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    y = sc.fused_causal_conv1d(leaves["x"], leaves["weight"], leaves.get("bias"), halo=leaves["halo"], cu_seqlens=cu,
                         cu_seqlens_cpu=cu.cpu(), activation=activation)
    grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
    check(inputs, dy, cu, activation, y, grads)


def test_strided_input_and_gradient_need_no_copy():
    inputs, dy = make(2, 20, 16, 4, halo=True, seed=2)
    qkv = torch.cat([inputs["x"], inputs["x"].flip(-1)], -1)   # x is the first half of a fused tensor
    x = qkv[..., :16]
    assert not x.is_contiguous()
    dy_t = dy.transpose(0, 1).contiguous().transpose(0, 1)     # a batch-major-strided dy
    args = (x, inputs["weight"], inputs["bias"], inputs["halo"], None, "silu")
    y = sc.short_conv_fwd(*args)
    g = sc.short_conv_bwd(*args, dy_t)
    check(inputs, dy, None, "silu", y, {"x": g.dx, "weight": g.dweight, "bias": g.dbias, "halo": g.dhalo})


def test_halo_gradient_only_when_asked():
    # a halo that needs no gradient still feeds dweight (its rows' terms)
    inputs, dy = make(1, 20, 16, 4, halo=True, seed=3)
    x, weight = inputs["x"].clone().requires_grad_(), inputs["weight"].clone().requires_grad_()
    y = sc.fused_causal_conv1d(x, weight, inputs["bias"], halo=inputs["halo"])
    dx, dweight = torch.autograd.grad(y, [x, weight], dy)
    g_ref = truth(inputs, dy, None, "silu")[1]
    assert rel_err(dx, g_ref["x"]) < TOL[torch.float32] and rel_err(dweight, g_ref["weight"]) < TOL[torch.float32]
    assert sc.short_conv_bwd(*[inputs[n] for n in ("x", "weight", "bias", "halo")], None, "silu", dy,
                             want_dhalo=False).dhalo is None


def test_nan_stays_in_its_document():
    inputs, dy = make(1, 60, 16, 4, seed=4)
    inputs["x"][0, 10] = float("nan")
    cu = torch.tensor([0, 12, 60], device=DEVICE)
    x = inputs["x"].clone().requires_grad_()
    y = sc.fused_causal_conv1d(x, inputs["weight"], inputs["bias"], cu_seqlens=cu)
    (dx,) = torch.autograd.grad(y, [x], dy)
    assert y[0, 10:12].isnan().all() and y[0, 12:].isfinite().all()
    assert dx[0, 12:].isfinite().all() and dx[0, 7:10].isnan().all()


@pytest.mark.parametrize("change, error, match", [
    (dict(weight=torch.zeros(16, 5)), ValueError, r"weight must have shape \[D=16, W\] with 2 <= W <= 4"),
    (dict(weight=torch.zeros(16, 1)), ValueError, "W <= 4"),
    (dict(bias=torch.zeros(15)), ValueError, r"bias must have shape \[D=16\]"),
    (dict(halo=torch.zeros(1, 2, 16)), ValueError, r"halo must have shape \[B=1, W-1=3, D=16\]"),
    (dict(halo=torch.zeros(1, 3, 16, dtype=torch.float64)), TypeError, "halo must have x's dtype"),
    (dict(x=torch.zeros(1, 20, 16, dtype=torch.float64)), TypeError, "x must have dtype"),
    (dict(x=torch.zeros(20, 16)), ValueError, "x must have 3 dims"),
    (dict(cu_seqlens=torch.tensor([0, 5, 19])), ValueError, "cu_seqlens"),
    (dict(activation="gelu"), ValueError, "activation must be 'silu' or None"),
])
def test_bad_input_is_named(change, error, match):
    args = dict(x=torch.zeros(1, 20, 16), weight=torch.zeros(16, 4), bias=None, halo=None, cu_seqlens=None,
                activation="silu")
    args.update({n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in change.items()})
    with pytest.raises(error, match=match):
        sc.fused_causal_conv1d(**{n: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for n, t in args.items()})


def test_bad_tiles_are_named():
    with pytest.raises(ValueError, match="groups must be 1 or 2, got 3"):
        sc.ConvTiles(rows=8, BD=32, num_warps=1, groups=3)
    with pytest.raises(ValueError, match="ahead .* needs groups=1, got groups=2"):
        sc.ConvTiles(rows=8, BD=32, num_warps=1, groups=2, ahead=True)
    inputs, _ = make(1, 8, 16, 4)
    with pytest.raises(ValueError, match="stages must be 1 to 4, got 0"):
        sc.ConvTiles(rows=8, BD=32, num_warps=1, stages=0)
    for tiles in (SMALL_AHEAD, SMALL_STAGES):
        with pytest.raises(ValueError, match="tiles.ahead and tiles.stages are the backward's options"):
            sc.short_conv_fwd(inputs["x"], inputs["weight"], None, None, None, "silu", tiles=tiles)


# --- GPU, real sizes -------------------------------------------------------------------------------------

# 16K tokens packed in 13 documents, the first continuing a halo; one of Kimi Linear's q, k, v (32 x 128)
# and Qwen3-Next's fused q|k|v width (2048 x 3)
REAL_CU = [0, 700, 1601, 1602, 2048, 3000, 5000, 5003, 8192, 9000, 12000, 15000, 16000, 16384]


@pytest.mark.gpu
@pytest.mark.parametrize("D, bias", [(4096, False), (6144, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_real_sizes_match_reference(D, bias, packed):
    inputs, dy = make(1, 16384, D, 4, bias=bias, halo=True, dtype=torch.bfloat16, seed=5)
    cu = torch.tensor(REAL_CU, device=DEVICE) if packed else None
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    y = sc.fused_causal_conv1d(leaves["x"], leaves["weight"], leaves.get("bias"), halo=leaves["halo"], cu_seqlens=cu)
    grads = dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))
    check(inputs, dy, cu, "silu", y, grads)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [sc.ConvTiles(rows=128, BD=1024, num_warps=8, groups=2),
                                   sc.ConvTiles(rows=512, BD=1024, num_warps=8, ahead=True),
                                   sc.ConvTiles(rows=256, BD=2048, num_warps=16, stages=3)],
                         ids=["groups2", "ahead", "stages3"])
@pytest.mark.parametrize("packed", [False, True])
def test_real_sizes_other_steps(packed, tiles):
    # the launchers with steps of two groups of four rows, and the backward loading a step ahead (tilings the
    # sweep tries), at real sizes
    inputs, dy = make(1, 16384, 4096, 4, bias=True, halo=True, dtype=torch.bfloat16, seed=8)
    cu = torch.tensor(REAL_CU, device=DEVICE) if packed else None
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["halo"], cu, "silu")
    g = sc.short_conv_bwd(*args, dy, tiles=tiles)
    check(inputs, dy, cu, "silu", sc.short_conv_fwd(*args, tiles=replace(tiles, ahead=False, stages=1)),
          {"x": g.dx, "weight": g.dweight, "bias": g.dbias, "halo": g.dhalo})


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_real_sizes_within_bf16_rounding_of_fla(packed):
    from kdacp.backends.fla_adapter import fla_available, load_fla
    if not fla_available():
        pytest.skip("needs fla-core")
    inputs, dy = make(1, 16384, 4096, 4, bias=True, halo=True, dtype=torch.bfloat16, seed=6)
    cu = torch.tensor(REAL_CU, device=DEVICE) if packed else None
    names = ["x", "weight", "bias", "halo"]
    ours = {n: inputs[n].clone().requires_grad_() for n in names}
    y = sc.fused_causal_conv1d(ours["x"], ours["weight"], ours["bias"], halo=ours["halo"], cu_seqlens=cu)
    g = dict(zip(names, torch.autograd.grad(y, list(ours.values()), dy)))
    # FLA's cache holds the W tokens before each sequence ([N, D, W], newest last; it reads the last W-1)
    theirs = {n: inputs[n].clone().requires_grad_() for n in names}
    state = torch.nn.functional.pad(theirs["halo"].transpose(1, 2), (1, 0))
    if packed:
        state = torch.cat([state, state.new_zeros(len(REAL_CU) - 2, *state.shape[1:])])
    y_fla = load_fla().causal_conv1d(x=theirs["x"], weight=theirs["weight"], bias=theirs["bias"],
                                     initial_state=state, activation="silu", backend="triton", cu_seqlens=cu)[0]
    g_fla = dict(zip(names, torch.autograd.grad(y_fla, list(theirs.values()), dy)))
    # each is within one bf16 rounding (2^-8) of the float64 truth, so of each other within twice that
    assert rel_err(y, y_fla) < 8e-3
    for n in names:
        assert rel_err(g[n], g_fla[n]) < 8e-3, n


@pytest.mark.gpu
def test_backward_is_deterministic():
    inputs, dy = make(1, 16384, 4096, 4, bias=True, halo=True, dtype=torch.bfloat16, seed=7)
    cu = torch.tensor(REAL_CU, device=DEVICE)
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["halo"], cu, "silu")
    first, second = sc.short_conv_bwd(*args, dy), sc.short_conv_bwd(*args, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("W, bias", [(4, True), (3, False), (2, True)])
def test_partial_sums_over_many_programs(W, bias, monkeypatch):
    # the reduction made small: 2 x 5 programs of 4 rows give more partial-sum rows than one of its steps takes,
    # not a multiple of it, and channels over more than one of its programs (the last one masked)
    monkeypatch.setattr(sc.launch, "SUM_BR", 4)
    monkeypatch.setattr(sc.launch, "SUM_BD", 16)
    inputs, dy = make(2, 18, 40, W, bias=bias, halo=True, seed=9)
    args = (inputs["x"], inputs["weight"], inputs["bias"], inputs["halo"], None, "silu")
    y = sc.short_conv_fwd(*args)
    g = sc.short_conv_bwd(*args, dy, tiles=replace(SMALL, rows=4))
    check(inputs, dy, None, "silu", y, {"x": g.dx, "weight": g.dweight, "halo": g.dhalo}
          | ({"bias": g.dbias} if bias else {}))
