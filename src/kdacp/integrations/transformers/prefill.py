"""A long prompt's forward pass under context parallelism into the model's own cache, then decoding from it.

:func:`prefill` runs a :func:`kdacp.parallelize`'d transformers model (Kimi Linear, Qwen3-Next) once over a
prompt cut by :func:`kdacp.shard_batch` (batch size 1, one document) under the model's token layout
(:data:`PREFILL_LAYOUTS`: contiguous, or zigzag, where rank 0 holds the prompt's first and last chunks),
without gradients, and returns on every rank the model's own ``DynamicCache`` for the whole prompt, as the
one-process ``model(prompt, use_cache=True)`` fills it, and the last prompt token's logits:

* linear-attention layers (KDA, GDN): the recurrent state ``[1, HV, K, V]`` float32, exact on every rank
  (``cp.chunk_kda`` returns the final state on every rank), and the convolution state ``[1, C, W]``, the last
  ``W`` tokens of the convolution's *input* (q|k|v before the convolution, the model's channel order) in the
  model's dtype, from the rank holding the prompt's last token (one broadcast for all layers), continued
  from the left halo of the range holding it where that range is shorter;
* attention layers: keys and values of every prompt token in the model's own cache layout (Kimi Linear's MLA:
  its compressed latents; Qwen3-Next: keys after the rotary embedding), all-gathered over the group as each
  layer runs and put in global order; the queries of each of a rank's ranges attend the gathered keys up to the
  range's last token (lower-right causal), so the cache's keys are the ones attended;
* the cache's position (``cache.get_seq_length()``): its attention layers' key count, and its linear-attention
  layers' token count.

Passing a ``cache`` continues it (chunked prefill): the pieces' recurrent states enter as initial states, the
first rank's convolution reads the cached convolution input as its left halo, and the attention keys append.

How the token mixers take part: the cache handed to the model is a :class:`PrefillCache`, a view of the
model's cache for this rank's shard. A linear-attention forward installed by ``parallelize``
(:func:`kdacp.integrations.transformers.install.mixer_forward`) that receives it asks it for the layer's hooks
(:meth:`PrefillCache.layer`, a :class:`LayerPrefill`): ``mix_tokens`` runs on them from the cached state, its
convolution continuing the cached input and recording its last input tokens, and the final state is recorded.
The attention modules' function is swapped, for the pass, for :class:`_GatheredAttention`; their own forwards
call :meth:`PrefillCache.update`, which all-gathers the keys and values into the cache.

:func:`generate` prefills all but the prompt's last token under CP and hands that cache to transformers'
``model.generate``, which runs the model's own code on the calling rank (:func:`own_forwards`): the last
prompt token and every new one, greedy or sampled, no collective until one check that the ranks agree.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...cp.batch_context import CPContext
from ...cp.groups import process_group
from ...cp.hooks import CPHooks
from ...cp.layout import make_layout
from ...cp.sharding import ShardedBatch, shard_batch
from .attention import ATTENTION_NAME, cudnn_attend, split_lower_right

__all__ = ["PREFILL_ATTENTIONS", "PREFILL_LAYOUTS", "LayerPrefill", "PrefillCache", "PrefillOutput", "cache_tensors", "generate",
           "own_forwards", "prefill", "split_lower_right"]

# the attention implementations the gathered prefill attention calls (lower-right causal masks)
PREFILL_ATTENTIONS = ("eager", "sdpa")
# The token layouts prefill runs: a prompt's padding comes after its last token, every rank holds as many tokens.
PREFILL_LAYOUTS = ("contiguous", "zigzag")


class PrefillOutput(NamedTuple):
    """What :func:`prefill` returns on every rank: ``cache``, the model's transformers cache of the whole prompt
    (the same tensors on every rank), and ``logits [1, vocab]``, the last prompt token's, in the model's dtype."""

    cache: object
    logits: torch.Tensor


class PrefillCache:
    """The model's transformers ``cache`` as this rank's token mixers see it during one :func:`prefill` pass.

    The pass covers global tokens ``[0, valid)`` after the cache's ``past`` ones (``valid``: the prompt's tokens,
    without :func:`kdacp.shard_batch`'s padding, which comes after them); this rank holds its ranges of
    ``layout`` (contiguous or zigzag). Attention layers call :meth:`update`; linear-attention layers run on
    :meth:`layer`'s hooks. Every other attribute is the model cache's. :meth:`finish` writes the
    linear-attention layers' states into the cache.
    """

    def __init__(self, cache, group, layout, valid: int):
        self.cache, self.group, self.layout, self.valid = cache, group, layout, valid
        self.rank = dist.get_rank(group)
        self.owner, last = layout.owner(valid - 1)  # the group rank holding the prompt's last token
        # this rank's last prompt token (the prompt's last one on the owner; a rank of padding only: 0)
        own = layout.local_token_index(self.rank)
        self.last_local = last if self.rank == self.owner else max(int((own < valid).sum()) - 1, 0)
        self._order = torch.cat([layout.local_token_index(r) for r in range(layout.world_size)]).argsort()
        self._conv_inputs: dict[int, torch.Tensor] = {}  # layer -> this rank's candidate [B, C, W]
        self._states: dict[int, torch.Tensor] = {}       # layer -> final state [1, HV, K, V]

    def __getattr__(self, name):
        if "cache" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["cache"], name)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x [..., T_local, D]`` -> every rank's, in global order, the prompt's tokens only
        ``[..., valid, D]`` (one all-gather; every rank holds as many tokens)."""
        if dist.get_world_size(self.group) == 1:
            return x[..., :self.valid, :]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        stream = torch.cat(parts, dim=-2)
        if not self.layout.is_contiguous:
            stream = stream.index_select(-2, self._order.to(stream.device))
        return stream[..., :self.valid, :]

    def query_pieces(self) -> list[tuple[int, int, int, int]]:
        """``(local_start, length, n, global_start)`` of each of this rank's ranges: its first ``n`` tokens are
        prompt tokens, the rest padding."""
        pieces, local = [], 0
        for s, e in self.layout.ranges[self.rank]:
            pieces.append((local, e - s, min(max(self.valid - s, 0), e - s), s))
            local += e - s
        return pieces

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """An attention layer's ``cache.update``: this rank's keys and values ``[B, H, T_local, D]`` gathered and
        appended to the model's cache; returns all its keys and values ``[B, H, past + valid, D]``."""
        return self.cache.update(self.gather(key_states), self.gather(value_states), layer_idx)

    def layer(self, cp, layer_idx: int) -> LayerPrefill:
        """The context-parallel hooks of linear-attention layer ``layer_idx`` (``cp``: those ``parallelize``
        installed) for this pass."""
        return LayerPrefill(cp, self, layer_idx)

    def conv_state(self, layer_idx: int) -> torch.Tensor | None:
        """The cached convolution input ``[B, C, W]`` of ``layer_idx`` before this pass, or None."""
        return self.cache.get_conv_state(layer_idx)

    def recurrent_state(self, layer_idx: int) -> torch.Tensor | None:
        """The cached recurrent state ``[B, HV, K, V]`` of ``layer_idx`` before this pass, or None."""
        return self.cache.get_recurrent_state(layer_idx)

    def record_conv_input(self, layer_idx: int, xs: list[torch.Tensor], halos: list[torch.Tensor | None],
                          width: int) -> None:
        """Keep the last ``W = width + 1`` convolution input tokens up to this rank's last prompt token,
        ``[B, C, W]`` (the model's layout): ``xs`` (``[B, T_local, C_i]``, q|k|v in the model's channel order)
        after the left halo of the range holding that token (``halos[i] [B, R, width, C_i]``; None: zeros, as
        transformers pads a short prompt)."""
        e = self.last_local
        k = max(i for i, piece in enumerate(self.query_pieces()) if piece[0] <= e)
        start = self.query_pieces()[k][0]  # the range's first local token
        x = torch.cat([x[:, max(e - width, start):e + 1] for x in xs], dim=-1)  # only what the tail needs
        if e - start < width:  # the tail reaches into the range's halo
            halo = (x.new_zeros(x.shape[0], width - (e - start), x.shape[-1]) if halos[0] is None
                    else torch.cat([h[:, k] for h in halos], dim=-1)[:, e - start:].to(x.dtype))
            x = torch.cat([halo, x], dim=1)
        self._conv_inputs[layer_idx] = x.transpose(1, 2).contiguous()

    def record_state(self, layer_idx: int, final_state: torch.Tensor) -> None:
        self._states[layer_idx] = final_state

    def finish(self) -> None:
        """Write the recorded states into the model's cache: the recurrent states (already the same on every
        rank) and the owner's convolution inputs (one broadcast for all layers)."""
        layers = sorted(self._conv_inputs)
        if dist.get_world_size(self.group) > 1 and layers:
            flat = torch.cat([self._conv_inputs[i].flatten() for i in layers])
            dist.broadcast(flat, src=dist.get_global_rank(self.group, self.owner), group=self.group)
            parts = flat.split([self._conv_inputs[i].numel() for i in layers])
            self._conv_inputs = {i: p.view_as(self._conv_inputs[i]) for i, p in zip(layers, parts)}
        for i in layers:
            conv = self._conv_inputs.pop(i)
            self.cache.update_conv_state(conv, i, conv_kernel_size=conv.shape[-1])
            # transformers (5.25 on) counts a linear-attention layer's tokens by the convolution input handed to
            # it, and the model's position is the first layer's count: this pass hands the last W of its tokens.
            counted = getattr(self.cache.layers[i], "cumulative_length_linear", None)
            if counted is not None:
                counted.add_(self.valid - conv.shape[-1])
            self.cache.update_recurrent_state(self._states.pop(i).to(torch.float32), i)


class _PrefillConv:
    """A layer's convolution context during prefill: the context-parallel one's halos, except that the halo slots
    before the prompt's first token (of the ranges starting within ``W - 1`` tokens of it) continue the cached
    convolution input, and the layer's last ``W`` input tokens recorded."""

    # the context's convolution, run on these halos (it reads the boundaries and range starts below)
    short_convolution = CPContext.short_convolution

    def __init__(self, base: CPContext, view: PrefillCache, layer_idx: int):
        self.base, self.view, self.layer_idx = base, view, layer_idx
        self.local_cu_seqlens, self.local_cu_seqlens_cpu = base.local_cu_seqlens, base.local_cu_seqlens_cpu
        self.range_starts = base.range_starts

    def recurrence(self, *args, **kwargs):
        """The context-parallel context's :meth:`~kdacp.cp.CPContext.recurrence`."""
        return self.base.recurrence(*args, **kwargs)

    def left_halos(self, xs: list[torch.Tensor], width: int) -> list[torch.Tensor | None]:
        halos = self.base.left_halos(xs, width)  # each [B, R, W-1, C] (None on one device)
        past = self.view.conv_state(self.layer_idx)
        starts = [k for k, (s, _) in enumerate(self.base.ranges) if s < width]
        if past is not None and width and starts:
            # [B, C, W] -> its last W-1 tokens [B, W-1, C] (global tokens -(W-1) .. -1), split as xs' channels
            tail = past[..., past.shape[-1] - width:].transpose(1, 2).to(xs[0].dtype)
            R = len(self.base.ranges)
            halos = [(h if h is not None else x.new_zeros(x.shape[0], R, width, x.shape[-1])).clone()
                     for h, x in zip(halos, xs)]
            for h, t in zip(halos, tail.split([x.shape[-1] for x in xs], dim=-1)):
                for k in starts:  # slot j of range k holds global token start_k - width + j
                    s = self.base.ranges[k][0]
                    h[:, k, :width - s] = t[:, s:]
        self.view.record_conv_input(self.layer_idx, xs, halos, width)
        return halos


class LayerPrefill(CPHooks):
    """A linear-attention layer's context-parallel hooks (``cp``'s, mode ``state``) during prefill, for
    ``mix_tokens``: the convolution continues the cached input and records the layer's last input tokens
    (:class:`_PrefillConv`); :attr:`initial_state` is the cached state and :meth:`record_state` keeps the final
    one. Every other hook is ``cp``'s."""

    def __init__(self, cp, view: PrefillCache, layer_idx: int):
        if getattr(cp, "mode", None) != "state":
            raise ValueError(f"kdacp.integrations.transformers.prefill runs the linear-attention layers in ContextParallel mode "
                             f"'state', layer {layer_idx} has {cp!r}")
        if dist.get_process_group_ranks(cp.group) != dist.get_process_group_ranks(view.group):
            raise ValueError(f"prefill's group (ranks {dist.get_process_group_ranks(view.group)}) is not layer "
                             f"{layer_idx}'s context-parallel group (ranks {dist.get_process_group_ranks(cp.group)})")
        self.cp, self.view, self.layer_idx = cp, view, layer_idx

    @property
    def backend(self) -> str | None:
        return self.cp.backend

    @property
    def split(self):
        return self.cp.split

    def validate_heads(self, num_heads: int, num_v_heads: int) -> None:
        self.cp.validate_heads(num_heads, num_v_heads)

    def to_heads(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.cp.to_heads(xs)

    def head_slice(self, num_heads: int) -> slice:
        return self.cp.head_slice(num_heads)

    def to_sequence(self, o: torch.Tensor, final_state: torch.Tensor | None):
        return self.cp.to_sequence(o, final_state)

    def context(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device=None):
        return _PrefillConv(self.cp.context(B, T, cu_seqlens, device), self.view, self.layer_idx)

    def initial_state(self, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
        """``[N, HV, K, V]`` float32: the cached state for the prompt (sequence 0), zeros for the padding's
        document if any (``cu_seqlens``); None without a cached state."""
        initial = self.view.recurrent_state(self.layer_idx)
        if initial is None:
            return None
        initial = initial.to(torch.float32)
        if cu_seqlens is not None:
            initial = torch.cat([initial, initial.new_zeros(cu_seqlens.numel() - 2, *initial.shape[1:])])
        return initial

    def record_state(self, final_state: torch.Tensor) -> None:
        """Keep the prompt's (sequence 0's) final state ``[1, HV, K, V]`` of ``final_state [N, HV, K, V]``."""
        self.view.record_state(self.layer_idx, final_state[:1])


def _lower_right_causal(inner_name: str, n: int, Tk: int, dtype: torch.dtype, device: torch.device):
    """The mask of ``n`` queries that are the last of ``Tk`` keys (query ``i`` sees keys ``j <= i + Tk - n``),
    for ``inner_name``: sdpa's causal path (None) when square, else its lower-right ``CausalBias`` (no ``n x Tk``
    tensor); an additive ``[1, 1, n, Tk]`` tensor for eager (which takes None for no mask at all)."""
    if inner_name == "sdpa":
        from torch.nn.attention.bias import causal_lower_right
        return None if n == Tk else causal_lower_right(n, Tk)
    seen = torch.arange(Tk, device=device)[None, :] <= torch.arange(n, device=device)[:, None] + (Tk - n)
    return torch.zeros(n, Tk, dtype=dtype, device=device).masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def _fast_lower_right(module, query, key, value, n: int, scale: float | None):
    """:func:`split_lower_right` on cuDNN for sdpa on a GPU (``[B, n, H, Dv]``, sdpa's output layout), or None
    where cuDNN's attention is not available for these tensors. sdpa's own lower-right mask
    (``causal_lower_right``) runs on PyTorch's memory-efficient kernel, several times slower for long pieces."""
    if not (query.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()):
        return None
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped key/value heads, expanded as transformers' sdpa path does
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    try:
        out = split_lower_right(cudnn_attend(scale), query, key, value, n)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError:  # cuDNN refuses these shapes or dtypes: sdpa's own path
        return None
    return out.transpose(1, 2).contiguous()


class _GatheredAttention:
    """The attention modules' function during prefill (in place of the Ulysses one): the prompt queries of each of
    this rank's ranges ``[B, H, n, D]`` against the cache's keys up to the range's last prompt token
    (``key``/``value`` as :meth:`PrefillCache.update` returned them, in global order), through the model's
    implementation; the padding's queries get zeros."""

    def __init__(self, inner_name: str, inner, view: PrefillCache):
        self.inner_name, self.inner, self.view = inner_name, inner, view

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        view = self.view
        B, H = query.shape[:2]
        past = key.shape[-2] - view.valid  # the cache's keys before this pass
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "use_cache"):
            kwargs.pop(name, None)
        outs = []
        for local, length, n, start in view.query_pieces():
            if n:
                outs.append(self._attend(module, query[:, :, local:local + n], key[:, :, :past + start + n],
                                         value[:, :, :past + start + n], kwargs))
            if n < length:  # the padding's queries
                outs.append(query.new_zeros(B, length - n, H, value.shape[-1]))
        return torch.cat(outs, dim=1), None

    def _attend(self, module, query, key, value, kwargs):
        """``n`` queries ``[B, H, n, D]`` that are the last ``n`` of the keys ``[B, H_kv, Tk, D]``, lower-right
        causal -> ``[B, n, H, Dv]``."""
        n, Tk = query.shape[-2], key.shape[-2]
        out = None
        if self.inner_name == "sdpa" and n < Tk and not kwargs.get("dropout"):
            out = _fast_lower_right(module, query, key, value, n, kwargs.get("scaling"))
        if out is None:
            mask = _lower_right_causal(self.inner_name, n, Tk, query.dtype, query.device)
            out, _ = self.inner(module, query, key, value, mask, **kwargs)
        return out


def _parallel_modules(model) -> tuple[list, list]:
    """``(linear, attention)``: the token mixers whose forward ``parallelize`` replaced, and the attention modules
    it routed through the Ulysses function."""
    linear = [m for m in model.modules() if hasattr(m, "layer_idx") and "forward" in vars(m)]
    attention = [m for m in model.modules() if hasattr(m, "_kdacp_ulysses")]
    return linear, attention


@contextlib.contextmanager
def _gathered_attention(model, view: PrefillCache):
    """Inside the block the model's attention modules run :class:`_GatheredAttention` over ``view``."""
    _, attention = _parallel_modules(model)
    saved = {m: m._kdacp_ulysses for m in attention}
    try:
        for m, spec in saved.items():
            m._kdacp_ulysses = _GatheredAttention(spec.inner_name, spec.inner, view)
        yield
    finally:
        for m, spec in saved.items():
            m._kdacp_ulysses = spec


def cache_tensors(cache) -> dict:
    """Every tensor of a transformers cache by name: ``"{layer}.conv"`` / ``"{layer}.recurrent"`` of a
    linear-attention layer (batch row 0), ``"{layer}.keys"`` / ``"{layer}.values"`` of an attention layer."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "conv_states"):
            out[f"{i}.conv"], out[f"{i}.recurrent"] = layer.conv_states[0], layer.recurrent_states[0]
        else:
            out[f"{i}.keys"], out[f"{i}.values"] = layer.keys, layer.values
    return out


# The cache reaches the model as ``cache=`` from this transformers on (``past_key_values=`` before it).
MIN_TRANSFORMERS = "5.24"


def _model_layout(linear: list, attention: list):
    """The token layout of a parallelised model's contexts (a name or a TokenLayout), or None without one;
    ``ValueError`` if its token mixers disagree."""
    contexts = [m._kdacp_ulysses.cp for m in attention] + [m.forward.args[2] for m in linear
                                                           if isinstance(m.forward, functools.partial)]
    layouts = {repr(cp.layout): cp.layout for cp in contexts}
    if len(layouts) > 1:
        raise ValueError(f"the model's token mixers run different layouts: {sorted(layouts)}")
    return next(iter(layouts.values()), None)


def _check_call(model, batch: ShardedBatch, group) -> None:
    """``ValueError`` for what :func:`prefill` does not run (``ImportError`` for a transformers older than
    :data:`MIN_TRANSFORMERS`), before anything runs."""
    import transformers
    from packaging.version import Version
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(f"kdacp.integrations.transformers.prefill and generate need transformers >= {MIN_TRANSFORMERS} (the cache "
                          f"as the models' cache= argument); found {transformers.__version__}")
    if not isinstance(batch, ShardedBatch):
        raise ValueError(f"batch must be a kdacp.ShardedBatch (kdacp.shard_batch), got {type(batch).__name__}")
    linear, attention = _parallel_modules(model)
    if not linear and not attention:
        raise ValueError(f"kdacp.integrations.transformers.prefill runs a kdacp.parallelize'd model; {type(model).__name__} is not")
    layout = _model_layout(linear, attention)
    if layout not in PREFILL_LAYOUTS:
        raise ValueError(f"kdacp.integrations.transformers.prefill and generate run the layouts {PREFILL_LAYOUTS}; the model runs "
                         f"{layout!r}")
    expected = make_layout(layout, dist.get_world_size(group), batch.layout.num_tokens, batch.cu_seqlens)
    if batch.layout != expected:
        raise ValueError(f"the prompt was sharded under another layout than the model's {layout!r}: rank "
                         f"{batch.rank} holds {list(batch.layout.ranges[batch.rank])}, expected "
                         f"{list(expected.ranges[batch.rank])}; pass shard_batch(layout={layout!r})")
    B = batch.input_ids.shape[0]
    cu = batch.cu_seqlens
    one_document = cu is None or cu.numel() == (3 if batch.padding else 2)
    if B != 1 or not one_document:
        raise ValueError(f"kdacp.integrations.transformers.prefill takes one prompt: batch size 1 and one document, got B={B} and "
                         f"cu_seqlens={None if cu is None else cu.tolist()}")
    for m in attention:
        spec = m._kdacp_ulysses
        if spec.inner_name not in PREFILL_ATTENTIONS:
            raise ValueError(f"prefill's attention runs the model's {PREFILL_ATTENTIONS} implementations, the model "
                             f"uses {spec.inner_name!r}")
        if dist.get_process_group_ranks(spec.group) != dist.get_process_group_ranks(group):
            raise ValueError(f"prefill's group (ranks {dist.get_process_group_ranks(group)}) is not the model's "
                             f"context-parallel group (ranks {dist.get_process_group_ranks(spec.group)})")


def prefill(model, batch: ShardedBatch, cache=None, group=None) -> PrefillOutput:
    """One forward pass of a ``parallelize``'d model over a prompt, without gradients, into its own cache.

    Call it on every rank, like the forward.

    Args:
        model: a transformers ``KimiLinearForCausalLM`` or ``Qwen3NextForCausalLM`` after
            :func:`kdacp.parallelize` (``ContextParallel`` mode ``state``; attention ``eager`` or ``sdpa``).
        batch: this rank's shard of one prompt, :func:`kdacp.shard_batch` ``(prompt [1, T], group=group)``
            (``pad_id=`` where ``T % P != 0``); every rank needs at least ``W - 1`` tokens (the convolution).
        cache: the model's cache of the text before this prompt, from an earlier :func:`prefill` (chunked
            prefill) or None (a new ``DynamicCache``). Updated in place.
        group: the context-parallel process group or 1-D ``DeviceMesh`` of ``parallelize`` (default: the world).

    Returns:
        :class:`PrefillOutput`: the cache (the same on every rank) and the last prompt token's logits.

    Raises:
        ValueError: an unparallelised model, a model under another token layout than those of
            :data:`PREFILL_LAYOUTS` (the prompt sharded under another than the model's is refused by its token
            mixers), a batch of several rows or documents, another attention implementation, another group, or a
            linear-attention mode other than ``state``.
        ImportError: transformers older than :data:`MIN_TRANSFORMERS`.
    """
    group = process_group(group, "group")
    _check_call(model, batch, group)
    if cache is None:
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
    past = cache.get_seq_length()
    view = PrefillCache(cache, group, batch.layout, batch.layout.num_tokens - batch.padding)
    kwargs = batch.model_kwargs()
    del kwargs["labels"]  # no loss
    kwargs.update(cache=view, use_cache=True, position_ids=batch.position_ids + past,
                  logits_to_keep=torch.tensor([view.last_local], device=batch.input_ids.device))
    with torch.no_grad(), _gathered_attention(model, view):
        logits = model(**kwargs).logits[:, -1].contiguous()       # [1, vocab]
        view.finish()
        if dist.get_world_size(group) > 1:
            dist.broadcast(logits, src=dist.get_global_rank(group, view.owner), group=group)
    return PrefillOutput(cache, logits)


@contextlib.contextmanager
def own_forwards(model):
    """Inside the block a ``parallelize``'d model runs transformers' own code on the calling rank: its token
    mixers' own forwards and its own attention implementation (no collective); ``parallelize``'s on exit."""
    linear, attention = _parallel_modules(model)
    installed = {m: vars(m).pop("forward") for m in linear}
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_NAME}
    call_checks = [m._kdacp_call_check for m in model.modules() if hasattr(m, "_kdacp_call_check")]
    try:
        for check in call_checks:  # the model's own code honours every argument
            check.enabled = False
        if attention:
            for config in configs.values():
                config._attn_implementation = attention[0]._kdacp_ulysses.inner_name
        yield model
    finally:
        for m, forward in installed.items():
            m.forward = forward
        for check in call_checks:
            check.enabled = True
        for config in configs.values():
            config._attn_implementation = ATTENTION_NAME


def _prompt(batch: ShardedBatch, group) -> torch.Tensor:
    """The whole prompt ``[1, T]`` from every rank's shard (one all-gather), in global order, without padding."""
    parts = [torch.empty_like(batch.input_ids) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, batch.input_ids.contiguous(), group=group)
    layout = batch.layout
    order = torch.cat([layout.local_token_index(r) for r in range(layout.world_size)]).argsort()
    ids = torch.cat(parts, dim=1).index_select(1, order.to(batch.input_ids.device))
    return ids[:, :ids.shape[1] - batch.padding]


def _check_same_on_every_rank(ids: torch.Tensor, group) -> None:
    """``RuntimeError`` on every rank unless every rank generated ``ids``."""
    length = torch.tensor([ids.shape[1]], device=ids.device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, length, group=group)
    same = len({int(n) for n in lengths}) == 1
    if same:
        first = ids.clone()
        dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
        differs = torch.tensor([int(not torch.equal(first, ids))], device=ids.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
        same = not differs.item()
    if not same:
        raise RuntimeError("the ranks generated different tokens: seed every rank alike (torch.manual_seed) "
                           "before sampling")


def generate(model, batch: ShardedBatch, max_new_tokens: int, group=None, **generate_kwargs) -> torch.Tensor:
    """Prefill a prompt under context parallelism, then decode from that cache with transformers' own code.

    The prompt but its last token is prefilled (:func:`prefill`); then ``model.generate(prompt, cache=...)``
    runs the model's own code on each rank (:func:`own_forwards`) from the last prompt token on. Call it on
    every rank; for sampling, seed every rank alike (``torch.manual_seed``) first.

    Args:
        model, group: as for :func:`prefill`.
        batch: this rank's shard of the prompt (:func:`kdacp.shard_batch`; its padding is dropped here).
        max_new_tokens: passed to ``model.generate``.
        **generate_kwargs: ``model.generate``'s (``do_sample``, ``temperature``, ``top_k``, ...); not
            ``cache`` or ``use_cache``.

    Returns:
        ``[1, T + new]`` token ids, the prompt and the new tokens, the same on every rank.

    Raises:
        ValueError: as :func:`prefill`, or ``generate_kwargs`` naming a cache.
        RuntimeError: the ranks generated different tokens (sampling seeded differently).
    """
    group = process_group(group, "group")
    for name in ("cache", "past_key_values", "use_cache"):
        if name in generate_kwargs:
            raise ValueError(f"kdacp.integrations.transformers.generate makes the cache itself: drop {name}=")
    _check_call(model, batch, group)
    prompt = _prompt(batch, group)
    cache = None
    if prompt.shape[1] > 1:
        layout = _model_layout(*_parallel_modules(model))
        head = shard_batch(prompt[:, :-1], group=group, pad_id=int(prompt[0, 0]), layout=layout)
        cache = prefill(model, head, group=group).cache
    with own_forwards(model):
        ids = model.generate(prompt, cache=cache, use_cache=True, max_new_tokens=max_new_tokens, **generate_kwargs)
    _check_same_on_every_rank(ids, group)
    return ids
