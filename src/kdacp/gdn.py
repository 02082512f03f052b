"""Deprecated: Gated DeltaNet's op moved to :mod:`kdacp.ops.gdn`. This alias re-exports what users imported
from here, with a :class:`DeprecationWarning`, for one release."""
import warnings

from .ops.gdn import chunk_gated_delta_rule, gdn_gate_arguments

__all__ = ["chunk_gated_delta_rule", "gdn_gate_arguments"]

warnings.warn("kdacp.gdn is deprecated; import from kdacp.ops.gdn instead", DeprecationWarning, stacklevel=2)
