"""The op on one GPU: ``kdacp.chunk_kda`` forward and forward+backward, median ms (``triton.testing.do_bench``),
Kimi Linear's settings (32 heads of 128, gate and L2 norm in kernel, safe gate), bf16, ``fla`` backend, on one
sequence and on the 7-document batch scaled to ``T`` tokens. For before/after comparisons of the op's
one-device path: run it with ``PYTHONPATH`` pointing at each tree's ``src``.

    PYTHONPATH=src python benchmarks/op_one_gpu.py [T]        (default T = 16384)

Without CUDA it runs each case once on a small CPU problem (torch backend) and times nothing.
"""
import sys

import torch
import triton.testing

import kdacp

DOCS7 = (0, 7777, 10777, 22777, 23290, 24290, 25290, 32768)  # kdacp.bench.batches' docs7, 32K tokens


def main(T: int) -> None:
    cuda = torch.cuda.is_available()
    dev, H, K, dtype, backend = ("cuda", 32, 128, torch.bfloat16, "fla") if cuda else ("cpu", 2, 64, torch.float32,
                                                                                           "torch")
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                   backend=backend)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype).requires_grad_()

    x = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, K), g=rnd(1, T, H, K),
             beta=torch.rand(1, T, H, generator=gen, device=dev).to(dtype).requires_grad_(),
             A_log=torch.zeros(H, device=dev, requires_grad=True),
             dt_bias=torch.zeros(H * K, device=dev, requires_grad=True))
    do = torch.randn(1, T, H, K, generator=gen, device=dev).to(dtype)
    docs7 = [round(c * T / DOCS7[-1]) for c in DOCS7]
    for name, cu in (("one_sequence", None), ("docs7", docs7)):
        packed = {} if cu is None else dict(cu_seqlens=torch.tensor(cu, device=dev), cu_seqlens_cpu=torch.tensor(cu))

        def forward():
            return kdacp.chunk_kda(**x, **options, **packed)[0]

        def step():
            torch.autograd.grad(forward(), list(x.values()), do)
        if not cuda:
            step()
            print(f"chunk_kda {name} T={T}: ran once on the CPU (no CUDA), not timed")
            continue
        fwd, both = (triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") for fn in (forward, step))
        print(f"chunk_kda {name} T={T}: forward {fwd:.3f} ms, forward+backward {both:.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16384)
