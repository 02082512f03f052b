"""kdacp.precompile (:mod:`kdacp.precompilation`): a dry run that compiles a step's new Triton kernels in parallel and launches none.

On CPU (the interpreter) it must not run the step at all; on a GPU the dry run must skip every launch
that needed a compile, leave the kernels compiled for the real run (no compile then), skip untuned
autotuners without caching a choice (compiling all their configurations where asked), catch launches from autograd's backward thread, and restore
Triton's hooks afterwards, also when the step raises."""
import random

import pytest
import torch
import triton
import triton.language as tl

from kdacp import precompile

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _scale(X, Y, N, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * FACTOR, mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["N"])
@triton.jit
def _scale_tuned(X, Y, N, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * FACTOR, mask=mask)


def _launch(x: torch.Tensor, factor: float) -> torch.Tensor:
    y = torch.full_like(x, -1.0)
    _scale[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), FACTOR=factor, BLOCK=128)
    return y


class _Scaled(torch.autograd.Function):
    """y = a x forward, dx = b dy backward, each a kernel of its own (fresh constants: new compiles)."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.b = b
        return _launch(x, a)

    @staticmethod
    def backward(ctx, dy):
        return _launch(dy.contiguous(), ctx.b), None, None


def _fresh_factor() -> float:
    """A constant no earlier run compiled (a new constexpr value is a new specialization)."""
    return round(random.uniform(1.5, 1000.0), 6)


class _CompileCounter:
    """Counts Triton compilations through the jit_cache_hook (called before every compile)."""

    def __enter__(self):
        from triton import knobs
        self.count, self.saved = 0, knobs.runtime.jit_cache_hook

        def hook(**kwargs):
            self.count += 1
            return None

        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc):
        from triton import knobs
        knobs.runtime.jit_cache_hook = self.saved


def test_precompile_does_not_run_the_step_without_compiled_kernels():
    calls = []
    assert precompile(lambda: calls.append(1), device="cpu") == 0
    assert calls == []


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_precompile_needs_a_cuda_device_to_do_anything(device):
    assert precompile(lambda: pytest.fail("ran the step"), device=device) == 0


@pytest.mark.gpu
@needs_cuda
def test_dry_run_skips_launches_and_leaves_kernels_compiled():
    x = torch.randn(1000, device="cuda")
    a, b = _fresh_factor(), _fresh_factor()
    dry = []
    assert precompile(lambda: dry.append((_launch(x, a), _launch(x, a))), device="cuda") == 1  # one kernel, deduplicated
    assert torch.equal(dry[0][0], torch.full_like(x, -1.0)), "the dry run launched the kernel"
    with _CompileCounter() as compiles:
        y = _launch(x, a)
    torch.testing.assert_close(y, x * a)
    assert compiles.count == 0, "the real run compiled again"
    with _CompileCounter() as compiles:
        _launch(x, b)
    assert compiles.count == 1, "the counter does not see compiles, so the check above proves nothing"


@pytest.mark.gpu
@needs_cuda
def test_dry_run_catches_the_backward_thread():
    a, b = _fresh_factor(), _fresh_factor()
    x = torch.randn(1000, device="cuda", requires_grad=True)

    def step():
        _Scaled.apply(x, a, b).sum().backward()

    assert precompile(step, device="cuda") == 2
    x.grad = None
    with _CompileCounter() as compiles:
        step()
    assert compiles.count == 0
    torch.testing.assert_close(x.grad, torch.full_like(x, b))


@pytest.mark.gpu
@needs_cuda
def test_untuned_autotuner_is_skipped_and_tuned_later():
    factor = _fresh_factor()
    n = random.randrange(10_000, 20_000)  # a tuning key no earlier run cached
    x = torch.randn(n, device="cuda")
    y = torch.full_like(x, -1.0)

    def launch(factor):
        _scale_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, FACTOR=factor)

    assert precompile(lambda: launch(factor), device="cuda") == 0
    assert torch.equal(y, torch.full_like(x, -1.0))
    assert not any(k[0] == n for k in _scale_tuned.cache), "the dry run cached a tuning choice"
    launch(factor)
    torch.testing.assert_close(y, x * factor)
    assert any(k[0] == n for k in _scale_tuned.cache)
    # Now tuned: a new constant compiles only the chosen configuration, ahead.
    y.fill_(-1.0)
    other = _fresh_factor()
    assert precompile(lambda: launch(other), device="cuda") == 1
    assert torch.equal(y, torch.full_like(x, -1.0))
    launch(other)
    torch.testing.assert_close(y, x * other)


@pytest.mark.gpu
@needs_cuda
def test_configs_of_an_untuned_autotuner_compile_ahead():
    """``configs=True``: the dry run compiles every configuration of an untuned autotuner (none timed, none
    chosen), and the real run's autotuning then times them without compiling any."""
    factor = _fresh_factor()
    n = random.randrange(20_000, 30_000)  # a tuning key no earlier run cached
    x = torch.randn(n, device="cuda")
    y = torch.full_like(x, -1.0)

    def launch():
        _scale_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, FACTOR=factor)

    assert precompile(launch, device="cuda", configs=True) == 2  # both configurations
    assert torch.equal(y, torch.full_like(x, -1.0)), "the dry run launched the kernel"
    assert not any(k[0] == n for k in _scale_tuned.cache), "the dry run cached a tuning choice"
    with _CompileCounter() as compiles:
        launch()
    assert compiles.count == 0, "the autotuning compiled a configuration again"
    assert any(k[0] == n for k in _scale_tuned.cache)
    torch.testing.assert_close(y, x * factor)


@pytest.mark.gpu
@needs_cuda
def test_hooks_restored_after_an_error():
    from triton import knobs
    from triton.runtime.autotuner import Autotuner
    run, bench, hook = Autotuner.run, Autotuner._bench, knobs.runtime.jit_cache_hook
    with pytest.raises(RuntimeError, match="boom"):
        precompile(lambda: (_ for _ in ()).throw(RuntimeError("boom")), device="cuda")
    assert (Autotuner.run, Autotuner._bench, knobs.runtime.jit_cache_hook) == (run, bench, hook)
