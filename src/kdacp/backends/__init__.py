"""Local (one-rank) KDA backends behind one stage interface (:class:`LocalBackend`).

``torch``: built on :mod:`kdacp.reference`, any device and dtype. ``fla``: FLA 0.6.0's CUDA stage
kernels (needs ``fla-core==0.6.0`` and a CUDA device). ``auto``: ``fla`` for CUDA tensors when it is
installed, else ``torch``.
"""
from __future__ import annotations

import torch

from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads, LocalStates, Span
from .torch_backend import TorchBackend

__all__ = ["BACKENDS", "KDAInputs", "KDAOptions", "LocalBackend", "LocalGrads", "LocalStates", "Span",
           "TorchBackend", "make_backend", "resolve_backend"]

BACKENDS = ("auto", "torch", "fla")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend name (``"torch"`` or ``"fla"``) for ``backend`` on ``device``.

    Raises:
        ValueError: unknown name, or ``"fla"`` for a non-CUDA device.
        ImportError: ``"fla"`` without a usable ``fla-core==0.6.0``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        from .fla_adapter import fla_available
        return "fla" if fla_available() else "torch"
    if backend == "fla":
        if device.type != "cuda":
            raise ValueError(f"backend='fla' needs CUDA tensors, got device {device}")
        from .fla_adapter import require_fla
        require_fla()
    return backend


def make_backend(name: str, options: KDAOptions, scalar_gate: bool = False) -> LocalBackend:
    """A backend instance for one call; ``name`` as returned by :func:`resolve_backend`. With
    ``scalar_gate`` (``"fla"`` only) it runs FLA's GDN kernels on a gate ``g [1, T, HV]``."""
    if name == "torch" and not scalar_gate:
        return TorchBackend(options)
    if name == "fla":
        if scalar_gate:
            from .fla_gdn_backend import FlaGDNBackend
            return FlaGDNBackend(options)
        from .fla_backend import FlaBackend
        return FlaBackend(options)
    raise ValueError(f"backend must be 'torch' or 'fla' ('fla' with scalar_gate), got {name!r}")
