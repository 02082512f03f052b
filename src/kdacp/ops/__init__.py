"""The ops, with FLA's arguments: :func:`chunk_kda` (Kimi Delta Attention, :mod:`.kda`) and
:func:`chunk_gated_delta_rule` (Gated DeltaNet, :mod:`.gdn`, the KDA op's prepared call with GDN's own gate).
Both run on one device, or context-parallel with ``cp=`` a :class:`kdacp.cp.CPPlan` from
:func:`kdacp.build_cp_plan` (the layers take a :class:`kdacp.cp.ContextParallel` instead).

Imports :mod:`kdacp.cp` and the parts below it, never the layers or models.
"""
from .gdn import chunk_gated_delta_rule, gdn_gate_arguments
from .kda import ChunkKDAFunction, chunk_kda

__all__ = ["ChunkKDAFunction", "chunk_gated_delta_rule", "chunk_kda", "gdn_gate_arguments"]
