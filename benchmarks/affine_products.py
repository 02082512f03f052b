"""The exchange's products on one GPU: the old float64 rule against kdacp.affine's float32 kernel.

Per message row and head, apply is ``M x + S`` (``[K, K] @ [K, V]``), apply_T ``M^T x + G``, compose
``(M2 M1, M2 S1 + S2)``. Contenders, timed round-robin with CUDA events in one run:
``float64`` (casts, a batched DGEMM, an add, a cast back: kdacp.affine before 1c981a8),
``cublas_fp32`` (one ``torch.baddbmm`` in IEEE float32, TF32 off), ``kdacp`` (kdacp.affine now).
Errors are against float64 products of the same float32 operands.

    python benchmarks/affine_products.py [--rows 1 4] [--heads 32] [--head-dim 128]
"""
from __future__ import annotations

import argparse

import torch

from kdacp import affine
from kdacp.bench.timing import time_round_robin


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("affine_products.py: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    HV, K = args.heads, args.head_dim
    V = K
    print(f"{'op':8} {'n':>3} {'float64 us':>11} {'cublas_fp32 us':>15} {'kdacp us':>9} {'kdacp err':>10} {'fp32 err':>9}")
    for n in args.rows:
        g = torch.Generator(device="cuda").manual_seed(n)
        M1, M2 = (torch.randn(n, HV, K, K, device=dev, generator=g) / K ** 0.5 for _ in range(2))
        S1, S2, x = (torch.randn(n, HV, K, V, device=dev, generator=g) for _ in range(3))
        MT = M1.transpose(-1, -2)

        def f64(A, X, B=None):
            out = A.double() @ X.double()
            return (out if B is None else out + B.double()).float()

        def fp32(A, X, B=None):
            a, xx = A.reshape(-1, K, K), X.reshape(-1, K, X.shape[-1])
            out = torch.bmm(a, xx) if B is None else torch.baddbmm(B.reshape(-1, K, X.shape[-1]), a, xx)
            return out.view(*X.shape)

        cases = {
            "apply": (lambda f: f(M1, x, S1), lambda: affine.apply_state_summary(S1, M1, x), M1.double() @ x.double() + S1.double()),
            "apply_T": (lambda f: f(MT, x, S1), lambda: affine.apply_state_gradient_summary(S1, M1, x),
                        MT.double() @ x.double() + S1.double()),
            "compose": (lambda f: torch.cat([f(M2, S1, S2), f(M2, M1)], -1),
                        lambda: torch.cat(affine.compose_state_summaries((S1, M1), (S2, M2)), -1),
                        torch.cat([M2.double() @ S1.double() + S2.double(), M2.double() @ M1.double()], -1)),
        }
        for op, (generic, ours, expect) in cases.items():
            fns = {"float64": lambda: generic(f64), "cublas_fp32": lambda: generic(fp32), "kdacp": ours}
            ms = time_round_robin(fns, warmup=20, rounds=10, iters=50, group=None, device=dev)
            print(f"{op:8} {n:>3} {ms['float64'] * 1e3:>11.1f} {ms['cublas_fp32'] * 1e3:>15.1f} {ms['kdacp'] * 1e3:>9.1f} "
                  f"{_rel(ours(), expect):>10.2e} {_rel(generic(fp32), expect):>9.2e}")


if __name__ == "__main__":
    main()
