"""Triton precision primitives of the summary kernels: float32 products from low-precision inputs.

Every product that touches a float32 state keeps the state in float32: with bf16 inputs the float32
operand is split into bf16 pieces (``b = b1 + b2 (+ b3)``), each tensor-core product ``a * b_i`` is
exact and only the float32 accumulation rounds. Three pieces carry ~24 significant bits
(float32-faithful), two ~16 (``SummaryConfig.bf16_pieces``, default 2). With fp16/fp32 inputs both
operands go to float32 and ``tl.dot`` runs in 3xTF32. Products are formed from a zero accumulator and
added to the state outside the tensor cores (see :func:`dot_state`). The per-chunk decays
``exp2(gc_last)`` use the hardware float32 ``exp2`` with two pieces and are evaluated in float64
(correctly rounded) with three pieces or fp16/fp32 inputs (:func:`chunk_decay`): with two pieces the
float64 evaluation left the errors as they were (``G`` 9.97e-7 against 1.00e-6, ``M`` 6.1e-6 against
5.8e-6) and cost ``G`` a fifth of its time, being on its serial chain.

Measured (one H200, bf16, T=16K, 32 heads, K=V=128, slowly decaying channels; relative error against
float64 on the same inputs): with the running state passed to ``tl.dot`` as its accumulator, ``M``
was off by 6e-5 whether 2 or 3 pieces; with products from zero, ``M`` 5.8e-6 (2 pieces) / 2.3e-6
(3), ``S_ext`` 2.7e-6 / 1.2e-7, ``G`` 1.0e-6 / 1.3e-7. FLA 0.6.0's CP kernels on the same inputs:
``S_ext`` 1.8e-3, ``M`` 2.2e-5, ``G`` 6.7e-4 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["F32_DOT", "INTERPRET", "split_bf16", "chunk_decay", "dot_state", "dot_state_paired", "dot_state_left",
           "dot_inputs", "stack_rows"]

# tl.dot precision for float32 x float32 products (the interpreter ignores it and uses numpy float32).
F32_DOT: tl.constexpr = tl.constexpr("tf32x3")
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def split_bf16(dtype: torch.dtype) -> bool:
    """Whether to run the bf16 piece products. Triton 3.6's interpreter multiplies bf16 tiles as raw
    uint16 and truncates float32 -> bf16 casts, so there every input goes through float32."""
    return dtype == torch.bfloat16 and not INTERPRET


@triton.jit
def chunk_decay(g_last, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr):
    """``exp2(g_last)`` in float32, as precise as the products it scales: correctly rounded (float64
    evaluation) with three bf16 pieces or fp16/fp32 inputs, else the hardware float32 ``exp2``
    (within 2 ulp, and 8x cheaper than float64 on an H200)."""
    if INTERPRET:  # libdevice does not run in the interpreter
        out = tl.exp2(g_last.to(tl.float64)).to(tl.float32)
    elif NSPLIT == 3 or not SPLIT_BF16:
        out = libdevice.exp2(g_last.to(tl.float64)).to(tl.float32)
    else:
        out = tl.exp2(g_last)
    return out


@triton.jit
def dot_state(a, b, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr):
    """``a @ b`` in float32: ``a`` an input-dtype tile, ``b`` float32 (``NSPLIT`` bf16 pieces of ``b``).

    Callers add the result to the state themselves: a running state passed to ``tl.dot`` as the
    accumulator is truncated at every tensor-core k-step, a bias that adds up along the chunk chain.
    """
    if SPLIT_BF16:
        b1 = b.to(tl.bfloat16)
        r = b - b1.to(tl.float32)
        b2 = r.to(tl.bfloat16)
        # smallest pieces first
        if NSPLIT == 3:
            acc = tl.dot(a, (r - b2.to(tl.float32)).to(tl.bfloat16))
            acc = tl.dot(a, b2, acc)
        else:
            acc = tl.dot(a, b2)
        acc = tl.dot(a, b1, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b, input_precision=F32_DOT)
    return acc


@triton.jit
def dot_state_paired(a, b, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr):
    """:func:`dot_state` with both bf16 pieces side by side in one product, ``a @ [b1 | b2]`` (columns
    interleaved, ``[.., 2N]``), whose column pairs are then added in float32: one tensor-core product
    where :func:`dot_state` issues two. Three pieces (and non-bf16 inputs) go through :func:`dot_state`
    (Triton 3.6 faulted on an H200 with a third product added to the paired one)."""
    if SPLIT_BF16 and NSPLIT == 2:
        b1 = b.to(tl.bfloat16)
        b2 = (b - b1.to(tl.float32)).to(tl.bfloat16)
        pairs = tl.dot(a, tl.reshape(tl.join(b1, b2), [b.shape[0], 2 * b.shape[1]]))
        hi, lo = tl.split(tl.reshape(pairs, [pairs.shape[0], b.shape[1], 2]))
        acc = lo + hi
    else:
        acc = dot_state(a, b, SPLIT_BF16, NSPLIT)
    return acc


@triton.jit
def stack_rows(top, bottom):
    """``[R, N]`` and ``[R, N]`` -> ``[2R, N]``: the rows of ``top``, then those of ``bottom``."""
    both = tl.permute(tl.join(top, bottom), (2, 0, 1))
    return tl.reshape(both, [2 * top.shape[0], top.shape[1]])


@triton.jit
def dot_state_left(a, b, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr):
    """``a @ b`` in float32: ``a`` float32 (split into ``NSPLIT`` bf16 pieces), ``b`` an input-dtype tile."""
    if SPLIT_BF16:
        a1 = a.to(tl.bfloat16)
        r = a - a1.to(tl.float32)
        a2 = r.to(tl.bfloat16)
        if NSPLIT == 3:
            acc = tl.dot((r - a2.to(tl.float32)).to(tl.bfloat16), b)
            acc = tl.dot(a2, b, acc)
        else:
            acc = tl.dot(a2, b)
        acc = tl.dot(a1, b, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), input_precision=F32_DOT)
    return acc


@triton.jit
def dot_inputs(a, b, SPLIT_BF16: tl.constexpr):
    """``a @ b`` of two input-dtype tiles in float32 (bf16 products are exact on tensor cores)."""
    if SPLIT_BF16:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    return out
