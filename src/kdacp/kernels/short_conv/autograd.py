"""The short convolution as a differentiable op on the fused kernels, its inputs checked before any kernel
runs: :func:`fused_causal_conv1d`."""
from __future__ import annotations

import os

import torch

from ...validation import check_cu_seqlens, check_tensor
from .launch import short_conv_bwd, short_conv_fwd

ACTIVATIONS = (None, "silu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_WIDTH, MAX_WIDTH = 2, 4


class _ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, halo, cu_seqlens, activation):
        ctx.save_for_backward(x, weight, bias, halo, cu_seqlens)
        ctx.activation = activation
        return short_conv_fwd(x, weight, bias, halo, cu_seqlens, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, halo, cu_seqlens = ctx.saved_tensors
        grads = short_conv_bwd(x, weight, bias, halo, cu_seqlens, ctx.activation, dy,
                               want_dhalo=ctx.needs_input_grad[3])
        return grads.dx, grads.dweight, grads.dbias, grads.dhalo, None, None


def _check_inputs(x, weight, bias, halo, cu_seqlens, cu_seqlens_cpu, activation) -> None:
    check_tensor("x", x, ndim=3)
    check_tensor("weight", weight, ndim=2)
    if x.dtype not in DTYPES:
        raise TypeError(f"x must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"x is on {x.device}; the kernels need a CUDA device (or TRITON_INTERPRET=1 set before "
                         "triton is imported)")
    B, T, D = x.shape
    if T < 1 or D < 1:
        raise ValueError(f"x must have at least one token and one channel, got shape {tuple(x.shape)}")
    if weight.shape[0] != D or not MIN_WIDTH <= weight.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight must have shape [D={D}, W] with {MIN_WIDTH} <= W <= {MAX_WIDTH}, "
                         f"got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        if bias.shape[0] != D:
            raise ValueError(f"bias must have shape [D={D}], got {tuple(bias.shape)}")
    if halo is not None:
        check_tensor("halo", halo, ndim=3)
        if tuple(halo.shape) != (B, W - 1, D):
            raise ValueError(f"halo must have shape [B={B}, W-1={W - 1}, D={D}], got {tuple(halo.shape)}")
        if halo.dtype != x.dtype:
            raise TypeError(f"halo must have x's dtype ({x.dtype}), got {halo.dtype}")
    for name, t in (("weight", weight), ("bias", bias), ("halo", halo), ("cu_seqlens", cu_seqlens)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must share a device")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, B, T)
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be cu_seqlens' host copy, got shapes {tuple(cu_seqlens_cpu.shape)} "
                             f"and {tuple(cu_seqlens.shape)}")
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens; pass cu_seqlens too")


def fused_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        halo: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                        cu_seqlens_cpu: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """``act(sum_j weight[:, W-1-j] * x[t-j] + bias)`` over each sequence, differentiable in ``x``,
    ``weight``, ``bias`` and ``halo`` (the module docstring has the math).

    Args:
        x: ``[B, T, D]`` bfloat16, float16 or float32, any strides (a q|k|v slice needs no copy).
        weight: ``[D, W]``, ``2 <= W <= 4``, any float dtype (tap ``W-1`` multiplies the current token).
        bias: ``[D]`` or None.
        halo: ``[B, W-1, D]`` in ``x``'s dtype: the ``W-1`` tokens before ``x[:, 0]`` of the sequence that
            continues into ``x[:, 0]``; None: ``x`` starts its sequences.
        cu_seqlens: ``[N+1]`` int boundaries of packed sequences (``B == 1``), on ``x``'s device.
        cu_seqlens_cpu: the same on the host, if at hand: the check then reads it instead of syncing.
        activation: ``"silu"`` or None.

    Returns:
        ``[B, T, D]`` in ``x``'s dtype, contiguous.

    Raises:
        TypeError, ValueError: naming the argument, before any kernel runs.
    """
    _check_inputs(x, weight, bias, halo, cu_seqlens, cu_seqlens_cpu, activation)
    return _ShortConvFunction.apply(x, weight, bias, halo, cu_seqlens, activation)
