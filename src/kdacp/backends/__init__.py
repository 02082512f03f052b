"""Local (one-rank) KDA backends behind one stage interface (:class:`LocalBackend`).

``torch``: built on :mod:`kdacp.reference`, any device and dtype. ``fla``: FLA 0.6.0's CUDA stage
kernels (needs ``fla-core==0.6.0`` and a CUDA device). ``attn_gym``: attention-gym 0.0.17's staged KDA and
GDN cores for training, FLA's kernels for the rest (needs both, and a Hopper GPU: capability 9.0).
``auto``: for a GDN call ``attn_gym`` on a Hopper GPU when both are installed (GDN trains faster on its core;
KDA does not), else ``fla`` when FLA is installed and the tensors are on CUDA, else ``torch``; a call outside
attention-gym's limits then runs on ``fla`` (:func:`kdacp.backends.call.call_backend`).
"""
from __future__ import annotations

import torch

from ..choices import BACKENDS, FLA_BACKENDS
from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads, LocalStates, Span
from .torch_backend import TorchBackend

__all__ = ["BACKENDS", "FLA_BACKENDS", "backend_usable", "KDAInputs", "KDAOptions", "LocalBackend", "LocalGrads",
           "LocalStates", "Span", "TorchBackend", "make_backend", "resolve_backend"]



def resolve_backend(backend: str, device: torch.device, *, scalar_gate: bool = False) -> str:
    """The concrete backend name (``"torch"``, ``"fla"`` or ``"attn_gym"``) for ``backend`` on ``device``.

    ``scalar_gate``: the call is GDN's (one decay per head). ``"auto"`` picks ``"attn_gym"`` for GDN only:
    kdacp's KDA layer trains faster on FLA's kernels (forward + backward, 16K tokens, one H200: 14.51 against
    15.01 ms, one sequence; 14.54 against 15.02 ms, 5 documents), its GDN layer in 0.68x of the time on
    attention-gym's core.

    Raises:
        ValueError: unknown name; ``"fla"`` or ``"attn_gym"`` for a non-CUDA device; ``"attn_gym"`` on a GPU
            other than Hopper.
        ImportError: ``"fla"`` or ``"attn_gym"`` without a usable ``fla-core==0.6.0``; ``"attn_gym"`` without a
            usable ``attn-gym==0.0.17`` with its ``[linear]`` extra (the message names what is missing).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        from .attn_gym_adapter import attn_gym_available, attn_gym_device_supported
        from .fla_adapter import fla_available
        if not fla_available():
            return "torch"
        return "attn_gym" if scalar_gate and attn_gym_device_supported(device) and attn_gym_available() else "fla"
    if backend in FLA_BACKENDS:
        if device.type != "cuda":
            raise ValueError(f"backend={backend!r} needs CUDA tensors, got device {device}")
        from .fla_adapter import require_fla
        require_fla()
    if backend == "attn_gym":
        from .attn_gym_adapter import SUPPORTED_CAPABILITY, attn_gym_device_supported, require_attn_gym
        require_attn_gym()
        if not attn_gym_device_supported(device):
            raise ValueError(f"backend='attn_gym' runs on GPUs of capability {SUPPORTED_CAPABILITY} (Hopper), got "
                             f"{torch.cuda.get_device_capability(device)} on {device}; use backend='fla'")
    return backend


def backend_usable(backend: str, device: torch.device) -> bool:
    """Whether :func:`resolve_backend` accepts ``backend`` on ``device`` (for benchmarks' optional columns)."""
    try:
        resolve_backend(backend, device)
    except (ImportError, ValueError):
        return False
    return True


def make_backend(name: str, options: KDAOptions, scalar_gate: bool = False) -> LocalBackend:
    """A backend instance for one call; ``name`` as returned by :func:`resolve_backend`. With
    ``scalar_gate`` (``"fla"`` and ``"attn_gym"``) it runs GDN kernels on a gate ``g [1, T, HV]``."""
    if name == "torch" and not scalar_gate:
        return TorchBackend(options)
    if name == "fla":
        if scalar_gate:
            from .fla_gdn_backend import FlaGDNBackend
            return FlaGDNBackend(options)
        from .fla_backend import FlaBackend
        return FlaBackend(options)
    if name == "attn_gym":
        from .attn_gym_backend import AttnGymBackend, AttnGymGDNBackend
        return AttnGymGDNBackend(options) if scalar_gate else AttnGymBackend(options)
    raise ValueError(f"backend must be 'torch', 'fla' or 'attn_gym' ('fla' or 'attn_gym' with scalar_gate), "
                     f"got {name!r}")
