"""The exchange's products on one GPU: the old float64 rule against kdacp.affine's float32 kernel.

Per message row and head, apply is ``M x + S`` (``[K, K] @ [K, V]``), apply_T ``M^T x + G``, compose
``(M2 M1, M2 S1 + S2)``. Contenders, timed round-robin with CUDA events in one run:
``float64`` (casts, a batched DGEMM, an add, a cast back: kdacp.affine before 1c981a8),
``float64_fused`` (the same in one ``torch.baddbmm``), ``cublas_fp32`` (one ``torch.baddbmm`` in IEEE float32, TF32 off), ``kdacp`` (kdacp.affine now).
Each is timed two ways, contenders in turn, median of 5 rounds: ``dev`` (device time per call, queued
behind a sleep kernel so the host runs ahead, as it does when a rank reaches the exchange with its
local kernels still running: :func:`kdacp.bench.timing.queued_device_time`) and ``host`` (the
Python call's own time while queued). Errors are against float64 products of the same operands.

    python benchmarks/affine_products.py [--rows 1 4] [--heads 32] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kdacp import affine
from kdacp.bench.timing import queued_device_time


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
    names = ("float64", "float64_fused", "cublas_fp32", "kdacp")
    print(f"{'op':8} {'n':>3} " + " ".join(f"{n + ' dev/host us':>24}" for n in names) + f" {'kdacp err':>10} {'fp32 err':>9}")
    for n in args.rows:
        g = torch.Generator(device="cuda").manual_seed(n)
        M1, M2 = (torch.randn(n, HV, K, K, device=dev, generator=g) / K ** 0.5 for _ in range(2))
        S1, S2, x = (torch.randn(n, HV, K, V, device=dev, generator=g) for _ in range(3))
        MT = M1.transpose(-1, -2)

        def f64(A, X, B=None):
            out = A.double() @ X.double()
            return (out if B is None else out + B.double()).float()

        def f64_fused(A, X, B=None):
            a, xx = A.double().reshape(-1, K, K), X.double().reshape(-1, K, X.shape[-1])
            out = torch.bmm(a, xx) if B is None else torch.baddbmm(B.double().reshape(-1, K, X.shape[-1]), a, xx)
            return out.view(*X.shape).float()

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
            fns = {"float64": lambda: generic(f64), "float64_fused": lambda: generic(f64_fused),
                   "cublas_fp32": lambda: generic(fp32), "kdacp": ours}
            runs = {name: [] for name in fns}
            for _ in range(5):
                for name, fn in fns.items():
                    runs[name].append(queued_device_time(fn, iters=40))
            cells = []
            for name in names:
                d, h = (statistics.median(r[i] for r in runs[name]) * 1e6 for i in (0, 1))
                cells.append(f"{d:>11.1f} / {h:>10.1f}")
            print(f"{op:8} {n:>3} " + " ".join(cells) + f" {_rel(ours(), expect):>10.2e} {_rel(generic(fp32), expect):>9.2e}")


if __name__ == "__main__":
    main()
