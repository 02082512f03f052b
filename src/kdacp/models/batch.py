"""A packed global batch cut into context-parallel shards, and the loss and its scaling contract.

Model-independent: works for any causal LM whose context-parallel forward takes equal time shards in
rank order (what :func:`kdacp.parallelize` expects).

The loss-scaling contract (:func:`global_token_mean_loss`, and the ``.loss`` of a parallelised model): the
*loss group* is every rank holding part of the step's tokens (the context-parallel group, times the
data-parallel replicas: the flattened dp x cp mesh); each rank's loss has the value of the mean token loss
over the whole loss group, and the gradient ``W * sum(local token losses) / N``, with ``N`` the labelled
tokens of the loss group and ``W`` the number of ranks over which gradients are then *averaged*. FSDP2's
``fully_shard`` and DDP over the loss group average over its ``W`` ranks, so after ``backward()`` every
gradient is the gradient of the global token mean, with no collective written by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.comm import process_group
from ..layers.short_conv import sequence_positions

__all__ = ["ShardedBatch", "causal_lm_loss", "global_token_mean_loss", "shard_batch"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's share of a global batch.

    Attributes:
        input_ids: ``[B, T/P]`` this rank's tokens (shard ``rank`` of ``P`` equal time shards).
        labels: ``[B, T/P]`` the *next* token of each of them, already shifted over the global batch
            (a token at a rank's edge carries the first token of the next rank), ``-100`` at the last
            token of every document; do not shift again.
        position_ids: ``[B, T/P]`` global positions inside each document (restarting at 0 at each
            document start), this rank's slice.
        cu_seqlens: ``[N+1]`` int64 global document boundaries (None: ``B`` unpacked sequences). The
            same tensor object must reach every layer of a step: the plans are built once per tensor.
        padding: how many tokens :func:`shard_batch` appended to the global batch (``pad_id``) so that it
            splits evenly: the last document of ``cu_seqlens``, on the last ranks, labelled ``-100``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    padding: int = 0

    def model_kwargs(self) -> dict:
        """Keyword arguments for a parallelised Hugging Face model's forward: the tokens, positions, the
        globally shifted ``labels`` (the model's ``.loss`` follows the contract of
        :func:`global_token_mean_loss`), and the global boundaries under flash-attention's names
        (``cu_seq_lens_q/k``, ``max_length_q/k``)."""
        kwargs = dict(input_ids=self.input_ids, position_ids=self.position_ids, labels=self.labels)
        if self.cu_seqlens is not None:
            longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
            kwargs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens, max_length_q=longest,
                          max_length_k=longest)
        return kwargs


def _documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """``[N+1]`` boundaries where ``position_ids [1, T]`` restarts at 0 (how HF's packing collator marks documents)."""
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        raise ValueError("position_ids of a packed batch must start each document at 0, the first at token 0")
    return torch.cat([starts, starts.new_tensor([position_ids.shape[1]])]).to(torch.int64)


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, group=None, pad_id: int | None = None) -> ShardedBatch:
    """Cut a global batch into this rank's equal time shard, with next-token labels shifted globally.

    Call it on every rank with the same global batch.

    Args:
        input_ids: ``[B, T]`` the global tokens; ``B == 1`` for a packed batch. ``T`` must split
            evenly over the group's ``P`` ranks, unless ``pad_id`` is given.
        labels: ``[B, T]`` the target of each token *before* shifting (Hugging Face's convention:
            ``labels = input_ids``, ``-100`` where no loss is wanted); default ``input_ids``.
        position_ids: ``[B, T]`` global positions restarting at each document; default derived
            from ``cu_seqlens`` (or ``arange(T)``). Without ``cu_seqlens``, a ``position_ids`` row with
            restarts (``B == 1``) defines the documents, as Hugging Face's flattening collator does.
        cu_seqlens: ``[N+1]`` global document boundaries (``0 ... T``), or None.
        group: the context-parallel process group or 1-D ``DeviceMesh`` (default: the world).
        pad_id: where ``T % P != 0`` (``B == 1``), append ``(-T) % P`` tokens ``pad_id`` as a document of
            their own (labels ``-100``): no real token sees them, and no token of theirs is learned
            (:attr:`ShardedBatch.padding` says how many). None: refuse such a ``T``.

    Returns:
        A :class:`ShardedBatch`; pass ``batch.model_kwargs()`` to the parallelised model.

    Raises:
        ValueError: shapes that disagree, ``T % P != 0`` without ``pad_id`` (or with ``B > 1``), or boundaries
            that do not cover ``0 ... T``.
    """
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
    group = process_group(group, "group")
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    padding = (-T) % P
    if padding and (pad_id is None or B != 1):
        how = "or pass pad_id= to pad it" if B == 1 else f"pad_id= pads only batches of B == 1, got B={B}"
        raise ValueError(f"the global batch's T={T} tokens must split evenly over {P} ranks ({how})")
    if padding:  # a document of its own at the end: it changes nothing before it
        input_ids = torch.cat([input_ids, input_ids.new_full((1, padding), pad_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((1, padding), IGNORE_INDEX)], dim=1)
        position_ids = torch.cat([position_ids, torch.arange(padding, device=position_ids.device)[None]], dim=1)
        ends = ([T] if cu_seqlens is None else cu_seqlens[1:].tolist()) + [T + padding]
        cu_seqlens = torch.tensor([0, *ends], dtype=torch.int64, device=input_ids.device)
        T += padding

    # Shift over the global batch, so the token at a rank's last place still learns the next rank's first.
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        shifted[:, cu_seqlens[1:-1] - 1] = IGNORE_INDEX  # a document's last token has no next token
    own = slice(rank * (T // P), (rank + 1) * (T // P))
    return ShardedBatch(input_ids[:, own].contiguous(), shifted[:, own].contiguous(),
                        position_ids[:, own].contiguous(), cu_seqlens, padding)


def global_token_mean_loss(logits: torch.Tensor, labels: torch.Tensor, group=None,
                           ignore_index: int = IGNORE_INDEX, *, averaged: bool = False) -> torch.Tensor:
    """Cross-entropy averaged over every labelled token of the loss group, from this rank's shard: the
    loss-scaling contract of :mod:`kdacp.models.batch`.

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
