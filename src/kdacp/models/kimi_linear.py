"""Context parallelism for Hugging Face transformers' ``KimiLinearForCausalLM``, applied from outside.

:func:`parallelize` changes how the model's token mixers run, never what they hold: the model's own
parameters are used in place (``model.state_dict()`` keeps its keys and tensors), and the model code is
not forked. Every rank holds the whole model and one equal time shard of the global batch, in rank order
(:func:`kdacp.shard_batch`); everything but the two token mixers works per token and needs nothing else.

* KDA layers (``KimiLinearDeltaAttention``): their ``forward`` is replaced, on the instance, by
  :func:`_kda_forward`, which runs kdacp's context-parallel composition (the one of
  :class:`kdacp.layers.DeltaRuleLayer`) on the module's parameters: the projections, the fused q|k|v
  short convolution sliced per part with the left halo from the previous rank
  (:meth:`ConvContext.left_halos`), the gate inside the KDA kernel (``A_log``, ``dt_bias`` of
  ``forget_gate``), ``cp.chunk_kda`` (state exchange, Ulysses or both, as ``cp`` says), the gated
  RMSNorm and the output projection. ``del module.forward`` restores the model's own.
* MLA layers (``KimiLinearAttention``): Ulysses sequence parallelism through transformers' attention
  registry. The module's own forward still computes q, k, v on the local tokens; the registered
  function ``"kdacp_ulysses"`` all-to-alls them from time shards to head shards (every rank then holds
  the whole global sequence of ``H/P`` heads), calls the model's previous attention implementation
  (``eager``, ``sdpa`` or ``flash_attention_*``) on it with a per-document causal mask, and
  all-to-alls the output back. Why Ulysses rather than gathering K/V: it keeps the model's forward and
  its attention kernel unchanged (the registry is the extension point transformers offers; gathering
  MLA's compressed latent would need a forked forward), it balances the causal work over ranks (with
  gathered K/V the last rank does most of it), and the mask is the plain global one. Its condition:
  ``num_attention_heads % P == 0`` (checked, ``ValueError``). Gathering the latent would move less data
  (``kv_lora_rank + qk_rope_head_dim`` per token instead of q, k, v and the output of ``H/P`` heads);
  worth it if the all-to-all shows up in profiles.

Positions and documents. Kimi Linear's MLA uses no rotary embedding (NoPE; the ``k_rot`` part is not
rotated), so ``position_ids`` only tell transformers' mask code where documents restart. Under
:func:`parallelize` the masks are built here from the global ``cu_seqlens`` instead: pass
``batch.model_kwargs()`` from :func:`kdacp.shard_batch`, which gives every rank its slice of the global
``position_ids`` (restarting at each document) and the *global* boundaries as ``cu_seq_lens_q`` /
``cu_seq_lens_k`` (flash-attention's names). Transformers forwards these keyword arguments from the
model's ``forward`` to every decoder layer and from there to both token mixers: the KDA layers build
their convolution context and recurrence plan from them (once per tensor object), and the attention
function, after the all-to-all, holds exactly the global sequence they describe: it builds the
block-diagonal causal mask (``eager``/``sdpa``) or hands them to flash attention's varlen path, with
global positions derived from them. Without ``cu_seq_lens_q`` the batch is ``B`` unpacked sequences.

Not supported under ``parallelize``: caches (``use_cache`` must be False: training and scoring, not
generation), padding masks, returned attention weights, ``flex_attention``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import torch.nn as nn

from ..backends import resolve_backend
from ..layers.comm import all_to_all
from ..layers.context_parallel import KDAContextParallel
from ..layers.norm import RMSNormGated
from ..layers.short_conv import causal_conv1d, sequence_positions

__all__ = ["ATTENTION_NAME", "load_kimi_linear", "parallelize", "torch_fallbacks"]

ATTENTION_NAME = "kdacp_ulysses"
_INNER = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def load_kimi_linear():
    """transformers' ``modeling_kimi_linear`` module (``KimiLinearConfig``, ``KimiLinearForCausalLM``, ...).

    Importing it imports FLA where installed (transformers' kernel fallback), and FLA reads
    ``FLA_CACHE_MODE`` once, at import: so kdacp's adapter loads FLA first, pointed at kdacp's tuned
    configurations (:func:`kdacp.tuning.use_shipped_configs`). Build models through this module, or
    call it before transformers imports its Kimi Linear code, to have them.

    Raises:
        ImportError: transformers missing or without Kimi Linear (the ``models`` extra).
    """
    from ..backends.fla_adapter import fla_available
    fla_available()
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as kl
    except ImportError as e:  # transformers < 5.x or missing: the `models` extra
        raise ImportError("kdacp.parallelize needs Hugging Face transformers with Kimi Linear: "
                          "pip install 'kdacp[models]'") from e
    return kl


# transformers' functions that bind a kernel package (FLA; causal-conv1d) where it imports, at import time.
_KERNEL_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
                     "causal_conv1d_update")


@contextlib.contextmanager
def torch_fallbacks():
    """Inside the block, transformers' unmodified Kimi Linear models run its own PyTorch code.

    transformers binds FLA's Triton kernels for KDA when it imports its Kimi Linear code, wherever FLA
    imports, and calls them whatever the tensors' device: on a machine without a GPU they fail in Triton
    ("0 active drivers"). The block swaps those module functions for the PyTorch code they wrap, and
    restores them on exit. That code ignores packed-sequence boundaries: one sequence per row.
    """
    kl = load_kimi_linear()
    saved = {name: getattr(kl, name) for name in _KERNEL_FUNCTIONS if hasattr(kl, name)}
    try:
        for name, fn in saved.items():
            setattr(kl, name, inspect.unwrap(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(kl, name, fn)


def _global_cu_seqlens(kwargs: dict) -> torch.Tensor | None:
    cu = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu is not None and cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError("under kdacp.parallelize, cu_seq_lens_q and cu_seq_lens_k are the same global boundaries")
    return cu


def _kda_forward(module: nn.Module, cp: KDAContextParallel, o_norm: RMSNormGated, hidden_states: torch.Tensor,
                 cache=None, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """``KimiLinearDeltaAttention.forward`` on this rank's time shard ``hidden_states [B, T/P, hidden]``,
    with kdacp's halo'd convolution and context-parallel recurrence; ``kwargs['cu_seq_lens_q']`` holds the
    global ``[N+1]`` boundaries of a packed batch (``B == 1``) or is absent. Returns ``[B, T/P, hidden]``."""
    # `cache` (transformers >= 5.24), `cache_params` / `past_key_values` (earlier 5.x)
    if any(c is not None for c in (cache, kwargs.pop("cache_params", None), kwargs.pop("past_key_values", None))) \
            or kwargs.get("use_cache"):
        raise ValueError("kdacp.parallelize runs without a cache: pass use_cache=False (batch.model_kwargs() does)")
    if attention_mask is not None:
        raise ValueError("kdacp.parallelize takes packed batches (cu_seq_lens_q), not padding masks")
    cu_seqlens = _global_cu_seqlens(kwargs)
    x = hidden_states
    H, K = module.num_heads, module.head_dim  # Kimi Linear: HV == H, V == K
    W = module.conv_kernel_size
    gate_module = module.forget_gate
    backend = cp.backend or "auto"
    fused = resolve_backend(backend, x.device) == "fla"
    # Ulysses moves the convolution's inputs, so it then sees whole sequences of its head shard.
    q, k, v, gate, beta = cp.to_heads([module.q_proj(x), module.k_proj(x), module.v_proj(x),
                                       gate_module.f_b_proj(gate_module.f_a_proj(x)), module.b_proj(x)])
    beta = beta.to(torch.promote_types(beta.dtype, torch.float32)).sigmoid()
    u, U = cp.head_shard()
    heads = slice(u * H // U, (u + 1) * H // U)

    conv = cp.conv_context(q.shape[1], cu_seqlens)
    halos = conv.left_halos([q, k, v], W - 1)
    # One depthwise Conv1d over q|k|v in the model: part i's channels start at i * H * K.
    weight, bias = module.conv1d.weight[:, 0], module.conv1d.bias
    outs = []
    for part, (y, halo) in enumerate(zip((q, k, v), halos)):
        channels = slice(part * H * K + heads.start * K, part * H * K + heads.stop * K)
        outs.append(causal_conv1d(y, weight[channels], None if bias is None else bias[channels], halo=halo,
                                  cu_seqlens=conv.cu_seqlens, cu_seqlens_cpu=conv.cu_seqlens_cpu, fused=fused))
    q, k, v = (y.unflatten(-1, (-1, K)) for y in outs)

    # The model's gate, -exp(A_log) * softplus(f + dt_bias), computed inside the KDA kernel.
    o, _ = cp.chunk_kda(q, k, v, beta=beta, cu_seqlens=cu_seqlens, backend=backend, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, g=gate.unflatten(-1, (-1, K)), A_log=gate_module.A_log.view(-1)[heads],
                        dt_bias=gate_module.dt_bias[heads.start * K:heads.stop * K], lower_bound=None,
                        safe_gate=False)
    o, _ = cp.to_sequence(o, None)
    o = o_norm(o, module.g_b_proj(module.g_a_proj(x)).unflatten(-1, (-1, K)), fused=fused)
    return module.o_proj(o.flatten(-2))


def document_causal_mask(cu_seqlens: torch.Tensor | None, T: int, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where query ``i`` may attend key ``j``: ``j <= i`` inside one document
    of the global boundaries ``cu_seqlens`` (None: one sequence)."""
    t = torch.arange(T, device=device)
    mask = t[None, :] <= t[:, None]
    if cu_seqlens is not None:
        doc = torch.searchsorted(cu_seqlens.to(device), t, right=True)
        mask = mask & (doc[None, :] == doc[:, None])
    return mask[None, None]


class _UlyssesAttention:
    """Per-module settings of the registered attention function: the group and the inner implementation."""

    def __init__(self, group, inner_name: str, inner):
        self.group, self.inner_name, self.inner = group, inner_name, inner

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("use_cache"):
            raise ValueError("kdacp.parallelize runs without a cache: pass use_cache=False "
                             "(batch.model_kwargs() does)")
        if attention_mask is not None:
            raise ValueError("kdacp.parallelize takes packed batches (cu_seq_lens_q), not padding masks")
        U = torch.distributed.get_world_size(self.group)
        B, H, T, Dq = query.shape
        Dk, Dv = key.shape[-1], value.shape[-1]
        # One all-to-all for q|k|v: time shards [B, H, T, D] -> head shards [B, H/U, U*T, D].
        send = torch.cat([query, key, value], dim=-1).unflatten(1, (U, H // U)).movedim(1, 0)
        recv = all_to_all(send, self.group)                                   # [U(src), B, H/U, T, D]
        full = recv.permute(1, 2, 0, 3, 4).reshape(B, H // U, U * T, Dq + Dk + Dv)
        q, k, v = full.split([Dq, Dk, Dv], dim=-1)

        cu = _global_cu_seqlens(kwargs)
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


def parallelize(model: nn.Module, cp: KDAContextParallel) -> nn.Module:
    """Apply context parallelism to a Hugging Face ``KimiLinearForCausalLM`` (or ``KimiLinearModel``) in place.

    KDA layers run kdacp's halo'd short convolution and ``cp.chunk_kda`` on the module's own parameters;
    MLA layers run Ulysses sequence parallelism over ``cp.group`` around the model's attention
    implementation (see the module docstring for the why). Parameters are used in place: no copies, and
    ``model.state_dict()`` is unchanged. Call it on every rank, after moving the model to its device.

    Feed each rank its shard from :func:`kdacp.shard_batch`: ``model(**batch.model_kwargs())``, then
    :func:`kdacp.models.global_token_mean_loss` on the logits (not the model's ``labels`` loss, which would
    shift labels within the shard).

    Args:
        model: a transformers Kimi Linear model; its attention implementation (``eager``, ``sdpa``,
            ``flash_attention_2/3/4``) becomes the inner one of the Ulysses attention.
        cp: the :class:`kdacp.KDAContextParallel` of the KDA layers (``state``, ``ulysses`` or
            ``hybrid``); the MLA layers use its whole ``group``.

    Returns:
        ``model``.

    Raises:
        ImportError: transformers without Kimi Linear.
        ValueError: a model without Kimi Linear token mixers, one already parallelised, heads that do not
            split over the ranks, an unsupported attention implementation or convolution activation.
    """
    kl = load_kimi_linear()
    from transformers import AttentionInterface

    if not isinstance(cp, KDAContextParallel):
        raise ValueError(f"cp must be a kdacp.KDAContextParallel, got {type(cp).__name__}")
    kda = [m for m in model.modules() if isinstance(m, kl.KimiLinearDeltaAttention)]
    mla = [m for m in model.modules() if isinstance(m, kl.KimiLinearAttention)]
    if not kda and not mla:
        raise ValueError(f"{type(model).__name__} holds no Kimi Linear token mixers "
                         "(KimiLinearDeltaAttention, KimiLinearAttention)")
    if any("forward" in vars(m) for m in kda) or any(hasattr(m, "_kdacp_ulysses") for m in mla):
        raise ValueError("model is already parallelised by kdacp")
    P = torch.distributed.get_world_size(cp.group)
    for m in kda:
        cp.validate_heads(m.num_heads, m.num_heads)
        if m.activation not in ("silu", "swish"):
            raise ValueError(f"KDA layer {m.layer_idx}: kdacp's short convolution applies SiLU, "
                             f"the model's uses {m.activation!r}")
    config = model.config
    inner_name = config._attn_implementation
    if mla:
        if inner_name not in _INNER:
            raise ValueError(f"the Ulysses attention wraps one of {_INNER}; the model uses {inner_name!r}")
        heads = {m.num_heads for m in mla}
        if any(h % P for h in heads):
            raise ValueError(f"Ulysses attention shards the MLA layers' num_attention_heads={sorted(heads)} over "
                             f"the {P} ranks of the context-parallel group: needs num_attention_heads % {P} == 0")
        inner = kl.eager_attention_forward if inner_name == "eager" else AttentionInterface()[inner_name]

    for m in kda:
        # kdacp's gated RMSNorm (FLA's fused kernel on the GPU) around the model's own weight; kept
        # outside the module tree, so the state dict does not see it.
        o_norm = RMSNormGated(m.head_dim, eps=m.o_norm.variance_epsilon, activation="sigmoid", device="meta")
        o_norm.weight = m.o_norm.weight
        m.forward = functools.partial(_kda_forward, m, cp, o_norm)
    if mla:
        for m in mla:
            m._kdacp_ulysses = _UlyssesAttention(cp.group, inner_name, inner)
        AttentionInterface.register(ATTENTION_NAME, _ulysses_attention)
        # The config object may be shared with other models (built from the same config, or a reference
        # copy's): this model's modules get their own copy, so that only they look up the Ulysses function.
        # The mask code builds no mask for a name it does not know, and the function builds its own.
        own = copy.deepcopy(config)
        own._attn_implementation = ATTENTION_NAME
        for m in model.modules():
            if getattr(m, "config", None) is config:
                m.config = own
    return model
