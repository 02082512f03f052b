"""Pure-PyTorch KDA: the ground truth for every kernel and distributed path.

Runs on any device and dtype (float64 included) and is differentiable end to end.
"""
from .chunk import ChunkIntermediates, chunk_bounds, chunk_kda, chunk_kda_intermediates, chunk_output
from .gdn import chunk_gated_delta_rule, gdn_gate, recurrent_gated_delta_rule, scalar_gate_as_kda
from .gates import kda_gate, l2norm, prepare_inputs
from .recurrent import recurrent_kda
from .summary import (apply_state_gradient_summary, apply_state_summary, chunk_dv_local,
                      compose_state_summaries, state_gradient_summary, state_summary, transition)

__all__ = [
    "ChunkIntermediates", "chunk_gated_delta_rule", "gdn_gate", "recurrent_gated_delta_rule",
    "scalar_gate_as_kda", "apply_state_gradient_summary", "apply_state_summary",
    "chunk_bounds", "chunk_dv_local", "chunk_kda", "chunk_kda_intermediates", "chunk_output", "compose_state_summaries",
    "kda_gate", "l2norm", "prepare_inputs", "recurrent_kda", "state_gradient_summary",
    "state_summary", "transition",
]
