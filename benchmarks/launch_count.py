"""What kdacp's op and layer launch beside FLA's own, counted on the CPU: Triton kernels, PyTorch operations, and
reads of a tensor's values back to the host (each a device sync on a GPU). The layers: kdacp's ``KimiDeltaAttention``
alone and under ``ContextParallel("state")`` over one rank (the CP step of benchmarks/cuda_graph.py), FLA's with the
same weights (``flash-linear-attention`` installed), each a forward + backward to the input and every parameter.

FLA's and kdacp's Triton kernels run under Triton's interpreter with their bodies skipped (a launch is counted, not
run), FLA's autotuners keep their first configuration, and kdacp's ``fla`` backend is let run on the CPU. The
outputs are then meaningless; the host's control flow, which decides what is launched, is the one a GPU call takes
(it reads boundaries and shapes, not values). Each call runs twice and the second is counted, so that per-batch and
per-tensor caches are warm as in a training loop. kdacp's op is counted whole and cut into 8 pieces (``split=8``),
its pieces planned for the 132 SMs of an H100: a copy to the device or a host read in a counted call is one a
CUDA-graph capture of it would fail on. On the CPU the cut carries the states along its pieces piece by piece in
float64 (PyTorch operations) where a GPU launches the chain kernel once (with its per-batch table, made on the
first call). Needs fla-core importable (``pip install fla-core==0.6.0``).

    python benchmarks/launch_count.py [--tokens 384] [--heads 2] [--head-dim 64]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

READ_METHODS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__")


class Counts(TorchDispatchMode):
    """Within the block: PyTorch operations, Triton launches (by kernel name), host reads (by method) and kdacp's
    host-to-device copies (:func:`kdacp.host_copies.to_device`: per-batch tensors its memos make)."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.reads = collections.Counter(), collections.Counter(), collections.Counter()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def instrument(counts_of) -> None:
    """Route every Triton launch, autotuner and host read through ``counts_of()`` (the active :class:`Counts`)."""
    def launch(self, *args, **kwargs):  # counted, not run
        counts_of().launches[self.fn.__name__] += 1
    interpreter.InterpretedFunction.run = launch

    first_config = autotuner.Autotuner.run

    def run(self, *args, **kwargs):
        self.configs = self.configs[:1]  # no benchmarking on the interpreter
        return first_config(self, *args, **kwargs)
    autotuner.Autotuner.run = run

    import kdacp.host_copies as host_copies
    to_device = host_copies.to_device

    def copy(host, device):
        counts_of().copies += 1
        return to_device(host, device)
    for module in [m for name, m in sys.modules.items() if name.startswith("kdacp")]:
        if getattr(module, "to_device", None) is to_device:  # host_copies itself, and its importers so far
            module.to_device = copy

    for name in READ_METHODS:
        def read(self, *args, _method=getattr(torch.Tensor, name), _name=name, **kwargs):
            counts_of().reads[_name] += 1
            return _method(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64, help="64 or 128 (the summary kernels' K, for the cut)")
    args = parser.parse_args()

    import kdacp
    from fla.ops.kda import chunk_kda as fla_kda
    from kdacp.backends.registry import BackendSpec
    from kdacp.bench.inputs import random_inputs

    BackendSpec.runs_on = lambda self, device_type: True  # the fla backend on the CPU's interpreter
    _as_on_a_gpu()
    active = [Counts()]
    instrument(lambda: active[0])
    T, H, D = args.tokens, args.heads, args.head_dim
    x = random_inputs(T, H, H, D, D, gate="kda", seed=1, device="cpu")
    batches = {"one sequence": None, "3 documents": torch.tensor([0, T // 4, T // 2 + 10, T])}
    print("| batch | mode | op | Triton launches | PyTorch operations | host reads | device copies |\n"
          "|---|---|---|---|---|---|---|")
    for batch, cu in batches.items():
        options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
                       A_log=x["A_log"].float(), dt_bias=x["dt_bias"].float(), cu_seqlens=cu, output_final_state=True)
        for mode in ("forward", "forward + backward"):
            for name, op, extra in (("FLA", fla_kda, {}), ("kdacp", kdacp.chunk_kda, dict(backend="fla", split=None)),
                                    ("kdacp, split=8", kdacp.chunk_kda, dict(backend="fla", split=8))):
                for _ in range(2):  # the second call counted: caches warm
                    leaves = {n: x[n].detach().requires_grad_(mode != "forward")
                              for n in ("q", "k", "v", "g", "beta")}
                    active[0] = Counts()
                    with torch.set_grad_enabled(mode != "forward"), active[0]:
                        o, _ = op(**leaves, **options, **extra)
                        if mode != "forward":
                            o.backward(torch.ones_like(o))
                _row(batch, mode, name, active[0])
    _layers(args, batches, active)


def _as_on_a_gpu() -> None:
    """The cut's pieces and the summary kernels' sub-segments planned for the 132 SMs of an H100 (the CPU's stand-in
    count is 4)."""
    import kdacp.cp.split as split
    import kdacp.kernels.subsegments as subsegments
    subsegments.sm_count = split.sm_count = lambda device: 132


def _row(batch: str, mode: str, name: str, c: Counts) -> None:
    print(f"| {batch} | {mode} | {name} | {sum(c.launches.values())} | {sum(c.ops.values())} | "
          f"{sum(c.reads.values())} | {c.copies} |")


def _layers(args, batches: dict, active: list) -> None:
    """The layers' rows (module docstring), the second of two steps counted."""
    import torch.distributed as dist
    from kdacp.bench.layer import fla_layer_like, layer_step
    from kdacp.cp.context import ContextParallel
    from kdacp.layers import KimiDeltaAttention

    torch.manual_seed(0)
    hidden = args.heads * args.head_dim
    ours = KimiDeltaAttention(hidden, args.heads, head_k_dim=args.head_dim, head_v_dim=args.head_dim, backend="fla",
                              dtype=torch.bfloat16)
    fla = fla_layer_like(ours)
    own_group = not dist.is_initialized()
    if own_group:  # ContextParallel's group: this process alone
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    layers = {"kdacp layer": (ours, None), "kdacp layer, CP over one rank": (ours, ContextParallel("state")),
              **({} if fla is None else {"FLA layer": (fla, None)})}
    for batch, cu in batches.items():
        x = torch.randn(1, args.tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        for name, (layer, cp) in layers.items():
            if layer is ours:
                layer.cp = cp
            for _ in range(2):
                active[0] = Counts()
                with active[0]:
                    layer_step(layer, x, torch.ones_like(x), cu)
            _row(batch, "layer step", name, active[0])
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
