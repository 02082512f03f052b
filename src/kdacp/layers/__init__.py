"""``nn.Module`` layers: the Kimi Delta Attention layer and its context-parallel execution."""
from .context_parallel import KDAContextParallel
from .kda import KimiDeltaAttention, apply_context_parallel
from .norm import RMSNormGated
from .short_conv import ShortConvolution, causal_conv1d, sequence_positions

__all__ = ["KDAContextParallel", "KimiDeltaAttention", "RMSNormGated", "ShortConvolution", "apply_context_parallel",
           "causal_conv1d", "sequence_positions"]
