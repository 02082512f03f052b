"""The summary kernels' sub-segments: how sequences are cut into pieces walked in parallel, as device work lists."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..caches import SUMMARY_PLANS
from ..host_copies import to_device

# Measured on one H200 (T=16K, 32 heads, K=V=128): two programs per SM beat four or more, and a
# sub-segment shorter than this costs more in transition columns and folding than it gains.
_MIN_CHUNKS = 8
_WAVES = 2


@dataclass(frozen=True)
class SummaryPlan:
    """Device tables of one launch.

    ``work [NW, 4]`` int64 rows ``(batch row, first token, end token, needs transition)`` of every
    sub-segment, in sequence order; ``seqs [N, 2]`` int64 rows ``(first work row, count)``; ``starts``:
    every sub-segment's first token, ``counts`` the sub-segments of each sequence, on the host.
    """

    work: torch.Tensor
    seqs: torch.Tensor
    num_work: int
    max_subsegments: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (4 off a GPU: the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_chunks_per_program(bounds, programs_per_subsegment: int, chunk_size: int, device,
                            serial_programs: int | None = None, sms: int | None = None) -> int:
    """Chunks per program: sequences are cut so that the grid holds about ``_WAVES`` programs per SM.

    ``serial_programs``: the grid without cutting (when cutting adds transition columns); if that
    already fills the GPU, nothing is cut. ``sms``: the SM count to fill (default: ``device``'s).
    """
    sms = sm_count(device) if sms is None else sms
    chunks = [-(-(e - s) // chunk_size) for _, s, e in bounds]
    longest = max(chunks)
    if serial_programs is not None and serial_programs * len(bounds) >= sms:
        return longest
    num_work = max(len(bounds), (_WAVES * sms) // programs_per_subsegment)
    L = max(_MIN_CHUNKS, -(-sum(chunks) // num_work))
    if L >= longest:
        return longest
    return -(-longest // -(-longest // L))  # equal sub-segments of the longest sequence


def plan_summary(bounds, chunk_size: int, chunks_per_program: int, reverse: bool, transition_everywhere: bool,
                 device) -> SummaryPlan:
    """Cut every sequence ``(b, bos, eos)`` into sub-segments of ``chunks_per_program`` chunks.

    The transition columns are needed by every sub-segment whose state is later pushed through
    another's transition: all but the first (forward) or all but the last (``reverse``), or all of
    them when ``transition_everywhere`` (the transition itself is an output).
    """
    return _plan_cached(tuple(bounds), chunk_size, chunks_per_program, reverse, transition_everywhere,
                        str(device))


@functools.lru_cache(maxsize=SUMMARY_PLANS)
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
    return SummaryPlan(work=to_device(torch.tensor(work, dtype=torch.int64), device),
                       seqs=to_device(torch.tensor(seqs, dtype=torch.int64), device),
                       num_work=len(work), max_subsegments=max_sub, starts=tuple(row[1] for row in work),
                       counts=tuple(c for _, c in seqs))
