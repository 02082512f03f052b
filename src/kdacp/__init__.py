"""kdacp: context-parallel Kimi Delta Attention for PyTorch.

Entry points: :func:`chunk_kda` (one device), :func:`cp_chunk_kda` with :func:`build_cp_plan` and
:func:`new_cp_group` (context-parallel over ``torch.distributed``), :class:`KimiDeltaAttention` (the
layer, with :class:`KDAContextParallel`), the same for Gated DeltaNet (:func:`chunk_gated_delta_rule`,
:func:`cp_chunk_gated_delta_rule`, :class:`GatedDeltaNet`), the Triton state-summary launchers, and :mod:`kdacp.reference`.
Hugging Face models: :func:`parallelize` (Kimi Linear, Qwen3-Next) with :func:`shard_batch` (see :mod:`kdacp.models`);
:func:`precompile` compiles a step's Triton kernels in parallel before its first run.
"""
from . import reference
from .distributed import CPPlan, build_cp_plan, new_cp_group
from .affine import StateSummary, apply_state_gradient_summary, apply_state_summary, compose_state_summaries
from .kernels import state_gradient_summary, state_summary, transition
from .gdn import chunk_gated_delta_rule, cp_chunk_gated_delta_rule
from .layers import GatedDeltaNet, KDAContextParallel, KimiDeltaAttention
from .models import parallelize, shard_batch
from .precompile import precompile
from .kda import chunk_kda, cp_chunk_kda

__version__ = "0.1.0"

__all__ = [
    "CPPlan", "GatedDeltaNet", "StateSummary", "KDAContextParallel", "KimiDeltaAttention", "apply_state_gradient_summary",
    "apply_state_summary", "build_cp_plan", "chunk_gated_delta_rule", "chunk_kda", "compose_state_summaries",
    "cp_chunk_gated_delta_rule", "cp_chunk_kda", "new_cp_group", "parallelize", "precompile", "reference", "shard_batch",
    "state_gradient_summary", "state_summary", "transition",
]
