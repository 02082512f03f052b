"""Context parallelism for torchtitan 0.3.0's Qwen3.5, applied from outside torchtitan's code.

torchtitan's ``parallelize_qwen3_5`` refuses context parallelism (its Gated DeltaNet layers would
need the whole sequence). This module is a torchtitan config module (``--module
kdacp.integrations.torchtitan``): its config functions (``qwen35_kdacp_*``) return torchtitan
``Trainer.Config`` objects whose model spec, named ``qwen3_5_kdacp``, builds torchtitan's own
Qwen3.5 and parallelizes it with :func:`parallelize_qwen3_5_kdacp`:

1. every ``GatedDeltaNet`` of the model gets kdacp's recurrence and short convolution
   (:func:`apply_kdacp_to_gated_deltanet`): its ``kernel`` module becomes a
   :class:`KdacpGatedDeltaKernel` (state exchange between time shards by kdacp's GDN op, with one
   plan per batch built from the global ``cu_seqlens``) and its ``_causal_conv`` runs
   :func:`kdacp.layers.short_conv.causal_conv1d` with a left halo from the previous rank;
   parameters and state-dict keys do not change;
2. the attention layers (one in four) run under torchtitan's own context parallelism for
   FlexAttention (``apply_cp_to_forward``: keys and values all-gathered over ``cp``; each rank's
   document mask is built for its queries, :func:`local_document_mask`). kdacp's Ulysses attention
   would need ``n_kv_heads % cp == 0``, and every dense Qwen3.5 has 2 key/value heads;
3. then torchtitan's ``parallelize_qwen3_5`` for everything it does (activation checkpointing,
   FSDP2 over ``dp_shard x cp``), with context parallelism marked as done.

:class:`KdacpTrainer` cuts each batch over the ``cp`` mesh axis into contiguous equal shards
(:func:`shard_batch`, no load balancing: the recurrence needs rank ``r`` to hold tokens
``[r T / P, (r + 1) T / P)``) and keeps the global document boundaries for the GDN layers.

Configs: :func:`qwen35_kdacp_debugmodel`, :func:`qwen35_kdacp_0_8b` and the baseline
:func:`qwen35_titan_0_8b` (torchtitan's own spec), on text (:func:`text_config`). On CPU,
:class:`DenseFlexAttention` stands in for FlexAttention (no backward on CPU) and kdacp's ``torch``
backend for FLA's kernels.

Loss contract: torchtitan's loss is the rank's summed token loss over the global count of valid
tokens, and FSDP2 sums gradients over ``dp_shard x cp`` (divide factor 1), so the sums are the
gradients of the global mean; nothing here changes that.

torch.compile (``compile.components`` with ``"model"``: torchtitan compiles each block with ``fullgraph=True``): the
GDN modules' short convolutions and recurrence, which read the batch's offsets on the host and exchange between
ranks, each run as one opaque custom op (:mod:`kdacp.compile`); the rest of the block traces.

Refused with an error before any rank blocks: CUDA graphs, tensor, pipeline and expert parallelism, the
``spmd_types`` / ``full_dtensor`` backends under context parallelism, vision inputs, ``local_batch_size > 1``
and attention other than FlexAttention under context parallelism.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_mask

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.context_parallel import apply_cp_to_forward
from torchtitan.distributed.utils import is_in_batch_invariant_mode
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import qwen3_5
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.common.attention import (FlexAttention, create_attention_mask,
                                                 create_varlen_metadata_for_document, get_causal_mask_mod,
                                                 get_efficient_causal_mask_mod_for_packed_document)
from torchtitan.models.qwen3_5.model import GatedDeltaNet
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.utils import device_type
from torchtitan.trainer import Trainer

from ..backends import FLA_BACKENDS, resolve_backend
from ..compile import run_opaque
from ..gdn import chunk_gated_delta_rule
from ..layers.context_parallel import SINGLE_DEVICE, ContextParallel
from ..layers.short_conv import causal_conv1d

__all__ = ["DenseFlexAttention", "GatedDeltaContext", "KdacpGatedDeltaKernel", "KdacpGatedDeltaNet", "KdacpTrainer",
           "TEXT_ONLY_TOKENS", "VISION_INPUTS", "apply_dense_attention", "apply_kdacp_to_gated_deltanet",
           "local_document_mask", "model_registry", "parallelize_qwen3_5_kdacp", "qwen35_kdacp_0_8b",
           "qwen35_kdacp_debugmodel", "qwen35_titan_0_8b", "shard_batch", "text_config"]

SPEC_NAME = "qwen3_5_kdacp"
CACHED_BATCHES = 8  # global cu_seqlens kept per model (a few batches are in flight with AC recompute)
# Token ids no token has: Qwen3.5 reads them only to place vision embeddings.
TEXT_ONLY_TOKENS = {"image_id": -1, "video_id": -1}
# Batch keys of torchtitan's multimodal loader: their tokens must be scattered before any cut.
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "grid_thw", "grid_thw_videos", "mrope_positions")


class GatedDeltaContext:
    """How the swapped GDN modules of one model run: on one device, or over the ``cp`` process group
    by kdacp's state exchange (recurrence) and halo (short convolution).

    torchtitan hands each GDN module the *global* document offsets of the batch (``cu_seqlens`` on
    the device, ``cu_seqlens_cpu`` on the host, int32, ``[N+1]``) and this rank's tokens. Their host
    values key one canonical device tensor per batch, so that kdacp builds the batch's plan, local
    offsets and halo masks once per batch, not per layer (torchtitan clones ``cu_seqlens`` per call).

    Args:
        group: the context-parallel process group, or None for one device.
        strategy: kdacp's state exchange (``"p2p"``, ``"allgather"``, ``"scan"``, ``"auto"``).
        backend: kdacp's local backend (``"auto"``: FLA's kernels on CUDA, PyTorch on CPU).
    """

    def __init__(self, group=None, *, strategy: str = "p2p", backend: str = "auto"):
        self.cp = SINGLE_DEVICE if group is None else ContextParallel("state", group, strategy=strategy)
        self.backend = backend
        self._global_offsets: OrderedDict = OrderedDict()

    def __repr__(self) -> str:
        return f"GatedDeltaContext(cp={self.cp!r}, backend={self.backend!r})"

    def _offsets(self, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor:
        """The canonical device tensor of the global offsets ``cu_seqlens_cpu`` holds."""
        key = tuple(cu_seqlens_cpu.tolist())
        hit = self._global_offsets.pop(key, None)
        if hit is None:
            hit = cu_seqlens.to(torch.int64)
            if len(self._global_offsets) >= CACHED_BATCHES:
                self._global_offsets.popitem(last=False)
        self._global_offsets[key] = hit
        return hit

    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor:
        """``silu(depthwise causal conv)`` of this rank's tokens ``x [1, T, D]`` with ``weight [D, 1, W]``,
        each document's taps reaching back onto the previous rank where the document began there."""
        _check_offsets(cu_seqlens, cu_seqlens_cpu)
        # under torch.compile one opaque op: it reads the offsets on the host (kdacp.compile)
        return run_opaque(_HaloConvolution, (self,), x, weight, cu_seqlens, cu_seqlens_cpu)[0]

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, cu_seqlens: torch.Tensor | None,
                         cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor:
        """The gated delta rule over this rank's tokens, with L2-normalised q, k (torchtitan's contract).

        Args:
            q, k: ``[1, T, H, K]``; v ``[1, T, HV, V]`` (``HV % H == 0``, key head ``h`` serves value
                heads ``h*HV/H ...``, as torchtitan's ``repeat_interleave``); g ``[1, T, HV]`` natural-log
                decay (any float dtype); beta ``[1, T, HV]``; cu_seqlens, cu_seqlens_cpu: the global ``[N+1]`` offsets.

        Returns:
            ``o [1, T, HV, V]`` in v's dtype.
        """
        _check_offsets(cu_seqlens, cu_seqlens_cpu)
        # kdacp takes g in q's dtype: torchtitan's float32 gate is rounded to it under bf16 mixed precision
        # (FLA's kernels would read it in float32).
        return run_opaque(_GatedDeltaRecurrence, (self,), q, k, v, g.to(q.dtype), beta, cu_seqlens, cu_seqlens_cpu)[0]


def _check_offsets(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None) -> None:
    if cu_seqlens is None or cu_seqlens_cpu is None:
        raise ValueError("kdacp's Gated DeltaNet needs the batch's document offsets (cu_seqlens and "
                         "cu_seqlens_cpu, [N+1]): build the batch's attention masks with attn_backend='flex'")


@dataclass(frozen=True)
class _HaloConvolution:
    """:meth:`GatedDeltaContext.causal_conv` (an :class:`kdacp.compile.OpaqueRegion`: it reads the offsets on
    the host and exchanges the halo)."""

    context: GatedDeltaContext

    def __call__(self, x, weight, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        """``x [1, T, D]``, ``weight [D, 1, W]``, the global offsets -> ``(silu(conv(x)) [1, T, D],)``."""
        context = self.context.cp.context(1, x.shape[1], self.context._offsets(cu_seqlens, cu_seqlens_cpu))
        halo = context.left_halos([x], weight.shape[-1] - 1)[0]
        return (causal_conv1d(x, weight[:, 0], halo=halo, cu_seqlens=context.local_cu_seqlens,
                              cu_seqlens_cpu=context.local_cu_seqlens_cpu, range_starts=context.range_starts,
                              fused=resolve_backend(self.context.backend, x.device) in FLA_BACKENDS),)

    def fake(self, x, weight, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        return (x.new_empty(x.shape),)


@dataclass(frozen=True)
class _GatedDeltaRecurrence:
    """:meth:`GatedDeltaContext.gated_delta_rule` (an :class:`kdacp.compile.OpaqueRegion`: it reads the offsets
    on the host and exchanges states)."""

    context: GatedDeltaContext

    def __call__(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        """:meth:`GatedDeltaContext.gated_delta_rule`'s arguments (``g`` in ``q``'s dtype) -> ``(o,)``."""
        # The one call of kdacp's GDN op (through the layers' context-parallel hook, which owns the plan).
        o, _ = self.context.cp.recurrence(chunk_gated_delta_rule, q, k, v, g, beta,
                                          cu_seqlens=self.context._offsets(cu_seqlens, cu_seqlens_cpu),
                                          backend=self.context.backend, use_qk_l2norm_in_kernel=True)
        return (o,)

    def fake(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        return (v.new_empty(v.shape),)


class KdacpGatedDeltaKernel(nn.Module):
    """Drop-in for torchtitan's ``GatedDeltaKernel`` (same call, no parameters) running kdacp's GDN op."""

    def __init__(self, context: GatedDeltaContext):
        super().__init__()
        self.context = context

    def extra_repr(self) -> str:
        return repr(self.context)

    def forward(self, xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, *, cu_seqlens=None, cu_seqlens_cpu=None):
        """torchtitan's ``GatedDeltaKernel.forward`` contract: ``[1, T, H, K]`` q, k (grouped heads are
        not repeated: kdacp maps them), ``[1, T, HV, V]`` v, ``[1, T, HV]`` g and beta -> ``[1, T, HV, V]``."""
        return self.context.gated_delta_rule(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, cu_seqlens, cu_seqlens_cpu)


class KdacpGatedDeltaNet(GatedDeltaNet):
    """torchtitan's ``GatedDeltaNet`` whose short convolutions run kdacp's (halo'd under context
    parallelism); set on a built module by :func:`apply_kdacp_to_gated_deltanet`, never constructed."""

    def _causal_conv(self, x_BLD, conv, cu_seqlens=None, cu_seqlens_cpu=None):
        # conv.weight is looked up per call: FSDP2 replaces the parameters after this class is set.
        return self.kernel.context.causal_conv(x_BLD, conv.weight, cu_seqlens, cu_seqlens_cpu)


def apply_kdacp_to_gated_deltanet(model: nn.Module, cp_mesh: DeviceMesh | None, *, strategy: str = "p2p",
                                  backend: str = "auto") -> GatedDeltaContext:
    """Swap every torchtitan ``GatedDeltaNet`` of ``model`` to kdacp's recurrence and convolution.

    Args:
        model: a built torchtitan Qwen3.5 (before FSDP, compile and activation checkpointing).
        cp_mesh: the 1-D ``cp`` mesh axis, or None for one device.
        strategy, backend: see :class:`GatedDeltaContext`.

    Returns:
        The context the swapped modules share.

    Raises:
        ValueError: the model has no ``GatedDeltaNet``, or one was already swapped.
    """
    nets = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not nets:
        raise ValueError(f"model has no torchtitan GatedDeltaNet to swap (got {type(model).__name__})")
    if any(isinstance(m, KdacpGatedDeltaNet) for m in nets):
        raise ValueError("model's GatedDeltaNet modules already run kdacp's (apply once)")
    context = GatedDeltaContext(None if cp_mesh is None else cp_mesh.get_group(), strategy=strategy,
                                backend=backend)
    for net in nets:
        net.kernel = KdacpGatedDeltaKernel(context)
        net.__class__ = KdacpGatedDeltaNet
    return context


class DenseFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` for CPU runs: FlexAttention has no backward on CPU, so the
    ``BlockMask`` (also one cut along queries by context parallelism) is materialised and handed to
    ``scaled_dot_product_attention``; O(Tq x Tkv) memory, for small CPU models and tests only."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: BlockMask, score_mod=None, scale=None,
                enable_gqa: bool = False, out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("DenseFlexAttention runs mask-only attention (score_mod and out_transform None)")
        Q, KV = attention_masks.seq_lengths
        mask = create_mask(attention_masks.mask_mod, None, None, Q, KV, device=q_BLNH.device)
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def apply_dense_attention(model: nn.Module) -> None:
    """Run every FlexAttention of ``model`` as :class:`DenseFlexAttention` (CPU); no parameters change."""
    for module in model.modules():
        if type(module) is FlexAttention:
            module.__class__ = DenseFlexAttention


class _ContextParallelApplied:
    """``parallel_dims`` as torchtitan's ``parallelize_qwen3_5`` must see it once kdacp has applied
    context parallelism: ``cp_enabled`` False, everything else (meshes, degrees) unchanged."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def _check_supported(parallel_dims, training, parallelism) -> None:
    """Raise before any rank blocks on what kdacp's spec does not run."""
    if not training.disable_cuda_graphs:
        raise NotImplementedError("training.disable_cuda_graphs=False: kdacp's Gated DeltaNet reads each batch's "
                                  "document offsets on the host, which a CUDA graph cannot replay; set it to True")
    refused = {"tensor_parallel_degree": parallel_dims.tp, "pipeline_parallel_degree": parallel_dims.pp,
               "expert_parallel_degree": parallel_dims.ep}
    for name, degree in refused.items():
        if degree > 1:
            raise NotImplementedError(f"parallelism.{name}={degree}: kdacp's Qwen3.5 spec ({SPEC_NAME}) runs data "
                                      f"(FSDP2, replicate) and context parallelism only; set it to 1")
    if parallel_dims.cp_enabled and parallelism.spmd_backend != "partial_dtensor":
        raise NotImplementedError(f"parallelism.spmd_backend={parallelism.spmd_backend!r} with context parallelism: "
                                  "kdacp's spec runs torchtitan's FlexAttention CP, which is written for "
                                  "'partial_dtensor'; set parallelism.spmd_backend='partial_dtensor'")


def parallelize_qwen3_5_kdacp(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                              dump_folder: str):
    """torchtitan's ``parallelize_qwen3_5`` with context parallelism over the ``cp`` mesh axis.

    Same arguments as torchtitan's parallelize functions. Order: kdacp's GDN modules (and, on CPU,
    :func:`apply_dense_attention`), torchtitan's FlexAttention CP on the attention layers (before any
    wrapping, as torchtitan requires), then torchtitan's own parallelize (activation checkpointing, FSDP2;
    on CPU with plain SUM gradient reductions, as gloo has no PREMUL_SUM).

    Raises:
        NotImplementedError: see :func:`_check_supported`.
        ValueError: attention other than FlexAttention under context parallelism.
    """
    _check_supported(parallel_dims, training, parallelism)
    cp_mesh = parallel_dims.get_mesh("cp") if parallel_dims.cp_enabled else None
    apply_kdacp_to_gated_deltanet(model, cp_mesh)
    if device_type == "cpu":
        apply_dense_attention(model)
    if cp_mesh is not None:
        inner = [layer.attn.inner_attention for layer in model.layers.values() if layer.full_attn]
        if inner and not isinstance(inner[0], FlexAttention):
            raise ValueError(f"context parallelism needs the attention layers on FlexAttention (attn_backend='flex'), "
                             f"got {type(inner[0]).__name__}")
        if inner:
            apply_cp_to_forward(inner, cp_mesh)
    model = qwen3_5.parallelize_qwen3_5(
        model, parallel_dims=_ContextParallelApplied(parallel_dims), training=training, parallelism=parallelism,
        compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)
    if device_type == "cpu":
        # gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor of 1; a plain SUM is the same.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def local_document_mask(model: nn.Module, positions: torch.Tensor, rank: int, world_size: int) -> BlockMask:
    """The FlexAttention mask of rank ``rank``'s queries (a contiguous ``1/world_size`` of the row) against
    all keys: causal within each document of the global ``positions [1, T]`` (0 at each document start),
    built with torchtitan's mask functions and block size. Built directly rather than cut from the
    global mask: torch cuts a ``BlockMask`` over ranks only when ``T`` is a multiple of ``P x 128``."""
    T = positions.shape[1]
    offset, length = rank * T // world_size, T // world_size
    document = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))

    def local(b, h, q_idx, kv_idx):
        return document(b, h, q_idx + offset, kv_idx)

    return create_attention_mask(local, 1, None, length, T, device=positions.device,
                                 BLOCK_SIZE=model.config.first_attention.inner_attention.block_size,
                                 separate_full_blocks=not is_in_batch_invariant_mode())


def shard_batch(model: nn.Module, input_dict: dict, labels: torch.Tensor, cp_mesh: DeviceMesh):
    """This rank's contiguous shard of one packed batch, and the model's keyword arguments for it.

    Args:
        model: the torchtitan Qwen3.5 (its config gives the attention kind and block size).
        input_dict: ``{"input": [1, T] token ids, "positions": [1, T] (0 at each document start)}``;
            without ``positions`` the row is one document.
        labels: ``[1, T]``.
        cp_mesh: the 1-D ``cp`` mesh axis; ``T`` must split evenly over it.

    Returns:
        ``(inputs [1, T/P], labels [1, T/P], kwargs)``: ``kwargs`` holds this rank's ``positions`` and
        ``attention_masks``: :func:`local_document_mask` for the attention layers, the global document
        offsets (host copy included) for the GDN layers.

    Raises:
        ValueError: batch rows other than 1, vision inputs, ``T % P != 0``, attention other than FlexAttention.
    """
    inputs = input_dict["input"]
    P, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if inputs.dim() != 2 or inputs.shape[0] != 1:
        raise ValueError(f"context parallelism with kdacp needs one packed row per rank (training.local_batch_size=1), "
                         f"got input of shape {tuple(inputs.shape)}")
    vision = [key for key in VISION_INPUTS if input_dict.get(key) is not None]
    if vision:
        raise ValueError(f"context parallelism with kdacp runs text batches only; got vision inputs {vision}")
    if inputs.shape[1] % P:
        raise ValueError(f"the batch's {inputs.shape[1]} tokens must split evenly over cp={P} ranks")
    positions = input_dict.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
    attention = model.config.first_attention
    if attention is not None and not isinstance(attention.inner_attention, FlexAttention.Config):
        raise ValueError(f"context parallelism with kdacp needs attn_backend='flex', "
                         f"got {type(attention.inner_attention).__name__}")
    kwargs = {key: value for key, value in input_dict.items() if key != "input"}
    kwargs["positions"] = positions.tensor_split(P, dim=1)[rank]
    kwargs["attention_masks"] = {
        "quadratic_attention": None if attention is None else local_document_mask(model, positions, rank, P),
        "deltanet": create_varlen_metadata_for_document(positions, include_host_offsets=True)}
    return inputs.tensor_split(P, dim=1)[rank], labels.tensor_split(P, dim=1)[rank], kwargs


class KdacpTrainer(Trainer):
    """torchtitan's ``Trainer`` for Qwen3.5 on text batches, cut by :func:`shard_batch` under context
    parallelism. Qwen3.5's forward looks up the image and video token ids even without vision inputs;
    torchtitan's text loader has none, so text batches get :data:`TEXT_ONLY_TOKENS`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def post_dataloading_process(self, input_dict, labels):
        if self.parallel_dims.cp_enabled:
            inputs, labels, kwargs = shard_batch(self.model_parts[0], input_dict, labels,
                                                 self.parallel_dims.get_mesh("cp"))
            self.ntokens_seen += labels.numel()
        else:
            inputs, labels, kwargs = super().post_dataloading_process(input_dict, labels)
        kwargs.setdefault("special_tokens", TEXT_ONLY_TOKENS)
        return inputs, labels, kwargs


def model_registry(flavor: str, attn_backend: str = "flex", **kwargs) -> ModelSpec:
    """torchtitan's Qwen3.5 spec of ``flavor`` (its ``model_registry`` arguments), named ``qwen3_5_kdacp``
    and parallelized by :func:`parallelize_qwen3_5_kdacp`; the model and its state dict are torchtitan's."""
    spec = qwen3_5.model_registry(flavor, attn_backend=attn_backend, **kwargs)
    return dataclasses.replace(spec, name=SPEC_NAME, parallelize_fn=parallelize_qwen3_5_kdacp)


def text_config(spec: ModelSpec, *, seq_len: int, steps: int, local_batch_size: int = 1,
                trainer: type[Trainer] = Trainer) -> Trainer.Config:
    """A trainer config for ``spec`` on text, with the settings of torchtitan's Qwen3.5 configs (chunked
    cross-entropy, AdamW at 5e-3, linear warm-up, selective activation checkpointing, a checkpoint at
    the last step when enabled), without CUDA graphs (kdacp's spec refuses them), and torchtitan's
    text loader (``c4_test``: a local ``{"text": ...}`` dataset at ``dataloader.dataset_path``) and
    tokenizer (``tokenizer.json`` at ``hf_assets_path``). Written out here because torchtitan's Qwen3.5
    config module needs torchvision for its image loader."""
    return trainer.Config(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        tokenizer=HuggingFaceTokenizer.Config(),
        model_spec=spec,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        optimizer=default_adamw(lr=5e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        metrics=MetricsProcessor.Config(log_freq=1),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=steps,
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None),
        checkpoint=CheckpointManager.Config(interval=steps, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
    )


def qwen35_kdacp_debugmodel() -> KdacpTrainer.Config:
    """torchtitan's Qwen3.5 ``debugmodel`` (8 layers, dim 256) on text with kdacp's spec, 512 tokens, 10 steps."""
    return text_config(model_registry("debugmodel"), seq_len=512, steps=10, trainer=KdacpTrainer)


def qwen35_kdacp_0_8b() -> KdacpTrainer.Config:
    """torchtitan's Qwen3.5 ``0.8B`` (24 layers, dim 1024) on text with kdacp's spec, 16K tokens, 20 steps."""
    return text_config(model_registry("0.8B"), seq_len=16384, steps=20, trainer=KdacpTrainer)


def qwen35_titan_0_8b() -> KdacpTrainer.Config:
    """torchtitan's own Qwen3.5 ``0.8B`` spec with :func:`qwen35_kdacp_0_8b`'s settings (the baseline; without
    context parallelism :class:`KdacpTrainer` only adds :data:`TEXT_ONLY_TOKENS` to torchtitan's batches)."""
    return text_config(qwen3_5.model_registry("0.8B"), seq_len=16384, steps=20, trainer=KdacpTrainer)
