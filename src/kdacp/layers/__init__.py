"""``nn.Module`` layers: Kimi Delta Attention and Gated DeltaNet on one shared delta-rule layer, each on one
device or in a context-parallel mode (:class:`kdacp.cp.ContextParallel`)."""
import importlib
import warnings

from .delta_rule import DeltaRuleLayer, beta_from_logits
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .norm import RMSNormGated
from .short_conv import ShortConvolution, causal_conv1d, sequence_positions

__all__ = ["DeltaRuleLayer", "GatedDeltaNet", "KimiDeltaAttention", "RMSNormGated", "ShortConvolution",
           "beta_from_logits", "causal_conv1d", "sequence_positions"]

# names this package exported that moved to kdacp.cp (deprecated here for one release)
_MOVED = {"CPContext": "kdacp.cp", "ContextParallel": "kdacp.cp", "build_cp_context": "kdacp.cp"}


def __getattr__(name: str):
    """A name this package exported that moved (:data:`_MOVED`), with a :class:`DeprecationWarning`."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"kdacp.layers.{name} is deprecated; use {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
