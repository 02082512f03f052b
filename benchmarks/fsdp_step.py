"""The cost of FSDP2 around ``kdacp.parallelize`` on one GPU: the 346M Kimi Linear of
``benchmarks/train_curve.py`` (bf16 weights, AdamW) at 16K tokens, one training step (the model's own
``.loss``, backward, optimizer step) under ``parallelize`` alone and under ``parallelize`` + ``fully_shard``
on every decoder layer and the root over the same one-rank mesh: FSDP2's default (the layers' parameters
freed after the forward and gathered again for the backward) and ``reshard_after_forward=False`` (kept
from the forward to the backward, what a layer that fits does best; on P GPUs it saves one all-gather per
layer and step).

    python benchmarks/fsdp_step.py [--tokens 16384] [--steps 10] [--warmup 3] [--optimizer fused] [--profile]
    python benchmarks/fsdp_step.py --device cpu      # a check of the script (tiny config, gloo), not a result

AdamW runs fused by default (one kernel for all parameters: torchtitan's default implementation; ``foreach``,
torch's default, launches one per operation and, on FSDP2's sharded parameters, dispatches each through DTensor).
All models are built from the same seed and timed in alternation (one step of each, round robin, after the
warm-up steps that compile and tune), each step ending in a device synchronisation. Prints the median step
time of each, their ratios and whether they are within 1.02x. Current figures: benchmarks/RESULTS.md,
"Model training step".
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from train_curve import CPU_SIZE, GPU_SIZE, build_model, make_batch

import kdacp
from kdacp.bench.timing import Clock, sync
from kdacp.bench.trace import top_ops
from kdacp.workers import free_port

TARGET = 1.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--optimizer", default="fused", choices=["fused", "foreach"], help="AdamW's implementation")
    parser.add_argument("--profile", action="store_true",
                        help="after the timing, profile one step of each: device time by kernel, top rows")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    size, dtype = (GPU_SIZE, torch.bfloat16) if cuda else (CPU_SIZE, torch.float32)
    tokens = args.tokens if cuda else min(args.tokens, 256)

    kdacp.models.load_kimi_linear()  # before the process group (README: the gloo abort at exit)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    device = torch.device("cuda" if cuda else "cpu")
    mesh = kdacp.init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
    from torch.distributed.fsdp import fully_shard

    runs = {}
    for name, reshard in (("parallelize", None), ("+fsdp2", True), ("+fsdp2 kept", False)):
        model = build_model(size, seed=0, device=device, dtype=dtype)
        kdacp.parallelize(model, mesh)
        if reshard is not None:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                      **{args.optimizer: True})
        runs[name] = (model, optimizer)
    params = sum(p.numel() for p in runs["parallelize"][0].parameters())

    clock = Clock(device)

    def step(name: str, i: int) -> float:
        model, optimizer = runs[name]
        ids, cu = make_batch(i, [tokens], size["vocab"], seed=0)
        batch = kdacp.shard_batch(ids.to(device), cu_seqlens=cu.to(device), group=mesh)
        sync(device)
        start = clock.stamp()
        model(**batch.model_kwargs()).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock.seconds(start, clock.stamp())

    times = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name in runs:
            t = step(name, i)
            if i >= args.warmup:
                times[name].append(t)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    if args.profile:
        for name in runs:
            print(f"profile {name}: " + top_ops(lambda: step(name, 0), cuda))
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{gpu}, Kimi Linear {params / 1e6:.1f}M parameters, {tokens} tokens, {dtype}, AdamW ({args.optimizer}), "
          f"median of {args.steps} steps after {args.warmup}:")
    for name, m in median.items():
        ratio = m / median["parallelize"]
        verdict = "" if name == "parallelize" else f"  {ratio:.3f}x: {'within' if ratio <= TARGET else 'NOT within'} {TARGET}x"
        print(f"  {name:14s} {m:.4f} s   (min {min(times[name]):.4f}, max {max(times[name]):.4f}){verdict}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
