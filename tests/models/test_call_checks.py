"""What a ``kdacp.parallelize``'d model does with keyword arguments its forward would otherwise drop, on one gloo
rank (a tiny random Kimi Linear, float32): ``cu_seqlens=`` means the global boundaries, as everywhere else in
kdacp (the same logits as ``batch.model_kwargs()``'s ``cu_seq_lens_q/k``, and other logits than one document);
any other argument that would not be honoured is refused by name before any layer runs; a cache request names
the ways to decode, which exist; inside ``own_forwards`` the model's own code takes its own arguments."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.models.cp_common import CU_SEQLENS, tokens
from tests.models.test_kimi_linear_cp import _model
from tests.multiprocess import run_ranks


def _worker(rank, world_size):
    import kdacp
    import kdacp.integrations.transformers
    from kdacp.integrations.transformers import install

    model = kdacp.parallelize(_model(), kdacp.ContextParallel("state"))
    batch = kdacp.shard_batch(tokens(), cu_seqlens=torch.tensor(CU_SEQLENS))
    plain = dict(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
    with torch.no_grad():
        packed = model(**batch.model_kwargs())
        named = model(**plain, cu_seqlens=batch.cu_seqlens)
        one_row = model(**plain)
    assert torch.equal(named.logits, packed.logits) and torch.equal(named.loss, packed.loss)
    assert (named.logits - one_row.logits).abs().max() > 1e-3, "the boundaries changed nothing: the test sees nothing"
    with pytest.raises(ValueError, match="cu_seqlens and cu_seq_lens_q"):
        model(**batch.model_kwargs() | {"cu_seqlens": torch.tensor([0, 100, 192])})

    # Refused by name before any token mixer runs.
    calls = []
    real = install.mix_tokens
    install.mix_tokens = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for name, value in (("padding", 0), ("seq_idx", torch.zeros(1, 192, dtype=torch.int32)),
                            ("cu_seq_lens", batch.cu_seqlens)):
            with pytest.raises(ValueError, match=f"does not take {name}=.*model_kwargs"):
                model(**batch.model_kwargs(), **{name: value})
        with pytest.raises(ValueError, match="does not take (layout|rank|padding)="):  # the dataclass's fields
            model(**dataclasses.asdict(batch))
        with pytest.raises(ValueError, match="output_attentions"):
            model(**batch.model_kwargs(), output_attentions=True)
        with pytest.raises(ValueError, match="is_causal"):
            model(**batch.model_kwargs(), is_causal=False)
    finally:
        install.mix_tokens = real
    assert not calls

    # The cache refusal names the ways to decode, and they exist.
    with pytest.raises(ValueError, match=r"kdacp\.integrations\.transformers\.generate.*kdacp\.integrations\.transformers\.own_forwards"):
        model(**batch.model_kwargs(), use_cache=True)
    assert callable(kdacp.integrations.transformers.generate) and callable(kdacp.integrations.transformers.own_forwards)
    with kdacp.integrations.transformers.own_forwards(model), kdacp.integrations.transformers.torch_fallbacks(), torch.no_grad():
        model(input_ids=tokens()[:, :16], seq_idx=None, use_cache=True)  # no refusal: the check is off


def test_parallelized_model_takes_cu_seqlens_and_refuses_what_it_would_drop():
    run_ranks(_worker, 1)


def test_cu_seqlens_is_read_on_the_host_once_per_tensor():
    """The hook reads the longest document of a ``cu_seqlens=`` tensor on the host (a device sync) on the first
    forward that passes it, not on every one; a second set of boundaries is read once too; the layers' per-batch
    context of those boundaries reads nothing more."""
    from kdacp.cp import build_cp_context
    from kdacp.integrations.transformers.checks import CallCheck
    from tests.helpers import HostReads

    def forward(input_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None):
        pass

    check = CallCheck(forward)
    cu, other = torch.tensor([0, 5, 40, 64]), torch.tensor([0, 30, 64])
    counts = []
    with HostReads() as mode:
        mode.on_device(cu, other)
        for boundaries in (cu, cu, cu, other, other):
            before = len(mode.found)
            _, kwargs = check(None, (), dict(cu_seqlens=boundaries, cu_seq_lens_q=boundaries))
            counts.append(len(mode.found) - before)
            assert kwargs["max_length_q"] == int((boundaries[1:] - boundaries[:-1]).max())
        # the layers' per-batch context of the same boundaries takes the hook's host copy: no second sync a step
        before = len(mode.found)
        assert build_cp_context(cu, local_length=64).local_cu_seqlens_cpu.tolist() == [0, 5, 40, 64]
        assert len(mode.found) == before, mode.found[before:]
    assert counts == [1, 0, 0, 1, 0], counts
