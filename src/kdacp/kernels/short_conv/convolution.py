"""Depthwise causal short convolution (then SiLU, or none), aware of packed sequences and of a left halo: the one
contract :func:`causal_conv1d` over two implementations, kdacp's Triton kernels on CUDA (``fused=True``,
:func:`~kdacp.kernels.short_conv.fused_causal_conv1d`: forward and backward each read ``x`` (and ``dy``) once) and
a plain PyTorch one, which is the CPU path and the reference the kernels are tested against.

Parameter layout matches FLA's ``ShortConvolution`` (an ``nn.Conv1d`` with ``groups=D``):
``weight [D, 1, W]``, optional ``bias [D]``; tap ``W-1`` multiplies the current token.

A rank of a context-parallel group may hold several ranges of the global stream (a token layout); each range
then starts a local sequence and continues the ``W-1`` tokens before it (its halo, from whichever rank holds
them). :func:`causal_conv1d` takes one halo per range: the halos are put in line before their ranges and the
boundaries moved with them, so the one-halo contract (and kernel) serves every range.
"""
from __future__ import annotations

import bisect
from functools import lru_cache

import torch
import torch.nn.functional as F

from ...caches import HALO_BOUNDARIES
from ...host_copies import to_device
from ...sequences import sequence_positions
from . import autograd as kernels

__all__ = ["causal_conv1d"]


def _eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, halo: torch.Tensor | None,
           cu_seqlens: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    B, T, D = x.shape
    W = weight.shape[-1]
    xe = torch.cat([x.new_zeros(B, W - 1, D) if halo is None else halo, x], dim=1)
    positions = None
    if cu_seqlens is not None:
        positions = sequence_positions(cu_seqlens.to(x.device), 0, T)
        if halo is not None:  # the first sequence continues the halo's: its taps may reach back into it
            positions = torch.where(torch.arange(T, device=x.device) < cu_seqlens[1].item(), positions + W, positions)
    # Shift-and-add instead of F.conv1d: the per-tap mask is what keeps packed sequences apart
    # (torch.where, not a product, so that a NaN in one sequence stays there).
    y = x * weight[:, W - 1]
    for i in range(1, W):
        tap = xe[:, W - 1 - i:W - 1 - i + T]
        if positions is not None:
            tap = torch.where((positions >= i)[:, None], tap, 0)
        y = y + tap * weight[:, W - 1 - i]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation == "silu" else y


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  halo: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                  cu_seqlens_cpu: torch.Tensor | None = None, fused: bool = False,
                  activation: str | None = "silu", range_starts: tuple[int, ...] = (0,)) -> torch.Tensor:
    """``act(sum_i weight[:, W-1-i] * x[t-i] + bias)`` over each sequence, ``act`` SiLU or the identity.

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, W]``; ``bias``: ``[D]`` or None.
        halo: ``[B, W-1, D]``, the ``W-1`` tokens before ``x[:, 0]`` of the sequence that continues into
            ``x[:, 0]`` (e.g. from the previous rank); or ``[B, R, W-1, D]``, one per range of ``x`` (the
            ``R`` ranges start at ``range_starts``): halo ``k`` feeds the first ``W-1`` outputs of range ``k``.
            Tokens of another sequence must be zero in it. None: ``x`` starts its sequences.
        cu_seqlens: ``[N+1]`` int64 boundaries of packed sequences inside ``x`` (``B == 1``, except with ranges:
            then the boundaries of every row); a tap reaching before a sequence's start reads zero, except that
            the first sequence of a range reads its halo. With ranges, every range start is a boundary.
        cu_seqlens_cpu: the same on the host, if at hand (spares the fused path a device sync; needed with
            ``R > 1`` ranges).
        fused: run kdacp's Triton kernels (:mod:`kdacp.kernels.short_conv`; CUDA, ``2 <= W <= 4``; other
            widths run the PyTorch code) instead of the PyTorch code.
        activation: ``"silu"`` or None.
        range_starts: the local token where each range starts, ascending from 0 (one per halo).

    Returns:
        ``[B, T, D]`` in ``x``'s dtype.

    Raises:
        ValueError: a halo of another rank count than ``range_starts``, or ranges without host boundaries
            holding every range start.
    """
    if halo is not None and halo.dim() == 4:
        if halo.shape[1] != len(range_starts) or range_starts[0] != 0:
            raise ValueError(f"halo [B, R, W-1, D] needs one range start per range, the first 0: got halo shape "
                             f"{tuple(halo.shape)} and range_starts={range_starts}")
        if halo.shape[1] == 1:
            halo = halo[:, 0]
        else:
            return _with_halos_in_line(x, weight, bias, halo, cu_seqlens_cpu, fused, activation, range_starts)
    if fused and kernels.MIN_WIDTH <= weight.shape[-1] <= kernels.MAX_WIDTH:
        return kernels.fused_causal_conv1d(x, weight, bias, halo=halo, cu_seqlens=cu_seqlens,
                                          cu_seqlens_cpu=cu_seqlens_cpu, activation=activation)
    return _eager(x, weight, bias, halo, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, activation)


@lru_cache(maxsize=HALO_BOUNDARIES)
def _boundaries_in_line(cu: tuple[int, ...], starts: tuple[int, ...], halo_len: int, rows: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Host and device ``[rows * n + 1]`` boundaries of ``rows`` rows laid end to end, each row's local
    boundaries ``cu`` moved for ``halo_len`` tokens in line before each range start: a range's start moves to
    its halo's first token (the halo joins the range's first sequence), later boundaries past the halo."""
    moved = [c + halo_len * (bisect.bisect_right(starts, c) - (c in starts)) for c in cu]
    T = moved[-1]
    host = torch.tensor([b * T + c for b in range(rows) for c in moved[:-1]] + [rows * T], dtype=torch.int64)
    return host, to_device(host, device)


def _with_halos_in_line(x, weight, bias, halo, cu_cpu, fused, activation, starts):
    """:func:`causal_conv1d` with ``R > 1`` ranges: ``[halo_0, range_0, halo_1, range_1, ...]`` of every row laid
    end to end as one packed row, convolved with the halos joining their ranges' first sequences; the outputs
    at the halos are dropped."""
    if cu_cpu is None:
        raise ValueError("causal_conv1d with several ranges needs cu_seqlens_cpu (host boundaries of x's local "
                         "sequences, a boundary at every range start)")
    cu = tuple(int(c) for c in cu_cpu.tolist())
    if not set(starts) <= set(cu):
        raise ValueError(f"every range start must be a boundary of cu_seqlens_cpu: range_starts={starts}, "
                         f"cu_seqlens_cpu={list(cu)}")
    B, T, D = x.shape
    n = halo.shape[2]
    ends = starts[1:] + (T,)
    pieces = [part for k, (s, e) in enumerate(zip(starts, ends)) for part in (halo[:, k], x[:, s:e])]
    line = torch.cat(pieces, dim=1)                                       # [B, T + R*(W-1), D]
    host, device = _boundaries_in_line(cu, starts, n, B, x.device)
    y = causal_conv1d(line.reshape(1, -1, D), weight, bias, cu_seqlens=device, cu_seqlens_cpu=host, fused=fused,
                      activation=activation).view(B, -1, D)
    return torch.cat([y[:, s + (k + 1) * n:e + (k + 1) * n] for k, (s, e) in enumerate(zip(starts, ends))], dim=1)
