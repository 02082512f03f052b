"""Local (one-rank) KDA backends behind one stage interface (:class:`LocalBackend`), registered as specs
(:mod:`.registry`: :data:`BACKEND_SPECS`, :func:`register_backend`, :func:`choose_backend`).

``torch``: built on :mod:`kdacp.reference`, any device and dtype. ``fla``: FLA 0.6.0's CUDA stage
kernels (needs ``fla-core==0.6.0`` and a CUDA device). ``attn_gym``: attention-gym 0.0.17's staged KDA and
GDN cores for training, FLA's kernels for the rest (needs both, and a Hopper GPU: capability 9.0).
``auto``: for a GDN call ``attn_gym`` on a Hopper GPU when both are installed (GDN trains faster on its core;
KDA does not), else ``fla`` when FLA is installed and the tensors are on CUDA, else ``torch``; a call outside
attention-gym's limits then runs on ``fla`` (:func:`~kdacp.backends.registry.choose_backend`).
"""
from __future__ import annotations

import torch

from ..choices import BACKENDS
from .base import KDAInputs, KDAOptions, LocalBackend, LocalGrads, LocalStates, Span
from .registry import (BACKEND_SPECS, BackendSpec, CallFacts, backend_choices, backend_fuses, choose_backend,
                       register_backend)
from .torch_backend import TorchBackend

__all__ = ["BACKENDS", "BACKEND_SPECS", "BackendSpec", "CallFacts", "KDAInputs", "KDAOptions", "LocalBackend",
           "LocalGrads", "LocalStates", "Span", "TorchBackend", "backend_choices", "backend_fuses", "backend_usable",
           "choose_backend", "make_backend", "needs_cuda", "register_backend", "resolve_backend"]



def resolve_backend(backend: str, device: torch.device, *, scalar_gate: bool = False) -> str:
    """The name of the backend ``backend`` resolves to on ``device``, whatever the call
    (:func:`~kdacp.backends.registry.choose_backend` without the call's facts). Raises as it."""
    return choose_backend(backend, device, scalar_gate=scalar_gate).name


def backend_usable(backend: str, device: torch.device) -> bool:
    """Whether :func:`resolve_backend` accepts ``backend`` on ``device`` (for benchmarks' optional columns)."""
    try:
        resolve_backend(backend, device)
    except (ImportError, ValueError):
        return False
    return True


def needs_cuda(backend: str) -> bool:
    """Whether the registered backend ``backend`` runs on CUDA devices only (False for ``"auto"``)."""
    spec = BACKEND_SPECS.get(backend)
    return spec is not None and not spec.runs_on("cpu")


def make_backend(name: str, options: KDAOptions, scalar_gate: bool = False) -> LocalBackend:
    """A backend instance for one call; ``name`` a registered backend. With ``scalar_gate`` (``"fla"`` and
    ``"attn_gym"``) it runs GDN kernels on a gate ``g [1, T, HV]``."""
    if name not in BACKEND_SPECS:
        raise ValueError(f"backend must be one of {tuple(BACKEND_SPECS)}, got {name!r}")
    return BACKEND_SPECS[name].build(options, scalar_gate)
