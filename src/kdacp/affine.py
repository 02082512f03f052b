"""The algebra of affine state summaries, written once: the type, apply and compose.

A summary acts on a state as ``S_out = M S_in + S_ext`` (forward; backward the same form with ``M^T``
and ``G``: ``dS_in = M^T dS_out + G``), and ``(M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2)``.

Precision rule (every caller: the reference, the kernels' users, the exchange strategies): float32
operands on a GPU go through one Triton kernel in float32 (3xTF32 products, as the summary kernels';
:mod:`kdacp.kernels.affine_product`); anything else (a float64 operand, or the CPU) is formed in float64
with autocast off. The result has the inputs' promoted dtype, at least float32. No TF32 setting or
autocast can round a chain of them. Why not float64 on the GPU: these products sit on the exchange's
serial path, once per hop or scan round, and there float64 PyTorch took 86 us (apply) and 139 us
(compose) on an H200 at 32 heads of 128, against tens of us of link latency; float32 products left
the virtual-ranks errors unchanged at P = 2..64 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["StateSummary", "apply_state_summary", "apply_state_gradient_summary", "compose_state_summaries"]


class StateSummary(NamedTuple):
    """``S_out = M S_in + S_ext``: ``state`` is ``S_ext [N, HV, K, V]``, ``transition`` is ``M [N, HV, K, K]``
    (either may be ``None`` where it was not asked for)."""

    state: torch.Tensor | None
    transition: torch.Tensor | None


def _check_pair(name_a, a, name_b, b, b_last):
    for n, x in ((name_a, a), (name_b, b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{n} must have at least 2 dims [..., K, *], got shape {tuple(x.shape)}")
    K = a.shape[-2]
    if tuple(a.shape[-2:]) != (K, K):
        raise ValueError(f"{name_a} must be square in its last two dims [..., K, K], got {tuple(a.shape)}")
    if b.shape[-2] != K or (b_last is not None and b.shape[-1] != b_last):
        raise ValueError(f"{name_b} must have shape [..., K={K}, *], got {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}")


def _out_dtype(*xs: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _kernel_path(*xs: torch.Tensor) -> bool:
    """Float32 GPU operands outside autograd (the kernel has no backward) take the Triton kernel."""
    return (xs[0].is_cuda and all(x.dtype == torch.float32 for x in xs)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in xs)))


def _affine(A: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``A x + b`` (``b`` may be ``None``: zero) by the precision rule."""
    operands = (A, x) if b is None else (A, x, b)
    if _kernel_path(*operands):
        # imported here: kdacp.kernels imports this module for StateSummary
        from .kernels.affine_product import affine_product
        lead = torch.broadcast_shapes(A.shape[:-2], x.shape[:-2], *(() if b is None else (b.shape[:-2],)))
        return affine_product(A.expand(*lead, *A.shape[-2:]), x.expand(*lead, *x.shape[-2:]),
                              None if b is None else b.expand(*lead, *b.shape[-2:]))
    with torch.autocast(device_type=A.device.type, enabled=False):
        out = A.double() @ x.double()
        if b is not None:
            out = out + b.double()
        return out.to(_out_dtype(*operands))


def apply_state_summary(S_ext: torch.Tensor, M: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """``M S_in + S_ext``: ``M [..., K, K]``, ``S_in, S_ext [..., K, V]``."""
    _check_pair("M", M, "S_in", S_in, None)
    _check_pair("M", M, "S_ext", S_ext, S_in.shape[-1])
    return _affine(M, S_in, S_ext)


def apply_state_gradient_summary(G: torch.Tensor, M: torch.Tensor, dS_out: torch.Tensor) -> torch.Tensor:
    """``M^T dS_out + G``: ``M [..., K, K]``, ``dS_out, G [..., K, V]``."""
    _check_pair("M", M, "dS_out", dS_out, None)
    _check_pair("M", M, "G", G, dS_out.shape[-1])
    return _affine(M.transpose(-1, -2), dS_out, G)


def compose_state_summaries(first, second) -> StateSummary:
    """Summary of ``first`` followed by ``second`` (each ``(S_ext, M)``): ``(M2 S1 + S2, M2 M1)``."""
    (S1, M1), (S2, M2) = first, second
    _check_pair("second M", M2, "first M", M1, M2.shape[-1])
    _check_pair("second M", M2, "first S_ext", S1, None)
    _check_pair("second M", M2, "second S_ext", S2, S1.shape[-1])
    return StateSummary(_affine(M2, S1, S2), _affine(M2, M1, None))
