"""The only module that imports attention-gym (``attn-gym``), and what its staged cores accept.

kdacp runs attention-gym's staged KDA and GDN cores (``attn_gym.linear.kda.stages``,
``attn_gym.linear.gdn.stages``: CuTe DSL and Triton kernels, its ``[linear]`` extra) and rebuilds their
handles on a span of tokens, which reads fields of its handle dataclasses: it pins the exact version
and names every missing piece instead of failing deep inside a kernel call. On a machine without
CUDA the stage modules do not import (the CuTe DSL, ``nvidia-cutlass-dsl``, ships GPU libraries
only); :func:`attn_gym_available` is then False.

:func:`attn_gym_refusal` states attention-gym 0.0.17's limits that differ from FLA's, read from its
sources and docstrings, so that a call outside them is refused by name (or, under ``backend="auto"``,
runs on FLA) before any kernel runs.
"""
from __future__ import annotations

import functools
import importlib
import math
from types import SimpleNamespace

import torch

from .pinned_stages import PinnedStages, installed_version, load_pinned

__all__ = ["REQUIRED_ATTN_GYM_VERSION", "SUPPORTED_CAPABILITY", "MAX_GATE_MAGNITUDE", "attn_gym_available",
           "require_attn_gym", "load_attn_gym", "attn_gym_device_supported", "attn_gym_refusal"]

REQUIRED_ATTN_GYM_VERSION = "0.0.17"
INSTALL_HINT = f"pip install 'attn-gym[linear]=={REQUIRED_ATTN_GYM_VERSION}' (or 'kdacp[attn-gym]')"
# The GPUs kdacp measured attention-gym's cores on and picks them for under backend="auto": Hopper.
SUPPORTED_CAPABILITY = (9, 0)
# attention-gym 0.0.17's fused KDA core rebases the gate over 15 steps inside a chunk and keeps the
# exponent below float32's 128: a per-token natural-log gate must lie in [-MAX_GATE_MAGNITUDE, 0]
# (its attn_gym.linear.kda.constants.MAX_GATE_LOWER_BOUND_MAGNITUDE, about 5.914). Its kernels do not check.
MAX_GATE_MAGNITUDE = 128.0 / (15 * math.log2(math.e)) - 1e-3
HEAD_DIM = 128  # the staged cores' only K = V
INT32_EXTENT = 2 ** 31  # GDN's kernels index with int32 offsets (attention-gym refuses wider tensors)

# name in the namespace -> (module, attribute); here each stage keeps its module's name for it
_STAGES = {name: (module, name) for module, names in {
    "attn_gym.linear.kda.stages": ("chunk_kda_prepare", "chunk_kda_prepare_backward", "ChunkKDASaved"),
    "attn_gym.linear.gdn.stages": ("chunk_gdn_prepare", "chunk_gdn_prepare_backward", "ChunkGDNSaved"),
    "attn_gym.linear._delta_rule.chunk_schedule": ("prepare_ragged_chunk_metadata",),
    "attn_gym.linear.kda.constants": ("MAX_GATE_LOWER_BOUND_MAGNITUDE",),
}.items() for name in names}


def _installed_version() -> str | None:
    return installed_version("attn-gym")


def _import_module(name: str):
    return importlib.import_module(name)


@functools.cache
def _load() -> tuple[SimpleNamespace | None, str | None]:
    return load_pinned(
        "attn-gym", REQUIRED_ATTN_GYM_VERSION, _STAGES, version=_installed_version(), import_module=_import_module,
        install_hint=INSTALL_HINT, why_pinned="it rebuilds its stage handles",
        kernels_hint="They need its [linear] extra (nvidia-cutlass-dsl, apache-tvm-ffi) and a CUDA machine; with pip "
                     "install --target, put <target>/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH")


_ATTN_GYM = PinnedStages(_load)
attn_gym_available = _ATTN_GYM.available
require_attn_gym = _ATTN_GYM.require  # raises ImportError naming what is missing
load_attn_gym = _ATTN_GYM.load  # attention-gym's stage functions by name (see ``_STAGES``)


def attn_gym_device_supported(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA GPU of :data:`SUPPORTED_CAPABILITY`."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == SUPPORTED_CAPABILITY


def attn_gym_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scalar_gate: bool,
                     use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool, lower_bound: float | None,
                     summary_precision: str | None) -> str | None:
    """Why attention-gym's staged cores cannot run this call (None: they can), from shapes, dtypes and
    options alone (no device read, the same on every rank).

    Args:
        q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``: the call's tensors (any device, meta included).
        scalar_gate: a GDN call (one decay per head) rather than a KDA one.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, summary_precision: the call's options.
    """
    H, K, HV, V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    if (K, V) != (HEAD_DIM, HEAD_DIM):
        return f"attention-gym's staged cores need K = V = {HEAD_DIM}, got K={K}, V={V}"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return (f"attention-gym's staged cores need q, k, v all bfloat16 or all float16, got {q.dtype}, {k.dtype}, "
                f"{v.dtype}")
    if q.dtype == torch.float16 and not use_qk_l2norm_in_kernel:
        return ("float16 needs use_qk_l2norm_in_kernel=True: unnormalised q, k overflow attention-gym's float16 "
                "intermediates")
    if summary_precision is not None:
        return (f"summary_precision={summary_precision!r} chooses the fla backend's summary kernels; attention-gym "
                "computes its own float32 summaries (pass summary_precision=None)")
    if scalar_gate:
        if q.shape[0] * q.shape[1] * HV * HEAD_DIM > INT32_EXTENT:
            return (f"attention-gym's GDN kernels index with int32 offsets: B*T*HV*{HEAD_DIM} must be at most 2**31, "
                    f"got B*T={q.shape[0] * q.shape[1]}, HV={HV}")
        return None
    if HV != H:
        return f"attention-gym's KDA core needs as many value heads as q/k heads (HV == H), got H={H}, HV={HV}"
    if not use_gate_in_kernel or lower_bound is None or not -MAX_GATE_MAGNITUDE <= lower_bound <= 0:
        return (f"attention-gym's KDA core needs every gate in [-{MAX_GATE_MAGNITUDE:.4f}, 0] and does not check: "
                "kdacp runs it only on a gate bounded by construction, use_gate_in_kernel=True with lower_bound in "
                f"[-{MAX_GATE_MAGNITUDE:.4f}, 0] (Kimi Linear's safe gate), got "
                f"use_gate_in_kernel={use_gate_in_kernel}, lower_bound={lower_bound}")
    return None
