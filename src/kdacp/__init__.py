"""kdacp: context-parallel Kimi Delta Attention for PyTorch.

What users call: the op :func:`chunk_kda` (one device; with ``cp=`` a :class:`CPPlan` from
:func:`build_cp_plan` over a group from :func:`new_cp_group`, context-parallel over
``torch.distributed``) and Gated DeltaNet's :func:`chunk_gated_delta_rule` (the same ``cp=``); the
layers :class:`KimiDeltaAttention` and :class:`GatedDeltaNet` with their context-parallel mode
:class:`ContextParallel`; for Hugging Face models :func:`parallelize` (Kimi Linear, Qwen3-Next),
:func:`shard_batch` and :func:`global_token_mean_loss` (see :mod:`kdacp.models`); :func:`precompile`,
which compiles a step's Triton kernels in parallel before its first run; and :mod:`kdacp.reference`,
the plain-PyTorch oracle. The summary algebra (:mod:`kdacp.affine`) and the Triton launchers
(:mod:`kdacp.kernels`) stay in their modules.
"""
from . import reference
from .distributed import CPPlan, build_cp_plan, init_device_mesh, new_cp_group
from .gdn import chunk_gated_delta_rule
from .layers import CPContext, ContextParallel, GatedDeltaNet, KimiDeltaAttention, build_cp_context
from .models import global_token_mean_loss, parallelize, shard_batch
from .precompile import precompile
from .kda import chunk_kda

__version__ = "0.1.0"

__all__ = [
    "CPContext", "CPPlan", "ContextParallel", "GatedDeltaNet", "KimiDeltaAttention", "build_cp_context", "build_cp_plan",
    "chunk_gated_delta_rule",
    "chunk_kda", "global_token_mean_loss", "init_device_mesh", "new_cp_group", "parallelize", "precompile", "reference",
    "shard_batch",
]
