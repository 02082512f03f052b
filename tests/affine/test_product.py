"""The summaries' product kernel ``(A @ X1 + B1, A @ X2)`` against float64 (CPU: Triton interpreter;
GPU: `gpu` marker), and :mod:`kdacp.affine` taking it for float32 GPU operands."""
import pytest
import torch

from kdacp import affine
from kdacp.affine.product import affine_product
from tests.helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-6  # float32 sums of K products (3xTF32 on the GPU, numpy float32 in the interpreter)


def _rand(*shape, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)


@pytest.mark.parametrize("lead,K,C,C2", [((3,), 16, 16, None), ((2, 3), 16, 32, 16), ((1, 2), 20, 13, 20),
                                         ((2,), 80, 48, 80), ((2,), 16, 80, 5)])
@pytest.mark.parametrize("with_b", [True, False])
def test_product_matches_float64(lead, K, C, C2, with_b):
    A, X, B = _rand(*lead, K, K, seed=1), _rand(*lead, K, C, seed=2), _rand(*lead, K, C, seed=3)
    X2 = None if C2 is None else _rand(*lead, K, C2, seed=4)
    expect = A @ X + (B if with_b else 0)
    out, out2 = affine_product(A.float(), X.float(), B.float() if with_b else None, None if X2 is None else X2.float())
    assert out.dtype == torch.float32 and out.shape == expect.shape and out.is_contiguous()
    assert torch.isfinite(out).all()
    assert rel_err(out.double(), expect) < TOL
    if X2 is None:
        assert out2 is None
    else:
        assert out2.shape == (*lead, K, C2) and out2.is_contiguous() and rel_err(out2.double(), A @ X2) < TOL


def test_strided_operands():
    """A transposed ``A`` (the backward's ``M^T``) and column slices of one gathered buffer."""
    K, V = 16, 24
    wide = _rand(2, 3, K, V + K, seed=4).float()      # [S | M] as the all-gather delivers them
    S, M = wide[..., :V], wide[..., V:]
    X, B = _rand(2, 3, K, V, seed=5).float(), _rand(2, 3, K, V, seed=6).float()
    out, _ = affine_product(M.transpose(-1, -2), X, S)
    expect = M.double().transpose(-1, -2) @ X.double() + S.double()
    assert rel_err(out.double(), expect) < TOL
    out, out2 = affine_product(M, B, None, M)
    assert rel_err(out.double(), M.double() @ B.double()) < TOL
    assert rel_err(out2.double(), M.double() @ M.double()) < TOL


def test_bad_input_errors():
    A, X = torch.zeros(2, 16, 16, device=DEVICE), torch.zeros(2, 16, 8, device=DEVICE)
    with pytest.raises(TypeError, match="X1 must be float32"):
        affine_product(A, X.double())
    with pytest.raises(ValueError, match="A must be square"):
        affine_product(torch.zeros(2, 16, 8, device=DEVICE), X)
    with pytest.raises(ValueError, match=r"X1 must have shape \[2, 16, C\]"):
        affine_product(A, torch.zeros(2, 8, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"B1 must have shape \[2, 16, 8\]"):
        affine_product(A, X, torch.zeros(2, 16, 9, device=DEVICE))
    with pytest.raises(ValueError, match=r"X1 must have shape \[2, 16, C\]"):
        affine_product(A, torch.zeros(3, 16, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"X2 must have shape \[2, 16, C\]"):
        affine_product(A, X, None, torch.zeros(2, 15, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3])
def test_affine_takes_the_kernel_on_gpu(n, monkeypatch):
    """Kimi Linear's sizes (32 heads of 128): apply and compose in float32 through the kernel, within
    float32 rounding of float64, one kernel launch per apply and per composition."""
    HV, K, V = 32, 128, 128
    M1, M2 = (_rand(n, HV, K, K, seed=s, device="cuda") / K ** 0.5 for s in (7, 8))
    S1, S2, x = (_rand(n, HV, K, V, seed=s, device="cuda") for s in (9, 10, 11))
    calls = []
    real = affine.affine_product
    monkeypatch.setattr(affine, "affine_product", lambda *a: calls.append(1) or real(*a))
    got = affine.apply_state_summary(S1.float(), M1.float(), x.float())
    assert got.dtype == torch.float32 and rel_err(got.double(), M1 @ x + S1) < 1e-5
    dg = affine.apply_state_gradient_summary(S1.float(), M1.float(), x.float())
    assert rel_err(dg.double(), M1.transpose(-1, -2) @ x + S1) < 1e-5
    S, M = affine.compose_state_summaries((S1.float(), M1.float()), (S2.float(), M2.float()))
    assert rel_err(S.double(), M2 @ S1 + S2) < 1e-5 and rel_err(M.double(), M2 @ M1) < 1e-5
    assert len(calls) == 3  # one launch each, the composition's two products included
    # float64 operands keep the float64 products
    assert affine.apply_state_summary(S1, M1, x).dtype == torch.float64 and len(calls) == 3
