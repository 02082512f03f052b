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


def test_apply_all_batches_like_maps_and_equals_each_apply(monkeypatch):
    """Constant maps, affine maps of two shapes and two dtypes: each result is its own map's apply, and the
    affine maps of one shape and dtype go through one product."""
    import kdacp.affine as affine
    g = torch.Generator().manual_seed(5)

    def affine_map(n, K, V, dtype):
        return AffineMap(torch.randn(n, 2, K, V, generator=g, dtype=dtype), torch.randn(n, 2, K, K, generator=g, dtype=dtype))
    maps = [affine_map(1, 4, 3, torch.float64), AffineMap(torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64)),
            affine_map(1, 4, 3, torch.float64), affine_map(2, 4, 3, torch.float64), affine_map(1, 4, 3, torch.float32),
            affine_map(1, 4, 3, torch.float64)]
    xs = [None if m.constant else torch.randn(m.offset.shape, generator=g, dtype=m.offset.dtype) for m in maps]
    calls = []
    real = affine.apply_state_summary
    monkeypatch.setattr(affine, "apply_state_summary", lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    got = affine.apply_all(maps, xs)
    products = list(calls)
    want = [m.apply(x) for m, x in zip(maps, xs)]
    assert got[1] is maps[1].offset
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # the three float64 maps of one row in one product; the two-row map and the float32 map each alone
    assert sorted(products) == sorted([(3, 1, 2, 4, 3), (2, 2, 4, 3), (1, 2, 4, 3)])
