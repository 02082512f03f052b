"""Context parallelism for torchtitan 0.3.0's Qwen3.5, applied from outside torchtitan's code.

torchtitan's ``parallelize_qwen3_5`` refuses context parallelism (its Gated DeltaNet layers would
need the whole sequence). This module is a torchtitan config module (``--module
kdacp.integrations.torchtitan``): its config functions (``qwen35_kdacp_*``) return torchtitan
``Trainer.Config`` objects whose model spec, named ``qwen3_5_kdacp``, builds torchtitan's own
Qwen3.5 and parallelizes it with :func:`parallelize_qwen3_5_kdacp`:

1. every ``GatedDeltaNet`` of the model gets kdacp's recurrence and short convolution
   (:func:`apply_kdacp_to_gated_deltanet`): its ``kernel`` module becomes a
   :class:`KdacpGatedDeltaKernel` (state exchange between the ranks' ranges by kdacp's GDN op, with one
   plan per batch built from the global ``cu_seqlens`` and the layout) and its ``_causal_conv`` runs
   :meth:`kdacp.cp.CPContext.short_convolution`: a left halo from whichever rank holds the tokens before
   each range;
   parameters and state-dict keys do not change;
2. the attention layers (one in four) run under torchtitan's own context parallelism for
   FlexAttention (``apply_cp_to_forward``: keys and values all-gathered over ``cp``; each rank's
   document mask is built for its queries under the layout, :func:`local_document_mask`). kdacp's Ulysses attention
   would need ``n_kv_heads % cp == 0``, and every dense Qwen3.5 has 2 key/value heads;
3. then torchtitan's ``parallelize_qwen3_5`` for everything it does (activation checkpointing,
   FSDP2 over ``dp_shard x cp``), with context parallelism marked as done.

:class:`KdacpTrainer` cuts each batch over the ``cp`` mesh axis (:func:`shard_batch`) as torchtitan's
context-parallel load balancer (``parallelism.context_parallel_load_balancer``: ``"headtail"``, its default,
``"ptrr"`` or None) rearranges it, and keeps the global document boundaries for the GDN layers. The GDN
layers follow that token order natively (:class:`BalancedLayout`: a rank's ranges are links of kdacp's state
chain and halo routes), so attention and recurrence share one layout with no relayout between them.

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
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer, _PTRRLoadBalancer
from torch.nn.attention.flex_attention import BlockMask, create_mask

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
                                                 create_varlen_metadata_for_document)
from torchtitan.models.qwen3_5.model import GatedDeltaNet
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools.utils import device_type
from torchtitan.trainer import Trainer

from ..backends import backend_fuses
from ..compile import hold_for_regions, run_opaque
from ..cp.batch_context import CPContext, build_cp_context
from ..cp.layout import TokenLayout, contiguous_layout, ranges_layout
from ..ops.gdn import chunk_gated_delta_rule
from ..models.batch import shard_tokens
from ..sequences import sequence_positions

__all__ = ["BalancedLayout", "DenseFlexAttention", "GatedDeltaContext", "KdacpGatedDeltaKernel", "KdacpGatedDeltaNet", "KdacpTrainer",
           "TEXT_ONLY_TOKENS", "VISION_INPUTS", "apply_dense_attention", "apply_kdacp_to_gated_deltanet",
           "local_document_mask", "model_registry", "parallelize_qwen3_5_kdacp", "qwen35_kdacp_0_8b",
           "qwen35_kdacp_debugmodel", "qwen35_titan_0_8b", "shard_batch", "text_config"]

SPEC_NAME = "qwen3_5_kdacp"
CACHED_BATCHES = 8  # batches whose layout and context are kept (a few are in flight with AC recompute)
# torchtitan's parallelism.context_parallel_load_balancer values (torchtitan 0.3.0's cp_shard).
LOAD_BALANCERS = (None, "headtail", "ptrr")
# Token ids no token has: Qwen3.5 reads them only to place vision embeddings.
TEXT_ONLY_TOKENS = {"image_id": -1, "video_id": -1}
# Batch keys of torchtitan's multimodal loader: their tokens must be scattered before any cut.
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "grid_thw", "grid_thw_videos", "mrope_positions")


def _document_mask_mod(positions: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor):
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
    mask = create_attention_mask(_document_mask_mod(positions, tokens, tokens), 1, None, T, T, device=device,
                                 BLOCK_SIZE=rule.block_size, separate_full_blocks=not is_in_batch_invariant_mode())
    return _layout_of_order(_PTRRLoadBalancer(mask, P)._generate_indices()[0], P)


class GatedDeltaContext:
    """How the swapped GDN modules of one model run: on one device, or over the ``cp`` process group
    by kdacp's state exchange (recurrence) and halo (short convolution), in the token order of ``layout``.

    torchtitan hands each GDN module the *global* document offsets of the batch (``cu_seqlens`` on
    the device, ``cu_seqlens_cpu`` on the host, int32, ``[N+1]``) and this rank's tokens. The host values
    key the batch's :class:`~kdacp.cp.CPContext` (its layout, plan, local offsets and halo routes), built
    by the first layer call of the batch and read by every later one (torchtitan clones ``cu_seqlens`` per call).

    Args:
        group: the context-parallel process group, or None for one device.
        layout: the layout rule the batches were cut by (:class:`BalancedLayout`; :func:`shard_batch` reads it
            from here, so the GDN layers and the attention follow one token order).
        strategy: kdacp's state exchange (``"p2p"``, ``"allgather"``, ``"scan"``, ``"auto"``).
        backend: kdacp's local backend (``"auto"``: FLA's kernels on CUDA, PyTorch on CPU).
    """

    def __init__(self, group=None, *, layout: BalancedLayout = BalancedLayout(), strategy: str = "p2p",
                 backend: str = "auto"):
        self.group, self.layout, self.strategy, self.backend = group, layout, strategy, backend
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self._contexts = lru_cache(maxsize=CACHED_BATCHES)(self._build_context)
        hold_for_regions(self)  # a setting of its opaque regions under torch.compile

    def __repr__(self) -> str:
        return (f"GatedDeltaContext(cp={self.world_size}, layout={self.layout!r}, strategy={self.strategy!r}, "
                f"backend={self.backend!r})")

    def batch_context(self, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                      local_length: int) -> CPContext:
        """The :class:`~kdacp.cp.CPContext` of the batch of global offsets ``cu_seqlens_cpu`` of which this
        rank holds ``local_length`` tokens (its device tensors on ``cu_seqlens``' device)."""
        _check_offsets(cu_seqlens, cu_seqlens_cpu)
        return self._contexts(tuple(cu_seqlens_cpu.tolist()), local_length, cu_seqlens.device)

    def _build_context(self, cu: tuple[int, ...], local_length: int, device: torch.device) -> CPContext:
        return build_cp_context(cu, local_length=local_length, layout=self.layout(cu, self.world_size, device),
                                group=self.group, strategy=self.strategy, device=device)

    def causal_conv(self, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    cu_seqlens_cpu: torch.Tensor | None) -> torch.Tensor:
        """``silu(depthwise causal conv)`` of this rank's tokens ``x [1, T, D]`` with ``weight [D, 1, W]``,
        each range's first taps reaching back to whichever rank holds the tokens before it in its document."""
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
        batch = self.context.batch_context(cu_seqlens, cu_seqlens_cpu, x.shape[1])
        return tuple(batch.short_convolution([x], [weight[:, 0]], [None],
                                             fused=bool(backend_fuses(self.context.backend, x.device,
                                                                      scalar_gate=True))))

    def fake(self, x, weight, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        return (x.new_empty(x.shape),)


@dataclass(frozen=True)
class _GatedDeltaRecurrence:
    """:meth:`GatedDeltaContext.gated_delta_rule` (an :class:`kdacp.compile.OpaqueRegion`: it reads the offsets
    on the host and exchanges states)."""

    context: GatedDeltaContext

    def __call__(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        """:meth:`GatedDeltaContext.gated_delta_rule`'s arguments (``g`` in ``q``'s dtype) -> ``(o,)``."""
        batch = self.context.batch_context(cu_seqlens, cu_seqlens_cpu, q.shape[1])
        o, _ = batch.recurrence(chunk_gated_delta_rule, q, k, v, g, beta, backend=self.context.backend,
                                use_qk_l2norm_in_kernel=True)
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


def apply_kdacp_to_gated_deltanet(model: nn.Module, cp_mesh: DeviceMesh | None, *,
                                  layout: BalancedLayout = BalancedLayout(), strategy: str = "p2p",
                                  backend: str = "auto") -> GatedDeltaContext:
    """Swap every torchtitan ``GatedDeltaNet`` of ``model`` to kdacp's recurrence and convolution.

    Args:
        model: a built torchtitan Qwen3.5 (before FSDP, compile and activation checkpointing).
        cp_mesh: the 1-D ``cp`` mesh axis, or None for one device.
        layout, strategy, backend: see :class:`GatedDeltaContext` (``layout``: torchtitan's default
            head-tail load balancer unless given).

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
    context = GatedDeltaContext(None if cp_mesh is None else cp_mesh.get_group(), layout=layout, strategy=strategy,
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


def _balanced_layout(model: nn.Module, parallelism) -> BalancedLayout:
    """The :class:`BalancedLayout` of torchtitan's ``parallelism.context_parallel_load_balancer`` for ``model``
    (a torchtitan Qwen3.5): ``"ptrr"`` deals out the blocks of the attention layers' mask (their FlexAttention
    block size; torchtitan's 128 for a model without attention layers).

    Raises:
        ValueError: an unknown balancer, or ``"ptrr"`` with ``parallelism.context_parallel_ptrr_mask_key`` naming
            another mask than the attention layers' (``"quadratic_attention"``).
    """
    balancer, key = parallelism.context_parallel_load_balancer, parallelism.context_parallel_ptrr_mask_key
    if balancer == "ptrr" and key not in (None, "quadratic_attention"):
        raise ValueError(f"parallelism.context_parallel_ptrr_mask_key={key!r}: kdacp's spec balances by the attention "
                         "layers' mask; set it to 'quadratic_attention' or leave it unset")
    attention = model.config.first_attention
    inner = None if attention is None else attention.inner_attention
    return BalancedLayout(balancer, inner.block_size if isinstance(inner, FlexAttention.Config) else 128)


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
    apply_kdacp_to_gated_deltanet(model, cp_mesh, layout=_balanced_layout(model, parallelism))
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


def local_document_mask(model: nn.Module, positions: torch.Tensor, layout: TokenLayout, rank: int) -> BlockMask:
    """The FlexAttention mask of rank ``rank``'s queries (its tokens under ``layout``, in their local order) against
    every rank's keys as torchtitan's FlexAttention CP all-gathers them (rank 0's tokens, then rank 1's, ...):
    causal within each document of the global ``positions [1, T]`` (0 at each document start), in the model's
    block size. Built directly rather than cut from the global mask: torch cuts a ``BlockMask`` over ranks only
    when ``T`` is a multiple of ``P x 128``."""
    keys = torch.cat([layout.local_token_index(r) for r in range(layout.world_size)])
    keys = keys.to(device=positions.device, dtype=torch.int32)
    offset = sum(layout.local_lengths[:rank])
    queries = keys[offset:offset + layout.local_lengths[rank]]
    return create_attention_mask(_document_mask_mod(positions, queries, keys), 1, None, queries.numel(), keys.numel(),
                                 device=positions.device,
                                 BLOCK_SIZE=model.config.first_attention.inner_attention.block_size,
                                 separate_full_blocks=not is_in_batch_invariant_mode())


def _gated_delta_context(model: nn.Module) -> GatedDeltaContext:
    for module in model.modules():
        if isinstance(module, KdacpGatedDeltaKernel):
            return module.context
    raise ValueError("context parallelism with kdacp needs the model's GatedDeltaNet modules swapped first "
                     "(apply_kdacp_to_gated_deltanet, or the qwen3_5_kdacp spec)")


def shard_batch(model: nn.Module, input_dict: dict, labels: torch.Tensor, cp_mesh: DeviceMesh):
    """This rank's shard of one packed batch under torchtitan's load balancer, and the model's keyword arguments.

    The tokens are dealt out by the layout the model's GDN layers follow (:class:`BalancedLayout`, set by
    :func:`apply_kdacp_to_gated_deltanet`), so the attention layers and the GDN layers see one token order,
    with no relayout between them; the cut itself is :func:`kdacp.models.batch.shard_tokens`'s.

    Args:
        model: the torchtitan Qwen3.5 with kdacp's GDN modules (its config gives the attention kind and
            block size).
        input_dict: ``{"input": [1, T] token ids, "positions": [1, T] (0 at each document start)}``;
            without ``positions`` the row is one document.
        labels: ``[1, T]``, each token's own target (torchtitan's loader shifts them): dealt out as they are.
        cp_mesh: the 1-D ``cp`` mesh axis; ``T`` must suit the balancer (see :class:`BalancedLayout`).

    Returns:
        ``(inputs [1, T/P], labels [1, T/P], kwargs)``: ``kwargs`` holds this rank's ``positions`` and
        ``attention_masks``: :func:`local_document_mask` for the attention layers, the global document
        offsets (host copy included) for the GDN layers.

    Raises:
        ValueError: batch rows other than 1, vision inputs, a ``T`` the balancer does not split evenly, attention
            other than FlexAttention, a model without kdacp's GDN modules.
    """
    inputs = input_dict["input"]
    P, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if inputs.dim() != 2 or inputs.shape[0] != 1:
        raise ValueError(f"context parallelism with kdacp needs one packed row per rank (training.local_batch_size=1), "
                         f"got input of shape {tuple(inputs.shape)}")
    vision = [key for key in VISION_INPUTS if input_dict.get(key) is not None]
    if vision:
        raise ValueError(f"context parallelism with kdacp runs text batches only; got vision inputs {vision}")
    attention = model.config.first_attention
    if attention is not None and not isinstance(attention.inner_attention, FlexAttention.Config):
        raise ValueError(f"context parallelism with kdacp needs attn_backend='flex', "
                         f"got {type(attention.inner_attention).__name__}")
    positions = input_dict.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device)[None]
    deltanet = create_varlen_metadata_for_document(positions, include_host_offsets=True)
    layout = _gated_delta_context(model).layout(deltanet.cu_seq_q_host, P, inputs.device)
    batch = shard_tokens(inputs, labels, positions, torch.tensor(deltanet.cu_seq_q_host), rank=rank, world_size=P,
                         layout=layout, labels_shifted=True)
    kwargs = {key: value for key, value in input_dict.items() if key != "input"}
    kwargs["positions"] = batch.position_ids
    kwargs["attention_masks"] = {
        "quadratic_attention": None if attention is None else local_document_mask(model, positions, layout, rank),
        "deltanet": deltanet}
    return batch.input_ids, batch.labels, kwargs


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
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
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
