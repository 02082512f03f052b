"""kdacp.bench.steps.step_functions: the op suites' per-contender step, forward and backward or forward only."""
import torch

from kdacp.bench.steps import step_functions


def test_step_functions_backward_and_forward_only():
    q = torch.randn(3, requires_grad=True)
    runs = {"double": lambda q: (2 * q, None), "square": lambda q: (q * q, q.sum())}
    do = torch.ones(3)
    train = step_functions(runs, ["double", "square"], {"q": q}, do, backward=True)
    o, (dq,) = train["double"]()
    assert torch.equal(o, 2 * q) and torch.equal(dq, torch.full((3,), 2.0))
    assert torch.allclose(train["square"]()[1][0], 2 * q.detach())
    assert q.grad is None  # gradients returned, not accumulated
    forward = step_functions(runs, ["double", "square"], {"q": q}, do, backward=False)
    o, extra = forward["double"]()
    assert not o.requires_grad and extra == []
    o, extra = forward["square"]()
    assert len(extra) == 1 and torch.equal(extra[0], q.detach().sum())
    assert set(step_functions(runs, ["square"], {"q": q}, do, backward=True)) == {"square"}
