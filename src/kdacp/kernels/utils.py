"""Shared Triton helpers and launch planning for the summary kernels.

Precision. Every product that touches a float32 state keeps the state in float32: with bf16 inputs
the float32 operand is split into bf16 pieces (``b = b1 + b2 (+ b3)``), each tensor-core product
``a * b_i`` is exact and only the float32 accumulation rounds. Three pieces carry ~24 significant
bits (float32-faithful), two ~16 (``SummaryConfig.bf16_pieces``, default 2). With fp16/fp32 inputs
both operands go to float32 and ``tl.dot`` runs in 3xTF32. Products are formed from a zero
accumulator and added to the state outside the tensor cores (see :func:`dot_state`). The per-chunk
decays ``exp2(gc_last)`` use the hardware float32 ``exp2`` with two pieces and are evaluated in
float64 (correctly rounded) with three pieces or fp16/fp32 inputs (:func:`chunk_decay`): with two
pieces the float64 evaluation left the errors as they were (``G`` 9.97e-7 against 1.00e-6, ``M``
6.1e-6 against 5.8e-6) and cost ``G`` a fifth of its time, being on its serial chain.

Measured (one H200, bf16, T=16K, 32 heads, K=V=128, slowly decaying channels; relative error against
float64 on the same inputs): with the running state passed to ``tl.dot`` as its accumulator, ``M``
was off by 6e-5 whether 2 or 3 pieces; with products from zero, ``M`` 5.8e-6 (2 pieces) / 2.3e-6
(3), ``S_ext`` 2.7e-6 / 1.2e-7, ``G`` 1.0e-6 / 1.3e-7. FLA 0.6.0's CP kernels on the same inputs:
``S_ext`` 1.8e-3, ``M`` 2.2e-5, ``G`` 6.7e-4 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["SummaryConfig", "SummaryPlan", "plan_summary", "dot_state", "dot_state_left", "dot_inputs",
           "chunk_decay", "split_bf16", "load_last_gate", "locate_program", "initial_tile", "store_tile",
           "launch_fitting_stages", "F32_DOT", "INTERPRET"]

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
def locate_program(work, head_start, MOFF, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """This program's place in a ``(column tile, work item, head)`` grid.

    ``work`` rows are ``(batch row, first token, end token, needs transition)``; columns from ``MOFF``
    are transition columns. Returns ``(b, h, start, end, n_chunks, n_run, o_k, o_c)``: ``n_run`` is
    ``n_chunks``, or 0 for transition columns of a work item whose transition is never read.
    """
    i_c, i_w, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = work + 4 * i_w
    b, start, end, needs_t = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    n_chunks = tl.cdiv(end - start, BT)
    n_run = tl.where((i_c * BV >= MOFF) & (needs_t == 0), 0, n_chunks)
    h = (head_start + i_h).to(tl.int64)
    return b, h, start, end, n_chunks, n_run, tl.arange(0, K), i_c * BV + tl.arange(0, BV)


@triton.jit
def initial_tile(o_k, o_c, first_identity_col, VF: tl.constexpr):
    """A state tile's start, float32 ``[K, BV]`` (``[BV, K]`` with ``VF``): zero in columns before
    ``first_identity_col``, identity columns from there on."""
    if VF:
        st = tl.where((o_c - first_identity_col)[:, None] == o_k[None, :], 1.0, 0.0).to(tl.float32)
    else:
        st = tl.where(o_k[:, None] == (o_c - first_identity_col)[None, :], 1.0, 0.0).to(tl.float32)
    return st


@triton.jit
def store_tile(ws, HV, st, o_k, o_c, K: tl.constexpr, NCOL: tl.constexpr, VF: tl.constexpr):
    """Write this program's state tile into ``ws [NW, HV, K, NCOL]`` (work item and head from the grid)."""
    base = (tl.program_id(1) * HV + tl.program_id(2)).to(tl.int64) * K
    if VF:
        tl.store(ws + (base + o_k[None, :]) * NCOL + o_c[:, None], st)
    else:
        tl.store(ws + (base + o_k[:, None]) * NCOL + o_c[None, :], st)


@triton.jit
def load_last_gate(p_g, s_gt, start, end, chunk, o_k, valid, BT: tl.constexpr):
    """``gc`` at the last token of chunk ``chunk`` of the segment ``[start, end)`` (zeros where not ``valid``)."""
    last = tl.minimum(start + (chunk + 1) * BT, end) - 1
    return tl.load(p_g + last * s_gt + o_k, mask=(o_k >= 0) & valid, other=0.0)


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


@dataclass(frozen=True)
class SummaryConfig:
    """Tiling and precision of the summary kernels; ``None`` fields take each kernel's default.

    Args:
        block_v: state columns per program (16, 32 or 64).
        chunks_per_program: chunks one program walks serially; a longer sequence is cut into
            sub-segments summarised in parallel and folded afterwards (each but one then also walks
            the ``K`` transition columns). ``None``: pick from the grid and the GPU size.
        num_warps, num_stages: Triton launch options of the main kernel (fewer stages are used where
            the requested ones do not fit in shared memory).
        bf16_pieces: bf16 pieces of the float32 state operand with bf16 inputs: 3 (float32-faithful)
            or 2 (~16 bits per product, faster).
        v_first: hold the state tile transposed (``[BV, K]``), so that it is the left (register)
            operand of every product.
    """

    block_v: int | None = None
    chunks_per_program: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    bf16_pieces: int | None = None
    v_first: bool | None = None

    def __post_init__(self):
        allowed = {"block_v": (16, 32, 64), "num_warps": (1, 2, 4, 8, 16), "bf16_pieces": (2, 3),
                   "v_first": (False, True)}
        for name, values in allowed.items():
            value = getattr(self, name)
            if value is not None and (type(value) is not type(values[0]) or value not in values):
                raise ValueError(f"SummaryConfig.{name} must be one of {values} or None, got {value!r}")
        for name in ("chunks_per_program", "num_stages"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"SummaryConfig.{name} must be a positive int or None, got {value!r}")

    def resolved(self, default: "SummaryConfig") -> "SummaryConfig":
        """This config with its ``None`` fields taken from ``default``."""
        return replace(default, **{k: v for k, v in self.__dict__.items() if v is not None})


# (kernel, launch constants, input dtypes, requested stages) -> stages whose buffers fit
_STAGES_THAT_FIT: dict = {}


def launch_fitting_stages(kernel, grid, args, constants: dict, num_warps: int, num_stages: int) -> None:
    """``kernel[grid](*args, **constants)`` with ``num_stages`` pipeline stages, or the most below that
    whose buffers fit in shared memory (Triton's ``OutOfResources``; the choice is remembered)."""
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    key = (kernel, tuple(sorted(constants.items())), dtypes, num_warps, num_stages)
    stages = _STAGES_THAT_FIT.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, **constants, num_warps=num_warps, num_stages=stages)
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        return


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


def pick_chunks_per_program(bounds, programs_per_subsegment: int, chunk_size: int, device,
                            serial_programs: int | None = None) -> int:
    """Chunks per program: sequences are cut so that the grid holds about ``_WAVES`` programs per SM.

    ``serial_programs``: the grid without cutting (when cutting adds transition columns); if that
    already fills the GPU, nothing is cut.
    """
    sms = _sm_count(device)
    chunks = [-(-(e - s) // chunk_size) for _, s, e in bounds]
    longest = max(chunks)
    if serial_programs is not None and serial_programs * len(bounds) >= sms:
        return longest
    num_work = max(len(bounds), (_WAVES * sms) // programs_per_subsegment)
    L = max(_MIN_CHUNKS, -(-sum(chunks) // num_work))
    if L >= longest:
        return longest
    return -(-longest // -(-longest // L))  # equal sub-segments of the longest sequence


# Measured on one H200 (T=16K, 32 heads, K=V=128): two programs per SM beat four or more, and a
# sub-segment shorter than this costs more in transition columns and folding than it gains.
_MIN_CHUNKS = 8
_WAVES = 2


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
