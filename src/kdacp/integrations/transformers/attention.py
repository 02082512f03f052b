"""Softmax attention of a parallelised Hugging Face model over the context-parallel group, registered in
transformers' attention registry as :data:`ATTENTION_NAME`.

The module's own forward computes q, k, v (norms, rotary embedding of the global positions) on the local
tokens, which are this rank's ranges of the context's token layout (:class:`kdacp.cp.CPContext`, the one
the linear-attention layers of the step use); the registered function exchanges them and attends with the
layout's causal per-document mask: query at global position ``i`` sees keys ``j <= i`` of its own document.
Two exchanges, chosen per call (:func:`kv_replication`):

* Ulysses (where ``H % P == 0`` and every rank holds as many tokens): one all-to-all from time shards to head
  shards (every rank then holds the whole global sequence of ``H/P`` query heads, put in global order for a
  non-contiguous layout), the inner attention, one all-to-all back. Where the key/value heads do not split
  (``H_kv % P != 0``: Qwen3-Next's 2 key/value heads at ``P = 4, 8``) each is sent
  ``r = lcm(H_kv, P) / H_kv`` times (a rank's query heads need their group's key/value head). Its per-rank
  FLOPs are equal whatever the layout.
* K/V all-gather: every rank gathers the keys and values of the whole sequence (padded to the longest rank)
  and attends its own queries; backward reduce-scatters their gradients. Its per-rank FLOPs follow the
  layout's causal work (:attr:`kdacp.cp.CPContext.attention_work`): ``(2r+1)/P^2`` of the total on rank
  ``r`` under the contiguous layout, equal to within a chunk's rounding under zigzag.

Bytes each rank sends per local token and layer (forward; the backward moves the same), ``P`` ranks, head
dims ``Dq, Dk, Dv``: Ulysses ``(P-1)/P * (H*Dq + r*H_kv*(Dk+Dv) + H*Dv)``; the gather ``(P-1) * H_kv*(Dk+Dv)``.
The choice: the gather where Ulysses cannot run (heads or rank lengths do not split); where the gather's
work is balanced (max over mean within :data:`BALANCED`, e.g. zigzag) the exchange that moves fewer bytes;
where it is not (contiguous), Ulysses when heads divide (``r = 1``, whatever the bytes: its work is equal),
else the fewer bytes. Qwen3-Next (``H = 16``, ``H_kv = 2``, ``D = 256``): Ulysses with replication 30 units at
``P = 4``, 42 at ``P = 8``; the gather 12 and 28 (units of ``T * 256``): the gather. Flash attention's inner
call takes no mask, so it runs Ulysses only (``H % P == 0``, checked by :func:`check_attention`).

The gathered path runs the inner function with a dense ``[T_local, T]`` mask on the CPU; on a GPU it runs no
dense mask: each piece of the rank's queries (one range, one document) attends its document's keys up to its
last token in one SDPA call with a lower-right causal bias (:func:`gathered_attention`, the memory-efficient
kernel, differentiable; a merge of split calls by their log-sum-exps would not be, since the kernels return the
log-sum-exp without a gradient).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ...compile import hold_for_regions, run_opaque
from ...cp.autograd_collectives import all_gather_along, heads_to_time, time_to_heads
from ...cp.sharding import LAYOUT_KWARG
from ...layers.short_conv import sequence_positions
from .checks import global_cu_seqlens, refuse_cache_and_mask

ATTENTION_NAME = "kdacp_ulysses"
INNER_ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
BALANCED = 1.05  # the gather's attention work max/mean over ranks up to which it counts as balanced
# The keywords of the batch that the attention function takes from the boundaries (or refuses, or, the layout,
# leaves to the token mixers' check) rather than passing them on to the inner function.
_BATCH_KWARGS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
                           "use_cache", LAYOUT_KWARG})


def document_causal_mask(cu_seqlens: torch.Tensor | None, T: int, device: torch.device,
                         queries: slice | torch.Tensor | None = None) -> torch.Tensor:
    """``[1, 1, Tq, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` inside one document of
    the global boundaries ``cu_seqlens`` (None: one sequence); ``queries``: the global positions of the
    queries, a slice or an int64 index tensor (default all ``T``)."""
    t = torch.arange(T, device=device)
    tq = t if queries is None else t[queries.to(device) if isinstance(queries, torch.Tensor) else queries]
    mask = t[None, :] <= tq[:, None]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device)
        mask = mask & (torch.searchsorted(cu, t, right=True)[None, :] == torch.searchsorted(cu, tq, right=True)[:, None])
    return mask[None, None]


def kv_replication(H: int, H_kv: int, dims: tuple[int, int, int], P: int, flash: bool, imbalance: float = None,
                   equal_lengths: bool = True) -> int | None:
    """How many times Ulysses sends each key/value head, or None for the K/V all-gather (the module docstring
    states the rule); ``dims``: ``(Dq, Dk, Dv)``; ``imbalance``: the gather's attention work max/mean over the
    ranks (None: the contiguous layout's ``(2P-1)/P``); ``equal_lengths``: every rank holds as many tokens."""
    if H % P or not equal_lengths:
        return None
    r = math.lcm(H_kv, P) // H_kv
    if flash:
        return r
    imbalance = (2 * P - 1) / P if imbalance is None else imbalance
    if r == 1 and imbalance > BALANCED:
        return r
    Dq, Dk, Dv = dims
    ulysses = (P - 1) * (H * Dq + r * H_kv * (Dk + Dv) + H * Dv)
    gather = P * (P - 1) * H_kv * (Dk + Dv)
    return None if gather < ulysses else r


def replicate_kv_heads(x: torch.Tensor, r: int) -> torch.Tensor:
    """``x [B, H_kv, T, D]`` -> ``[B, r*H_kv, T, D]``, each head ``r`` times in a row: query head ``i`` of ``H``
    then finds its group's head as ``i // (H / (r*H_kv))``, as it did as ``i // (H / H_kv)``."""
    return x if r == 1 else x.repeat_interleave(r, dim=1)


def split_lower_right(attend, query, key, value, n: int):
    """Lower-right causal attention of ``n`` queries ``[B, H, n, D]`` that are the last ``n`` of the keys
    ``key, value [B, H, Tk, *]`` (query ``i`` sees keys ``j <= i + Tk - n``), as two calls of ``attend``
    merged by their log-sum-exps: every query against the ``Tk - n`` earlier keys (no mask), and against
    the last ``n`` keys (square causal). ``attend(q, k, v, causal) -> (out [B, H, n, Dv], lse [B, H, n])``.
    Returns ``[B, H, n, Dv]`` in ``query``'s dtype."""
    Tk = key.shape[-2]
    if n == Tk:
        return attend(query, key, value, True)[0]
    past, past_lse = attend(query, key[..., :Tk - n, :], value[..., :Tk - n, :], False)
    own, own_lse = attend(query, key[..., Tk - n:, :], value[..., Tk - n:, :], True)
    wide = torch.promote_types(query.dtype, torch.float32)  # the merge in float32 (or wider)
    past_lse, own_lse = (x.to(wide).reshape(*query.shape[:3], 1) for x in (past_lse, own_lse))
    top = torch.maximum(past_lse, own_lse)
    w_past, w_own = torch.exp(past_lse - top), torch.exp(own_lse - top)
    return ((past.to(wide) * w_past + own.to(wide) * w_own) / (w_past + w_own)).to(query.dtype)


def cudnn_attend(scale: float | None):
    """An ``attend`` for :func:`split_lower_right`: PyTorch's cuDNN attention (the kernel sdpa picks on Hopper for
    square causal attention), with its log-sum-exp."""
    def attend(q, k, v, causal):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return attend


def sdpa_lower_right(scale: float | None):
    """An ``attend`` for :func:`gathered_attention`: PyTorch's SDPA with a lower-right causal bias
    (``torch.nn.attention.bias.causal_lower_right``; its memory-efficient kernel on a GPU, with its backward:
    outputs and gradients in one call, no mask tensor)."""
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]),
                                              scale=scale)
    return attend


def gathered_attention(attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context) -> torch.Tensor:
    """This rank's queries ``query [B, H, T_local, Dq]`` against the whole sequence's keys and values
    ``[B, H, T, D*]`` (global order, heads already matching the queries') under the layout's causal
    per-document mask, with no mask tensor: each of ``context.attention_pieces`` (one range, one document)
    attends its document's keys up to its last token by ``attend(q, k, v) -> out``, lower-right causal
    (:func:`sdpa_lower_right`). Returns ``[B, H, T_local, Dv]``."""
    outs = [attend(query[:, :, a:b], key[:, :, k0:k1], value[:, :, k0:k1]) for a, b, k0, k1 in context.attention_pieces]
    return torch.cat(outs, dim=2)


class _Grouped:
    """The attention module as the inner function sees it, with ``num_key_value_groups`` query heads per
    key/value head after replication."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


class _ContextParallelAttention:
    """Per-module settings of the registered attention function: the layers' context parallelism ``cp`` (its
    group, its layout and the per-batch contexts it keeps) and the inner implementation."""

    def __init__(self, cp, inner_name: str, inner):
        self.cp, self.group, self.inner_name, self.inner = cp, cp.group, inner_name, inner
        hold_for_regions(self)  # a setting of the attention's opaque region under torch.compile

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        """``query [B, H, T, Dq]``, ``key [B, H_kv, T, Dk]``, ``value [B, H_kv, T, Dv]`` of this rank's tokens
        -> ``([B, T, H, Dv], None)``."""
        refuse_cache_and_mask(bool(kwargs.get("use_cache")), attention_mask)
        cu = global_cu_seqlens(kwargs)
        options = tuple((name, a) for name, a in kwargs.items() if name not in _BATCH_KWARGS)
        # under torch.compile one opaque op: the batch's context is looked up and read on the host (kdacp.compile)
        out, = run_opaque(_AttendOverGroup, (self, module, options), query, key, value, cu)
        return out, None

    def attend(self, module, query, key, value, cu, kwargs: dict) -> torch.Tensor:
        """The exchanges and the inner attention of :meth:`__call__` for the global boundaries ``cu`` (or None)
        and the inner function's other keywords ``kwargs``: ``[B, T, H, Dv]``."""
        P = dist.get_world_size(self.group)
        (B, H, T, Dq), H_kv = query.shape, key.shape[1]
        context = self.cp.attention_context(B, T, cu, query.device)
        work, lengths = context.attention_work, context.layout.local_lengths
        r = kv_replication(H, H_kv, (Dq, key.shape[-1], value.shape[-1]), P, self.inner_name.startswith("flash"),
                           max(work) * P / max(sum(work), 1), len(set(lengths)) == 1)
        if r is None:
            return self._gathered(module, query, key, value, cu, context, kwargs)
        key, value = (replicate_kv_heads(x, r) for x in (key, value))
        # One all-to-all for q|k|v (k and v may have fewer heads: grouped-query attention).
        q, k, v = (x.transpose(1, 2) for x in time_to_heads([x.transpose(1, 2) for x in (query, key, value)],
                                                              self.group))
        TP = P * T
        # The all-to-all lays the ranks' tokens end to end: under another layout than contiguous, put them in
        # global order for the inner call (any inner implementation then sees one causal sequence) and back.
        in_order = None if context.layout.is_contiguous else context.all_token_index
        if in_order is not None:
            q, k, v = (x.index_select(2, in_order.argsort()) for x in (q, k, v))
        if self.inner_name.startswith("flash_attention"):
            mask = None
            kwargs["position_ids"] = (torch.arange(TP, device=q.device) if cu is None
                                      else sequence_positions(cu, 0, TP).to(q.device)).expand(B, TP)
            if cu is not None:  # the longest document from the context's host boundaries: no device read
                bounds = context.cu_seqlens
                longest = max(b - a for a, b in zip(bounds, bounds[1:]))
                cu = cu.to(device=q.device, dtype=torch.int32)
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif cu is None and self.inner_name == "sdpa":
            mask = None  # plain causal: sdpa's is_causal path
        else:
            mask = self._mask(cu, TP, None, q)
        inner_module = module if r == 1 else _Grouped(module, H // (H_kv * r))
        out, _ = self.inner(inner_module, q, k, v, mask, **kwargs)            # [B, P*T, H/P, Dv]
        if in_order is not None:
            out = out.index_select(1, in_order)
        out, _ = heads_to_time(out, self.group)                                # [B, T, H, Dv]
        return out

    def _gathered(self, module, query, key, value, cu, context, kwargs):
        """This rank's queries against the keys and values of the whole sequence, gathered in one collective
        (each rank's padded to the longest rank's tokens) and put in global order."""
        layout, T, Dk = context.layout, query.shape[2], key.shape[-1]
        kv = torch.cat([key, value], dim=-1)
        longest = max(layout.local_lengths)
        if longest > T:
            kv = F.pad(kv, (0, 0, 0, longest - T))
        kv = all_gather_along(kv, 2, self.group)                                   # [B, H_kv, P*longest, Dk+Dv]
        if not (layout.is_contiguous and len(set(layout.local_lengths)) == 1):
            kv = kv.index_select(2, context.gather_index)                          # [B, H_kv, T_global, Dk+Dv]
        k, v = kv[..., :Dk], kv[..., Dk:]
        if query.is_cuda and not (kwargs.get("dropout") or kwargs.get("sliding_window") or kwargs.get("softcap")):
            out = self._split(module, query, k, v, context, kwargs)
            if out is not None:
                return out
        mask = self._mask(cu, layout.num_tokens, context.token_index, query)
        out, _ = self.inner(module, query, k, v, mask, **kwargs)                 # [B, T, H, Dv]
        return out

    def _split(self, module, query, k, v, context, kwargs):
        """:func:`gathered_attention` on SDPA's memory-efficient kernel (``[B, T, H, Dv]``), or None where it does
        not run these tensors (the caller then masks densely)."""
        if not torch.backends.cuda.mem_efficient_sdp_enabled():
            return None
        groups = query.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        scale = kwargs.get("scaling", getattr(module, "scaling", None))
        try:
            return gathered_attention(sdpa_lower_right(scale), query, k, v, context).transpose(1, 2)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError:  # the kernel refuses these shapes or dtypes
            return None

    def _mask(self, cu, T: int, queries, q: torch.Tensor) -> torch.Tensor:
        mask = document_causal_mask(cu, T, q.device, queries)
        if self.inner_name == "eager":  # an additive mask
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        return mask


@dataclass(frozen=True)
class _AttendOverGroup:
    """The registered attention function's exchanges and inner attention for one module (an
    :class:`kdacp.compile.OpaqueRegion`: it looks the batch's context up and reads its boundaries on the host).
    Settings: the module's :class:`_ContextParallelAttention`, the module, and the inner function's keywords
    ``(name, value)`` other than the batch's."""

    attention: _ContextParallelAttention
    module: torch.nn.Module
    options: tuple

    def __call__(self, query, key, value, cu_seqlens) -> tuple[torch.Tensor]:
        """``query [B, H, T, Dq]``, ``key, value [B, H_kv, T, D*]``, the global ``cu_seqlens [N+1]`` or None ->
        ``(out [B, T, H, Dv],)``."""
        return (self.attention.attend(self.module, query, key, value, cu_seqlens, dict(self.options)),)

    def fake(self, query, key, value, cu_seqlens) -> tuple[torch.Tensor]:
        B, H, T, _ = query.shape
        return (query.new_empty(B, T, H, value.shape[-1]),)


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


def install_attention(modules: list, cp, inner_name: str, eager) -> None:
    """Route ``modules``' attention through the registered function over ``cp``'s group and layout (a
    :class:`kdacp.ContextParallel`; the per-batch contexts are the layers') around ``inner_name``
    (``eager``: the model's own eager function). The caller sets the modules' config's
    ``_attn_implementation`` to :data:`ATTENTION_NAME`. Call :func:`check_attention` first."""
    from transformers import AttentionInterface
    inner = eager if inner_name == "eager" else AttentionInterface()[inner_name]
    for m in modules:
        m._kdacp_ulysses = _ContextParallelAttention(cp, inner_name, inner)
        hold_for_regions(m)  # the module is a setting of its attention's opaque region
    AttentionInterface.register(ATTENTION_NAME, _attention)
