"""The only module that imports flash-linear-attention (``fla-core``).

kdacp calls FLA's internal stage functions, which change between releases, so it pins the exact
version and names every missing piece instead of failing deep inside a kernel call.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from types import SimpleNamespace

from .pinned_stages import PinnedStages, import_stages

__all__ = ["REQUIRED_FLA_VERSION", "fla_available", "require_fla", "load_fla", "load_fla_layer",
           "autotuned_kernel_names"]

REQUIRED_FLA_VERSION = "0.6.0"

# name in the namespace -> (module, attribute)
_STAGES = {
    "l2norm_fwd": ("fla.modules.norm.l2norm", "l2norm_fwd"),
    "l2norm_bwd": ("fla.modules.norm.l2norm", "l2norm_bwd"),
    "kda_gate_chunk_cumsum": ("fla.ops.kda.gate", "kda_gate_chunk_cumsum"),
    "kda_gate_fwd": ("fla.ops.kda.gate", "kda_gate_fwd"),
    "chunk_local_cumsum": ("fla.ops.utils", "chunk_local_cumsum"),
    "prepare_chunk_indices": ("fla.ops.utils", "prepare_chunk_indices"),
    "RCP_LN2": ("fla.ops.utils.constant", "RCP_LN2"),
    "chunk_kda_fwd_intra": ("fla.ops.kda.chunk_intra", "chunk_kda_fwd_intra"),
    "chunk_gated_delta_rule_fwd_h": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_h"),
    "chunk_gla_fwd_o_gk": ("fla.ops.gla.chunk", "chunk_gla_fwd_o_gk"),
    "recompute_w_u_fwd": ("fla.ops.kda.wy_fast", "recompute_w_u_fwd"),
    "chunk_kda_bwd_dAv": ("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_dAv"),
    "chunk_gated_delta_rule_bwd_dhu": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_dhu"),
    "chunk_kda_bwd_wy_dqkg_fused": ("fla.ops.kda.chunk_bwd", "chunk_kda_bwd_wy_dqkg_fused"),
    "chunk_kda_bwd_intra": ("fla.ops.kda.chunk_intra", "chunk_kda_bwd_intra"),
    "kda_gate_bwd": ("fla.ops.kda.gate", "kda_gate_bwd"),
    # GDN (scalar gate)
    "gdn_gate_chunk_cumsum": ("fla.ops.gated_delta_rule.gate", "gdn_gate_chunk_cumsum"),
    "gdn_gate_fwd": ("fla.ops.gated_delta_rule.gate", "gdn_gate_fwd"),
    "chunk_gated_delta_rule_fwd_intra": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_intra"),
    "gdn_recompute_w_u_fwd": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd"),
    "chunk_fwd_o": ("fla.ops.common.chunk_o", "chunk_fwd_o"),
    "chunk_bwd_dv_local": ("fla.ops.common.chunk_o", "chunk_bwd_dv_local"),
    "chunk_bwd_dqkwg": ("fla.ops.common.chunk_o", "chunk_bwd_dqkwg"),
    "gdn_prepare_wy_repr_bwd": ("fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd"),
    "gdn_gate_bwd": ("fla.ops.gated_delta_rule.gate", "gdn_gate_bwd"),
    # the layer's fused parts
    "causal_conv1d": ("fla.modules.causal_conv1d", "causal_conv1d"),
    "rms_norm_gated": ("fla.modules.norm.fused_norm_gate", "rms_norm_gated"),
    # whole ops, for comparisons and benchmarks
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "build_cp_context": ("fla.ops.cp", "build_cp_context"),
    "chunk_cp_fwd_h": ("fla.ops.cp.chunk_fwd", "chunk_cp_fwd_h"),
    "chunk_cp_bwd_dh": ("fla.ops.cp.chunk_bwd", "chunk_cp_bwd_dh"),
}


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    # Before FLA is imported (it reads FLA_CACHE_MODE once): kdacp's tuned configurations for this GPU,
    # unless the user chose FLA's settings; a config missed still autotunes.
    from .fla_configs import use_configs_for_this_gpu
    shipped = use_configs_for_this_gpu()
    try:
        import fla
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        return None, f"fla-core is not importable ({type(e).__name__}: {e}); install fla-core=={REQUIRED_FLA_VERSION}"
    if shipped is not None:
        _reread_cache_mode()
        _lend_configs_across_heads()
    version = getattr(fla, "__version__", "unknown")
    if version != REQUIRED_FLA_VERSION:
        return None, (f"kdacp needs fla-core=={REQUIRED_FLA_VERSION} (its stage functions are internal API), "
                      f"found {version}")
    found, missing = import_stages(_STAGES)
    if missing:
        return None, "fla-core " + version + " lacks: " + "; ".join(missing)
    _seed_plain_autotuners()
    return SimpleNamespace(**found), None


def _reread_cache_mode() -> None:
    """Give FLA the ``FLA_CACHE_MODE`` kdacp just set. FLA reads it once, when first imported, and other
    code may have imported FLA before kdacp (transformers' model modules do): FLA would then ignore the
    shipped configurations and autotune. Its configuration directory it reads at each lookup."""
    from fla.ops.utils import cache
    cache.FLA_CACHE_MODE = cache.FlaCacheMode.from_env()


def _lend_configs_across_heads() -> None:
    """A kernel shape kdacp's files lack but for its head counts takes the nearest head count's entry instead
    of autotuning (:func:`kdacp.backends.fla_configs.lend_configs_across_heads`), while FLA reads its files."""
    from fla.ops.utils import cache

    from .fla_configs import lend_configs_across_heads
    lend_configs_across_heads(cache.CachedAutotuner, cache.get_fla_config_dir,
                              lambda: cache.FLA_CACHE_MODE is not cache.FlaCacheMode.DISABLED)


# FLA modules whose kernels use Triton's plain autotuner, not FLA's configuration-reading one
_PLAIN_AUTOTUNED_MODULES = ("fla.modules.norm.fused_norm_gate",)


def _autotuners(modules) -> list:
    """The Triton autotuners defined in ``modules`` (module objects), found under any
    ``@triton.heuristics`` that wraps them."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    found = []
    for module in modules:
        for obj in vars(module).values():
            while isinstance(obj, Heuristics):
                obj = obj.fn
            if isinstance(obj, Autotuner):
                found.append(obj)
    return found


def _plain_autotuners() -> list:
    """The plain Triton autotuners (not FLA's ``CachedAutotuner``) of :data:`_PLAIN_AUTOTUNED_MODULES`."""
    from fla.ops.utils.cache import CachedAutotuner
    modules = [importlib.import_module(name) for name in _PLAIN_AUTOTUNED_MODULES]
    return [a for a in _autotuners(modules) if not isinstance(a, CachedAutotuner)]


def _seed_plain_autotuners() -> None:
    """Where FLA reads configuration files (``FLA_CONFIG_DIR`` and a ``FLA_CACHE_MODE`` other than
    ``disabled``), give the plain autotuners their entries too, so they do not autotune either."""
    import os

    from .fla_configs import seed_autotuner
    folder, mode = os.environ.get("FLA_CONFIG_DIR"), os.environ.get("FLA_CACHE_MODE", "disabled")
    if folder and mode != "disabled":
        for autotuner in _plain_autotuners():
            seed_autotuner(autotuner, folder)


_FLA = PinnedStages(_load)
fla_available = _FLA.available
require_fla = _FLA.require  # raises ImportError naming what is missing
load_fla = _FLA.load  # FLA's stage functions by name (see ``_STAGES``)


@functools.lru_cache(maxsize=None)
def fla_gated_gdn_backward_supported() -> bool:
    """Whether FLA's GDN backward can run here: FLA 0.6.0 refuses its gated ``chunk_bwd_dqkwg`` (its
    own words: wrong results, FLA issue #640) on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1, unless
    tilelang is installed, in which case FLA runs tilelang's kernel instead. Loads FLA first; answered
    once per process (FLA asks the file system for tilelang on every call, tens of microseconds)."""
    load_fla()
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    refused = IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
    return not refused or importlib.util.find_spec("tilelang") is not None


def load_fla_layer(name: str = "KimiDeltaAttention"):
    """FLA's own layer class ``fla.layers.<name>`` (package ``flash-linear-attention``, which ships
    ``fla.layers`` beside ``fla-core``), for comparisons and benchmarks.

    Raises:
        ImportError: saying which package or version is missing.
    """
    require_fla()
    from importlib import metadata
    try:
        version = metadata.version("flash-linear-attention")
    except metadata.PackageNotFoundError:
        raise ImportError(f"fla.layers needs flash-linear-attention=={REQUIRED_FLA_VERSION} "
                          "(pip install 'kdacp[fla]')") from None
    if version != REQUIRED_FLA_VERSION:
        raise ImportError(f"kdacp compares against flash-linear-attention=={REQUIRED_FLA_VERSION}, found {version}")
    try:
        return getattr(importlib.import_module("fla.layers"), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"fla.layers.{name} is not usable ({type(e).__name__}: {e})") from None


def autotuned_kernel_names() -> set[str]:
    """The names of FLA's autotuned kernels in the FLA modules imported so far: those that read FLA's
    configuration files (``CachedAutotuner``) and the plain ones kdacp seeds from them; loads FLA first."""
    import sys
    load_fla()
    from fla.ops.utils.cache import CachedAutotuner

    from .fla_configs import autotuner_kernel_name
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("fla") and m is not None]
    cached = [a for a in _autotuners(modules) if isinstance(a, CachedAutotuner)]
    return {autotuner_kernel_name(a) for a in cached + _plain_autotuners()}
