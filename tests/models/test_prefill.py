"""``kdacp.integrations.transformers.prefill`` and ``generate`` on tiny random Hugging Face Kimi Linear (sdpa) and Qwen3-Next (eager)
models over 2 and 4 gloo ranks against the unmodified one-process model, float32.

For prompts of 40 tokens (split evenly over 2 and 4 ranks) and 37 (over neither: ``shard_batch(pad_id=...)``
pads it with a document of its own), every rank's cache after ``prefill`` (each layer's convolution input and
recurrent state, each attention layer's keys and values; the cache's position) and the last token's logits
match the one-process ``model(prompt, use_cache=True)`` within ``TOL`` (relative, 2-norm), bitwise alike on
every rank; a prefill of 37 tokens in 3 pieces (13, 14, 10; each under CP, continuing the cache) matches the
one-pass cache the same way; ``generate`` gives the one-process ``model.generate(prompt, max_new_tokens=16,
do_sample=False)`` tokens; seeded sampling gives the same tokens on every rank. Each mechanism matters: without
the initial state, the cached convolution input, one rank's key/value block or the owner's convolution input,
the cache leaves ``TOL``. The same under zigzag (model and prompts), where without the gathered keys' global
order, the owner's range's halo in the convolution tail, or (4 ranks) the cached convolution input in the
halos of every range near a piece's start, the cache leaves ``TOL``.

Qwen3-Next's one-process reference runs its GDN in the recurrent form (tests/models/test_qwen3_next_cp.py says
why: the chunked form underflows in float32 on its strong decays).
"""
from __future__ import annotations

import contextlib
import inspect
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformers  # noqa: F401  (in the `test` extra: a missing install fails here, not skips)

from tests.helpers import rel_err
from tests.models import test_kimi_linear_cp, test_qwen3_next_cp
from tests.models.cp_common import TOL, VOCAB
from tests.multiprocess import run_ranks

LENGTHS = (40, 37)
PIECES = (13, 14, 10)  # a 37-token prompt in 3 pieces
NEW_TOKENS = 16


def _qwen3_next():
    """Qwen3-Next's test model with weak decays (``A = exp(A_log) = 0.14``): its initialisation draws ``A`` up to
    16, and a state so decayed is forgotten within a piece of the prompt, so that dropping it goes unseen."""
    model = test_qwen3_next_cp._model(attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(-2.0)
    return model


MODELS = {"kimi_linear": lambda: test_kimi_linear_cp._model(attn_implementation="sdpa"), "qwen3_next": _qwen3_next}


def _prompt(T: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))


@contextlib.contextmanager
def _transformers_code(name: str):
    """transformers' own PyTorch code; Qwen3-Next's GDN in its recurrent form."""
    from kdacp.integrations.transformers import load_qwen3_next, torch_fallbacks
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_fallbacks())
        if name == "qwen3_next":
            qn = load_qwen3_next()
            stack.enter_context(mock.patch.object(qn, "torch_chunk_gated_delta_rule",
                                                  inspect.unwrap(qn.torch_recurrent_gated_delta_rule)))
        yield


def cache_tensors(cache) -> dict:
    """Every tensor of a transformers cache by name (layer, kind), and its position."""
    from kdacp.integrations.transformers.prefill import cache_tensors as tensors
    return {"position": torch.tensor(float(cache.get_seq_length())), **tensors(cache)}


def _reference() -> dict:
    """Per model and prompt length: the one-process cache tensors, last logits and greedy tokens."""
    ref = {}
    for name, make in MODELS.items():
        model = make()
        with _transformers_code(name), torch.no_grad():
            for T in LENGTHS:
                out = model(input_ids=_prompt(T), use_cache=True)
                ref[name, T] = dict(cache=cache_tensors(out.cache), logits=out.logits[:, -1],
                                    tokens=model.generate(_prompt(T), max_new_tokens=NEW_TOKENS, do_sample=False,
                                                                  use_cache=True))
    return ref


def _worst(got: dict, want: dict, group=None) -> tuple[str, float]:
    """The largest relative error over the cache tensors (and logits) and over the ranks."""
    assert got.keys() == want.keys(), f"cache layout {sorted(got)} != {sorted(want)}"
    for k in got:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, \
            f"{k}: {tuple(got[k].shape)} {got[k].dtype} != {tuple(want[k].shape)} {want[k].dtype}"
    errs = torch.tensor([rel_err(got[k], want[k]) for k in got], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    i = int(errs.argmax())
    return list(got)[i], float(errs[i])


def _same_on_every_rank(tensors: dict) -> None:
    for k, t in tensors.items():
        first = t.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(first, t), f"{k} differs between rank 0 and rank {dist.get_rank()}"


def _prefill_tensors(model, T: int, pieces=None, layout="contiguous") -> dict:
    """The cache tensors and logits after prefilling a ``T``-token prompt under CP (in ``pieces``), the prompt
    sharded under ``layout``."""
    import kdacp
    prompt, cache, start = _prompt(T), None, 0
    for n in pieces or (T,):
        batch = kdacp.shard_batch(prompt[:, start:start + n], pad_id=0, layout=layout)
        cache, logits = kdacp.integrations.transformers.prefill(model, batch, cache=cache)
        start += n
    return dict(**cache_tensors(cache), logits=logits)


def _broken() -> dict:
    """What to drop -> (owner, attribute, fake), and the prefill (pieces) whose cache must then leave TOL."""
    from kdacp.integrations.transformers.prefill import PrefillCache  # (kdacp.integrations.transformers.prefill is the function)

    def no_initial_state(self, layer_idx):
        return None

    def no_cached_conv_input(self, layer_idx):
        return None

    def one_block_lost(self, x, real=PrefillCache.gather):
        full = real(self, x)
        full[..., :x.shape[-2], :] = 0  # rank 0's block
        return full

    def own_conv_input(self, real=PrefillCache.finish):  # each rank keeps its own candidate
        with mock.patch.object(dist, "broadcast", lambda *args, **kwargs: None):
            real(self)

    return {
        "initial state": ((PrefillCache, "recurrent_state", no_initial_state), PIECES),
        "cached convolution input": ((PrefillCache, "conv_state", no_cached_conv_input), PIECES),
        "a key/value block": ((PrefillCache, "gather", one_block_lost), None),
        "the owner's convolution input": ((PrefillCache, "finish", own_conv_input), None),
    }


def _check_contract(rank: int) -> None:
    """On 2 ranks: shard_batch's padding, and what prefill and generate refuse, with the argument named."""
    import kdacp
    from kdacp.cp.sharding import IGNORE_INDEX
    prompt = _prompt(37)
    batch = kdacp.shard_batch(prompt, pad_id=0)  # 38 tokens: the padding is the last rank's last token
    assert batch.padding == 1 and batch.cu_seqlens.tolist() == [0, 37, 38] and batch.input_ids.shape == (1, 19)
    if rank == 1:
        assert batch.input_ids[0, -1] == 0 and batch.position_ids[0, -1] == 0
        assert (batch.labels[0, -2:] == IGNORE_INDEX).all() and batch.labels[0, -3] == prompt[0, 36]
    with pytest.raises(ValueError, match="pad_id= pads only batches of B == 1"):
        kdacp.shard_batch(prompt.expand(2, -1), pad_id=0)
    with pytest.raises(ValueError, match="or pass pad_id= to pad it"):
        kdacp.shard_batch(prompt)
    model = MODELS["kimi_linear"]()
    with pytest.raises(ValueError, match="runs a kdacp.parallelize'd model"):
        kdacp.integrations.transformers.prefill(model, batch)
    kdacp.parallelize(model, kdacp.ContextParallel("state"))
    with pytest.raises(ValueError, match="batch must be a kdacp.ShardedBatch"):
        kdacp.integrations.transformers.prefill(model, prompt)
    with pytest.raises(ValueError, match="one prompt: batch size 1 and one document"):
        kdacp.integrations.transformers.prefill(model, kdacp.shard_batch(_prompt(40), cu_seqlens=torch.tensor([0, 20, 40])))
    with pytest.raises(ValueError, match="drop cache="):
        kdacp.integrations.transformers.generate(model, batch, 4, cache=None)
    # A prompt sharded under another layout than the model's, or a model under a layout prefill does not run, is
    # refused by name before any exchange.
    zigzag = kdacp.parallelize(MODELS["kimi_linear"](), kdacp.ContextParallel("state", layout="zigzag"))
    for m, layout in ((model, "zigzag"), (zigzag, "contiguous")):
        with pytest.raises(ValueError, match="sharded under another layout than the model's"):
            kdacp.integrations.transformers.prefill(m, kdacp.shard_batch(_prompt(40), layout=layout))
    from kdacp.cp.layout import ranges_layout
    ranges = kdacp.parallelize(MODELS["kimi_linear"](), kdacp.ContextParallel(
        "state", layout=ranges_layout([[(0, 10), (30, 40)], [(10, 30)]])))
    with pytest.raises(ValueError, match="prefill and generate run the layouts"):
        kdacp.integrations.transformers.generate(ranges, kdacp.shard_batch(_prompt(40)), 4)
    spec = next(m._kdacp_ulysses for m in model.modules() if hasattr(m, "_kdacp_ulysses"))
    spec.inner_name = "flash_attention_2"
    with pytest.raises(ValueError, match=r"runs the model's \('eager', 'sdpa'\) implementations"):
        kdacp.integrations.transformers.prefill(model, batch)
    ulysses = kdacp.parallelize(MODELS["kimi_linear"](), kdacp.ContextParallel("ulysses"))
    with pytest.raises(ValueError, match="mode 'state', layer 0 has ContextParallel\\(mode='ulysses'"):
        kdacp.integrations.transformers.prefill(ulysses, batch)


def _worker(rank, world_size, ref, results):
    import kdacp
    if world_size == 2:
        _check_contract(rank)
    worst = {}
    for name, make in MODELS.items():
        model = kdacp.parallelize(make(), kdacp.ContextParallel("state"))
        want = {T: dict(**ref[name, T]["cache"], logits=ref[name, T]["logits"]) for T in LENGTHS}
        for T in LENGTHS:
            got = _prefill_tensors(model, T)
            _same_on_every_rank(got)
            worst[f"{name} prefill {T}"] = _worst(got, want[T])
        got = _prefill_tensors(model, 37, PIECES)
        _same_on_every_rank(got)
        worst[f"{name} prefill 37 in {PIECES}"] = _worst(got, want[37])
        for what, ((owner, attr, fake), pieces) in (_broken() if world_size == 2 else {}).items():
            with mock.patch.object(owner, attr, fake):
                key, err = _worst(_prefill_tensors(model, 37, pieces), want[37])
            assert err > 100 * TOL, f"{name} on {world_size} ranks: without {what} the cache still matches"
            worst[f"{name} without {what}"] = (key, err)
        with _transformers_code(name):
            for T in LENGTHS:
                ids = kdacp.integrations.transformers.generate(model, kdacp.shard_batch(_prompt(T), pad_id=0), NEW_TOKENS,
                                            do_sample=False)
                assert torch.equal(ids, ref[name, T]["tokens"]), f"{name} T={T}: {ids} != {ref[name, T]['tokens']}"
            torch.manual_seed(7)  # every rank alike; generate checks that the ranks agree
            sampled = kdacp.integrations.transformers.generate(model, kdacp.shard_batch(_prompt(37), pad_id=0), NEW_TOKENS,
                                            do_sample=True, top_k=0, temperature=2.0)
            _same_on_every_rank({"sampled": sampled})
        # generate (own_forwards) put parallelize's forwards back
        assert all("forward" in vars(m) for m in model.modules() if type(m).__name__.endswith(("DeltaAttention",
                                                                                             "GatedDeltaNet")))
    if rank == 0:
        results.update(worst)


def _broken_zigzag(world_size: int) -> dict:
    """What zigzag prefill needs beyond the contiguous one -> (owner, attribute, fake): on 2 ranks the gathered keys
    and values put in global order, and the convolution's last input tokens continued from the owner's range's
    halo (the pieces of 13, 14 and 10 tokens end a token or two into rank 0's second range); on 4 ranks (chunks
    of 2 tokens, shorter than the convolution's halo) the cached convolution input in the halos of the ranges
    that start within ``W - 1`` tokens of the piece's first token, not only rank 0's."""
    from kdacp.integrations.transformers.prefill import PrefillCache

    def rank_0_only(self, layer_idx, real=PrefillCache.conv_state):
        return real(self, layer_idx) if self.rank == 0 else None

    if world_size == 4:
        return {"the cached convolution input beyond rank 0": (PrefillCache, "conv_state", rank_0_only)}

    def rank_order(self, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-2)[..., :self.valid, :]

    def no_halo(self, layer_idx, xs, halos, width, real=PrefillCache.record_conv_input):
        return real(self, layer_idx, xs, [None] * len(xs), width)

    return {"the global order of the gathered keys": (PrefillCache, "gather", rank_order),
            "the halo of the owner's range": (PrefillCache, "record_conv_input", no_halo)}


def _zigzag_worker(rank, world_size, ref, results):
    """Prefill and generate with the model and the prompts under zigzag: the same caches, logits and tokens."""
    import kdacp
    worst = {}
    for name, make in MODELS.items():
        model = kdacp.parallelize(make(), kdacp.ContextParallel("state", layout="zigzag"))
        want = {T: dict(**ref[name, T]["cache"], logits=ref[name, T]["logits"]) for T in LENGTHS}
        for T, pieces in [(T, None) for T in LENGTHS] + [(37, PIECES)]:
            got = _prefill_tensors(model, T, pieces, layout="zigzag")
            _same_on_every_rank(got)
            worst[f"{name} zigzag prefill {T} in {pieces or (T,)}"] = _worst(got, want[T])
        for what, (owner, attr, fake) in _broken_zigzag(world_size).items():
            with mock.patch.object(owner, attr, fake):
                key, err = _worst(_prefill_tensors(model, 37, PIECES, layout="zigzag"), want[37])
            assert err > 100 * TOL, f"{name} under zigzag: without {what} the cache still matches"
            worst[f"{name} zigzag without {what}"] = (key, err)
        with _transformers_code(name):
            for T in LENGTHS:
                ids = kdacp.integrations.transformers.generate(model, kdacp.shard_batch(_prompt(T), pad_id=0, layout="zigzag"),
                                            NEW_TOKENS, do_sample=False)
                results[f"{name} zigzag generate {T}"] = ids
    if rank == 0:
        results.update(worst)


reference = pytest.fixture(scope="module", name="reference")(lambda: _reference())


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_prefill_and_generate_match_one_process(world_size, reference):
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_worker, world_size, reference, results)
    for what, (key, err) in results.items():
        assert "without" in what or err < TOL, f"{what}: {key} off by {err:.2e}"
    print({what: f"{key}: {err:.1e}" for what, (key, err) in results.items()})


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zigzag_prefill_and_generate_match_one_process(world_size, reference):
    """Under zigzag (rank 0 holds the prompt's first and last chunks; padding after the last token): every rank's
    cache and logits after prefill (in one pass, and in 3 pieces) as one process's within TOL, and greedy
    generate's tokens as ``model.generate``'s."""
    results = torch.multiprocessing.Manager().dict()
    run_ranks(_zigzag_worker, world_size, reference, results)
    print({what: value for what, value in results.items() if "generate" not in what})
    for what, (key, err) in ((w, v) for w, v in results.items() if "generate" not in w and "without" not in w):
        assert err < TOL, f"{what}: {key} off by {err:.2e}"
    for what, ids in ((w, v) for w, v in results.items() if "generate" in w):
        name, _, _, T = what.split()
        assert torch.equal(ids, reference[name, int(T)]["tokens"]), f"{what}: {ids}"


def _attend_float64(q, k, v, causal):
    """``(out, lse)`` of softmax attention in float64, upper-left causal when ``causal`` (square)."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


@pytest.mark.parametrize("n,Tk", [(5, 5), (5, 12), (1, 9), (7, 8)])
def test_split_lower_right_matches_the_masked_softmax(n, Tk):
    """The GPU prefill's attention of a piece (or a later rank) against all earlier keys: two calls merged by
    their log-sum-exps equal one lower-right masked softmax (float64); the earlier keys' part matters."""
    from kdacp.integrations.transformers.prefill import split_lower_right
    gen = torch.Generator().manual_seed(n * 100 + Tk)
    q, k = torch.randn(2, 3, n, 8, generator=gen), torch.randn(2, 3, Tk, 8, generator=gen)
    v = torch.randn(2, 3, Tk, 6, generator=gen)
    seen = torch.arange(Tk)[None, :] <= torch.arange(n)[:, None] + (Tk - n)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 8 ** -0.5
    want = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v.double()
    got = split_lower_right(_attend_float64, q.double(), k.double(), v.double(), n)
    assert got.shape == want.shape and rel_err(got, want) < 1e-12
    if n < Tk:  # the square causal part alone (the earlier keys dropped) is far off
        own = _attend_float64(q, k[..., Tk - n:, :], v[..., Tk - n:, :], True)[0]
        assert rel_err(own, want) > 1e-2
