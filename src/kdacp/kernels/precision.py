"""The summary kernels' precision policy (:class:`SummaryPrecision`) and the Triton products it selects.

Every product that meets a float32 state (or a float32 ``v_new``/``dv'``) keeps that operand in float32
to the policy's precision: with bf16 inputs it is split into bf16 pieces (``b = b1 + b2 (+ b3)``), each
tensor-core product ``a * b_i`` is exact and only the float32 accumulation rounds. Three pieces carry
~24 significant bits (float32-faithful), two ~16, one 8: the last is FLA's own state pass's precision
(it rounds the state to bf16 before each product, with float32 accumulation). With fp16 or float32
inputs both operands go to float32 and ``tl.dot`` runs in 3xTF32 whatever the policy. Products are
formed from a zero accumulator and added to the state outside the tensor cores (see :func:`dot_state`).
The per-chunk decays ``exp2(gc_last)`` use the hardware float32 ``exp2`` with one or two pieces and are
evaluated in float64 (correctly rounded) with three pieces or float32 products (:func:`chunk_decay`):
with two pieces the float64 evaluation left the errors as they were (``G`` 9.97e-7 against 1.00e-6,
``M`` 6.1e-6 against 5.8e-6) and cost ``G`` a fifth of its time, being on its serial chain.

Measured (one H200, bf16, T=16K, 32 heads, K=V=128, slowly decaying channels; relative error against
float64 on the same inputs): with the running state passed to ``tl.dot`` as its accumulator, ``M``
was off by 6e-5 whether 2 or 3 pieces; with products from zero, ``M`` 5.8e-6 (2 pieces) / 2.3e-6
(3), ``S_ext`` 2.7e-6 / 1.2e-7, ``G`` 1.0e-6 / 1.3e-7. FLA 0.6.0's CP kernels on the same inputs:
``S_ext`` 1.8e-3, ``M`` 2.2e-5, ``G`` 6.7e-4 (benchmarks/RESULTS.md).

Kernels take the policy as two constexprs, ``PIECES`` (bf16 pieces of the float32 operand in the
``S_ext``/``G`` columns; 0: float32 products) and ``M_PIECES`` (the same for transition columns), from
:meth:`SummaryPrecision.pieces`. Triton 3.6's interpreter multiplies bf16 tiles as raw uint16 and
truncates float32 -> bf16 casts: there every bf16 operand is a float32 tile holding the bf16 value
(rounded to nearest even by :func:`to_bf16`), and its float32 products are exact as on tensor cores.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..choices import SummaryPrecision


# The default for bf16 inputs: the cheapest policy whose end-to-end error (the context-parallel op's outputs,
# final states and gradients against float64, virtual P = 2 to 1024) stays within 1.05x of the one-GPU error.
# Every policy's errors were equal there (the bf16 outputs dominate); one_piece_forward makes the forward
# summary a third cheaper and keeps the gradient summary's two-piece walk, which one piece does not speed up
# (benchmarks/RESULTS.md, "Summary precision").
DEFAULT_LOW_PRECISION = SummaryPrecision.ONE_PIECE_FORWARD
_NAMES = tuple(p.value for p in SummaryPrecision)


def resolve_precision(precision, dtype: torch.dtype, name: str = "precision") -> SummaryPrecision:
    """The policy ``precision`` (a :class:`SummaryPrecision` or its name), or with ``None`` the default for
    inputs of ``dtype``: :data:`DEFAULT_LOW_PRECISION` for bf16, ``exact`` for fp16 and float32 (which run
    float32 products under every policy: :meth:`SummaryPrecision.pieces`).

    Raises:
        ValueError: an unknown policy, naming the argument ``name``.
    """
    if precision is None:
        return DEFAULT_LOW_PRECISION if dtype == torch.bfloat16 else SummaryPrecision.EXACT
    if precision not in _NAMES:  # a SummaryPrecision is equal to its name
        raise ValueError(f"{name} must be one of {_NAMES} or None, got {precision!r}")
    return SummaryPrecision(precision)


# tl.dot precision for float32 x float32 products (the interpreter ignores it and uses numpy float32).
F32_DOT: tl.constexpr = tl.constexpr("tf32x3")
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def to_bf16(x):
    """float32 -> the bf16 operand of a tensor-core product, rounded to nearest even (the interpreter:
    a float32 tile holding that bf16 value, rounded on the bits)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = x.to(tl.bfloat16)
    return out


@triton.jit
def _dot_bf16(a, b):
    """``a @ b`` of bf16 operands (input tiles or :func:`to_bf16` pieces), exact products, float32 sums."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _dot_bf16_acc(a, b, acc):
    """``acc + a @ b`` as :func:`_dot_bf16`, the sum on the tensor cores."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def chunk_decay(g_last, PIECES: tl.constexpr):
    """``exp2(g_last)`` in float32, as precise as the products it scales: correctly rounded (float64
    evaluation) with three bf16 pieces or float32 products, else the hardware float32 ``exp2``
    (within 2 ulp, and 8x cheaper than float64 on an H200)."""
    if INTERPRET:  # libdevice does not run in the interpreter
        out = tl.exp2(g_last.to(tl.float64)).to(tl.float32)
    elif PIECES == 3 or PIECES == 0:
        out = libdevice.exp2(g_last.to(tl.float64)).to(tl.float32)
    else:
        out = tl.exp2(g_last)
    return out


@triton.jit
def _dot_piece(a, b, piece, SPLIT_A: tl.constexpr):
    """``piece @ b`` (``SPLIT_A``: ``piece`` is a piece of ``a``) or ``a @ piece``, as :func:`_dot_bf16`."""
    return _dot_bf16(piece, b) if SPLIT_A else _dot_bf16(a, piece)


@triton.jit
def _dot_piece_acc(a, b, piece, acc, SPLIT_A: tl.constexpr):
    """``acc +`` :func:`_dot_piece`, the sum on the tensor cores."""
    return _dot_bf16_acc(piece, b, acc) if SPLIT_A else _dot_bf16_acc(a, piece, acc)


@triton.jit
def _dot_split(a, b, PIECES: tl.constexpr, SPLIT_A: tl.constexpr):
    """``a @ b`` in float32, the float32 operand (``a`` with ``SPLIT_A``, else ``b``) split into ``PIECES``
    bf16 pieces (0: float32 products), the other an input-dtype tile; the smallest pieces' products first."""
    if PIECES == 0:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    else:
        x = a if SPLIT_A else b
        x1 = to_bf16(x)
        if PIECES == 1:
            acc = _dot_piece(a, b, x1, SPLIT_A)
        else:
            r = x - x1.to(tl.float32)
            x2 = to_bf16(r)
            if PIECES == 3:
                acc = _dot_piece(a, b, to_bf16(r - x2.to(tl.float32)), SPLIT_A)
                acc = _dot_piece_acc(a, b, x2, acc, SPLIT_A)
            else:
                acc = _dot_piece(a, b, x2, SPLIT_A)
            acc = _dot_piece_acc(a, b, x1, acc, SPLIT_A)
    return acc


@triton.jit
def dot_state(a, b, PIECES: tl.constexpr):
    """``a @ b`` in float32: ``a`` an input-dtype tile, ``b`` float32 (``PIECES`` bf16 pieces of ``b``;
    0: float32 products).

    Callers add the result to the state themselves: a running state passed to ``tl.dot`` as the
    accumulator is truncated at every tensor-core k-step, a bias that adds up along the chunk chain.
    """
    return _dot_split(a, b, PIECES, False)


@triton.jit
def dot_state_paired(a, b, PIECES: tl.constexpr):
    """:func:`dot_state` with both bf16 pieces side by side in one product, ``a @ [b1 | b2]`` (columns
    interleaved, ``[.., 2N]``), whose column pairs are then added in float32: one tensor-core product
    where :func:`dot_state` issues two. Other piece counts go through :func:`dot_state` (Triton 3.6
    faulted on an H200 with a third product added to the paired one)."""
    if PIECES == 2:
        b1 = to_bf16(b)
        b2 = to_bf16(b - b1.to(tl.float32))
        pairs = _dot_bf16(a, tl.reshape(tl.join(b1, b2), [b.shape[0], 2 * b.shape[1]]))
        hi, lo = tl.split(tl.reshape(pairs, [pairs.shape[0], b.shape[1], 2]))
        acc = lo + hi
    else:
        acc = dot_state(a, b, PIECES)
    return acc


@triton.jit
def stack_rows(top, bottom):
    """``[R, N]`` and ``[R, N]`` -> ``[2R, N]``: the rows of ``top``, then those of ``bottom``."""
    both = tl.permute(tl.join(top, bottom), (2, 0, 1))
    return tl.reshape(both, [2 * top.shape[0], top.shape[1]])


@triton.jit
def dot_state_left(a, b, PIECES: tl.constexpr):
    """``a @ b`` in float32: ``a`` float32 (split into ``PIECES`` bf16 pieces; 0: float32 products),
    ``b`` an input-dtype tile."""
    return _dot_split(a, b, PIECES, True)


@triton.jit
def dot_inputs(a, b, PIECES: tl.constexpr):
    """``a @ b`` of two input-dtype tiles in float32 (bf16 products are exact on tensor cores; 0
    ``PIECES``: float32 products)."""
    if PIECES == 0:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    else:
        out = _dot_bf16(a, b)
    return out
