"""``shard_tokens`` / ``shard_batch`` under every token layout, on one process (the sharding needs no process
group): each rank's tokens, positions and globally shifted labels against the unsharded batch, the padding
that makes a layout split evenly, and the loss contract (the ranks' local token losses add up to the global
ones)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kdacp.cp.layout import document_zigzag_layout, ranges_layout, zigzag_layout
from kdacp.cp.sharding import IGNORE_INDEX, LAYOUT_KWARG, shard_tokens

VOCAB = 50
# Documents of every size class at P = 2, 3, 4: shorter than a zigzag chunk, one token, longer than a rank's share.
CU_SEQLENS = [0, 5, 6, 70, 73, 120]


def _tokens(T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, T), generator=torch.Generator().manual_seed(seed))


def _expected(ids: torch.Tensor, labels: torch.Tensor, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded batch's shifted labels and positions, token by token: a token's label is the next token's
    label inside its document, ``-100`` at a document's last token."""
    T = ids.shape[1]
    shifted = torch.full((T,), IGNORE_INDEX, dtype=labels.dtype)
    positions = torch.empty(T, dtype=torch.int64)
    for s, e in zip(cu[:-1], cu[1:]):
        for t in range(s, e):
            positions[t] = t - s
            if t + 1 < e:
                shifted[t] = labels[0, t + 1]
    return shifted, positions


def _reassembled(shards) -> dict:
    """The global stream put back together from every rank's share, by each local token's global index."""
    layout = shards[0].layout
    out = {name: torch.full((layout.num_tokens,), -7, dtype=torch.int64) for name in ("ids", "labels", "positions")}
    for batch in shards:
        own = layout.local_token_index(batch.rank)
        assert batch.input_ids.shape == (1, own.numel())
        out["ids"][own] = batch.input_ids[0]
        out["labels"][own] = batch.labels[0]
        out["positions"][own] = batch.position_ids[0]
    return out


def _random_ranges(T: int, P: int, seed: int):
    """Random ranges: the stream cut at random places, the pieces dealt to random ranks (every rank at least one)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), 3 * P - 1))
    pieces = list(zip([0, *cuts], [*cuts, T]))
    owners = list(range(P)) + [rng.randrange(P) for _ in range(len(pieces) - P)]
    rng.shuffle(owners)
    return ranges_layout([[p for p, o in zip(pieces, owners) if o == r] for r in range(P)], T)


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "document_zigzag", "balanced_documents", "ranges"])
def test_labels_and_positions_match_the_unsharded_batch(layout, P):
    T = 24 * P  # a multiple of 2P: no padding under contiguous and zigzag
    cu = [0, 5, 6, 3 * P + 1, 3 * P + 4, T] if layout != "document_zigzag" else [0, 2 * P, 8 * P, T]
    ids = _tokens(T)
    labels = ids.clone()
    labels[0, 3] = IGNORE_INDEX  # a caller's own ignored target stays ignored after the shift
    if layout == "ranges":
        layout = _random_ranges(T, P, seed=P)
    shards = [shard_tokens(ids, labels, cu_seqlens=torch.tensor(cu), rank=r, world_size=P, layout=layout)
              for r in range(P)]
    assert all(b.padding == 0 and b.cu_seqlens.tolist() == cu for b in shards)
    if isinstance(layout, str):  # a named layout gives every rank the same number of tokens
        assert {b.input_ids.shape[1] for b in shards} == {T // P}
    got = _reassembled(shards)
    shifted, positions = _expected(ids, labels, cu)
    assert torch.equal(got["ids"], ids[0])
    assert torch.equal(got["labels"], shifted)
    assert torch.equal(got["positions"], positions)
    # every rank's tokens in ascending global order
    for b in shards:
        own = b.layout.local_token_index(b.rank)
        assert bool((own.diff() > 0).all())
    # the point: at every range edge inside a document, the token's target is the first token of the next range
    crossing = [p.end - 1 for p in shards[0].layout.chain[:-1] if p.end not in cu and p.end != 3]
    assert crossing and all(shifted[t] == ids[0, t + 1] for t in crossing)


@pytest.mark.parametrize("layout", ["contiguous", "ranges"])
def test_labels_already_shifted_are_dealt_out_as_given(layout):
    """``labels_shifted``: each token keeps the target given for it (torchtitan's loaders shift labels), none
    shifted again nor ignored at document ends; tokens and positions as without it."""
    P, T = 3, CU_SEQLENS[-1]
    ids, labels = _tokens(T), _tokens(T, seed=1)
    layout = _random_ranges(T, P, seed=5) if layout == "ranges" else layout
    shards = [shard_tokens(ids, labels, cu_seqlens=torch.tensor(CU_SEQLENS), rank=r, world_size=P, layout=layout,
                           labels_shifted=True) for r in range(P)]
    got = _reassembled(shards)
    assert torch.equal(got["labels"], labels[0]) and torch.equal(got["ids"], ids[0])
    assert torch.equal(got["positions"], _expected(ids, labels, CU_SEQLENS)[1])


def test_rows_without_documents_share_one_layout():
    """``B > 1`` rows without boundaries: the layout applies to each row the same way; positions are ``arange``."""
    P, T = 3, 36
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    shards = [shard_tokens(ids, rank=r, world_size=P, layout="zigzag") for r in range(P)]
    for b in shards:
        own = b.layout.local_token_index(b.rank)
        assert torch.equal(b.input_ids, ids[:, own])
        assert torch.equal(b.position_ids, own.expand(2, -1))
        nxt = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
        assert torch.equal(b.labels, nxt[:, own])
    assert shards[0].layout.ranges[0] == ((0, 6), (30, 36))


def test_zigzag_padding_is_a_document_of_its_own_at_the_end():
    P, T = 4, 61  # 61 % 8 = 5: three pad tokens, in chunk 2P - 1, rank 0's second range
    ids = _tokens(T)
    cu = [0, 20, T]
    shards = [shard_tokens(ids, cu_seqlens=torch.tensor(cu), rank=r, world_size=P, layout="zigzag", pad_id=0)
              for r in range(P)]
    assert {b.input_ids.shape[1] for b in shards} == {16} and shards[0].padding == 3
    assert shards[0].cu_seqlens.tolist() == [0, 20, T, T + 3]
    assert torch.equal(shards[0].input_ids[0, -3:], torch.zeros(3, dtype=torch.int64))
    got = _reassembled(shards)
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.int64)], dim=1)
    pad_labels = padded.clone()
    pad_labels[0, T:] = IGNORE_INDEX
    shifted, positions = _expected(padded, pad_labels, [0, 20, T, T + 3])
    assert torch.equal(got["labels"], shifted) and torch.equal(got["positions"], positions)
    assert torch.equal(got["labels"][:T], _expected(ids, ids, cu)[0])  # the real tokens' targets unchanged


def test_balanced_documents_pad_to_a_multiple_of_p_as_a_document_of_their_own():
    P, T = 4, 61  # 61 % 4 = 1: three pad tokens after the last document
    ids = _tokens(T)
    cu = [0, 20, 23, T]
    shards = [shard_tokens(ids, cu_seqlens=torch.tensor(cu), rank=r, world_size=P, layout="balanced_documents",
                           pad_id=0) for r in range(P)]
    assert {b.input_ids.shape[1] for b in shards} == {16} and shards[0].padding == 3
    assert shards[0].cu_seqlens.tolist() == [0, 20, 23, T, T + 3]
    got = _reassembled(shards)
    assert torch.equal(got["labels"][:T], _expected(ids, ids, cu)[0])  # the real tokens' targets unchanged
    with pytest.raises(ValueError, match=r"a multiple of P \(or pass pad_id"):
        shard_tokens(ids, cu_seqlens=torch.tensor(cu), rank=0, world_size=P, layout="balanced_documents")


@pytest.mark.parametrize("cu_seqlens", [CU_SEQLENS, [0, 5, 6, 70, 73, 120, 126]])  # the last one needs no pad
def test_document_zigzag_pads_every_document_to_2p(cu_seqlens):
    """Each document grows to a multiple of ``2P`` by pad tokens after its last real token (positions going
    on, labels ``-100``); every rank then holds the same number of tokens of every document."""
    P, CU_SEQLENS = 3, cu_seqlens
    ids = _tokens(CU_SEQLENS[-1])
    shards = [shard_tokens(ids, cu_seqlens=torch.tensor(CU_SEQLENS), rank=r, world_size=P, layout="document_zigzag",
                           pad_id=0) for r in range(P)]
    lengths = [e - s for s, e in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])]
    padded_lengths = [n + (-n) % (2 * P) for n in lengths]
    cu = [0]
    for n in padded_lengths:
        cu.append(cu[-1] + n)
    assert shards[0].cu_seqlens.tolist() == cu and shards[0].padding == cu[-1] - CU_SEQLENS[-1]
    assert {b.input_ids.shape[1] for b in shards} == {cu[-1] // P}
    # the padded stream built by hand: each document, then its pads
    parts, labels = [], []
    for (s, e), n in zip(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]), padded_lengths):
        pad = torch.zeros(1, n - (e - s), dtype=torch.int64)
        parts += [ids[:, s:e], pad]
        labels += [ids[:, s:e], pad + IGNORE_INDEX]
    padded, padded_labels = torch.cat(parts, dim=1), torch.cat(labels, dim=1)
    got = _reassembled(shards)
    shifted, positions = _expected(padded, padded_labels, cu)
    assert torch.equal(got["ids"], padded[0])
    assert torch.equal(got["labels"], shifted) and torch.equal(got["positions"], positions)
    real = got["ids"] != 0
    assert int((got["labels"][real] != IGNORE_INDEX).sum()) == sum(n - 1 for n in lengths)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "document_zigzag"])
def test_loss_contract_holds_under_the_layout(layout):
    """The ranks' summed local cross-entropies and label counts are the unsharded batch's (Hugging Face's own
    per-document shift), so the global token mean of :func:`global_token_mean_loss` is unchanged."""
    P = 4
    ids = _tokens(CU_SEQLENS[-1], seed=5)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    total, count = 0.0, 0
    for s, e in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]):
        total += float(F.cross_entropy(table[ids[0, s:e - 1]], ids[0, s + 1:e], reduction="sum"))
        count += e - s - 1
    local_total, local_count = 0.0, 0
    for r in range(P):
        b = shard_tokens(ids, cu_seqlens=torch.tensor(CU_SEQLENS), rank=r, world_size=P, layout=layout, pad_id=0)
        local_total += float(F.cross_entropy(table[b.input_ids[0]], b.labels[0], ignore_index=IGNORE_INDEX,
                                             reduction="sum"))
        local_count += int((b.labels != IGNORE_INDEX).sum())
    assert local_count == count
    assert abs(local_total - total) < 1e-9 * abs(total)


def test_model_kwargs_carry_the_layout():
    ids = _tokens(48)
    contiguous = shard_tokens(ids, rank=1, world_size=4)
    zigzag = shard_tokens(ids, rank=1, world_size=4, layout="zigzag")
    assert contiguous.model_kwargs()[LAYOUT_KWARG].ranges[1] == ((12, 24),)
    assert zigzag.model_kwargs()[LAYOUT_KWARG] is zigzag.layout
    assert zigzag.layout.ranges[1] == ((6, 12), (36, 42))


def test_bad_arguments_are_named():
    ids = _tokens(30)
    with pytest.raises(ValueError, match=r"zigzag' layout, a multiple of 2P .*or pass pad_id="):
        shard_tokens(ids, rank=0, world_size=4, layout="zigzag")  # 30 % 8 != 0 (30 % 4 too)
    with pytest.raises(ValueError, match="multiple of 2P"):
        shard_tokens(_tokens(28), rank=0, world_size=2, cu_seqlens=torch.tensor([0, 5, 28]), layout="document_zigzag")
    with pytest.raises(ValueError, match="layout must be a TokenLayout, one of .* or a layout rule"):
        shard_tokens(ids, rank=0, world_size=2, layout="spiral")
    with pytest.raises(ValueError, match="layout must cover 30 tokens over 2 ranks"):
        shard_tokens(ids, rank=0, world_size=2, layout=ranges_layout([[(0, 10)], [(10, 31)]]))
    with pytest.raises(ValueError, match="pad_id pads for a named layout"):
        shard_tokens(ids, rank=0, world_size=2, layout=ranges_layout([[(0, 10)], [(10, 30)]]), pad_id=0)
    with pytest.raises(ValueError, match="layout must cover 30 tokens over 2 ranks"):
        shard_tokens(ids, rank=0, world_size=2, layout=lambda cu, world_size, device: zigzag_layout(32, world_size))


def test_a_layout_rule_shards_as_its_layout():
    """A layout rule (a callable from the batch's boundaries, P and device to a layout) deals the tokens out as the
    layout it returns for this batch, called with the global boundaries as host ints."""
    cu = torch.tensor([0, 6, 14, 30])
    seen = []

    def rule(boundaries, world_size, device):
        seen.append((boundaries, world_size, device))
        return document_zigzag_layout(boundaries, world_size)

    ids = _tokens(30)
    for rank in range(2):
        by_rule = shard_tokens(ids, rank=rank, world_size=2, cu_seqlens=cu, layout=rule)
        given = shard_tokens(ids, rank=rank, world_size=2, cu_seqlens=cu,
                             layout=document_zigzag_layout([0, 6, 14, 30], 2))
        assert by_rule.layout == given.layout and torch.equal(by_rule.input_ids, given.input_ids)
        assert torch.equal(by_rule.labels, given.labels)
    assert seen == [((0, 6, 14, 30), 2, torch.device("cpu"))] * 2
    with pytest.raises(ValueError, match="rank must be < world_size=2"):
        shard_tokens(ids, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pad_id= pads only batches of B == 1"):
        shard_tokens(_tokens(30).expand(2, -1), rank=0, world_size=4, layout="zigzag", pad_id=0)
