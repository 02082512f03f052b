"""Deprecated: :class:`ContextParallel` and its per-batch context moved to :mod:`kdacp.cp`. This alias
re-exports what users imported from here, with a :class:`DeprecationWarning`, for one release."""
import warnings

from ..cp.batch_context import CPContext, build_cp_context
from ..cp.context import SINGLE_DEVICE, ContextParallel

__all__ = ["CPContext", "ContextParallel", "SINGLE_DEVICE", "build_cp_context"]

warnings.warn("kdacp.layers.context_parallel is deprecated; import from kdacp.cp instead", DeprecationWarning,
              stacklevel=2)
