"""One training step of the 346M Kimi Linear of ``benchmarks/train_curve.py`` under ``kdacp.parallelize`` on
one GPU (bf16 weights, AdamW, the model's own ``.loss``, backward, optimizer step), in variants:

- ``parallelize``: kdacp alone, eager;
- ``+fsdp2``: ``fully_shard`` on every decoder layer and the root over the same one-rank mesh, FSDP2's
  default (the layers' parameters freed after the forward and gathered again for the backward);
- ``+fsdp2 kept``: ``reshard_after_forward=False`` (kept from the forward to the backward, what a layer that
  fits does best; on P GPUs it saves one all-gather per layer and step);
- ``+compile``: ``torch.compile`` of the whole parallelised model (inductor; kdacp's token mixers and
  softmax attention run as opaque regions, :mod:`kdacp.compile`), its compilation in the warm-up steps;
- ``transformers``: transformers' own model, not parallelised (its own code, FLA's kernels where FLA imports),
  one sequence a step (it has no packed-document input), what a user trains without kdacp.

``--backend`` is kdacp's local backend in every parallelised variant (``auto``: FLA's kernels for Kimi Linear's
KDA layers; ``attn_gym``: attention-gym's KDA core).

    python benchmarks/model_step.py [--tokens 16384,65536] [--variants parallelize,+compile] [--steps 10]
    python benchmarks/model_step.py --variants transformers,parallelize --backend attn_gym
    python benchmarks/model_step.py --device cpu      # a check of the script (tiny config, gloo), not a result

AdamW runs fused by default (one kernel for all parameters: torchtitan's default implementation; ``foreach``,
torch's default, launches one per operation and, on FSDP2's sharded parameters, dispatches each through DTensor).
Every batch is new documents (log-normal lengths with ``--documents lognormal``), so a compiled model that
recompiled on new boundaries would show it: the count of dynamo's compiled frames after the warm-up is
printed. All models are built from the same seed and timed in alternation (one step of each, round robin,
after the warm-up steps), each step ending in a device synchronisation; the peak memory of one more step of
each follows. Prints, per token count, the median step time of each, its ratio to ``parallelize`` and its
peak GiB. Current figures: benchmarks/RESULTS.md, "Model training step".
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from train_curve import CPU_SIZE, GPU_SIZE, build_model, make_batch

import kdacp
from kdacp.bench.batches import document_lengths
from kdacp.bench.timing import Clock, peak_gb, sync
from kdacp.bench.trace import top_ops
from kdacp.workers import free_port

VARIANTS = ("parallelize", "+fsdp2", "+fsdp2 kept", "+compile", "transformers")
FSDP_TARGET = 1.02  # FSDP2's cost over parallelize alone that a user should not notice


def build_variant(name: str, size: dict, mesh, device: torch.device, dtype: torch.dtype, optimizer: str,
                  compile_backend: str, backend: str):
    """``(step model, AdamW)`` of variant ``name`` (:data:`VARIANTS`); ``backend``: kdacp's local backend."""
    from torch.distributed.fsdp import fully_shard
    model = build_model(size, seed=0, device=device, dtype=dtype)
    if name != "transformers":
        kdacp.parallelize(model, kdacp.ContextParallel.from_mesh(mesh, backend=backend))
    if name.startswith("+fsdp2"):
        reshard = name == "+fsdp2"
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **{optimizer: True})
    return (torch.compile(model, backend=compile_backend) if name == "+compile" else model), optim


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"variants must be from {VARIANTS}, got {unknown or text!r}")
    return names


def _counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise argparse.ArgumentTypeError(f"tokens must be comma-separated integers >= 2, got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=_counts, default=[16384], help="comma-separated tokens a step")
    parser.add_argument("--variants", type=_names, default=VARIANTS[:3], help=f"comma-separated, from {VARIANTS}")
    parser.add_argument("--documents", default="one_sequence", choices=["one_sequence", "lognormal"],
                        help="one document a step, or log-normal document lengths (new ones every step)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--optimizer", default="fused", choices=["fused", "foreach"], help="AdamW's implementation")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for +compile")
    parser.add_argument("--backend", default="auto", choices=kdacp.backends.BACKENDS,
                        help="kdacp's local backend in the parallelised variants")
    parser.add_argument("--profile", action="store_true",
                        help="after the timing, profile one step of each: device time by kernel, top rows")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if "transformers" in args.variants and args.documents != "one_sequence":
        parser.error("--variants transformers: transformers' own model takes one sequence a step, so --documents "
                     f"must be one_sequence, got {args.documents}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible (--device cpu checks the script)")
    size, dtype = (GPU_SIZE, torch.bfloat16) if cuda else (CPU_SIZE, torch.float32)
    token_counts = args.tokens if cuda else [min(t, 256) for t in args.tokens]

    kdacp.integrations.transformers.load_kimi_linear()  # before the process group (README: the gloo abort at exit)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    device = torch.device("cuda" if cuda else "cpu")
    mesh = kdacp.init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
    runs = {name: build_variant(name, size, mesh, device, dtype, args.optimizer, args.compile_backend, args.backend)
            for name in args.variants}
    params = sum(p.numel() for p in next(iter(runs.values()))[0].parameters())
    clock = Clock(device)
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{gpu}, Kimi Linear {params / 1e6:.1f}M parameters, {dtype}, AdamW ({args.optimizer}), {args.documents}, "
          f"kdacp backend {args.backend}, median of {args.steps} steps after {args.warmup}:")

    for tokens in token_counts:
        def step(name: str, i: int) -> float:
            model, optimizer = runs[name]
            ids, cu = make_batch(i, list(document_lengths(args.documents, tokens, seed=i)), size["vocab"], seed=0)
            ids = ids.to(device)
            if name == "transformers":
                kwargs = dict(input_ids=ids, labels=ids)
            else:
                kwargs = kdacp.shard_batch(ids, cu_seqlens=cu.to(device), group=mesh).model_kwargs()
            sync(device)
            start = clock.stamp()
            model(**kwargs).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return clock.seconds(start, clock.stamp())

        times = {name: [] for name in runs}
        frames_after_warmup = None
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                frames_after_warmup = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for name in runs:
                t = step(name, i)
                if i >= args.warmup:
                    times[name].append(t)
        recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_after_warmup
        peaks = {name: peak_gb(lambda name=name: step(name, 0), mesh.get_group(), device) for name in runs}
        median = {name: statistics.median(ts) for name, ts in times.items()}
        if args.profile:
            for name in runs:
                print(f"profile {name}, {tokens} tokens: " + top_ops(lambda name=name: step(name, 0), cuda))
        base = median.get("parallelize")
        print(f"{tokens} tokens" + (f" (graphs compiled after the warm-up: {recompiled})" if "+compile" in runs else ""))
        for name, m in median.items():
            ratio = "" if base is None or name == "parallelize" else f"  {m / base:.3f}x"
            if ratio and name.startswith("+fsdp2"):
                ratio += f": {'within' if m / base <= FSDP_TARGET else 'NOT within'} {FSDP_TARGET}x"
            print(f"  {name:14s} {m:.4f} s   (min {min(times[name]):.4f}, max {max(times[name]):.4f}), "
                  f"peak {peaks[name]:.2f} GiB{ratio}")
        if "transformers" in median and base is not None:
            print(f"  parallelize over transformers' own model: {base / median['transformers']:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
