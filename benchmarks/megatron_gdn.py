"""Megatron-Core 0.19.2's own ``GatedDeltaNet`` layer beside kdacp's ``KdacpGatedDeltaNet`` at cp = 1, one device.

Both layers come from one Megatron spec (:func:`kdacp.integrations.megatron.get_gated_delta_net_module_spec` with
Megatron's local provider: a column-parallel ``in_proj``, no Transformer Engine), kdacp's loading Megatron's
state dict, and take the same input ``[s, 1, hidden]`` and output gradient; packed batches
(:mod:`kdacp.bench.batches`) pass ``PackedSeqParams(qkv_format="thd")`` to both. Qwen3-Next's GDN shape: hidden
2048, 16 key heads and 32 value heads of 128, convolution 4, bf16.

Rows, one per batch, length and pass (contenders round-robin, :func:`kdacp.bench.timing.time_round_robin`: CUDA
events around calls back to back on a GPU, wall clock on the CPU; not queued behind a device sleep, since both
layers read a packed batch's boundaries to the host on every call, as they do in training):

- ``pass="forward"``: both forwards under ``torch.no_grad()``;
- ``pass="forward+backward"``: forward and the gradients of the input and every parameter.

Megatron's gate function is ``torch.compile``'d, as Megatron has it (compiled in the warm-up).

``ratio``: kdacp's time over Megatron's; ``out_rel_diff``: kdacp's output (and, for forward+backward, the input
gradient) against Megatron's, the larger ``||a - b|| / ||b||``; ``param_rel_diff``: the largest over the parameter
gradients (those of ``A_log`` and ``dt_bias`` are sums of many cancelling terms: float32 on the CPU leaves them
about 1e-4 apart where every other tensor agrees to 1e-6); ``peak_GB``: each layer's peak memory
over one call. Megatron's GDN calls FLA's ``chunk_gated_delta_rule``, whose backward FLA 0.6.0 refuses on Hopper
with Triton >= 3.4 and < 3.7.1 without tilelang (the H200 with Triton 3.6): the error is caught and its first
line goes in ``megatron_note``, Megatron's step time is NaN, and kdacp's step is timed alone (kdacp trains there
on FLA's KDA kernels with the gate broadcast over ``K``).

A through rank's cost at a CP degree is measured for the op by ``kdacp bench --suite overhead --family gdn``; the
layer adds to it only the convolution's halo of ``conv_size - 1`` rows.

On the CPU (a check of the script, not a measurement): float32, 2 key heads and 4 value heads of 16, hidden 64,
kdacp's ``torch`` backend, one round; Megatron's FLA calls run on plain-PyTorch stand-ins
(:func:`kdacp.integrations.megatron.fla_stand_ins`) and its backward runs.

    python benchmarks/megatron_gdn.py [--seq-lens 16384,65536] [--batches one_sequence,lognormal] [--out DIR]

Needs megatron-core 0.19.2 (``pip install --no-deps megatron-core==0.19.2``) and, on a GPU, fla-core 0.6.0.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

GPU_SHAPE = dict(hidden_size=2048, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_conv_kernel_dim=4)
CPU_SHAPE = dict(hidden_size=64, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_conv_kernel_dim=4)


def init_one_rank(device: torch.device) -> None:
    """A one-rank process group and Megatron's model-parallel state (cp = tp = 1) with its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from kdacp.workers import free_port
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=300))
    parallel_state.initialize_model_parallel()
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(0)


def build_layers(shape: dict, dtype: torch.dtype, device: torch.device, backend: str):
    """Megatron's ``GatedDeltaNet`` and kdacp's ``KdacpGatedDeltaNet`` of one spec, with Megatron's weights."""
    import torch.nn.functional as F
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import build_module

    from kdacp.integrations import megatron as km
    cfg = km.KdacpTransformerConfig(
        num_layers=1, num_attention_heads=shape["linear_num_key_heads"], use_cpu_initialization=device.type != "cuda",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1], normalization="RMSNorm",
        activation_func=F.silu, params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, **shape)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    layers = {}
    for name, cls in (("megatron", GatedDeltaNet), ("kdacp", km.KdacpGatedDeltaNet)):
        spec = km.get_gated_delta_net_module_spec(cfg, LocalSpecProvider(), kdacp_backend=backend)
        spec.module = cls
        if cls is GatedDeltaNet:
            spec.params = {}
        torch.manual_seed(0)
        layers[name] = build_module(spec, config=cfg, layer_number=1, pg_collection=pg).to(device)
    layers["kdacp"].load_state_dict(layers["megatron"].state_dict())
    return layers["megatron"], layers["kdacp"]


def packed_params(batch: str, total: int, device: torch.device):
    """``PackedSeqParams`` (THD) of ``batch``'s documents, or None for one sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from kdacp.bench.batches import cu_seqlens_of, document_lengths
    lengths = document_lengths(batch, total)
    if batch == "one_sequence":
        return None, 1
    cu = torch.tensor(cu_seqlens_of(lengths), dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths)), len(lengths)


def forward(layer, x, psp) -> torch.Tensor:
    with torch.no_grad():
        return layer(x, None, packed_seq_params=psp)[0]


def gradients(layer, x, dy, psp) -> tuple[torch.Tensor, list]:
    """The output and the gradients of ``sum(out * dy)`` for the input and every parameter."""
    out = layer(x, None, packed_seq_params=psp)[0]
    return out, torch.autograd.grad(out, [x, *layer.parameters()], dy)


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:160]


def measure(megatron, kdacp, batch: str, T: int, hidden: int, dtype, device, warmup: int, rounds: int,
            iters: int) -> list[dict]:
    from kdacp.bench.errors import rel_err
    from kdacp.bench.timing import peak_gb, time_round_robin
    g = torch.Generator(device="cpu").manual_seed(T)
    x = torch.randn(T, 1, hidden, generator=g).to(device, dtype).requires_grad_(True)
    dy = torch.randn(T, 1, hidden, generator=g).to(device, dtype)
    psp, docs = packed_params(batch, T, device)
    base = dict(batch=batch, docs=docs, tokens=T, dtype=str(dtype).removeprefix("torch."))
    rows = []
    start = time.perf_counter()

    def progress(what: str) -> None:  # first calls compile and autotune: a timed-out run's log says which held it
        print(f"{batch} {T}: {what} after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    out_m = forward(megatron, x, psp)
    progress("Megatron's first forward")
    out_k = forward(kdacp, x, psp)
    progress("kdacp's first forward")
    fns = {"megatron": lambda: forward(megatron, x, psp), "kdacp": lambda: forward(kdacp, x, psp)}
    ms = time_round_robin(fns, warmup, rounds, iters, None, device)
    rows.append(dict(base, **{"pass": "forward"}, megatron_ms=ms["megatron"], kdacp_ms=ms["kdacp"],
                     ratio=ms["kdacp"] / ms["megatron"], out_rel_diff=rel_err(out_k, out_m), param_rel_diff=None,
                     megatron_peak_GB=peak_gb(fns["megatron"], None, device),
                     kdacp_peak_GB=peak_gb(fns["kdacp"], None, device), megatron_note=""))
    del out_m, out_k

    note, diff, param_diff = "", float("nan"), float("nan")
    progress("the forwards timed")
    ours = gradients(kdacp, x, dy, psp)
    progress("kdacp's first backward")
    try:
        theirs = gradients(megatron, x, dy, psp)
        progress("Megatron's first backward")
    except Exception as error:  # noqa: BLE001 - FLA's refusal of its GDN backward, reported in the row
        note = f"backward failed: {first_line(error)}"
        print(f"Megatron's GDN backward ({batch}, {T} tokens) failed:\n{traceback.format_exc()}", file=sys.stderr)
    else:
        (out_k, (dx_k, *dp_k)), (out_m, (dx_m, *dp_m)) = ours, theirs
        diff = max(rel_err(out_k, out_m), rel_err(dx_k, dx_m))
        param_diff = max(rel_err(a, b) for a, b in zip(dp_k, dp_m))
        del theirs, out_k, dx_k, dp_k, out_m, dx_m, dp_m
    del ours
    fns = {"kdacp": lambda: gradients(kdacp, x, dy, psp)}
    if not note:
        fns["megatron"] = lambda: gradients(megatron, x, dy, psp)
    ms = time_round_robin(fns, warmup, rounds, iters, None, device)
    megatron_ms = ms.get("megatron", float("nan"))
    rows.append(dict(base, **{"pass": "forward+backward"}, megatron_ms=megatron_ms, kdacp_ms=ms["kdacp"],
                     ratio=ms["kdacp"] / megatron_ms, out_rel_diff=diff, param_rel_diff=param_diff,
                     megatron_peak_GB=peak_gb(fns["megatron"], None, device) if not note else float("nan"),
                     kdacp_peak_GB=peak_gb(fns["kdacp"], None, device), megatron_note=note))
    return rows


def main(argv=None) -> int:
    from kdacp.bench.batches import BATCHES
    from kdacp.bench.harness import markdown_table, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", default=None, help="comma-separated token counts (GPU: 16384,65536; CPU: 64)")
    parser.add_argument("--batches", default="one_sequence,lognormal", help=f"comma-separated, from {BATCHES}")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (GPU: 5, CPU: 1)")
    parser.add_argument("--out", default=None, help="folder for megatron_gdn.json and .md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    else:  # Megatron torch.compiles its gate function on first call (its default, kept on the GPU)
        from torch._dynamo import config as dynamo_config
        dynamo_config.disable = True
    seq_lens = [int(n) for n in (args.seq_lens or ("16384,65536" if cuda else "64")).split(",")]
    batches = args.batches.split(",")
    unknown = [b for b in batches if b not in BATCHES]
    if unknown:
        parser.error(f"--batches: {unknown[0]!r} is not one of {BATCHES}")
    shape, dtype = (GPU_SHAPE, torch.bfloat16) if cuda else (CPU_SHAPE, torch.float32)
    warmup, rounds, iters = (2, args.rounds or 5, 3) if cuda else (0, args.rounds or 1, 1)
    stand_ins = contextlib.ExitStack()

    init_one_rank(device)
    try:
        if not cuda:
            from kdacp.integrations import megatron as km
            stand_ins.enter_context(km.cpu_stand_ins())
            stand_ins.enter_context(km.fla_stand_ins())
        megatron, kdacp = build_layers(shape, dtype, device, "auto" if cuda else "torch")
        rows = []
        for T in seq_lens:
            for batch in batches:
                for row in measure(megatron, kdacp, batch, T, shape["hidden_size"], dtype, device, warmup, rounds,
                                   iters):
                    rows.append(row)
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        stand_ins.close()
        dist.destroy_process_group()
    print(markdown_table(rows))
    if args.out:
        for path in write_results("megatron_gdn", rows, args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
