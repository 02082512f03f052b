"""The relative error every benchmark reports: ``||a - b|| / ||b||``, the 2-norm over all elements."""
from __future__ import annotations

import torch

__all__ = ["rel_err"]


def rel_err(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float64) -> float:
    """``||a - b|| / ||b||`` computed in ``dtype`` (float64 by default; float32 where a float64 copy of large
    tensors would not fit), ``b`` of zero norm counting as a norm of 1e-30."""
    a, b = a.to(dtype), b.to(dtype)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
