"""The only module that imports FlashQLA (``flash-qla``), and what its GDN kernels accept.

kdacp runs FlashQLA's chunked Gated DeltaNet forward and backward (TileLang kernels, compiled at first use with
the machine's ``nvcc``) as the local state pass and gradient pass of the ``flashqla`` backend
(:mod:`kdacp.backends.flashqla_backend`). It calls the package's driver functions below its autograd entry
(``chunk_gated_delta_rule_fwd`` / ``_bwd``), its chunk-local gate cumsum and its ``A = (I + kkt)^-1`` solve,
which change between releases: it pins the exact version and names every missing piece instead of failing deep
inside a kernel call. FlashQLA's package picks its kernels by the GPU at import and raises on a machine without
a supported one, so on a CPU-only machine :func:`flashqla_available` is False.

:func:`flashqla_refusal` states FlashQLA 0.1.3's limits, read from its sources (``fused_gdr_fwd`` asserts
``K == V == 128``; ``chunk_gated_delta_rule`` asserts bfloat16 or float16), so that a call outside them is refused
by name before any kernel runs.
"""
from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import torch

from .pinned_stages import PinnedStages, installed_version, load_pinned

__all__ = ["REQUIRED_FLASHQLA_VERSION", "SUPPORTED_CAPABILITIES", "flashqla_available", "require_flashqla",
           "load_flashqla", "flashqla_device_supported", "flashqla_refusal"]

REQUIRED_FLASHQLA_VERSION = "0.1.3"
INSTALL_HINT = (f"pip install 'flash-qla=={REQUIRED_FLASHQLA_VERSION}' (or 'kdacp[flashqla]'); on a machine "
                "without a package index, benchmarks/flashqla_prep.sh carries its wheels")
# The GPUs whose FlashQLA kernels run chunks of 64 tokens with a backward (Hopper sm_90, Blackwell sm_100 and
# sm_103); its sm_120 kernels use chunks of 32.
SUPPORTED_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
HEAD_DIM = 128  # FlashQLA's only K = V

_DRIVER = "flash_qla.ops.gated_delta_rule.chunk"
# name in the namespace -> (module, attribute)
_STAGES = {
    "forward": (_DRIVER, "chunk_gated_delta_rule_fwd"),
    "backward": (_DRIVER, "chunk_gated_delta_rule_bwd"),
    "kkt_solve": (_DRIVER, "kkt_solve"),
    "CHUNK_SIZE": (_DRIVER, "CHUNK_SIZE"),
    "chunk_local_cumsum": ("flash_qla.ops.utils", "chunk_local_cumsum"),
}


def _installed_version() -> str | None:
    return installed_version("flash-qla")


def _import_module(name: str):
    return importlib.import_module(name)


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    return load_pinned(
        "flash-qla", REQUIRED_FLASHQLA_VERSION, _STAGES, version=_installed_version(), import_module=_import_module,
        install_hint=INSTALL_HINT, why_pinned="it calls its driver functions",
        kernels_hint="They need TileLang, nvcc and a Hopper or Blackwell GPU")


_FLASHQLA = PinnedStages(_load)
flashqla_available = _FLASHQLA.available
require_flashqla = _FLASHQLA.require  # raises ImportError naming what is missing
load_flashqla = _FLASHQLA.load  # FlashQLA's functions by name (see ``_STAGES``)


def flashqla_device_supported(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of one of :data:`SUPPORTED_CAPABILITIES`."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) in SUPPORTED_CAPABILITIES


def flashqla_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why FlashQLA's kernels cannot run this GDN call (None: they can), from shapes and dtypes alone (no device
    read, the same on every rank).

    Args:
        q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``: the call's tensors (any device, meta included).
    """
    K, V = q.shape[3], v.shape[3]
    if (K, V) != (HEAD_DIM, HEAD_DIM):
        return f"FlashQLA's kernels need K = V = {HEAD_DIM}, got K={K}, V={V}"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"FlashQLA's kernels need q, k, v all bfloat16 or all float16, got {q.dtype}, {k.dtype}, {v.dtype}"
    return None
