import torch

from kdacp.backends.base import Span


def test_span_take_is_the_tensor_itself_only_when_the_span_covers_it():
    x = torch.arange(2 * 10 * 3).view(2, 10, 3)[:1]  # [1, 10, 3]
    assert Span(0, 10, (0, 10)).take(x) is x
    for start, end in ((0, 4), (4, 10), (3, 7)):
        got = Span(start, end, (0, end - start)).take(x)
        assert torch.equal(got, x[:, start:end]) and got.shape[1] == end - start
