"""Launching a Triton kernel with the most pipeline stages that fit in shared memory."""
from __future__ import annotations

import torch
import triton

# (kernel, launch constants, input dtypes, warps, requested stages) -> stages whose buffers fit;
# bounded by the kernels and configurations a process uses
_STAGES_THAT_FIT: dict = {}


def launch_fitting_stages(kernel, grid, args, constants: dict, num_warps: int, num_stages: int,
                          max_registers: int | None = None) -> None:
    """``kernel[grid](*args, **constants)`` with ``num_stages`` pipeline stages, or the most below that
    whose buffers fit in shared memory (Triton's ``OutOfResources``; the choice is remembered);
    ``max_registers``: Triton's ``maxnreg`` (``None``: the compiler's choice)."""
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    key = (kernel, tuple(sorted(constants.items())), dtypes, num_warps, num_stages, max_registers)
    stages = _STAGES_THAT_FIT.get(key, num_stages)
    options = {} if max_registers is None else {"maxnreg": max_registers}
    while True:
        try:
            kernel[grid](*args, **constants, num_warps=num_warps, num_stages=stages, **options)
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        return
