"""Experiment: dot_state_left with both bf16 pieces stacked along M (one tl.dot, one wait)."""
import triton
import triton.language as tl
import sys
from kdacp.kernels import precision
import kdacp.kernels.state_summary
state_summary = sys.modules["kdacp.kernels.state_summary"]


@triton.jit
def dot_state_left_stacked(a, b, SPLIT_BF16: tl.constexpr, NSPLIT: tl.constexpr):
    if SPLIT_BF16 and NSPLIT == 2:
        a1 = a.to(tl.bfloat16)
        a2 = (a - a1.to(tl.float32)).to(tl.bfloat16)
        both = tl.reshape(tl.permute(tl.join(a2, a1), (2, 0, 1)), [2 * a.shape[0], a.shape[1]])
        out = tl.dot(both, b)
        lo_hi = tl.permute(tl.reshape(out, [2, a.shape[0], b.shape[1]]), (1, 2, 0))
        lo, hi = tl.split(lo_hi)
        acc = hi + lo
    else:
        acc = precision.dot_state_left(a, b, SPLIT_BF16, NSPLIT)
    return acc


state_summary.dot_state_left = dot_state_left_stacked
