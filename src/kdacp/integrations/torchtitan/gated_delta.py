"""torchtitan's Gated DeltaNet modules on kdacp's short convolution and recurrence (:func:`apply_kdacp_to_gated_deltanet`),
context-parallel over the ``cp`` mesh axis in the token order of a :class:`~.layout.BalancedLayout`; each runs as
one opaque op under ``torch.compile``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.qwen3_5.model import GatedDeltaNet

from ...backends import backend_fuses
from ...compile import hold_for_regions, run_opaque
from ...cp.batch_context import CPContext, build_cp_context
from ...cp.split import check_split
from ...ops.gdn import chunk_gated_delta_rule
from .layout import CACHED_BATCHES, BalancedLayout


class GatedDeltaParallel:
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
        split: the recurrence's split inside the device (:func:`kdacp.chunk_gated_delta_rule`'s ``split``:
            ``"auto"``, the default, an int, or None for none).
    """

    def __init__(self, group=None, *, layout: BalancedLayout = BalancedLayout(), strategy: str = "p2p",
                 backend: str = "auto", split="auto"):
        check_split(split)
        self.group, self.layout, self.strategy, self.backend, self.split = group, layout, strategy, backend, split
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self._contexts = lru_cache(maxsize=CACHED_BATCHES)(self._build_context)
        hold_for_regions(self)  # a setting of its opaque regions under torch.compile

    def __repr__(self) -> str:
        return (f"GatedDeltaParallel(cp={self.world_size}, layout={self.layout!r}, strategy={self.strategy!r}, "
                f"backend={self.backend!r}, split={self.split!r})")

    def batch_context(self, cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                      local_length: int) -> CPContext:
        """The :class:`~kdacp.cp.CPContext` of the batch of global offsets ``cu_seqlens_cpu`` of which this
        rank holds ``local_length`` tokens (its device tensors on ``cu_seqlens``' device)."""
        _check_offsets(cu_seqlens, cu_seqlens_cpu)
        return self._contexts(tuple(cu_seqlens_cpu.tolist()), local_length, cu_seqlens.device)

    def _build_context(self, cu: tuple[int, ...], local_length: int, device: torch.device) -> CPContext:
        return build_cp_context(cu, local_length=local_length, layout=self.layout,
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
    """:meth:`GatedDeltaParallel.causal_conv` (an :class:`kdacp.compile.OpaqueRegion`: it reads the offsets on
    the host and exchanges the halo)."""

    parallel: GatedDeltaParallel

    def __call__(self, x, weight, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        """``x [1, T, D]``, ``weight [D, 1, W]``, the global offsets -> ``(silu(conv(x)) [1, T, D],)``."""
        batch = self.parallel.batch_context(cu_seqlens, cu_seqlens_cpu, x.shape[1])
        return tuple(batch.short_convolution([x], [weight.squeeze(1)], [None],
                                             fused=bool(backend_fuses(self.parallel.backend, x.device,
                                                                      scalar_gate=True))))

    def fake(self, x, weight, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        return (x.new_empty(x.shape),)


@dataclass(frozen=True)
class _GatedDeltaRecurrence:
    """:meth:`GatedDeltaParallel.gated_delta_rule` (an :class:`kdacp.compile.OpaqueRegion`: it reads the offsets
    on the host and exchanges states)."""

    parallel: GatedDeltaParallel

    def __call__(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        """:meth:`GatedDeltaParallel.gated_delta_rule`'s arguments (``g`` in ``q``'s dtype) -> ``(o,)``."""
        batch = self.parallel.batch_context(cu_seqlens, cu_seqlens_cpu, q.shape[1])
        o, _ = batch.recurrence(chunk_gated_delta_rule, q, k, v, g, beta, backend=self.parallel.backend,
                                split=self.parallel.split, use_qk_l2norm_in_kernel=True)
        return (o,)

    def fake(self, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu) -> tuple[torch.Tensor]:
        return (v.new_empty(v.shape),)


class KdacpGatedDeltaKernel(nn.Module):
    """Drop-in for torchtitan's ``GatedDeltaKernel`` (same call, no parameters) running kdacp's GDN op."""

    def __init__(self, parallel: GatedDeltaParallel):
        super().__init__()
        self.parallel = parallel

    def extra_repr(self) -> str:
        return repr(self.parallel)

    def forward(self, xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, *, cu_seqlens=None, cu_seqlens_cpu=None):
        """torchtitan's ``GatedDeltaKernel.forward`` contract: ``[1, T, H, K]`` q, k (grouped heads are
        not repeated: kdacp maps them), ``[1, T, HV, V]`` v, ``[1, T, HV]`` g and beta -> ``[1, T, HV, V]``."""
        return self.parallel.gated_delta_rule(xq_BLNK, xk_BLNK, xv_BLNV, g_BLN, beta_BLN, cu_seqlens, cu_seqlens_cpu)


class KdacpGatedDeltaNet(GatedDeltaNet):
    """torchtitan's ``GatedDeltaNet`` whose short convolutions run kdacp's (halo'd under context
    parallelism); set on a built module by :func:`apply_kdacp_to_gated_deltanet`, never constructed."""

    def _causal_conv(self, x_BLD, conv, cu_seqlens=None, cu_seqlens_cpu=None):
        # conv.weight is looked up per call: FSDP2 replaces the parameters after this class is set.
        return self.kernel.parallel.causal_conv(x_BLD, conv.weight, cu_seqlens, cu_seqlens_cpu)


def apply_kdacp_to_gated_deltanet(model: nn.Module, cp_mesh: DeviceMesh | None, *,
                                  layout: BalancedLayout = BalancedLayout(), strategy: str = "p2p",
                                  backend: str = "auto", split="auto") -> GatedDeltaParallel:
    """Swap every torchtitan ``GatedDeltaNet`` of ``model`` to kdacp's recurrence and convolution.

    Args:
        model: a built torchtitan Qwen3.5 (before FSDP, compile and activation checkpointing).
        cp_mesh: the 1-D ``cp`` mesh axis, or None for one device.
        layout, strategy, backend, split: see :class:`GatedDeltaParallel` (``layout``: torchtitan's default
            head-tail load balancer unless given).

    Returns:
        The :class:`GatedDeltaParallel` the swapped modules share.

    Raises:
        ValueError: the model has no ``GatedDeltaNet``, or one was already swapped.
    """
    nets = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    if not nets:
        raise ValueError(f"model has no torchtitan GatedDeltaNet to swap (got {type(model).__name__})")
    if any(isinstance(m, KdacpGatedDeltaNet) for m in nets):
        raise ValueError("model's GatedDeltaNet modules already run kdacp's (apply once)")
    parallel = GatedDeltaParallel(None if cp_mesh is None else cp_mesh.get_group(), layout=layout, strategy=strategy,
                                  backend=backend, split=split)
    for net in nets:
        net.kernel = KdacpGatedDeltaKernel(parallel)
        net.__class__ = KdacpGatedDeltaNet
    return parallel
