"""What the Hugging Face adapters (:mod:`kdacp.models.kimi_linear`, :mod:`kdacp.models.qwen3_next`) share.

* The Ulysses attention registered in transformers' attention registry as :data:`ATTENTION_NAME`
  (:func:`install_ulysses`): the module's own forward computes q, k, v on the local tokens; the function
  all-to-alls them from time shards to head shards (every rank then holds the whole global sequence of
  ``H/P`` query heads and ``H_kv/P`` key/value heads), calls the model's previous attention implementation
  on it with a per-document causal mask (:func:`document_causal_mask`) and all-to-alls the output back.
* The checks of a token mixer's keyword arguments (no cache, no padding mask, one set of global
  boundaries: :func:`check_training_call`, :func:`global_cu_seqlens`).
* The fused q|k|v depthwise convolution of the linear-attention layers on kdacp's halo'd short convolution
  (:func:`fused_short_conv`), and kdacp's gated RMSNorm around a model's norm weight (:func:`gated_norm`).
* :func:`kernel_fallbacks`: transformers' module functions bound to kernel packages, swapped for the
  PyTorch code they wrap.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import torch.nn as nn

from ..layers.comm import all_to_all
from ..layers.context_parallel import ConvContext, ContextParallel
from ..layers.norm import RMSNormGated
from ..layers.short_conv import causal_conv1d, sequence_positions

__all__ = ["ATTENTION_NAME", "INNER_ATTENTIONS", "SILU_NAMES", "check_attention", "check_training_call",
           "document_causal_mask", "fused_short_conv", "gated_norm", "global_cu_seqlens", "install", "install_ulysses",
           "kernel_fallbacks", "load_model_module", "refuse_cache_and_mask", "token_mixers"]

ATTENTION_NAME = "kdacp_ulysses"
# the activation names of SiLU in transformers' configs: what kdacp's short convolution and gated norm apply
SILU_NAMES = ("silu", "swish")
INNER_ATTENTIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def load_model_module(module_path: str, what: str):
    """transformers' ``module_path`` (a ``modeling_*`` module), with FLA loaded first by kdacp.

    Importing such a module imports FLA where installed (transformers' kernel fallback), and FLA reads
    ``FLA_CACHE_MODE`` once, at import: so kdacp loads FLA first, pointed at kdacp's tuned configurations
    (:func:`kdacp.tuning.use_shipped_configs`).

    Raises:
        ImportError: transformers missing or without the model (the ``models`` extra).
    """
    import importlib

    from ..backends.fla_adapter import fla_available
    fla_available()
    try:
        return importlib.import_module(module_path)
    except ImportError as e:  # transformers < 5.x or missing: the `models` extra
        raise ImportError(f"kdacp.parallelize needs Hugging Face transformers with {what}: "
                          "pip install 'kdacp[models]'") from e


@contextlib.contextmanager
def kernel_fallbacks(module, names: tuple[str, ...]):
    """Inside the block, the functions ``names`` of ``module`` are the PyTorch code they wrap
    (``inspect.unwrap``); restored on exit. Names the module lacks are skipped."""
    saved = {name: getattr(module, name) for name in names if hasattr(module, name)}
    try:
        for name, fn in saved.items():
            setattr(module, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def global_cu_seqlens(kwargs: dict) -> torch.Tensor | None:
    """The global ``[N+1]`` boundaries a token mixer received (``cu_seq_lens_q``), or None."""
    cu = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu is not None and cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError("under kdacp.parallelize, cu_seq_lens_q and cu_seq_lens_k are the same global boundaries")
    return cu


def refuse_cache_and_mask(uses_cache: bool, attention_mask) -> None:
    """Raise ``ValueError`` for what ``parallelize`` does not run: a cache or a padding mask."""
    if uses_cache:
        raise ValueError("kdacp.parallelize runs without a cache: pass use_cache=False (batch.model_kwargs() does)")
    if attention_mask is not None:
        raise ValueError("kdacp.parallelize takes packed batches (cu_seq_lens_q), not padding masks")


def check_training_call(cache, attention_mask, kwargs: dict) -> None:
    """:func:`refuse_cache_and_mask` for a token mixer's arguments. Pops the earlier 5.x cache names
    (``cache_params``, ``past_key_values``) from ``kwargs``."""
    # `cache` (transformers >= 5.24), `cache_params` / `past_key_values` (earlier 5.x)
    caches = (cache, kwargs.pop("cache_params", None), kwargs.pop("past_key_values", None))
    refuse_cache_and_mask(any(c is not None for c in caches) or bool(kwargs.get("use_cache")), attention_mask)


def fused_short_conv(conv: ConvContext, xs: list[torch.Tensor], conv1d: nn.Conv1d, channels: list[slice],
                     fused: bool) -> list[torch.Tensor]:
    """SiLU(depthwise causal conv) of each ``x_i [B, T, C_i]`` with channels ``channels[i]`` of the model's one
    fused ``conv1d`` (``weight [D, 1, W]``), each with its left halo from the previous rank (one exchange)."""
    weight, bias = conv1d.weight[:, 0], conv1d.bias
    halos = conv.left_halos(xs, weight.shape[-1] - 1)
    return [causal_conv1d(x, weight[c], None if bias is None else bias[c], halo=halo, cu_seqlens=conv.cu_seqlens,
                          cu_seqlens_cpu=conv.cu_seqlens_cpu, fused=fused) for x, halo, c in zip(xs, halos, channels)]


def gated_norm(weight: nn.Parameter, eps: float, activation: str) -> RMSNormGated:
    """kdacp's gated RMSNorm (FLA's fused kernel on the GPU) around a model's own norm ``weight``; kept
    outside the module tree, so the state dict does not see it."""
    norm = RMSNormGated(weight.shape[-1], eps=eps, activation=activation, device="meta")
    norm.weight = weight
    return norm


def document_causal_mask(cu_seqlens: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` inside one document
    of the global boundaries ``cu_seqlens`` (None: one sequence)."""
    t = torch.arange(T, device=device)
    mask = t[None, :] <= t[:, None]
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.to(device), t, right=True)
        mask = mask & (doc[None, :] == doc[:, None])
    return mask[None, None]


def _to_head_shards(xs: list[torch.Tensor], U: int, group) -> list[torch.Tensor]:
    """Time shards ``[B, H_i, T, D_i]`` -> head shards ``[B, H_i/U, U*T, D_i]``, in one all-to-all."""
    B, T = xs[0].shape[0], xs[0].shape[2]
    send = torch.cat([x.unflatten(1, (U, -1)).movedim(1, 0).reshape(U, B, -1) for x in xs], dim=-1)
    recv = all_to_all(send, group)                                               # [U(src), B, sum_i H_i/U*T*D_i]
    out = []
    for x, part in zip(xs, recv.split([x.shape[1] // U * T * x.shape[3] for x in xs], dim=-1)):
        H, D = x.shape[1], x.shape[3]
        out.append(part.reshape(U, B, H // U, T, D).permute(1, 2, 0, 3, 4).reshape(B, H // U, U * T, D))
    return out


class _UlyssesAttention:
    """Per-module settings of the registered attention function: the group and the inner implementation."""

    def __init__(self, group, inner_name: str, inner):
        self.group, self.inner_name, self.inner = group, inner_name, inner

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        refuse_cache_and_mask(bool(kwargs.get("use_cache")), attention_mask)
        U = torch.distributed.get_world_size(self.group)
        B, H, T, _ = query.shape
        Dv = value.shape[-1]
        # One all-to-all for q|k|v (k and v may have fewer heads: grouped-query attention).
        q, k, v = _to_head_shards([query, key, value], U, self.group)

        cu = global_cu_seqlens(kwargs)
        TU = U * T
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "use_cache"):
            kwargs.pop(name, None)
        positions = (torch.arange(TU, device=q.device) if cu is None
                     else sequence_positions(cu, 0, TU).to(q.device))
        if self.inner_name.startswith("flash_attention"):
            mask = None
            kwargs["position_ids"] = positions.expand(B, TU)
            if cu is not None:
                longest = int((cu[1:] - cu[:-1]).max())
                cu = cu.to(device=q.device, dtype=torch.int32)
                kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        elif cu is None and self.inner_name == "sdpa":
            mask = None  # plain causal: sdpa's is_causal path
        else:
            mask = document_causal_mask(cu, TU, q.device)
            if self.inner_name == "eager":  # an additive mask
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    ~mask, torch.finfo(q.dtype).min)
        out, _ = self.inner(module, q, k, v, mask, **kwargs)                  # [B, U*T, H/U, Dv]
        send = out.reshape(B, U, T, H // U, Dv).movedim(1, 0)               # [U(dst), B, T, H/U, Dv]
        recv = all_to_all(send, self.group)                                   # [U(head shard), B, T, H/U, Dv]
        return recv.permute(1, 2, 0, 3, 4).reshape(B, T, H, Dv), None


def _ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered as ``"kdacp_ulysses"``: dispatches to the module's :class:`_UlyssesAttention`."""
    spec = getattr(module, "_kdacp_ulysses", None)
    if spec is None:
        raise RuntimeError(f"{type(module).__name__} reached the {ATTENTION_NAME!r} attention without "
                           "kdacp.parallelize having set it up")
    return spec(module, query, key, value, attention_mask, **kwargs)


def token_mixers(model: nn.Module, cp: ContextParallel, linear_type: type, attention_type: type, what: str):
    """``(linear, attention, P)``: the model's linear-attention and attention modules and the group size, after
    checking ``cp`` and that the model holds some of them (``what``: the model's name) not yet parallelised."""
    if not isinstance(cp, ContextParallel):
        raise ValueError(f"cp must be a kdacp.ContextParallel, got {type(cp).__name__}")
    linear = [m for m in model.modules() if isinstance(m, linear_type)]
    attention = [m for m in model.modules() if isinstance(m, attention_type)]
    if not linear and not attention:
        raise ValueError(f"{type(model).__name__} holds no {what} token mixers "
                         f"({linear_type.__name__}, {attention_type.__name__})")
    if any("forward" in vars(m) for m in linear) or any(hasattr(m, "_kdacp_ulysses") for m in attention):
        raise ValueError("model is already parallelised by kdacp")
    return linear, attention, torch.distributed.get_world_size(cp.group)


def check_attention(config, P: int, heads: dict[str, set[int]], layers: str = "attention layers") -> None:
    """Raise ``ValueError`` unless the model's attention implementation is one the Ulysses function wraps
    and every head count (config field name -> the layers' counts) splits over the ``P`` ranks."""
    inner_name = config._attn_implementation
    if inner_name not in INNER_ATTENTIONS:
        raise ValueError(f"the Ulysses attention wraps one of {INNER_ATTENTIONS}; the model uses {inner_name!r}")
    for field, counts in heads.items():
        if any(h % P for h in counts):
            raise ValueError(f"Ulysses attention shards the {layers}' {field}={sorted(counts)} over the "
                             f"{P} ranks of the context-parallel group: needs {field} % {P} == 0")


def install(model: nn.Module, cp: ContextParallel, linear: list[nn.Module], forward, norm,
            attention: list[nn.Module], eager) -> nn.Module:
    """Replace each linear-attention module's ``forward`` (on the instance) by ``forward(module, cp,
    norm(module), ...)`` and route the ``attention`` modules through Ulysses (:func:`install_ulysses`)."""
    for m in linear:
        m.forward = functools.partial(forward, m, cp, norm(m))
    if attention:
        install_ulysses(model, attention, cp.group, eager)
    return model


def install_ulysses(model: nn.Module, modules: list[nn.Module], group, eager) -> None:
    """Route ``modules``' attention through the Ulysses function over ``group`` around the model's
    implementation (``eager``: the model's own eager function). Call :func:`check_attention` first."""
    from transformers import AttentionInterface
    config = model.config
    inner_name = config._attn_implementation
    inner = eager if inner_name == "eager" else AttentionInterface()[inner_name]
    for m in modules:
        m._kdacp_ulysses = _UlyssesAttention(group, inner_name, inner)
    AttentionInterface.register(ATTENTION_NAME, _ulysses_attention)
    # The config object may be shared with other models (built from the same config, or a reference
    # copy's): this model's modules get their own copy, so that only they look up the Ulysses function.
    # The mask code builds no mask for a name it does not know, and the function builds its own.
    own = copy.deepcopy(config)
    own._attn_implementation = ATTENTION_NAME
    for m in model.modules():
        if getattr(m, "config", None) is config:
            m.config = own
