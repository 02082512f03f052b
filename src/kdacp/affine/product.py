"""The summaries' products on the GPU: ``A @ [X1 | X2] + [B1 | 0]`` batched, in float32, one launch.

Every hop of an exchange applies or composes summaries (``M S_in + S_ext``, ``M^T dS_out + G``,
``(M2 S1 + S2, M2 M1)``): ``[K, K]`` by ``[K, C]`` products per message row and head, on the serial
critical path. On an H200 at 32 heads of 128 one apply took 25.8 us of device time in float64 PyTorch
(casts, a batched DGEMM, an add, a cast back) and 8.2 us here (benchmarks/RESULTS.md). A composition
is one launch too: both of its products share ``A = M2``. Products run in 3xTF32 (as the summary
kernels' float32 products, :data:`kdacp.kernels.precision.F32_DOT`), each ``BK`` step formed from zero
and added in float32 outside the tensor cores, whatever PyTorch's TF32 settings.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(a, x, b, out, n, i_m, i_c, K, C, sa_n, sa_r, sa_c, sx_n, sx_r, sx_c, sb_n, sb_r, sb_c,
          HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One ``[BM, BN]`` tile of ``out[n] = a[n] @ x[n] (+ b[n])``, ``out [N, K, C]`` contiguous."""
    o_m = i_m * BM + tl.arange(0, BM)
    o_c = i_c * BN + tl.arange(0, BN)
    m_m, m_c = o_m < K, o_c < C
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        a_t = tl.load(a + n * sa_n + o_m[:, None] * sa_r + o_k[None, :] * sa_c, mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        x_t = tl.load(x + n * sx_n + o_k[:, None] * sx_r + o_c[None, :] * sx_c, mask=m_k[:, None] & m_c[None, :],
                      other=0.0)
        # from zero: a float32 sum passed to tl.dot as its accumulator is truncated by the tensor cores
        acc += tl.dot(a_t, x_t, input_precision="tf32x3")
    m_out = m_m[:, None] & m_c[None, :]
    if HAS_B:
        acc += tl.load(b + n * sb_n + o_m[:, None] * sb_r + o_c[None, :] * sb_c, mask=m_out, other=0.0)
    tl.store(out + (n * K + o_m[:, None]) * C + o_c[None, :], acc, mask=m_out)


@triton.jit
def _affine_product_kernel(a, x1, b1, out1, x2, out2, K, C1, C2, NT1,
                           sa_n, sa_r, sa_c, s1_n, s1_r, s1_c, sb_n, sb_r, sb_c, s2_n, s2_r, s2_c,
                           HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out1 = a @ x1 (+ b1)`` on column tiles ``< NT1``, ``out2 = a @ x2`` on the others."""
    n, i_c, i_m = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    if i_c < NT1:
        _tile(a, x1, b1, out1, n, i_m, i_c, K, C1, sa_n, sa_r, sa_c, s1_n, s1_r, s1_c, sb_n, sb_r, sb_c,
              HAS_B, BM, BN, BK)
    else:
        _tile(a, x2, x2, out2, n, i_m, i_c - NT1, K, C2, sa_n, sa_r, sa_c, s2_n, s2_r, s2_c, 0, 0, 0,
              False, BM, BN, BK)


def _batched(name: str, t: torch.Tensor, lead: tuple, K: int, C: int | None = None) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape[:-2]) != lead or t.shape[-2] != K or (C is not None and t.shape[-1] != C):
        want = ", ".join([*map(str, lead), str(K), "C" if C is None else str(C)])
        raise ValueError(f"{name} must have shape [{want}], got {tuple(t.shape)}")
    # merges leading dims without a copy wherever their strides allow (column slices of a gathered buffer do)
    return t.reshape(-1, *t.shape[-2:])


def affine_product(A: torch.Tensor, X1: torch.Tensor, B1: torch.Tensor | None = None,
                   X2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(A @ X1 + B1, A @ X2)`` over the leading dims, float32 in and out, in one launch.

    Args:
        A: ``[..., K, K]`` float32, any strides (a transposed view is fine).
        X1: ``[..., K, C1]`` float32, ``A``'s leading dims.
        B1: ``[..., K, C1]`` float32, or ``None`` (zero).
        X2: ``[..., K, C2]`` float32, or ``None`` (then the second result is ``None``).

    Returns:
        New contiguous float32 tensors ``[..., K, C1]`` and ``[..., K, C2]`` (or ``None``).
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A must be square in its last two dims [..., K, K], got {tuple(A.shape)}")
    lead, K = tuple(A.shape[:-2]), A.shape[-1]
    a = _batched("A", A, lead, K, K)
    x1 = _batched("X1", X1, lead, K)
    C1 = x1.shape[-1]
    b1 = None if B1 is None else _batched("B1", B1, lead, K, C1)
    x2 = None if X2 is None else _batched("X2", X2, lead, K)
    for name, t in (("X1", X1), ("B1", B1), ("X2", X2)):
        if t is not None and t.device != A.device:
            raise ValueError(f"{name} is on {t.device} but A is on {A.device}")
    C2 = 0 if x2 is None else x2.shape[-1]
    out1 = torch.empty(*lead, K, C1, dtype=torch.float32, device=A.device)
    out2 = None if x2 is None else torch.empty(*lead, K, C2, dtype=torch.float32, device=A.device)
    if a.shape[0] == 0 or K == 0 or C1 + C2 == 0:
        return out1.zero_() if B1 is None else out1.copy_(B1), None if out2 is None else out2.zero_()
    bm = bk = min(64, max(16, triton.next_power_of_2(K)))
    bn = min(64, max(16, triton.next_power_of_2(max(C1, C2))))
    nt1 = triton.cdiv(C1, bn)
    grid = (a.shape[0], nt1 + triton.cdiv(C2, bn), triton.cdiv(K, bm))
    _affine_product_kernel[grid](
        a, x1, a if b1 is None else b1, out1, a if x2 is None else x2, out1 if out2 is None else out2, K, C1, C2, nt1,
        *a.stride(), *x1.stride(), *(b1.stride() if b1 is not None else (0, 0, 0)),
        *(x2.stride() if x2 is not None else (0, 0, 0)), HAS_B=b1 is not None, BM=bm, BN=bn, BK=bk, num_warps=4)
    return out1, out2
