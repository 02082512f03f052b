"""Deprecated: context parallelism moved to :mod:`kdacp.cp` (and :class:`RankRole` and
:class:`StandInExchange` to :mod:`kdacp.bench.rank_role`). This alias re-exports the names this package
exported, with a :class:`DeprecationWarning`, for one release."""
import importlib
import warnings

# each name this package exported -> the module that now defines it
_MOVED = {"CPPlan": "kdacp.cp", "STRATEGIES": "kdacp.cp", "build_cp_plan": "kdacp.cp",
          "init_device_mesh": "kdacp.cp", "new_cp_group": "kdacp.cp",
          "RankRole": "kdacp.bench.rank_role", "StandInExchange": "kdacp.bench.rank_role"}

__all__ = sorted(_MOVED)

warnings.warn("kdacp.distributed is deprecated; import from kdacp.cp instead", DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    """A name this package exported, from its new module."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"kdacp.distributed.{name} is deprecated; use {_MOVED[name]}.{name}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
