"""Shared Triton helpers and launch planning for the summary kernels.

Precision: every product that touches a float32 state is accurate to float32 rounding.
With bf16 inputs the float32 operand is split into three bf16 pieces (``b = b1 + b2 + b3``
carries ~24 significant bits), so each of the three tensor-core products is exact and only
the float32 accumulation rounds. With fp16/fp32 inputs both operands go to float32 and
``tl.dot`` runs in 3xTF32 (about 2^-21 relative per product). Plain bf16 or TF32 products
of the state would drift along the chunk chain (DESIGN.md, precision).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SummaryConfig", "SummaryPlan", "plan_summary", "dot_state", "dot_inputs", "split_bf16", "F32_DOT"]

# tl.dot precision for float32 x float32 products (the interpreter ignores it and uses numpy float32).
F32_DOT: tl.constexpr = tl.constexpr("tf32x3")


def split_bf16(dtype: torch.dtype) -> bool:
    """Whether to run the bf16 three-piece products. Triton 3.6's interpreter multiplies bf16 tiles as
    raw uint16 and truncates float32 -> bf16 casts, so there every input goes through float32."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def dot_state(a, b, acc, SPLIT_BF16: tl.constexpr):
    """``acc + a @ b`` to float32 accuracy: ``a`` holds input values (bf16/fp16/fp32), ``b`` and
    ``acc`` are float32."""
    if SPLIT_BF16:
        # a is bf16, so a * b_i is exact for bf16 pieces b_i; add the small pieces first.
        b1 = b.to(tl.bfloat16)
        r = b - b1.to(tl.float32)
        b2 = r.to(tl.bfloat16)
        b3 = (r - b2.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a, b3, acc)
        acc = tl.dot(a, b2, acc)
        acc = tl.dot(a, b1, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b, acc, input_precision=F32_DOT)
    return acc


@triton.jit
def dot_inputs(a, b, SPLIT_BF16: tl.constexpr):
    """``a @ b`` of two input-dtype tiles in float32 (bf16 products are exact on tensor cores)."""
    if SPLIT_BF16:
        out = tl.dot(a, b)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=F32_DOT)
    return out


@dataclass(frozen=True)
class SummaryConfig:
    """Tiling of the summary kernels.

    Args:
        block_v: columns of the ``[K, V (+K)]`` state per program (16, 32 or 64).
        chunks_per_program: chunks one program walks serially; a sequence longer than that is cut
            into sub-segments summarised in parallel and folded afterwards (which costs the extra
            ``K`` transition columns per sub-segment). ``None``: pick from the GPU size.
        num_warps, num_stages: Triton launch options of the main kernel.
    """

    block_v: int = 64
    chunks_per_program: int | None = None
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class SummaryPlan:
    """Device tables of one launch.

    ``work [NW, 4]`` int64 rows ``(batch row, first token, end token, needs transition)`` of every
    sub-segment, in sequence order; ``seqs [N, 2]`` int64 rows ``(first work row, count)``.
    """

    work: torch.Tensor
    seqs: torch.Tensor
    num_work: int
    max_subsegments: int


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_chunks_per_program(bounds, programs_per_subsegment: int, chunk_size: int, device) -> int:
    """Chunks per program so that the grid fills the GPU about ``_WAVES`` times over, with the
    longest sequence cut into equal sub-segments."""
    target = _WAVES * _sm_count(device)
    chunks = [-(-(e - s) // chunk_size) for _, s, e in bounds]
    # programs ~= programs_per_subsegment * sum(chunks) / L
    L = max(_MIN_CHUNKS, -(-programs_per_subsegment * sum(chunks) // target))
    longest = max(chunks)
    if L >= longest:
        return longest
    return -(-longest // -(-longest // L))


# A sub-segment shorter than this costs more in transition columns and folding than it gains.
_MIN_CHUNKS = 8
_WAVES = 4


def plan_summary(bounds, chunk_size: int, chunks_per_program: int, reverse: bool, transition_everywhere: bool,
                 device) -> SummaryPlan:
    """Cut every sequence ``(b, bos, eos)`` into sub-segments of ``chunks_per_program`` chunks.

    The transition columns are needed by every sub-segment whose state is later pushed through
    another's transition: all but the first (forward) or all but the last (``reverse``), or all of
    them when ``transition_everywhere`` (the transition itself is an output).
    """
    return _plan_cached(tuple(bounds), chunk_size, chunks_per_program, reverse, transition_everywhere,
                        str(device))


@functools.lru_cache(maxsize=64)
def _plan_cached(bounds, chunk_size, chunks_per_program, reverse, transition_everywhere, device):
    span = chunk_size * chunks_per_program
    work, seqs = [], []
    for b, bos, eos in bounds:
        starts = list(range(bos, eos, span))
        seqs.append((len(work), len(starts)))
        for j, s in enumerate(starts):
            needs = transition_everywhere or (j < len(starts) - 1 if reverse else j > 0)
            work.append((b, s, min(s + span, eos), int(needs)))
    max_sub = max(c for _, c in seqs)
    return SummaryPlan(work=torch.tensor(work, dtype=torch.int64, device=device),
                       seqs=torch.tensor(seqs, dtype=torch.int64, device=device),
                       num_work=len(work), max_subsegments=max_sub)
