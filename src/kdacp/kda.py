"""Deprecated: the KDA op moved to :mod:`kdacp.ops.kda`. This alias re-exports what users imported from
here, with a :class:`DeprecationWarning`, for one release."""
import warnings

from .ops.kda import ChunkKDAFunction, check_and_prepare, chunk_kda, run_prepared

__all__ = ["ChunkKDAFunction", "check_and_prepare", "chunk_kda", "run_prepared"]

warnings.warn("kdacp.kda is deprecated; import from kdacp.ops.kda instead", DeprecationWarning, stacklevel=2)
