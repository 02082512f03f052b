"""``kdacp.parallelize`` on one GPU (one NCCL rank): the tiny Kimi Linear and Qwen3-Next configs of the CPU
tests, float32, on the packed batch of tests/models/cp_common.py, against the unmodified model run by
transformers' PyTorch code on the same GPU, one document at a time.

On one rank there is nothing to exchange; what this checks is the GPU path: kdacp's Triton kernels and
FLA's (the ``auto`` backend) inside the models' token mixers, the fused short convolution, the packed
documents. Float32 products run in TF32 on the GPU (10 mantissa bits), hence ``GPU_TOL``; dropping the
document boundaries that reach the linear-attention layers must break it."""
from __future__ import annotations

import pytest
import torch

from tests.models.cp_common import errors, one_document_at_a_time

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The demo's CUDA float32 tolerance (kdacp/demo.py): TF32 products in the kernels and in the reference.
GPU_TOL = 1e-2


def _family(name: str):
    """The model builder, the reference's context and the adapter module of a model family."""
    from kdacp.models import kimi_linear, qwen3_next, torch_fallbacks
    if name == "kimi_linear":
        from tests.models.test_kimi_linear_cp import _model
        return _model, torch_fallbacks, kimi_linear
    from tests.models.test_qwen3_next_cp import _model, _transformers_recurrent_gdn
    return _model, _transformers_recurrent_gdn, qwen3_next


def _worker(ctx, name: str) -> dict:
    import kdacp
    make_model, context, adapter = _family(name)
    ref = one_document_at_a_time(make_model().to(ctx.device), context())
    model = kdacp.parallelize(make_model().to(ctx.device), kdacp.KDAContextParallel("state"))
    errs = errors(model, ref, 0, 1)
    real = adapter.global_cu_seqlens
    adapter.global_cu_seqlens = lambda kwargs: None  # the linear-attention layers lose the documents
    try:
        broken = errors(model, ref, 0, 1)
    finally:
        adapter.global_cu_seqlens = real
    return dict(worst=max(errs.items(), key=lambda kv: kv[1]), broken=max(broken.values()))


@pytest.mark.parametrize("name", ["kimi_linear", "qwen3_next"])
def test_parallelize_on_one_gpu_matches_the_unmodified_model(name):
    from kdacp.workers import launch
    result = launch(_worker, 1, (name,), device="cuda", timeout_s=900)[0]
    (what, err), broken = result["worst"], result["broken"]
    print(f"{name}: worst {what} {err:.2e}; without the documents {broken:.2e}")
    assert err < GPU_TOL, f"{name} on one GPU: {what} off by {err:.2e}"
    assert broken > 10 * GPU_TOL, f"{name}: dropping the documents went unnoticed ({broken:.2e})"
