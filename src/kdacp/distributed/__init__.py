"""Context parallelism for chunk KDA over ``torch.distributed``.

Build a :class:`CPPlan` once per batch with :func:`build_cp_plan`, then call :func:`cp_chunk_kda`
on every rank with that rank's tokens.
"""
from .op import cp_chunk_kda
from .plan import STRATEGIES, CPPlan, LocalSegment, RankLayout, build_cp_plan

__all__ = ["CPPlan", "LocalSegment", "RankLayout", "STRATEGIES", "build_cp_plan", "cp_chunk_kda"]
