"""A packed global batch cut into context-parallel shards under a token layout, and the loss and its scaling
contract.

Model-independent: works for any causal LM whose context-parallel forward takes each rank's tokens in the
order of a :class:`~kdacp.cp.layout.TokenLayout` (a rank's ranges concatenated in ascending global
order; the contiguous layout: equal time shards in rank order).

The loss-scaling contract (:func:`global_token_mean_loss`, and the ``.loss`` of a parallelised model): the
*loss group* is every rank holding part of the step's tokens (the context-parallel group, times the
data-parallel replicas: the flattened dp x cp mesh); each rank's loss has the value of the mean token loss
over the whole loss group, and the gradient ``W * sum(local token losses) / N``, with ``N`` the labelled
tokens of the loss group and ``W`` the number of ranks over which gradients are then *averaged*. FSDP2's
``fully_shard`` and DDP over the loss group average over its ``W`` ranks, so after ``backward()`` every
gradient is the gradient of the global token mean, with no collective written by hand. The contract holds
under any layout: labels are shifted over the global stream before the tokens are dealt out, so every
token carries its own target wherever it lands.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .groups import process_group
from .layout import TokenLayout, check_layout, make_layout
from ..sequences import sequence_positions

__all__ = ["LAYOUT_KWARG", "ShardedBatch", "causal_lm_loss", "global_token_mean_loss", "shard_batch", "shard_tokens"]

IGNORE_INDEX = -100
# The keyword under which ShardedBatch.model_kwargs() hands the batch's layout to a parallelised model's token
# mixers (transformers forwards unknown keyword arguments to every layer).
LAYOUT_KWARG = "kdacp_layout"


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's share of a global batch.

    Attributes:
        input_ids: ``[B, L]`` this rank's tokens: its ranges of ``layout`` in ascending global order
            (``L = layout.local_lengths[rank]``; ``T/P`` under the contiguous layout).
        labels: ``[B, L]`` the *next* global token of each of them within its document, already shifted over
            the global batch (a token at the end of one of the rank's ranges carries the first token of the
            next range, whichever rank holds it), ``-100`` at the last token of every document and on padding;
            do not shift again. (Labels given already shifted, :func:`shard_tokens`' ``labels_shifted``: their
            values at this rank's tokens.)
        position_ids: ``[B, L]`` global positions inside each document (restarting at 0 at each document
            start), at this rank's tokens.
        cu_seqlens: ``[N+1]`` int64 global document boundaries, padding included (None: ``B`` unpacked
            sequences). The same tensor object must reach every layer of a step: the plans are built once
            per tensor.
        layout: the :class:`~kdacp.cp.layout.TokenLayout` of the global (padded) stream the shard
            was cut by; :meth:`model_kwargs` hands it to the model, which checks it against its own.
        rank: the rank whose share this is.
        padding: how many ``pad_id`` tokens :func:`shard_tokens` added to the global batch so that it splits
            evenly (see its ``pad_id``), all labelled ``-100``.
        max_length: the longest document's length (read on the host once, when the batch is sharded; None
            without ``cu_seqlens``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    layout: TokenLayout
    rank: int
    padding: int = 0
    max_length: int | None = None

    def model_kwargs(self) -> dict:
        """Keyword arguments for a parallelised Hugging Face model's forward: the tokens, positions, the
        globally shifted ``labels`` (the model's ``.loss`` follows the contract of
        :func:`global_token_mean_loss`), the global boundaries under flash-attention's names
        (``cu_seq_lens_q/k``, ``max_length_q/k``) and the layout under :data:`LAYOUT_KWARG` (a parallelised
        model refuses a batch of another layout than its own)."""
        kwargs = dict(input_ids=self.input_ids, position_ids=self.position_ids, labels=self.labels)
        if self.cu_seqlens is not None:
            kwargs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens, max_length_q=self.max_length,
                          max_length_k=self.max_length)
        kwargs[LAYOUT_KWARG] = self.layout
        return kwargs


def _documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` boundaries where ``position_ids [1, T]`` restarts at 0 (how HF's packing collator marks documents)."""
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        raise ValueError("position_ids of a packed batch must start each document at 0, the first at token 0")
    return torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int64)


def _pads_to_p(layout: str, cu_seqlens: torch.Tensor | None) -> bool:
    """Whether the named ``layout`` splits evenly at a multiple of ``P`` tokens (else of ``2P``, per document under
    ``"document_zigzag"``): ``"contiguous"``, and ``"balanced_documents"`` of a packed batch."""
    return layout == "contiguous" or layout == "balanced_documents" and cu_seqlens is not None


def _padding_plan(layout: str, P: int, T: int, cu_seqlens: torch.Tensor | None) -> tuple[list[tuple[int, int]], bool]:
    """Where ``pad_id`` tokens go so that the named ``layout`` gives every rank the same number of tokens:
    ``(pads, own_document)``, ``pads`` the ``(global position before padding, count)`` pairs with a count,
    ascending. ``"contiguous"`` (and ``"balanced_documents"`` of a packed batch): ``(-T) % P`` at the end;
    ``"zigzag"`` (and the document layouts of one sequence): ``(-T) % 2P`` at the end; both a document of their
    own. ``"document_zigzag"``: each document's ``(-length) % 2P`` at its own end, extending it."""
    if _pads_to_p(layout, cu_seqlens):
        return [(T, n) for n in [(-T) % P] if n], True
    if layout == "zigzag" or cu_seqlens is None:
        return [(T, n) for n in [(-T) % (2 * P)] if n], True
    cu = cu_seqlens.tolist()
    return [(e, n) for s, e in zip(cu[:-1], cu[1:]) for n in [(s - e) % (2 * P)] if n], False


def shard_tokens(input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 cu_seqlens: torch.Tensor | None = None, *, rank: int, world_size: int, layout="contiguous",
                 pad_id: int | None = None, labels_shifted: bool = False) -> ShardedBatch:
    """Rank ``rank``'s share of a global batch under ``layout``, with next-token labels shifted over the global
    stream: :func:`shard_batch` without a process group (the same on every rank; ``rank`` and ``world_size``
    given). Arguments as :func:`shard_batch`'s, and ``labels_shifted``: ``labels`` already hold each token's
    own target (torchtitan's loaders shift them); they are dealt out as given, not shifted again."""
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    check_layout(layout)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    if cu_seqlens is None and position_ids is not None and B == 1 and bool((position_ids[0, 1:] == 0).any()):
        cu_seqlens = _documents_from_positions(position_ids)
    if cu_seqlens is not None:
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=input_ids.device)
        if B != 1:
            raise ValueError(f"a packed batch (cu_seqlens given) needs B == 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or bool((cu_seqlens.diff() <= 0).any()):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}, got {cu_seqlens.tolist()}")
    if position_ids is None:
        position_ids = (torch.arange(T, device=input_ids.device) if cu_seqlens is None
                        else sequence_positions(cu_seqlens, 0, T)).expand(B, T)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(position_ids.shape)}")

    padding = 0
    if not isinstance(layout, str):
        if pad_id is not None:
            raise ValueError("pad_id pads for a named layout; a TokenLayout (or a layout rule's) must cover the "
                             "batch's T tokens as given")
    else:
        pads, own_document = _padding_plan(layout, world_size, T, cu_seqlens)
        if pads and (pad_id is None or B != 1):
            how = "or pass pad_id= to pad it" if B == 1 else f"pad_id= pads only batches of B == 1, got B={B}"
            unit = "P" if _pads_to_p(layout, cu_seqlens) else "2P (every document's, for document_zigzag)"
            raise ValueError(f"the global batch's T={T} tokens must split evenly over {world_size} ranks under the "
                             f"{layout!r} layout, a multiple of {unit} ({how})")
        if pads:
            input_ids, labels, position_ids, cu_seqlens = _padded(input_ids, labels, position_ids, cu_seqlens, pads,
                                                                  pad_id, own_document)
            padding = sum(n for _, n in pads)
            T += padding
    layout = make_layout(layout, world_size, T, cu_seqlens, input_ids.device)

    # Shift over the global stream before dealing the tokens out, so a token at the end of one of a rank's
    # ranges still learns the first token of the next range, wherever that lies.
    shifted = labels
    if not labels_shifted:
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        if cu_seqlens is not None:
            shifted[:, cu_seqlens[1:-1] - 1] = IGNORE_INDEX  # a document's last token has no next token
    own = layout.local_token_index(rank).to(input_ids.device)
    longest = None if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return ShardedBatch(input_ids[:, own].contiguous(), shifted[:, own].contiguous(), position_ids[:, own].contiguous(),
                        cu_seqlens, layout, rank, padding, longest)


def _padded(input_ids, labels, position_ids, cu_seqlens, pads, pad_id: int, own_document: bool):
    """The batch (``B == 1``) with ``pads`` (``(global position, count)``, ascending, at document ends) inserted,
    labels ``-100``. ``own_document``: the padding is a document of its own (one block after the last token:
    it changes nothing before it), positions from 0; otherwise each block extends the document that ends where
    it goes, after that document's last real token (so no real token sees it), continuing its positions."""
    T = input_ids.shape[1]
    ids, labs, pos, before = [], [], [], 0
    for at, n in pads:
        first = 0 if own_document else int(position_ids[0, at - 1]) + 1
        ids += [input_ids[:, before:at], input_ids.new_full((1, n), pad_id)]
        labs += [labels[:, before:at], labels.new_full((1, n), IGNORE_INDEX)]
        pos += [position_ids[:, before:at], torch.arange(first, first + n, device=position_ids.device)[None]]
        before = at
    ids.append(input_ids[:, before:])  # the documents after the last padded one
    labs.append(labels[:, before:])
    pos.append(position_ids[:, before:])
    ends = [T] if cu_seqlens is None else cu_seqlens[1:].tolist()
    if own_document:
        ends.append(T + pads[0][1])
    else:
        ends = [e + sum(n for at, n in pads if at <= e) for e in ends]
    return (torch.cat(ids, dim=1), torch.cat(labs, dim=1), torch.cat(pos, dim=1),
            torch.tensor([0, *ends], dtype=torch.int64, device=input_ids.device))


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, group=None, pad_id: int | None = None, *,
                layout="contiguous") -> ShardedBatch:
    """Cut a global batch into this rank's share under ``layout``, with next-token labels shifted globally.

    Call it on every rank with the same global batch.

    Args:
        input_ids: ``[B, T]`` the global tokens; ``B == 1`` for a packed batch. Under a named layout every
            rank gets the same number of tokens: ``T`` a multiple of ``P`` (contiguous) or ``2P`` (zigzag;
            every document's length, for document_zigzag), unless ``pad_id`` is given.
        labels: ``[B, T]`` the target of each token *before* shifting (Hugging Face's convention:
            ``labels = input_ids``, ``-100`` where no loss is wanted); default ``input_ids``.
        position_ids: ``[B, T]`` global positions restarting at each document; default derived
            from ``cu_seqlens`` (or ``arange(T)``). Without ``cu_seqlens``, a ``position_ids`` row with
            restarts (``B == 1``) defines the documents, as Hugging Face's flattening collator does.
        cu_seqlens: ``[N+1]`` global document boundaries (``0 ... T``), or None.
        group: the context-parallel process group or 1-D ``DeviceMesh`` (default: the world).
        pad_id: (``B == 1``, named layouts) the token that pads the batch to what the layout splits evenly,
            labelled ``-100`` so no token of it is learned (:attr:`ShardedBatch.padding` says how many).
            ``"contiguous"`` and ``"zigzag"``: ``(-T) % P`` resp. ``(-T) % 2P`` tokens appended as a document
            of their own, which no real token sees (under zigzag they land in rank 0's second range).
            ``"document_zigzag"`` of a packed batch: each document's ``(-length) % 2P`` tokens appended to that
            document, after its last real token (so no real token sees them), positions continuing, and
            ``cu_seqlens`` moved to include them (Megatron-Core's padded packed format). ``"balanced_documents"``
            of a packed batch: ``(-T) % P`` tokens as a document of their own at the end. None: refuse such a ``T``.
        layout: one of :data:`~kdacp.cp.layout.LAYOUTS` (``"contiguous"``: rank ``r`` holds the
            ``r``-th equal time shard; ``"zigzag"``: the stream cut into ``2P`` chunks, rank ``r`` holding chunks
            ``r`` and ``2P-1-r``; ``"document_zigzag"``: the same per document; ``"balanced_documents"``:
            :func:`~kdacp.cp.layout.balanced_document_layout`, the long documents cut per document, the
            short ones whole, for level attention work), or a
            :class:`~kdacp.cp.layout.TokenLayout` of the ``T`` tokens (taken as is, uneven allowed).

    Returns:
        A :class:`ShardedBatch`; pass ``batch.model_kwargs()`` to the parallelised model.

    Raises:
        ValueError: shapes that disagree, a ``T`` the layout does not split evenly without ``pad_id`` (or with
            ``B > 1``), boundaries that do not cover ``0 ... T``, an unknown layout or one of other size.
    """
    group = process_group(group, "group")
    return shard_tokens(input_ids, labels, position_ids, cu_seqlens, rank=dist.get_rank(group),
                        world_size=dist.get_world_size(group), layout=layout, pad_id=pad_id)


def global_token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, group=None,
                           ignore_index: int = IGNORE_INDEX, *, averaged: bool = False) -> torch.Tensor:
    """Cross-entropy averaged over every labelled token of the loss group, from this rank's shard: the
    loss-scaling contract of :mod:`kdacp.cp.sharding`.

    Args:
        logits: ``[B, T/P, vocab]`` this rank's logits.
        labels: ``[B, T/P]`` their targets, already shifted (:attr:`ShardedBatch.labels`).
        group: the loss group: a process group or 1-D ``DeviceMesh`` of every rank holding part of the
            step's tokens (default: the world).
        ignore_index: label of tokens without loss.
        averaged: the gradients are then averaged over ``group`` (FSDP2 or DDP over it; ``W`` its size);
            False: summed (an ``all_reduce(SUM)`` by hand; ``W = 1``).

    Returns:
        A float32 (or wider) scalar whose value is the global token mean on every rank and whose gradient is
        ``W * sum_local CE / N_global``: after the reduction that ``averaged`` names, every parameter's
        gradient is the one-process gradient of the global mean.
    """
    group = process_group(group, "group")
    local = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten().to(logits.device),
                            ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum().to(device=local.device, dtype=torch.float64)
    dist.all_reduce(count, group=group)
    mean_share = local / count.clamp(min=1).to(local.dtype)
    total = mean_share.detach().clone()
    dist.all_reduce(total, group=group)
    share = mean_share * dist.get_world_size(group) if averaged else mean_share
    # The value of the global mean with the gradient of this rank's share only.
    return share + (total - share.detach())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                   num_items_in_batch=None, ignore_index: int = IGNORE_INDEX, shift_labels: torch.Tensor | None = None,
                   *, group, **kwargs) -> torch.Tensor:
    """A parallelised model's ``loss_function`` (transformers' ``ForCausalLMLoss`` arguments):
    :func:`global_token_mean_loss` over the loss ``group`` with ``averaged=True``. ``labels`` are already
    shifted over the global batch (:attr:`ShardedBatch.labels`; ``shift_labels`` wins when given);
    ``num_items_in_batch`` is unused: the count is all-reduced over ``group``."""
    targets = labels if shift_labels is None else shift_labels
    return global_token_mean_loss(logits, targets, group, ignore_index, averaged=True)
