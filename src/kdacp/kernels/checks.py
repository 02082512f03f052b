"""Input checks of the kernel launchers: raise ``TypeError``/``ValueError`` naming the argument and
what was expected, before any kernel runs."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..sequences import sequence_bounds
from ..validation import check_tensor

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_K = (64, 128)
SUPPORTED_V = (64, 128, 256)
SUPPORTED_CHUNK = (16, 32, 64, 128)


@dataclass(frozen=True)
class SummaryDims:
    """Sizes of one launch: batch ``B``, tokens ``T``, heads of the given tensors ``HV_total``, the
    selected heads ``[head_start, head_start + HV)``, ``K``, ``V``, the sequences
    ``(batch row, first token, end token)``, whether ``gc`` is a scalar gate ``[B, T, HV]``, and
    ``key_group``: value heads per head of the raw (ungated) q/k inputs, 1 without them."""

    B: int
    T: int
    HV_total: int
    head_start: int
    HV: int
    K: int
    V: int
    bounds: tuple
    scalar_gate: bool = False
    key_group: int = 1


def _check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the first input is on {device}; all inputs must share a device")


def _check_layout(name: str, x: torch.Tensor, last_strides: tuple | None = (1,)) -> None:
    """Non-negative strides, and the last dim's in ``last_strides`` (any with None)."""
    if last_strides is not None and x.stride(-1) not in last_strides:
        what = "contiguous in its last dim (stride 1)" if last_strides == (1,) else \
            f"a last-dim stride in {last_strides}"
        raise ValueError(f"{name} must be {what}, got strides {tuple(x.stride())}")
    if any(s < 0 for s in x.stride()):
        raise ValueError(f"{name} must have non-negative strides, got {tuple(x.stride())}")


def _check_dtype(name: str, x: torch.Tensor, allowed, like: torch.Tensor | None = None, like_name: str = "") -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{name} must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if like is not None and x.dtype != like.dtype:
        raise TypeError(f"{name} must have the dtype of {like_name} ({like.dtype}), got {x.dtype}")


def _segment_bounds(B: int, T: int, segment) -> tuple:
    """The one sequence ``(0, start, end)`` of a ``segment`` launch."""
    if (not isinstance(segment, (tuple, list)) or len(segment) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in segment)):
        raise TypeError(f"segment must be a pair of ints (start, end), got {segment!r}")
    start, end = segment
    if B != 1:
        raise ValueError(f"segment needs a packed batch with B == 1, got B={B}")
    if not 0 <= start < end <= T:
        raise ValueError(f"segment must satisfy 0 <= start < end <= T={T}, got {tuple(segment)}")
    return ((0, start, end),)


def check_summary_inputs(keys: dict, values: dict, gc: torch.Tensor, *, chunk_size, head_start, num_heads,
                         w_head_first: bool, cu_seqlens, segment, dv=None, raw: tuple = ()) -> SummaryDims:
    """Check the launcher arguments and return their sizes.

    Args:
        keys: ``name -> tensor`` of the key-side inputs ``[B, T, HV, K]`` (``w`` may be head-first
            ``[B, HV, T, K]``); the first one fixes the dtype and device, the first one not in ``raw``
            the shapes.
        raw: names in ``keys`` given ungated at ``H`` heads, ``[B, T, H, K]`` with ``H`` dividing ``HV``
            (gated in the kernel: the gate must then be constant over ``K``).
        values: ``name -> tensor`` of the value-side inputs ``[B, T, HV, V]`` in the same dtype.
        gc: the within-chunk cumulative log2 gate, any supported float dtype: ``[B, T, HV, K]`` (unit or
            zero stride on ``K``: a broadcast scalar gate), or ``[B, T, HV]`` (a scalar gate, any strides).
        dv: optional ``[B, T, HV, V]`` tensor allowed its own float dtype.
    """
    names = list(keys) + list(values) + ["gc"] + (["dv"] if dv is not None else [])
    tensors = list(keys.values()) + list(values.values()) + [gc] + ([dv] if dv is not None else [])
    for name, x in zip(names, tensors):
        check_tensor(name, x, None if name == "gc" else 4)
    if gc.dim() not in (3, 4):
        raise ValueError(f"gc must have 4 dims [B, T, HV, K] or 3 dims [B, T, HV] (a scalar gate), "
                         f"got shape {tuple(gc.shape)}")
    first_name, first = next(iter(keys.items()))
    shape_name, shaper = next((n, x) for n, x in keys.items() if n not in raw)
    if shape_name == "w" and w_head_first:
        B, HV_total, T, K = shaper.shape
    else:
        B, T, HV_total, K = shaper.shape
    if T < 1 or HV_total < 1:
        raise ValueError(f"{shape_name} must have T >= 1 and at least one head, got shape {tuple(shaper.shape)}")
    device = first.device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{first_name} is on {device}; the kernels need a CUDA device "
                         "(or TRITON_INTERPRET=1 set before triton is imported)")
    H = next((keys[n].shape[2] for n in raw), HV_total)
    if H < 1 or HV_total % H:
        raise ValueError(f"{raw[0]} must have a number of heads that divides HV={HV_total} (the heads of "
                         f"{shape_name}), got shape {tuple(keys[raw[0]].shape)}")
    for name, x in keys.items():
        if name == "w" and w_head_first:
            expected, layout = (B, HV_total, T, K), "[B, HV, T, K]"
        elif name in raw:
            expected, layout = (B, T, H, K), "[B, T, H, K]"
        else:
            expected, layout = (B, T, HV_total, K), "[B, T, HV, K]"
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} must have shape {layout} = {expected}, got {tuple(x.shape)}")
        _check_dtype(name, x, INPUT_DTYPES, None if x is first else first, first_name)
    V = 0  # no value-side inputs: the transition only
    for name, x in values.items():
        V = x.shape[3] if V == 0 else V
        if tuple(x.shape) != (B, T, HV_total, V):
            raise ValueError(f"{name} must have shape [B, T, HV, V] = {(B, T, HV_total, V)}, got {tuple(x.shape)}")
        _check_dtype(name, x, INPUT_DTYPES, first, first_name)
    scalar_gate = gc.dim() == 3
    if tuple(gc.shape) != ((B, T, HV_total) if scalar_gate else (B, T, HV_total, K)):
        raise ValueError(f"gc must have shape [B, T, HV, K] = {(B, T, HV_total, K)} or, a scalar gate, [B, T, HV] = "
                         f"{(B, T, HV_total)}, got {tuple(gc.shape)}")
    _check_dtype("gc", gc, INPUT_DTYPES)
    if raw and not (scalar_gate or gc.stride(3) == 0):
        raise ValueError(f"raw (ungated) {' and '.join(raw)} need a gate constant over K: a scalar gate gc "
                         f"[B, T, HV] or a [B, T, HV, K] view of one with stride 0 on K, "
                         f"got strides {tuple(gc.stride())}")
    if dv is not None:
        if tuple(dv.shape) != (B, T, HV_total, V):
            raise ValueError(f"dv must have shape [B, T, HV, V] = {(B, T, HV_total, V)}, got {tuple(dv.shape)}")
        _check_dtype("dv", dv, INPUT_DTYPES)
    for name, x in zip(names, tensors):
        _check_device(name, x, device)
        if name != "gc":
            _check_layout(name, x)
        elif scalar_gate:
            _check_layout(name, x, None)
        else:
            _check_layout(name, x, (1, 0))
    if K == 256:
        raise NotImplementedError("K=256 is not supported by the summary kernels (the float32 K x K transition "
                                  "does not fit one tile); use K=64 or 128")
    if K not in SUPPORTED_K:
        raise ValueError(f"the key dim K (last dim of {first_name}) must be one of {SUPPORTED_K}, got {K}")
    if values and V not in SUPPORTED_V:
        raise ValueError(f"the value dim V (last dim of {next(iter(values))}) must be one of {SUPPORTED_V}, got {V}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in SUPPORTED_CHUNK:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK}, got {chunk_size!r}")
    if isinstance(head_start, bool) or not isinstance(head_start, int) or not 0 <= head_start < HV_total:
        raise ValueError(f"head_start must be an int in [0, HV={HV_total}), got {head_start!r}")
    HV = HV_total - head_start if num_heads is None else num_heads
    if isinstance(HV, bool) or not isinstance(HV, int) or HV < 1 or head_start + HV > HV_total:
        raise ValueError(f"num_heads must be an int >= 1 with head_start + num_heads <= HV={HV_total}, "
                         f"got head_start={head_start}, num_heads={num_heads!r}")
    if cu_seqlens is not None and segment is not None:
        raise ValueError("pass at most one of cu_seqlens and segment")
    bounds = sequence_bounds(B, T, cu_seqlens) if segment is None else _segment_bounds(B, T, segment)
    return SummaryDims(B=B, T=T, HV_total=HV_total, head_start=head_start, HV=HV, K=K, V=V, bounds=bounds,
                       scalar_gate=scalar_gate, key_group=HV_total // H)
