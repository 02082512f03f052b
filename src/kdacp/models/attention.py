"""Softmax attention of a parallelised Hugging Face model over the context-parallel group, registered in
transformers' attention registry as :data:`ATTENTION_NAME`.

The module's own forward computes q, k, v (norms, rotary embedding of the global positions) on the local
tokens; the registered function exchanges them and calls the model's previous attention implementation
(the "inner" one) with a per-document causal mask (:func:`document_causal_mask`). Two exchanges, chosen per
call from the head counts (:func:`kv_replication`):

* Ulysses (where ``H % P == 0``): one all-to-all from time shards to head shards (every rank then holds the
  whole global sequence of ``H/P`` query heads), the inner attention, one all-to-all back. Where the
  key/value heads do not split (``H_kv % P != 0``: Qwen3-Next's 2 key/value heads at ``P = 4, 8``) each is
  sent ``r = lcm(H_kv, P) / H_kv`` times (a rank's query heads need their group's key/value head), when that
  moves no more bytes than the gather below. Ulysses keeps the causal work balanced over ranks.
* K/V all-gather (where ``H % P != 0``: Kimi Linear's MLA with fewer heads than ranks; or where it moves
  fewer bytes than replicating): every rank gathers the keys and values of the whole sequence and attends
  its own queries with the global document-causal mask; backward reduce-scatters their gradients.

Bytes each rank sends per local token and layer (forward; the backward moves the same), ``P`` ranks, head
dims ``Dq, Dk, Dv``: Ulysses ``(P-1)/P * (H*Dq + r*H_kv*(Dk+Dv) + H*Dv)``; the gather ``(P-1) * H_kv*(Dk+Dv)``.
Where heads divide (``r = 1``) Ulysses stays, whatever the bytes: it is the exchange whose per-rank work is
equal. Qwen3-Next (``H = 16``, ``H_kv = 2``, ``D = 256``): Ulysses with replication 30 units at ``P = 4``,
42 at ``P = 8``; the gather 12 and 28 (units of ``T * 256``): the gather. Flash attention's inner call takes
no mask, so it runs Ulysses only (``H % P == 0``, checked by :func:`check_attention`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layers.comm import all_gather_along, heads_to_time, time_to_heads
from ..layers.short_conv import sequence_positions
from .checks import global_cu_seqlens, refuse_cache_and_mask

__all__ = ["ATTENTION_NAME", "INNER_ATTENTIONS", "check_attention", "document_causal_mask", "install_attention",
           "kv_replication", "replicate_kv_heads"]

ATTENTION_NAME = "kdacp_ulysses"
INNER_ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def document_causal_mask(cu_seqlens: torch.Tensor | None, T: int, device: torch.device,
                         queries: slice | None = None) -> torch.Tensor:
    """``[1, 1, Tq, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` inside one document of
    the global boundaries ``cu_seqlens`` (None: one sequence); ``queries``: the global positions of the
    queries (default all ``T``)."""
    t = torch.arange(T, device=device)
    tq = t if queries is None else t[queries]
    mask = t[None, :] <= tq[:, None]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device)
        mask = mask & (torch.searchsorted(cu, t, right=True)[None, :] == torch.searchsorted(cu, tq, right=True)[:, None])
    return mask[None, None]


def kv_replication(H: int, H_kv: int, dims: tuple[int, int, int], P: int, flash: bool) -> int | None:
    """How many times Ulysses sends each key/value head (``H % P == 0``), or None for the K/V all-gather
    (see the module docstring); ``dims``: ``(Dq, Dk, Dv)``."""
    if H % P:
        return None
    r = math.lcm(H_kv, P) // H_kv
    if r == 1 or flash:
        return r
    Dq, Dk, Dv = dims
    ulysses = (P - 1) * (H * Dq + r * H_kv * (Dk + Dv) + H * Dv)
    gather = P * (P - 1) * H_kv * (Dk + Dv)
    return None if gather < ulysses else r


def replicate_kv_heads(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x [B, H_kv, T, D]`` -> ``[B, r*H_kv, T, D]``, each head ``r`` times in a row: query head ``i`` of ``H``
    then finds its group's head as ``i // (H / (r*H_kv))``, as it did as ``i // (H / H_kv)``."""
    return x if r == 1 else x.repeat_interleave(r, dim=1)


class _Grouped:
    """The attention module as the inner function sees it, with ``num_key_value_groups`` query heads per
    key/value head after replication."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


class _ContextParallelAttention:
    """Per-module settings of the registered attention function: the group and the inner implementation."""

    def __init__(self, group, inner_name: str, inner):
        self.group, self.inner_name, self.inner = group, inner_name, inner

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        """``query [B, H, T, Dq]``, ``key [B, H_kv, T, Dk]``, ``value [B, H_kv, T, Dv]`` of this rank's tokens
        -> ``([B, T, H, Dv], None)``."""
        refuse_cache_and_mask(bool(kwargs.get("use_cache")), attention_mask)
        P = dist.get_world_size(self.group)
        (B, H, T, Dq), H_kv = query.shape, key.shape[1]
        cu = global_cu_seqlens(kwargs)
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "use_cache"):
            kwargs.pop(name, None)
        r = kv_replication(H, H_kv, (Dq, key.shape[-1], value.shape[-1]), P, self.inner_name.startswith("flash"))
        if r is None:
            return self._gathered(module, query, key, value, cu, kwargs), None
        key, value = (replicate_kv_heads(x, r) for x in (key, value))
        # One all-to-all for q|k|v (k and v may have fewer heads: grouped-query attention).
        q, k, v = (x.transpose(1, 2) for x in time_to_heads([x.transpose(1, 2) for x in (query, key, value)],
                                                              self.group))
        TP = P * T
        if self.inner_name.startswith("flash_attention"):
            mask = None
            kwargs["position_ids"] = (torch.arange(TP, device=q.device) if cu is None
                                      else sequence_positions(cu, 0, TP).to(q.device)).expand(B, TP)
            if cu is not None:
                longest = int((cu[1:] - cu[:-1]).max())
                cu = cu.to(device=q.device, dtype=torch.int32)
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif cu is None and self.inner_name == "sdpa":
            mask = None  # plain causal: sdpa's is_causal path
        else:
            mask = self._mask(cu, TP, None, q)
        inner_module = module if r == 1 else _Grouped(module, H // (H_kv * r))
        out, _ = self.inner(inner_module, q, k, v, mask, **kwargs)            # [B, P*T, H/P, Dv]
        out, _ = heads_to_time(out, self.group)                                # [B, T, H, Dv]
        return out, None

    def _gathered(self, module, query, key, value, cu, kwargs):
        """This rank's queries against the keys and values of the whole sequence, gathered in one collective."""
        P, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        T, Dk = query.shape[2], key.shape[-1]
        kv = all_gather_along(torch.cat([key, value], dim=-1), 2, self.group)   # [B, H_kv, P*T, Dk+Dv]
        k, v = kv[..., :Dk], kv[..., Dk:]
        mask = self._mask(cu, P * T, slice(rank * T, (rank + 1) * T), query)
        out, _ = self.inner(module, query, k, v, mask, **kwargs)                # [B, T, H, Dv]
        return out

    def _mask(self, cu, T: int, queries: slice | None, q: torch.Tensor) -> torch.Tensor:
        mask = document_causal_mask(cu, T, q.device, queries)
        if self.inner_name == "eager":  # an additive mask
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        return mask


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered as ``"kdacp_ulysses"``: dispatches to the module's settings."""
    spec = getattr(module, "_kdacp_ulysses", None)
    if spec is None:
        raise RuntimeError(f"{type(module).__name__} reached the {ATTENTION_NAME!r} attention without "
                           "kdacp.parallelize having set it up")
    return spec(module, query, key, value, attention_mask, **kwargs)


def check_attention(config, P: int, heads: dict[str, set[int]], layers: str = "attention layers") -> None:
    """Raise ``ValueError`` unless the model's attention implementation is one the function wraps and, for
    flash attention (Ulysses only), every query head count (config field name -> the layers' counts) splits
    over the ``P`` ranks."""
    inner_name = config._attn_implementation
    if inner_name not in INNER_ATTENTIONS:
        raise ValueError(f"the Ulysses attention wraps one of {INNER_ATTENTIONS}; the model uses {inner_name!r}")
    if inner_name.startswith("flash_attention"):
        for field, counts in heads.items():
            if any(h % P for h in counts):
                raise ValueError(f"{inner_name} runs the {layers} under Ulysses only, which shards {field}="
                                 f"{sorted(counts)} over the {P} ranks of the context-parallel group: needs "
                                 f"{field} % {P} == 0 (eager and sdpa gather K/V instead)")


def install_attention(modules: list, group, inner_name: str, eager) -> None:
    """Route ``modules``' attention through the registered function over ``group`` around ``inner_name``
    (``eager``: the model's own eager function). The caller sets the modules' config's
    ``_attn_implementation`` to :data:`ATTENTION_NAME`. Call :func:`check_attention` first."""
    from transformers import AttentionInterface
    inner = eager if inner_name == "eager" else AttentionInterface()[inner_name]
    for m in modules:
        m._kdacp_ulysses = _ContextParallelAttention(group, inner_name, inner)
    AttentionInterface.register(ATTENTION_NAME, _attention)
