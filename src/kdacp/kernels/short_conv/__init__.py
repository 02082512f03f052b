"""Depthwise causal short convolution (width 2..4) as Triton kernels, forward and backward.

    y[b, t, d] = act(bias[d] + sum_{j < W} weight[d, W-1-j] * x[b, t-j, d])        act: SiLU or identity

over each sequence: a tap reaching before its sequence's first token reads zero, except that the first
sequence's taps before token 0 read ``halo`` (the previous rank's last ``W-1`` tokens) when one is given.
Shapes are FLA's: ``x [B, T, D]`` (any strides), ``weight [D, W]``, ``bias [D]``, ``halo [B, W-1, D]``,
``cu_seqlens [N+1]`` with ``B == 1``. The contract every caller uses is :func:`causal_conv1d`
(:mod:`.convolution`: these kernels, or the plain-PyTorch path that is the CPU path and the reference they are
tested against; halos of several ranges put in line). Modules: :mod:`.jit_kernels` (Triton), :mod:`.launch` (grids
and tiles), :mod:`.autograd` (the checked, differentiable fused op :func:`fused_causal_conv1d`),
:mod:`.convolution`.

The bytes moved are the floor: the forward reads ``x`` and writes ``y``; the backward reads ``x`` and ``dy``
and writes ``dx``, recomputing the pre-activation in registers (nothing is saved but the inputs). Each program
walks a strip of rows of ``BD`` channels one row at a time (the loads of ``UNROLL`` rows issued together),
keeping the ``W-1`` previous rows of ``x`` (and, walking backward, the ``W-1`` next rows' gradient ``g`` at the
pre-activation) in registers, so every row is read once: no shifted reloads, no shuffles across threads.
``dweight`` and ``dbias`` are per-program float32 partial sums reduced once afterwards (no atomics: the
results are deterministic). Sequence boundaries are found in the kernel (one binary search of ``cu_seqlens``
per program, then scalar steps): no host sync, no index tensor. A group of four rows whose taps all lie in one
sequence and in the program's rows (all but a few per sequence start and program edge) runs without the
per-tap masks, and the sigmoid takes the hardware's approximate ``exp2`` and reciprocal: the backward was
bound by instruction issue (offline SASS for sm_90: about 50 -> 33 per element, 0.155 -> 0.141 ms). A step may
load two groups of four rows before computing them (``ConvTiles.groups``): the forward, bound by loads in
flight, gains (0.086 -> 0.078 ms). The backward instead issues the next step's loads before computing its own
(``ConvTiles.ahead``: kernel 129.7 -> 121.5 us), or Triton pipelines its loop (``ConvTiles.stages``, the loads
staged through shared memory: 111 us, shipped). Both passes reach about three quarters of the memory
bandwidth that torch's own copy and add reach (benchmarks/RESULTS.md, "Short convolution").
"""
from __future__ import annotations

from .autograd import ACTIVATIONS, DTYPES, MAX_WIDTH, MIN_WIDTH, fused_causal_conv1d
from .convolution import causal_conv1d
from .launch import BWD_TILES, FWD_TILES, ConvTiles, ShortConvGrads, short_conv_bwd, short_conv_fwd

__all__ = ["ACTIVATIONS", "BWD_TILES", "DTYPES", "FWD_TILES", "MAX_WIDTH", "MIN_WIDTH", "ConvTiles",
           "ShortConvGrads", "causal_conv1d", "fused_causal_conv1d", "short_conv_bwd", "short_conv_fwd"]
