"""kdacp: context-parallel Kimi Delta Attention for PyTorch.

What users call: the op :func:`chunk_kda` (one device; with ``cp=`` a :class:`CPPlan` from
:func:`build_cp_plan` over a group from :func:`new_cp_group`, context-parallel over
``torch.distributed``) and Gated DeltaNet's :func:`chunk_gated_delta_rule` (the same ``cp=``); the
layers :class:`KimiDeltaAttention` and :class:`GatedDeltaNet` with their context-parallel mode
:class:`ContextParallel`; for Hugging Face models :func:`parallelize` (Kimi Linear, Qwen3-Next),
:func:`shard_batch` and :func:`global_token_mean_loss` (see :mod:`kdacp.integrations.transformers`); :func:`precompile`,
which compiles a step's Triton kernels in parallel before its first run; and :mod:`kdacp.reference`,
the plain-PyTorch oracle. The summary algebra (:mod:`kdacp.affine`) and the Triton launchers
(:mod:`kdacp.kernels`) stay in their modules.

Each name is imported at its first use (``import kdacp`` alone loads no torch, so that the command line's
``--help`` answers at once): ``from kdacp import chunk_kda`` and ``kdacp.chunk_kda`` work as ever, as does
``kdacp.<submodule>``.
"""
import importlib
import importlib.util

from .choices import VERSION as __version__

# each exported name -> the module that defines it (None: the name is a submodule)
_EXPORTS = {
    "CPPlan": ".cp", "build_cp_plan": ".cp", "init_device_mesh": ".cp", "new_cp_group": ".cp",
    "chunk_gated_delta_rule": ".ops", "CPContext": ".cp", "ContextParallel": ".cp", "GatedDeltaNet": ".layers",
    "KimiDeltaAttention": ".layers", "build_cp_context": ".cp", "global_token_mean_loss": ".cp.sharding",
    "parallelize": ".integrations.transformers", "shard_batch": ".cp.sharding", "precompile": ".precompilation", "chunk_kda": ".ops",
    "reference": None,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """An exported name (:data:`_EXPORTS`) or a submodule, imported at its first use and kept."""
    if name in _EXPORTS and _EXPORTS[name] is not None:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
