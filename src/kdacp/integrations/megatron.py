"""kdacp's Gated DeltaNet as a drop-in module for Megatron-Core 0.19.2's layer specs.

:class:`KdacpGatedDeltaNet` subclasses Megatron's ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``: the
same constructor, parameters, state-dict and ``sharded_state_dict`` keys (its projections, norm and
checkpointing are Megatron's own code), and a forward that runs kdacp's halo'd short convolution and
kdacp's :func:`~kdacp.ops.gdn.chunk_gated_delta_rule` with state passing over ``pg_collection.cp``. Megatron's
own forward turns the sequence shards into head shards (an all-to-all, so ``cp`` must divide the key and
value head counts); kdacp's needs no head split, so any ``cp`` degree runs, on unpacked ``[s, b, h]``
batches and on packed ones (``PackedSeqParams``, ``qkv_format="thd"``, documents cut across ranks).

Swap it into a spec where Megatron's ``GatedDeltaNet`` sits: :func:`get_gated_delta_net_module_spec` (one
layer's mixer) or :func:`get_hybrid_layer_specs` / :func:`get_hybrid_block_spec` (Megatron's Qwen3-Next /
Qwen3.5 hybrid stack of GDN and attention layers, ``linear_attention_freq``, with kdacp's GDN). A model
whose ``cp`` exceeds the GDN head count needs :class:`KdacpTransformerConfig`, since Megatron's
``TransformerConfig`` asserts that the heads divide by ``tp x cp``.

Token layout: Megatron gives each rank a zigzag shard (``2P`` chunks, rank ``r`` holding chunks ``r`` and
``2P-1-r``; for THD batches per document). kdacp takes it as it comes (its ``"zigzag"`` and
``"document_zigzag"`` layouts): the state chain runs through the chunks in token order and each chunk's
convolution halo comes from whichever rank holds the tokens before it, so no token moves between ranks.

Supported: tensor parallelism on the head dimension (Megatron's sharding of ``in_proj``, ``conv1d``, ``A_log``,
``dt_bias`` and ``out_proj``) without sequence parallelism. Refused by name, before any rank blocks:
sequence parallelism with ``tp > 1``, inference, activations other than SiLU, ``gdn_norm_out`` recompute,
FP8, THD batches with ``b > 1`` or documents whose length does not divide by ``2 x cp``.

On CPU (tests, the example), Megatron-Core needs :func:`cpu_stand_ins` around model construction.
Megatron-Core 0.19.2 has no Kimi Delta Attention layer; a KDA twin would subclass the same way with
:func:`~kdacp.ops.kda.chunk_kda` as :attr:`KdacpGatedDeltaNet.op` and a ``[HV, K]`` gate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mcore_specs
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as mcore_gdn_common
from megatron.core.ssm.gated_delta_net import gdn as mcore_gdn
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ..backends import backend_fuses
from ..caches import TensorKey
from ..cp.context import SINGLE_DEVICE, ContextParallel
from ..cp.split import check_split
from ..ops.gdn import chunk_gated_delta_rule

__all__ = ["KdacpGatedDeltaNet", "KdacpTransformerConfig", "cpu_stand_ins", "fla_stand_ins",
           "get_gated_delta_net_module_spec", "get_hybrid_block_spec", "get_hybrid_layer_specs"]

CACHED_LAYOUTS = 8  # zigzag routes kept (one per batch shape / packing; a few batches in flight)


@dataclasses.dataclass
class KdacpTransformerConfig(TransformerConfig):
    """Megatron's ``TransformerConfig`` whose Gated DeltaNet check asks what kdacp's GDN needs: key and value
    heads divisible by ``tensor_model_parallel_size`` only (Megatron's own GDN also splits heads over ``cp``).

    Raises:
        ValueError: ``linear_num_key_heads`` or ``linear_num_value_heads`` not divisible by the TP size.
    """

    def __post_init__(self):
        gdn = self.experimental_attention_variant == "gated_delta_net" and self.linear_num_key_heads is not None \
            and self.linear_num_value_heads is not None
        if not gdn:
            return super().__post_init__()
        tp, cp = self.tensor_model_parallel_size, self.context_parallel_size
        H, HV = self.linear_num_key_heads, self.linear_num_value_heads
        if H % tp or HV % tp:
            raise ValueError(f"kdacp's GDN shards heads over tensor_model_parallel_size={tp} only: needs "
                             f"linear_num_key_heads % {tp} == 0 and linear_num_value_heads % {tp} == 0, "
                             f"got {H} and {HV}")
        # Megatron's check (heads % (tp * cp)) is the only reader of the head counts in __post_init__: it
        # sees them scaled by tp * cp, which keeps their ratio and every other check as they are.
        self.linear_num_key_heads, self.linear_num_value_heads = H * tp * cp, HV * tp * cp
        try:
            super().__post_init__()
        finally:
            self.linear_num_key_heads, self.linear_num_value_heads = H, HV


# --- the module ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _context(group, strategy: str, layout: str):
    """One kdacp context per CP group, strategy and layout, shared by every layer: its memo holds each batch's
    context (plan, boundaries, halo routes) once, not once per layer. Megatron's token layouts are kdacp's own:
    ``"zigzag"`` for [s, b, h] rows (rank r holds chunks r and 2cp-1-r of each row) and ``"document_zigzag"``
    for THD batches (the same per document)."""
    return ContextParallel("state", group, strategy=strategy, layout=layout)


@contextlib.contextmanager
def _fla_check_skipped():
    """Megatron's GDN constructor refuses to build without FLA; kdacp's module calls none of Megatron's FLA
    functions (kdacp's backend chooses FLA's kernels where CUDA and FLA are present)."""
    have = mcore_gdn_common.HAVE_FLA
    mcore_gdn_common.HAVE_FLA = True
    try:
        yield
    finally:
        mcore_gdn_common.HAVE_FLA = have


def _check_supported(config: TransformerConfig, pg_collection) -> None:
    """Raise before any rank blocks on what :class:`KdacpGatedDeltaNet` does not run."""
    if pg_collection is None:
        raise ValueError("KdacpGatedDeltaNet needs pg_collection (its tp and cp process groups)")
    tp = pg_collection.tp.size()
    if config.sequence_parallel and tp > 1:
        raise NotImplementedError(f"sequence_parallel=True with tensor_model_parallel_size={tp}: kdacp's GDN "
                                  "relays out whole hidden states between Megatron's zigzag and contiguous "
                                  "shards; set sequence_parallel=False or tensor_model_parallel_size=1")
    if config.activation_func.__name__ not in ("silu", "swish"):
        raise NotImplementedError(f"activation_func={config.activation_func.__name__}: the GDN convolution and "
                                  "output gate run SiLU; set activation_func=torch.nn.functional.silu")
    if config.recompute_granularity == "selective" and "gdn_norm_out" in config.recompute_modules:
        raise NotImplementedError("recompute_modules contains 'gdn_norm_out': kdacp's GDN does not recompute its "
                                  "output norm; remove it")
    if config.fp8:
        raise NotImplementedError(f"fp8={config.fp8!r}: kdacp's GDN runs in the parameters' dtype; set fp8=None")
    H, HV = config.linear_num_key_heads, config.linear_num_value_heads
    if H % tp or HV % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must divide linear_num_key_heads={H} and "
                         f"linear_num_value_heads={HV}")


class KdacpGatedDeltaNet(GatedDeltaNet):
    """Megatron's ``GatedDeltaNet`` (same constructor, parameters and checkpoint keys) running kdacp's short
    convolution and recurrence, with state passing over ``pg_collection.cp`` at any CP degree.

    Args:
        config, submodules, layer_number, bias, conv_bias, conv_init, use_qk_l2norm, A_init_range,
            pg_collection, name, cp_comm_type: Megatron's (``cp_comm_type`` ignored, as Megatron's GDN does).
        strategy: kdacp's state exchange (``"p2p"``, ``"allgather"``, ``"scan"``, ``"auto"``).
        backend: kdacp's local backend (``"auto"``: FLA's kernels on CUDA where FLA is installed, PyTorch on CPU).
        split: the recurrence's split inside the device (:func:`kdacp.chunk_gated_delta_rule`'s ``split``:
            ``"auto"``, the default, an int, or None for none).

    Forward (Megatron's contract): ``hidden_states [s, b, hidden_size]``, this rank's zigzag shard of ``s * cp``
    tokens; ``packed_seq_params`` with ``qkv_format="thd"`` (``b == 1``; ``cu_seqlens_q_padded`` or
    ``cu_seqlens_q`` the global document boundaries, each length divisible by ``2 * cp``). Returns
    ``(out [s, b, hidden_size], out_bias)`` as ``out_proj`` gives them.

    Raises:
        NotImplementedError: settings kdacp's GDN does not run (the module docstring lists them).
        ValueError: batches whose layout it cannot take (named in the message).
    """

    op = staticmethod(chunk_gated_delta_rule)

    def __init__(self, config: TransformerConfig, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 bias: bool = False, conv_bias: bool = False, conv_init: float | None = None,
                 use_qk_l2norm: bool = True, A_init_range: tuple[float, float] = (1, 16), pg_collection=None, *,
                 name: str | None = None, cp_comm_type: str | None = None, strategy: str = "p2p",
                 backend: str = "auto", split="auto"):
        _check_supported(config, pg_collection)
        check_split(split)
        with _fla_check_skipped():
            super().__init__(config, submodules, layer_number, bias, conv_bias, conv_init, use_qk_l2norm,
                             A_init_range, pg_collection, name=name, cp_comm_type=cp_comm_type)
        self.strategy, self.backend, self.split = strategy, backend, split
        cp = pg_collection.cp
        # Megatron's zigzag shards as they come: kdacp's state chain runs through each rank's two chunks
        self.contexts = {packed: SINGLE_DEVICE if cp.size() == 1 else
                         _context(cp, strategy, "document_zigzag" if packed else "zigzag") for packed in (False, True)}

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gated_delta_rule = self.op
        # kdacp keeps every head on its rank: the sections of in_proj's output are not divided by cp.
        self.feat_dim_split = (self.qk_dim_local_tp * 2 + self.v_dim_local_tp, self.v_dim_local_tp,
                               self.num_v_heads_local_tp, self.num_v_heads_local_tp)

    def extra_repr(self) -> str:
        return f"context={self.contexts[False]!r}, backend={self.backend!r}, split={self.split!r}"

    def _global_cu_seqlens(self, packed_seq_params: PackedSeqParams | None, batch: int,
                           total: int) -> torch.Tensor | None:
        """The global document boundaries of a THD batch (None for unpacked rows), checked against its layout."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None
        if batch != 1:
            raise ValueError(f"a THD batch (packed_seq_params.qkv_format='thd') has b == 1, got b={batch}")
        padded = packed_seq_params.cu_seqlens_q_padded
        cu = padded if padded is not None else packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params.qkv_format='thd' needs cu_seqlens_q (or cu_seqlens_q_padded)")
        _check_thd_boundaries(TensorKey(cu), total, self.cp_size)
        return cu

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, inference_context=None,
                packed_seq_params: PackedSeqParams | None = None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("kdacp's GDN runs training and prefill without an inference context; "
                                      "got inference_context")
        T, B, _ = hidden_states.shape
        cu = self._global_cu_seqlens(packed_seq_params, B, T * self.cp_size)
        if self.cp_size > 1 and cu is None and T % 2:
            raise ValueError(f"Megatron's zigzag layout gives each rank two equal chunks: s={T} must be even")
        qkvzba, _ = self.in_proj(hidden_states)                                                    # [T, B, C / tp]
        qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), self.feat_dim_split, dim=-1)
        batch = self.contexts[cu is not None].context(*qkv.shape[:2], cu, qkv.device)
        # the taps of each of this rank's zigzag chunks reach back to whichever rank holds the tokens before it
        weight = self.conv1d.weight  # looked up per call: wrappers may replace parameters after build
        qkv, = batch.short_convolution([qkv], [weight.squeeze(1)], [self.conv1d.bias],
                                       fused=bool(backend_fuses(self.backend, qkv.device, scalar_gate=True)))
        q, k, v = torch.split(qkv, [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp], dim=-1)
        q, k = (t.unflatten(-1, (-1, self.key_head_dim)) for t in (q, k))               # [B, T, H / tp, K]
        v = v.unflatten(-1, (-1, self.value_head_dim))                                  # [B, T, HV / tp, V]
        # g: raw logits, turned into -exp(A_log) softplus(g + dt_bias) inside kdacp's op (in float32)
        o, _ = batch.recurrence(self.gated_delta_rule, q, k, v, alpha.contiguous(), beta.sigmoid(),
                                backend=self.backend, split=self.split, use_gate_in_kernel=True, A_log=self.A_log,
                                dt_bias=self.dt_bias, use_qk_l2norm_in_kernel=self.use_qk_l2norm)
        norm = self._apply_gated_norm(o, gate.reshape(B, T, -1, self.value_head_dim))  # [B T HV / tp, V]
        out, out_bias = self.out_proj(norm.reshape(B, T, -1).transpose(0, 1).contiguous())
        return out, out_bias


@functools.lru_cache(maxsize=CACHED_LAYOUTS)
def _check_thd_boundaries(key: TensorKey, total: int, cp_size: int) -> None:
    """Raise ``ValueError`` unless the global boundaries ``key.tensor`` run from 0 to ``total`` in documents that
    Megatron's zigzag layout cuts into ``2 x cp_size`` equal chunks. Read on the host once per tensor (every layer
    of a step gets the same one): later layer calls of the step pass without a device sync."""
    values = key.tensor.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"packed_seq_params' cu_seqlens must run from 0 to the global token count {total} "
                         f"(this rank's s={total // cp_size} x cp={cp_size}), got {values}")
    step = 2 * cp_size if cp_size > 1 else 1
    bad = [e - s for s, e in zip(values, values[1:]) if (e - s) % step]
    if bad:
        raise ValueError(f"Megatron's zigzag layout cuts each document into 2 x cp={step} chunks: document "
                         f"lengths {bad} do not divide by {step} (pad them: cu_seqlens_q_padded)")


# --- specs --------------------------------------------------------------------------------------------------


def get_gated_delta_net_module_spec(config: TransformerConfig, backend: BackendSpecProvider | None = None, *,
                                    strategy: str = "p2p", kdacp_backend: str = "auto", split="auto") -> ModuleSpec:
    """Megatron's GDN mixer spec (``get_gated_delta_net_module_spec``) with :class:`KdacpGatedDeltaNet`.

    Args:
        config: the model's config.
        backend: Megatron's spec provider (default: Transformer Engine's where ``config.transformer_impl`` is
            ``"transformer_engine"``, else :class:`~megatron.core.models.backends.LocalSpecProvider`). Where it
            has no fused layer-norm + linear (the local one), ``in_proj`` is a plain column-parallel linear and
            ``metainfo["fuse_input_layernorm"]`` is False: the layer then needs its own input norm, which
            :func:`get_hybrid_layer_specs` gives it.
        strategy, kdacp_backend, split: :class:`KdacpGatedDeltaNet`'s ``strategy``, ``backend`` and ``split``.
    """
    backend = _spec_provider(config) if backend is None else backend
    spec = mcore_specs.get_gated_delta_net_module_spec(config=config, backend=backend)
    submodules = spec.submodules
    fused = submodules.in_proj is not None
    if not fused:
        submodules = dataclasses.replace(submodules, in_proj=backend.column_parallel_linear())
    return ModuleSpec(module=KdacpGatedDeltaNet, submodules=submodules,
                      params={**spec.params, "strategy": strategy, "backend": kdacp_backend, "split": split},
                      metainfo={**spec.metainfo, "fuse_input_layernorm": fused})


def _spec_provider(config: TransformerConfig) -> BackendSpecProvider:
    if config.transformer_impl == "transformer_engine":
        return mcore_specs._get_backend_spec_provider(config)
    return LocalSpecProvider()


def get_hybrid_layer_specs(config: TransformerConfig, backend: BackendSpecProvider | None = None, *,
                           strategy: str = "p2p", kdacp_backend: str = "auto", split="auto") -> list[ModuleSpec]:
    """Megatron's Qwen3-Next / Qwen3.5 layer specs (``get_transformer_layer_with_experimental_attention_variant_
    spec``: GDN and attention layers after ``config.linear_attention_freq``, dense or MoE MLPs after
    ``config.moe_layer_freq``), every GDN mixer replaced by :func:`get_gated_delta_net_module_spec`'s.

    Raises:
        ValueError: ``config.experimental_attention_variant`` is not ``"gated_delta_net"``.
        NotImplementedError: attention layers with a backend other than Transformer Engine's (Megatron's
            hybrid stack builds them from Transformer Engine's spec only).
    """
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(f"hybrid GDN specs need experimental_attention_variant='gated_delta_net', "
                         f"got {config.experimental_attention_variant!r}")
    backend = _spec_provider(config) if backend is None else backend
    if backend.column_parallel_layer_norm_linear() is None and 0 in mcore_specs.get_linear_attention_pattern(config):
        raise NotImplementedError(f"linear_attention_freq={config.linear_attention_freq!r} has attention layers: "
                                  f"Megatron builds them for its hybrid stack from Transformer Engine's spec only, "
                                  f"got {type(backend).__name__}")
    gdn = get_gated_delta_net_module_spec(config, backend, strategy=strategy, kdacp_backend=kdacp_backend, split=split)
    rms_norm = config.normalization == "RMSNorm"
    with _fla_check_skipped():  # Megatron's GDN spec is only read here, never built
        layers = mcore_specs.get_transformer_layer_with_experimental_attention_variant_spec(config, backend)
    specs = []
    for layer in layers:
        if layer.submodules.self_attention.module is GatedDeltaNet:
            norm = IdentityOp if gdn.metainfo["fuse_input_layernorm"] else backend.layer_norm(rms_norm=rms_norm)
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(
                layer.submodules, self_attention=gdn, input_layernorm=norm))
        specs.append(layer)
    return specs


def get_hybrid_block_spec(config: TransformerConfig, backend: BackendSpecProvider | None = None, *,
                          vp_stage: int | None = None, pp_rank: int | None = None, strategy: str = "p2p",
                          kdacp_backend: str = "auto") -> TransformerBlockSubmodules:
    """The ``transformer_layer_spec`` of a ``GPTModel`` (Megatron's ``get_transformer_block_with_experimental_
    attention_variant_spec``) built from :func:`get_hybrid_layer_specs`: this pipeline stage's layers and the
    final norm."""
    backend = _spec_provider(config) if backend is None else backend
    specs = get_hybrid_layer_specs(config, backend, strategy=strategy, kdacp_backend=kdacp_backend)
    if config.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.enums import LayerType
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                       vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return TransformerBlockSubmodules(layer_specs=[specs[i] for i in ids],
                                      layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"))


# --- CPU runs -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_stand_ins():
    """What Megatron-Core 0.19.2 needs to build, run and checkpoint a model on CPU (tests, the example with gloo),
    for the duration of the block: ``torch.cuda.current_device()`` (where Megatron creates GDN parameters, some
    buffers, and ``dist_checkpointing``'s failure flag) answers the CPU; ``torch.cuda.synchronize()`` (which
    ``dist_checkpointing.save`` calls after copying tensors to the host, whatever their device) returns at once,
    as CPU copies are done when they return; and the model-parallel RNG tracker, if not yet made, is Megatron's
    inference tracker (its ``fork`` leaves the CUDA RNG alone). Build with ``use_cpu_initialization=True``; set
    ``TORCHDYNAMO_DISABLE=1`` before importing Megatron (its fused functions are compiled on first call)."""
    if not mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        mcore_random.initialize_rng_tracker(inference_rng_tracker=True)
    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = current_device, synchronize


@contextlib.contextmanager
def fla_stand_ins():
    """Megatron's own ``GatedDeltaNet`` runnable without FLA's CUDA kernels, for the duration of the block (its
    reference in tests and CPU checks): plain-PyTorch functions of the contracts of the three FLA functions it
    calls, FLA's ``l2norm`` formula, ``F.conv1d`` per document for ``causal_conv1d`` (SiLU after), and Megatron's
    own ``torch_chunk_gated_delta_rule`` per document for ``chunk_gated_delta_rule`` (no initial or final state,
    no L2 norm in kernel, as Megatron calls it)."""

    def l2norm(x, dim=-1, eps=1e-6):
        return x * torch.rsqrt(x.square().sum(dim, keepdim=True) + eps)

    def documents(T, cu_seqlens):
        cu = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
        return list(zip(cu, cu[1:]))

    def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None):
        W, parts = weight.shape[-1], []
        for s, e in documents(x.shape[1], cu_seqlens):
            y = torch.nn.functional.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], bias, padding=W - 1,
                                           groups=weight.shape[0])
            parts.append(torch.nn.functional.silu(y[..., :e - s]).transpose(1, 2))
        return torch.cat(parts, 1), None

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if initial_state is not None or output_final_state or use_qk_l2norm_in_kernel:
            raise NotImplementedError("the stand-in runs Megatron's call only: no initial or final state, no L2 "
                                      "norm in kernel")
        rule = mcore_gdn_common.torch_chunk_gated_delta_rule
        return torch.cat([rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e])[0]
                          for s, e in documents(q.shape[1], cu_seqlens)], 1), None

    saved = (mcore_gdn_common.l2norm, mcore_gdn.causal_conv1d, mcore_gdn.chunk_gated_delta_rule)
    mcore_gdn_common.l2norm, mcore_gdn.causal_conv1d, mcore_gdn.chunk_gated_delta_rule = \
        l2norm, causal_conv1d, chunk_gated_delta_rule
    try:
        with _fla_check_skipped():
            yield
    finally:
        mcore_gdn_common.l2norm, mcore_gdn.causal_conv1d, mcore_gdn.chunk_gated_delta_rule = saved
