""":class:`kdacp.affine.AffineMap`, the one map type of summaries, exchange messages and the scan's runs:
apply and compose against plain float64 products, constant maps, and the precision rule's dtypes."""
import torch

from kdacp.affine import AffineMap
from tests.helpers import rel_err


def _rand(*shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def test_apply_and_compose_match_the_products():
    n, HV, K, V = 2, 3, 5, 4
    first = AffineMap(_rand(n, HV, K, V, seed=1), _rand(n, HV, K, K, seed=2))
    second = AffineMap(_rand(n, HV, K, V, seed=3), _rand(n, HV, K, K, seed=4))
    x = _rand(n, HV, K, V, seed=5)
    assert rel_err(first.apply(x), first.transition @ x + first.offset) < 1e-14
    both = second.compose(first)
    assert not both.constant
    assert rel_err(both.transition, second.transition @ first.transition) < 1e-14
    assert rel_err(both.apply(x), second.apply(first.apply(x))) < 1e-12


def test_constant_maps():
    """A constant map ignores its input; composed after anything it stays itself, composed before an affine
    map it gives the constant ``A b + b2``."""
    n, HV, K, V = 1, 2, 4, 3
    const = AffineMap(_rand(n, HV, K, V, seed=1))
    affine = AffineMap(_rand(n, HV, K, V, seed=2), _rand(n, HV, K, K, seed=3))
    assert const.constant and const.apply(None) is const.offset
    assert const.compose(affine) is const
    both = affine.compose(const)
    assert both.constant and rel_err(both.offset, affine.transition @ const.offset + affine.offset) < 1e-14


def test_float32_maps_compose_to_float32():
    """The precision rule: float32 operands off the GPU are formed in float64 and returned in float32."""
    K, V = 6, 5
    a = AffineMap(_rand(1, K, V, seed=1, dtype=torch.float32), _rand(1, K, K, seed=2, dtype=torch.float32))
    b = AffineMap(_rand(1, K, V, seed=3, dtype=torch.float32), _rand(1, K, K, seed=4, dtype=torch.float32))
    both = b.compose(a)
    assert both.offset.dtype == both.transition.dtype == torch.float32
    exact = b.transition.double() @ a.offset.double() + b.offset.double()
    assert torch.equal(both.offset, exact.float())
