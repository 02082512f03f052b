"""``nn.Module`` layers: the Kimi Delta Attention layer and its context-parallel execution."""
from .context_parallel import ContextParallel
from .cp_context import CPContext, build_cp_context
from .delta_rule import DeltaRuleLayer, beta_from_logits
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .norm import RMSNormGated
from .short_conv import ShortConvolution, causal_conv1d, sequence_positions

__all__ = ["CPContext", "DeltaRuleLayer", "GatedDeltaNet", "ContextParallel", "KimiDeltaAttention", "RMSNormGated", "ShortConvolution", "build_cp_context",
           "beta_from_logits", "causal_conv1d", "sequence_positions"]
