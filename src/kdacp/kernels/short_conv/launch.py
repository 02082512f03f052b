"""Launchers of the short convolution's kernels (:mod:`.jit_kernels`): shapes to grids, the tiles, the
partial sums reduced; no checks (:func:`kdacp.kernels.short_conv.fused_causal_conv1d` checks first)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from .jit_kernels import FAST_SIGMOID, SUM_BD, SUM_BR, UNROLL, bwd_kernel, fwd_kernel, sum_parts_kernel


@dataclass(frozen=True)
class ConvTiles:
    """Launch shape: each program walks ``rows`` rows of ``BD`` channels, ``groups`` groups of ``UNROLL`` rows
    per step (their loads issued together, 1 or 2); ``maxnreg`` caps the registers per thread (None: the
    compiler's choice); ``ahead`` (the backward, one group per step): each step issues the next step's
    loads before computing its own, in registers; ``stages`` (the backward): Triton's software pipelining of
    the row loop (``tl.range(num_stages=stages)``: ``stages - 1`` steps' loads in flight through shared
    memory; 1: none)."""

    rows: int
    BD: int
    num_warps: int
    maxnreg: int | None = None
    groups: int = 1
    ahead: bool = False
    stages: int = 1

    def __post_init__(self):
        if self.groups not in (1, 2):
            raise ValueError(f"groups must be 1 or 2, got {self.groups}")
        if self.ahead and self.groups != 1:
            raise ValueError(f"ahead loads the next step's one group: it needs groups=1, got groups={self.groups}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"stages must be 1 to 4, got {self.stages}")

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps} | ({} if self.maxnreg is None else {"maxnreg": self.maxnreg})


# The fastest of kdacp.bench.kernels.sweep_conv's tilings (least time summed over one sequence and 13 documents
# after a halo; T=16K, D=4096, bf16, W=4) on an H200; the backward's loop pipelined in 3 stages; 512 channels on
# 2 warps tie 1024 on 4 at D=4096 and win at D=6144 (benchmarks/RESULTS.md, "Short convolution").
FWD_TILES = ConvTiles(rows=32, BD=256, num_warps=2, groups=2)
BWD_TILES = ConvTiles(rows=256, BD=512, num_warps=2, stages=3)


class ShortConvGrads(NamedTuple):
    """Gradients of :func:`~kdacp.kernels.short_conv.fused_causal_conv1d`: ``dx`` like ``x``; ``dweight [D, W]``
    like ``weight``; ``dbias`` and ``dhalo`` like theirs, or None where there is none (or none was asked for)."""

    dx: torch.Tensor
    dweight: torch.Tensor
    dbias: torch.Tensor | None
    dhalo: torch.Tensor | None


def _varlen_args(cu_seqlens: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """``(cu_seqlens or a dummy pointer, N, binary-search steps over [0, N-1])``."""
    if cu_seqlens is None:
        return x, 1, 0
    n = cu_seqlens.numel() - 1
    return cu_seqlens, n, (n - 1).bit_length()


def short_conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None,
                   tiles: ConvTiles | None = None) -> torch.Tensor:
    """``y [B, T, D]`` in ``x``'s dtype (contiguous), for checked inputs (see
    :func:`~kdacp.kernels.short_conv.fused_causal_conv1d`); ``tiles`` default :data:`FWD_TILES`."""
    tiles = tiles or FWD_TILES
    if tiles.ahead or tiles.stages != 1:
        raise ValueError("tiles.ahead and tiles.stages are the backward's options; the forward's steps take "
                         "groups=2 instead")
    B, T, D = x.shape
    W = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    grid = (triton.cdiv(D, tiles.BD), triton.cdiv(T, tiles.rows), B)
    fwd_kernel[grid](x, h, weight, x if bias is None else bias, y, cu, T, D, n_seqs, steps, tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *y.stride(),
                      W=W, BD=tiles.BD, UNROLL_ROWS=UNROLL, SILU=activation == "silu", HAS_HALO=halo is not None,
                      HAS_BIAS=bias is not None, IS_VARLEN=cu_seqlens is not None, FAST=FAST_SIGMOID,
                      GROUPS=tiles.groups, **tiles.launch_options())
    return y


def short_conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, activation: str | None, dy: torch.Tensor, want_dhalo: bool = True,
                   tiles: ConvTiles | None = None) -> ShortConvGrads:
    """The gradients for ``dy [B, T, D]`` (any strides), recomputing the pre-activation from ``x``;
    ``want_dhalo=False`` skips ``dhalo``; ``tiles`` default :data:`BWD_TILES`."""
    B, T, D = x.shape
    tiles = tiles or BWD_TILES
    W = weight.shape[1]
    n_programs = triton.cdiv(T, tiles.rows)  # the first also owns the halo's rows
    dx = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    dhalo = torch.empty(B, W - 1, D, dtype=halo.dtype, device=x.device) if halo is not None else None
    # every program writes its slice of the partial sums: no zero fill needed
    has_bias = bias is not None
    parts = torch.empty(B, n_programs, W + has_bias, D, dtype=torch.float32, device=x.device)
    cu, n_seqs, steps = _varlen_args(cu_seqlens, x)
    h = x if halo is None else halo
    q = dx if dhalo is None else dhalo
    grid = (triton.cdiv(D, tiles.BD), n_programs, B)
    bwd_kernel[grid](x, h, weight, x if bias is None else bias, dy, dx, q, parts, cu, T, D, n_seqs, steps,
                      tiles.rows,
                      *x.stride(), *h.stride(), *weight.stride(), *dy.stride(), *dx.stride(), *q.stride(),
                      W=W, BD=tiles.BD, UNROLL_ROWS=UNROLL, SILU=activation == "silu",
                      HAS_HALO=halo is not None, HAS_BIAS=has_bias, IS_VARLEN=cu_seqlens is not None,
                      FAST=FAST_SIGMOID, GROUPS=tiles.groups, AHEAD=tiles.ahead, STAGES=tiles.stages,
                      **tiles.launch_options())
    dweight = torch.empty(D, W, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(D, dtype=bias.dtype, device=x.device) if has_bias else None
    sum_parts_kernel[(triton.cdiv(D, SUM_BD),)](parts, dweight, dweight if dbias is None else dbias,
                                                   B * n_programs, D, *dweight.stride(), W=W, HAS_BIAS=has_bias,
                                                   C_PAD=triton.next_power_of_2(W + has_bias), BR=SUM_BR,
                                                   BD=SUM_BD, num_warps=4)
    return ShortConvGrads(dx, dweight, dbias, dhalo if want_dhalo else None)
