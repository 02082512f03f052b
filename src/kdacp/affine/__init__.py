"""The affine maps of states, written once: the type, apply and compose.

One map ``x -> A x + b`` serves every place states are carried across tokens: a segment's summary
acts on a state as ``S_out = M S_in + S_ext`` (forward; backward the same form with ``M^T`` and ``G``:
``dS_in = M^T dS_out + G``), an exchange's message as ``x_out = A x_in + b`` (``A`` absent where the
value is known outright), and ``(M2, S2) o (M1, S1) = (M2 M1, M2 S1 + S2)``.

Precision rule (every caller: the reference, the kernels' users, the exchange strategies): float32
operands on a GPU, outside autograd, go through one Triton kernel in float32 (3xTF32 products, as the
summary kernels'; :mod:`.product`); anything else (a float64 operand, the CPU) is formed in float64 with
autocast off. The result has the inputs' promoted dtype, at least float32. No TF32 setting or
autocast can round a chain of them. Why not float64 on the GPU: these products sit on the exchange's
serial path, once per hop or scan round; on an H200 at 32 heads of 128 an apply takes 25.8 us of device
time in float64 PyTorch and 8.2 us in the kernel, against about 20 us of link latency, and float32
products left the virtual-ranks errors unchanged at P = 2..64 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..caches import CHAIN_TABLES
from ..host_copies import to_device

from .chain import chain_states as chain_kernel
from .product import affine_product

__all__ = ["AffineMap", "SummaryParts", "apply_state_summary", "apply_state_gradient_summary",
           "chain_states", "compose_state_summaries", "entry_states"]


class AffineMap(NamedTuple):
    """``x -> transition @ x + offset`` on states ``[..., K, V]``: ``offset [..., K, V]``, ``transition
    [..., K, K]``.

    ``transition`` ``None``: the constant map (its value is known outright, whatever comes in). A
    segment's summary is ``AffineMap(S_ext, M)`` (``S_out = M S_in + S_ext``), with ``None`` in a field
    that was not asked for. Products by the precision rule of this module.
    """

    offset: torch.Tensor | None
    transition: torch.Tensor | None = None

    @property
    def constant(self) -> bool:
        """The map ignores its input (no transition)."""
        return self.transition is None

    def apply(self, x: torch.Tensor | None) -> torch.Tensor:
        """``transition @ x + offset`` (``x [..., K, V]``; the offset itself for a constant map, whose ``x`` may
        be ``None``). Unchecked: an exchange applies a map per message it passes on, to maps and states kdacp
        formed itself; :func:`apply_state_summary` checks a caller's."""
        if self.transition is None:
            return self.offset
        return _products(self.transition, x, self.offset)[0]

    def compose(self, earlier: AffineMap) -> AffineMap:
        """``self o earlier``, the map of ``earlier`` then ``self``: ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)``
        (constant when either is: a constant ``self`` is returned as it is)."""
        if self.transition is None:
            return self
        if earlier.transition is None:
            return AffineMap(apply_state_summary(self.offset, self.transition, earlier.offset))
        return compose_state_summaries(earlier, self)


class SummaryParts(NamedTuple):
    """Sequences' summaries and those of consecutive pieces of each: ``summary`` (``S_ext [N, HV, K, V]``,
    ``M [N, HV, K, K]``); ``parts`` (``[n, HV, K, V]``, ``[n, HV, K, K]``), each piece's summary from its
    own first token, sequence by sequence; ``starts``: each piece's first token, relative to the first
    sequence's (host ints, increasing); ``counts``: pieces per sequence. A state pass over all pieces at
    once starts each from :func:`entry_states`."""

    summary: AffineMap
    parts: AffineMap
    starts: tuple[int, ...]
    counts: tuple[int, ...]


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


def _kernel_path(*xs: torch.Tensor | None) -> bool:
    """Float32 GPU operands outside autograd (the kernel has no backward) take the Triton kernel."""
    xs = [x for x in xs if x is not None]
    return (xs[0].is_cuda and all(x.dtype == torch.float32 for x in xs)
            and not (torch.is_grad_enabled() and any(x.requires_grad for x in xs)))


def _products(A: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None, x2: torch.Tensor | None = None):
    """``(A x + b, A x2)`` (``b``: ``None`` is zero; ``x2`` optional) by the precision rule."""
    if _kernel_path(A, x, b, x2):
        lead = torch.broadcast_shapes(*(t.shape[:-2] for t in (A, x, b, x2) if t is not None))
        return affine_product(*(None if t is None else t.expand(*lead, *t.shape[-2:]) for t in (A, x, b, x2)))
    with torch.autocast(device_type=A.device.type, enabled=False):
        A64 = A.double()
        out = A64 @ x.double()
        if b is not None:
            out = out + b.double()
        first = out.to(_out_dtype(*(t for t in (A, x, b) if t is not None)))
        return first, None if x2 is None else (A64 @ x2.double()).to(_out_dtype(A, x2))


def apply_state_summary(S_ext: torch.Tensor, M: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """``M S_in + S_ext``: ``M [..., K, K]``, ``S_in, S_ext [..., K, V]``."""
    _check_pair("M", M, "S_in", S_in, None)
    _check_pair("M", M, "S_ext", S_ext, S_in.shape[-1])
    return _products(M, S_in, S_ext)[0]


def apply_state_gradient_summary(G: torch.Tensor, M: torch.Tensor, dS_out: torch.Tensor) -> torch.Tensor:
    """``M^T dS_out + G``: ``M [..., K, K]``, ``dS_out, G [..., K, V]``."""
    _check_pair("M", M, "dS_out", dS_out, None)
    _check_pair("M", M, "G", G, dS_out.shape[-1])
    return _products(M.transpose(-1, -2), dS_out, G)[0]


def compose_state_summaries(first, second) -> AffineMap:
    """Summary of ``first`` followed by ``second`` (each ``(S_ext, M)``): ``(M2 S1 + S2, M2 M1)``."""
    (S1, M1), (S2, M2) = first, second
    _check_pair("second M", M2, "first M", M1, M2.shape[-1])
    _check_pair("second M", M2, "first S_ext", S1, None)
    _check_pair("second M", M2, "second S_ext", S2, S1.shape[-1])
    return AffineMap(*_products(M2, S1, S2, M1))


@functools.lru_cache(maxsize=CHAIN_TABLES)
def _chain_table(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[N, 2]`` int64 ``(first piece, count)`` rows on ``device``, kept per batch: made without a device sync,
    and the same memory on every call (what a captured CUDA graph reads)."""
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return to_device(torch.tensor(list(zip(firsts, counts)), dtype=torch.int64), device)


def chain_states(maps: AffineMap, counts: tuple[int, ...], initial: torch.Tensor | None,
                 reverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry states along chains of pieces: ``maps`` (``offset [n, HV, K, V]``, ``transition [n, HV, K, K]``)
    holds each piece's summary, sequence by sequence, ``counts`` the pieces of each of the ``N`` sequences
    (host ints), ``initial [N, HV, K, V]`` (or ``None``: zeros) what enters each sequence.

    Forward: piece ``j`` is entered by ``x_j`` and ``x_{j+1} = M_j x_j + S_ext_j``. ``reverse`` (the backward, with
    ``offset = G``): ``initial`` is each sequence's final-state gradient, entering its last piece, and
    ``x_j = M_{j+1}^T x_{j+1} + G_{j+1}``.

    Returns ``(entries [n, HV, K, V], out [N, HV, K, V])``: what enters each piece (``reverse``: the gradient of its
    final state) and what leaves each sequence (``reverse``: the gradient of its initial state). Products by the
    precision rule of this module: one Triton launch for float32 GPU operands outside autograd
    (:mod:`kdacp.affine.chain`), else piece by piece in float64."""
    offsets, transitions = maps
    if len(counts) == 0 or sum(counts) != offsets.shape[0]:
        raise ValueError(f"counts {counts} must add up to the {offsets.shape[0]} pieces of maps")
    if _kernel_path(offsets, transitions, initial):
        return chain_kernel(offsets, transitions, _chain_table(tuple(counts), offsets.device), initial, reverse)
    step = apply_state_gradient_summary if reverse else apply_state_summary
    entries = [None] * offsets.shape[0]
    outs, first = [], 0
    for row, count in enumerate(counts):
        x = offsets.new_zeros(offsets.shape[1:]) if initial is None else initial[row]
        order = range(first + count - 1, first - 1, -1) if reverse else range(first, first + count)
        for j in order:
            entries[j] = x
            x = step(offsets[j], transitions[j], x)
        outs.append(x)
        first += count
    dtype = _out_dtype(*(t for t in (offsets, transitions, initial) if t is not None))
    return torch.stack(entries).to(dtype), torch.stack(outs).to(dtype)


def entry_states(parts: SummaryParts, initial: torch.Tensor) -> torch.Tensor:
    """``[n, HV, K, V]``: the state entering each piece of ``parts`` when each sequence starts from its row
    of ``initial [N, HV, K, V]`` (:func:`chain_states` forward)."""
    return chain_states(parts.parts, parts.counts, initial)[0]
