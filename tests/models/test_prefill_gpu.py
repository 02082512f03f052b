"""``kdacp.integrations.transformers.prefill`` and ``generate`` on one GPU (one NCCL rank): the GPU models of
tests/models/test_parallelize_gpu.py (the models' own linear-attention head shapes, sdpa attention) in bf16,
against a float32 copy of the unmodified model run by transformers' PyTorch code on the same GPU.

On one rank nothing is exchanged; this checks the GPU path of prefill: FLA's and kdacp's kernels with an
initial state, FLA's fused convolution with the cached convolution input as its halo, sdpa's lower-right
causal attention (a piece after the first attends the cached keys: two cuDNN calls merged by their
log-sum-exps, never sdpa's slow ``causal_lower_right`` path), the cache's dtypes on CUDA. A 200-token prompt
in one pass and in 3 pieces (70, 64, 66): every cache tensor and the last logits within the bf16 tolerance of
the other GPU model tests; without the initial state the 3-piece cache leaves it. ``generate`` gives 16 new
tokens from that cache with the model's own decode code (FLA's recurrent kernels), the same in two calls."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.helpers import rel_err
from tests.models.cp_common import VOCAB
from tests.models.test_parallelize_gpu import GPU_TOL, HEAD_SHAPES, _family

def _transformers_too_old() -> bool:
    import transformers
    from packaging.version import Version

    from kdacp.integrations.transformers.prefill import MIN_TRANSFORMERS
    return Version(transformers.__version__) < Version(MIN_TRANSFORMERS)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(_transformers_too_old(),
                                 reason="prefill needs transformers >= 5.24 (it raises ImportError on older ones)")]

T, PIECES = 200, (70, 64, 66)


def _tensors(cache, logits) -> dict:
    from kdacp.integrations.transformers.prefill import cache_tensors
    return {"logits": logits.float(), **cache_tensors(cache)}


def _make(name: str, make_model):
    """The model with weak decays (``A = exp(A_log) = 0.007``), so that a state dropped 66 tokens before the
    prompt's end still shows."""
    model = make_model(**HEAD_SHAPES[name])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.fill_(-5.0)
    return model


def _worker(worker, name: str) -> dict:
    import kdacp
    from kdacp.integrations.transformers.prefill import PrefillCache
    make_model, context = _family(name)
    prompt = torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(0)).to(worker.device)
    reference = _make(name, make_model).to(worker.device)
    with context(), torch.no_grad():
        out = reference(input_ids=prompt, use_cache=True)
    want = _tensors(out.cache, out.logits[:, -1])
    model = kdacp.parallelize(_make(name, make_model).to(worker.device, torch.bfloat16),
                              kdacp.ContextParallel("state"))

    def prefill(pieces):
        cache, start = None, 0
        for n in pieces:
            cache, logits = kdacp.integrations.transformers.prefill(model, kdacp.shard_batch(prompt[:, start:start + n]), cache=cache)
            start += n
        got = _tensors(cache, logits)
        assert {k: (v.shape, v.dtype) for k, v in got.items() if k != "logits"} == \
            {k: (v.shape, v.dtype if "recurrent" in k else torch.bfloat16) for k, v in want.items() if k != "logits"}
        return max(((k, rel_err(got[k], want[k])) for k in want), key=lambda kv: kv[1])

    import torch.nn.attention.bias as bias
    with mock.patch.object(bias, "causal_lower_right", wraps=bias.causal_lower_right) as slow_path:
        result = dict(one=prefill((T,)), pieces=prefill(PIECES))
    result["slow_path_calls"] = slow_path.call_count
    with mock.patch.object(PrefillCache, "recurrent_state", lambda self, layer_idx: None):
        result["broken"] = prefill(PIECES)
    ids = [kdacp.integrations.transformers.generate(model, kdacp.shard_batch(prompt), 16, do_sample=False) for _ in range(2)]
    assert ids[0].shape == (1, T + 16) and torch.equal(ids[0][:, :T], prompt) and torch.equal(ids[0], ids[1])
    return result


@pytest.mark.parametrize("name", ["kimi_linear", "qwen3_next"])
def test_prefill_on_one_gpu_matches_the_unmodified_model(name):
    from kdacp.workers import launch
    result = launch(_worker, 1, (name,), device="cuda", timeout_s=900)[0]
    print(f"{name}: {result}")
    for what in ("one", "pieces"):
        key, err = result[what]
        assert err < GPU_TOL, f"{name} prefill ({what}): {key} off by {err:.2e}"
    assert result["slow_path_calls"] == 0, f"{name}: a piece's attention took sdpa's lower-right mask"
    key, err = result["broken"]
    assert err > max(GPU_TOL, 10 * result["pieces"][1]), \
        f"{name}: dropping the initial state went unnoticed ({err:.2e})"
