"""torchtitan's context-parallel load balancers (``parallelism.context_parallel_load_balancer``) as kdacp
token layouts: :class:`BalancedLayout`, a rule from a batch's global document offsets to its layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer, _PTRRLoadBalancer

from torchtitan.distributed.utils import is_in_batch_invariant_mode
from torchtitan.models.common.attention import create_attention_mask

from ...cp.layout import TokenLayout, contiguous_layout, ranges_layout
from ...sequences import sequence_positions

CACHED_BATCHES = 8  # batches whose layout and context are kept (a few are in flight with AC recompute)
# torchtitan's parallelism.context_parallel_load_balancer values (torchtitan 0.3.0's cp_shard).
LOAD_BALANCERS = (None, "headtail", "ptrr")


def document_mask_mod(positions: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor):
    """The FlexAttention ``mask_mod`` of torchtitan's packed-document attention (causal within each document of
    ``positions [1, T]``, 0 at each document start) for query place ``q_idx`` holding global token
    ``queries[q_idx]`` and key place ``kv_idx`` holding ``keys[kv_idx]`` (int32 tensors on ``positions``' device)."""
    first = queries - positions[0, queries.long()].to(torch.int32)  # each query's document start

    def mask_mod(b, h, q_idx, kv_idx):
        key = keys[kv_idx]
        # a where, not an &: Inductor's vectorised CPU code for the & of two gathered comparisons does not compile
        return torch.where(key <= queries[q_idx], key >= first[q_idx], False)

    return mask_mod


def _layout_of_order(order: torch.Tensor, world_size: int) -> TokenLayout:
    """The layout of a load balancer's rearranged order ``order [T]`` (the global token at each place, as torch's
    balancers' ``_generate_indices`` give it): rank ``r`` holds the ``r``-th of ``world_size`` equal parts, which
    must ascend (kdacp's layouts keep a rank's tokens in global order)."""
    ranges = []
    for r, part in enumerate(order.to(torch.int64).cpu().tensor_split(world_size)):
        step = part.diff()
        if bool((step <= 0).any()):
            raise ValueError(f"the load balancer's tokens for rank {r} are not in ascending global order; kdacp's "
                             "layouts need them so (torchtitan 0.3.0's balancers give them so)")
        edges = [0, *(torch.nonzero(step != 1).flatten() + 1).tolist(), part.numel()]
        ranges.append([(int(part[a]), int(part[b - 1]) + 1) for a, b in zip(edges[:-1], edges[1:])])
    return ranges_layout(ranges, order.numel())


@dataclass(frozen=True)
class BalancedLayout:
    """Which tokens of a batch each ``cp`` rank holds under torchtitan's context-parallel load balancer
    (``parallelism.context_parallel_load_balancer``), as a kdacp layout the GDN layers follow:

    - ``None``: equal contiguous shards, rank ``r`` holding tokens ``[r T/P, (r+1) T/P)``;
    - ``"headtail"``: torch's ``_HeadTailLoadBalancer``: ``2P`` equal chunks, rank ``r`` holding chunks ``r``
      and ``2P-1-r`` (kdacp's zigzag);
    - ``"ptrr"``: torch's ``_PTRRLoadBalancer`` over the document-causal ``BlockMask`` of ``block_size`` tokens
      (the attention layers' mask): whole blocks dealt out by their attention work.

    Rank ``r``'s tokens are the ``r``-th of ``P`` equal parts of the balancer's rearranged order (torch's
    contract), each rank's in ascending global order. Calling it with the batch's global document offsets
    gives its :class:`~kdacp.cp.layout.TokenLayout` (the last :data:`CACHED_BATCHES` kept).
    """

    balancer: str | None = "headtail"
    block_size: int = 128

    def __post_init__(self):
        if self.balancer not in LOAD_BALANCERS:
            raise ValueError(f"parallelism.context_parallel_load_balancer must be one of {LOAD_BALANCERS}, "
                             f"got {self.balancer!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def __call__(self, cu_seqlens, world_size: int, device=None) -> TokenLayout:
        """The layout of the packed row of global document offsets ``cu_seqlens`` (``[N+1]`` ints, ``0 ... T``)
        over ``world_size`` ranks; ``device``: where the ``"ptrr"`` balancer builds its mask (default the CPU).

        Raises:
            ValueError: ``T`` not a multiple of ``P`` (no balancer), ``2P`` (``"headtail"``) or
                ``P x block_size`` (``"ptrr"``).
        """
        return _batch_layout(self, tuple(int(c) for c in cu_seqlens), world_size,
                                torch.device("cpu" if device is None else device))


@lru_cache(maxsize=CACHED_BATCHES)
def _batch_layout(rule: BalancedLayout, cu_seqlens: tuple[int, ...], P: int, device: torch.device) -> TokenLayout:
    T = cu_seqlens[-1]
    if P == 1:
        return contiguous_layout(T, 1)
    unit, what = {None: (P, "P"), "headtail": (2 * P, "2P"),
                  "ptrr": (P * rule.block_size, f"P x the attention's block size {rule.block_size}")}[rule.balancer]
    if T % unit:
        raise ValueError(f"the batch's {T} tokens must split evenly over cp={P} ranks under the "
                         f"{rule.balancer!r} load balancer: a multiple of {what} ({unit})")
    if rule.balancer is None:
        return contiguous_layout(T, P)
    if rule.balancer == "headtail":
        return _layout_of_order(_HeadTailLoadBalancer(T, P, device)._generate_indices()[0], P)
    positions = sequence_positions(torch.tensor(cu_seqlens, device=device), 0, T)[None]
    tokens = torch.arange(T, dtype=torch.int32, device=device)
    mask = create_attention_mask(document_mask_mod(positions, tokens, tokens), 1, None, T, T, device=device,
                                 BLOCK_SIZE=rule.block_size, separate_full_blocks=not is_in_batch_invariant_mode())
    return _layout_of_order(_PTRRLoadBalancer(mask, P)._generate_indices()[0], P)
