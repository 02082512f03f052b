"""kdacp inside other trainers, applied from outside their code (each needs its extra, e.g. ``kdacp[torchtitan]``).

:mod:`kdacp.integrations.transformers`: context parallelism for Hugging Face transformers' Kimi Linear and Qwen3-Next
(``kdacp.parallelize``), prefill and generation.
:mod:`kdacp.integrations.torchtitan`: context parallelism for torchtitan 0.3.0's Qwen3.5.
:mod:`kdacp.integrations.megatron`: kdacp's Gated DeltaNet as a module of Megatron-Core 0.19.2's layer specs.
"""
import importlib

_SUBMODULES = ("megatron", "torchtitan", "transformers")


def __getattr__(name: str):
    """A submodule, imported at its first use (each needs its own extra)."""
    if name not in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f".{name}", __name__)
