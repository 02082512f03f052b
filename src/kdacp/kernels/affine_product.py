"""The exchange's products on the GPU: batched ``A @ X (+ B)`` in float32, one launch.

Every hop of an exchange applies or composes summaries (``M S_in + S_ext``, ``M^T dS_out + G``,
``(M2 M1, M2 S1 + S2)``): ``[K, K]`` by ``[K, C]`` products per message row and head, on the serial
critical path. Through float64 PyTorch one apply took 86 us and one composition 139 us on an H200
at 32 heads of 128 (casts, a batched DGEMM, an add, a cast back); here it is one kernel. The
products run in 3xTF32 (``F32_DOT``, as the summary kernels' float32 products), each ``BK`` step
formed from zero and added in float32 outside the tensor cores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .precision import F32_DOT

__all__ = ["affine_product"]


@triton.jit
def _affine_product_kernel(a, x, b, out, K, C, sa_n, sa_r, sa_c, sx_n, sx_r, sx_c, sb_n, sb_r, sb_c,
                           HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``out[n] = a[n] @ x[n] (+ b[n])``: one ``[BM, BN]`` tile per program; ``a [N, K, K]`` and
    ``x, b [N, K, C]`` at any strides, ``out [N, K, C]`` contiguous, all float32."""
    i_n, i_c, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_c = i_c * BN + tl.arange(0, BN)
    m_m, m_c = o_m < K, o_c < C
    n = i_n.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        a_t = tl.load(a + n * sa_n + o_m[:, None] * sa_r + o_k[None, :] * sa_c, mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        x_t = tl.load(x + n * sx_n + o_k[:, None] * sx_r + o_c[None, :] * sx_c, mask=m_k[:, None] & m_c[None, :],
                      other=0.0)
        # from zero: a float32 sum passed to tl.dot as its accumulator is truncated by the tensor cores
        acc += tl.dot(a_t, x_t, input_precision=F32_DOT)
    m_out = m_m[:, None] & m_c[None, :]
    if HAS_B:
        acc += tl.load(b + n * sb_n + o_m[:, None] * sb_r + o_c[None, :] * sb_c, mask=m_out, other=0.0)
    tl.store(out + (n * K + o_m[:, None]) * C + o_c[None, :], acc, mask=m_out)


def _as_batched(name: str, t: torch.Tensor, K: int, C: int | None) -> torch.Tensor:
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.dim() < 2 or t.shape[-2] != K or (C is not None and t.shape[-1] != C):
        raise ValueError(f"{name} must have shape [..., {K}, {'C' if C is None else C}], got {tuple(t.shape)}")
    # merges leading dims without a copy wherever their strides allow (column slices of a gathered buffer do)
    return t.reshape(-1, *t.shape[-2:])


def affine_product(A: torch.Tensor, X: torch.Tensor, B: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ X + B`` (``B`` optional) over the leading dims, float32 in and out.

    Args:
        A: ``[..., K, K]`` float32 (a transposed view is fine: strides are passed through).
        X: ``[..., K, C]`` float32, the same leading dims as ``A``.
        B: ``[..., K, C]`` float32 or ``None``.

    Returns:
        A new contiguous ``[..., K, C]`` float32 tensor.
    """
    if A.dim() < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"A must be square in its last two dims [..., K, K], got {tuple(A.shape)}")
    K = A.shape[-1]
    a = _as_batched("A", A, K, K)
    x = _as_batched("X", X, K, None)
    C = x.shape[-1]
    if X.shape[:-2] != A.shape[:-2]:
        raise ValueError(f"X must have A's leading dims {tuple(A.shape[:-2])}, got {tuple(X.shape)}")
    b = None
    if B is not None:
        if B.shape != X.shape:
            raise ValueError(f"B must have X's shape {tuple(X.shape)}, got {tuple(B.shape)}")
        b = _as_batched("B", B, K, C)
    for name, t in (("X", X), ("B", B)):
        if t is not None and t.device != A.device:
            raise ValueError(f"{name} is on {t.device} but A is on {A.device}")
    out = torch.empty(*X.shape, dtype=torch.float32, device=A.device)
    N = a.shape[0]
    if out.numel() == 0:
        return out
    bm = min(64, max(16, triton.next_power_of_2(K)))
    bn = min(64, max(16, triton.next_power_of_2(C)))
    bk = min(64, max(16, triton.next_power_of_2(K)))
    sb = b.stride() if b is not None else (0, 0, 0)
    grid = (N, triton.cdiv(C, bn), triton.cdiv(K, bm))
    _affine_product_kernel[grid](a, x, a if b is None else b, out, K, C, *a.stride(), *x.stride(), *sb,
                                 HAS_B=b is not None, BM=bm, BN=bn, BK=bk, num_warps=4)
    return out
