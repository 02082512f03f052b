"""CUDA-graph replay of kdacp's KDA layer against eager, where the host's time per step is what limits it.

Two captures, each of one fixed batch shape (the document boundaries are part of what is captured):

- ``step``: the layer's context-parallel training step, ``KimiDeltaAttention`` (Kimi Linear's gate:
  ``safe_gate``, ``lower_bound=-5``) under ``ContextParallel("state")`` over every rank of the launch, forward
  and backward (gradients of the input and of every parameter), ``--tokens`` tokens a rank, one sequence or
  packed log-normal documents. New inputs are copied into the captured input before each replay. Beside it,
  where ``flash-linear-attention`` is installed, FLA's ``KimiDeltaAttention`` with the same weights (no CP) run
  eagerly on the same inputs: the host time a layer of FLA's own takes for the same step, against which kdacp's
  share of the host's work is read.
- ``prefill``: chunked prefill's pieces through the layer, the hooks ``kdacp.integrations.transformers.prefill`` runs a layer on
  (:class:`kdacp.integrations.transformers.prefill.LayerPrefill`), over static buffers: each piece of ``--tokens`` tokens starts
  from the previous piece's recurrent state and convolution input and leaves its own there, so one captured
  piece, replayed piece after piece, runs a whole prompt. One rank only (a model's pieces under CP also
  gather the attention layers' keys, which grow from piece to piece).

Per capture: the host's milliseconds per step (from the call until it returns, the device's queue not
awaited), the wall milliseconds per step of ``--iters`` steps back to back, eager and replayed, and the
largest relative difference (2-norm) between the replay's outputs and eager's on the same inputs (0 where every
kernel is deterministic). The prefill replay is also compared with one eager pass
over the whole prompt (bf16 rounding differs with the piece boundaries).

    python benchmarks/cuda_graph.py [--tokens 2048[,4096,...]] [--iters 50]     # one GPU
    torchrun --nproc-per-node 2 benchmarks/cuda_graph.py --captures step           # NCCL, captured collectives
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from kdacp.bench.batches import cu_seqlens_of, document_lengths
from kdacp.bench.errors import rel_err
from kdacp.bench.layer import fla_layer_like
from kdacp.bench.timing import capture, host_and_wall_times
from kdacp.cp import new_cp_group
from kdacp.cp import ContextParallel
from kdacp.layers import KimiDeltaAttention
from kdacp.layers.delta_rule import mix_tokens
from kdacp.integrations.transformers.prefill import LayerPrefill
from kdacp.workers import free_port

CAPTURES = ("step", "prefill")
BATCHES = ("one_sequence", "lognormal")


def host_and_wall_ms(fn, iters: int, device: torch.device) -> tuple[float, float]:
    """:func:`~kdacp.bench.timing.host_and_wall_times` in milliseconds."""
    host, wall = host_and_wall_times(fn, iters, device)
    return host * 1e3, wall * 1e3


def largest_difference(got, want) -> float:
    """The largest relative difference (:func:`~kdacp.bench.errors.rel_err`) over paired tensors."""
    return max(rel_err(g, w) for g, w in zip(got, want))


def make_layer(args, device) -> KimiDeltaAttention:
    torch.manual_seed(0)  # the same weights on every rank
    return KimiDeltaAttention(args.hidden, args.heads, head_k_dim=args.head_dim, head_v_dim=args.head_dim,
                              backend="fla", device=device, dtype=torch.bfloat16)


def step_rows(args, tokens: int, group, device) -> list[dict]:
    """The ``step`` capture at ``tokens`` tokens a rank, per batch (module docstring), and FLA's layer eagerly."""
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    layer = make_layer(args, device)
    fla = fla_layer_like(layer)
    layer.cp = ContextParallel("state", group)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    rows = []
    for batch in args.batches:
        lengths = document_lengths(batch, tokens * P, seed=0)
        cu = torch.tensor(cu_seqlens_of(lengths), device=device) if len(lengths) > 1 else None
        x = torch.randn(1, tokens, args.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        dy = torch.randn_like(x)
        x.requires_grad_()

        def step(layer=layer):
            y = layer(x, cu_seqlens=cu)[0]
            return (y.detach(), *torch.autograd.grad(y, [x, *layer.parameters()], dy))

        graph, static = capture(step)
        new_x, new_dy = torch.randn_like(x), torch.randn_like(dy)
        with torch.no_grad():
            x.copy_(new_x), dy.copy_(new_dy)
        graph.replay()
        replayed = [t.clone() for t in static]
        eager = step()
        eager_host, eager_wall = host_and_wall_ms(step, args.iters, device)
        graph_host, graph_wall = host_and_wall_ms(graph.replay, args.iters, device)
        row = dict(capture="step", batch=batch, docs=len(lengths), P=P, tokens_per_rank=tokens,
                   eager_host_ms=eager_host, eager_wall_ms=eager_wall, graph_host_ms=graph_host,
                   graph_wall_ms=graph_wall, vs_eager=largest_difference(replayed, eager))
        del graph, static
        if args.compiled:
            compiled = torch.compile(layer, mode="reduce-overhead")
            compiled_step = lambda: step(compiled)  # noqa: E731
            for _ in range(3):  # compilation, then the CUDA graphs' recording
                compiled_step()
            got = [t.clone() for t in compiled_step()]  # a replay overwrites its outputs
            row["compiled_host_ms"], row["compiled_wall_ms"] = host_and_wall_ms(compiled_step, args.iters, device)
            row["compiled_vs_eager"] = largest_difference(got, eager)
        if fla is not None and P == 1:  # FLA's layer holds the whole sequence: one rank's figures only
            fla_step = lambda: step(fla)  # noqa: E731
            fla_step()  # FLA's autotuning and compilation, before the timing
            row["fla_host_ms"], row["fla_wall_ms"] = host_and_wall_ms(fla_step, args.iters, device)
        rows.append(row)
    return rows


class StaticPieceCache:
    """The cache view :class:`LayerPrefill` reads and writes (:class:`kdacp.integrations.transformers.prefill.PrefillCache`'s
    ``conv_state``, ``recurrent_state``, ``record_conv_input``, ``record_state``) over fixed buffers, for one
    rank holding a whole piece: ``conv [1, C, W]`` the last ``W`` convolution inputs, ``state [1, HV, K, V]``
    float32."""

    def __init__(self, group, channels: int, width: int, state_shape, device):
        self.group = group
        self.conv = torch.zeros(1, channels, width, device=device, dtype=torch.bfloat16)
        self.state = torch.zeros(1, *state_shape, device=device, dtype=torch.float32)

    def conv_state(self, layer_idx: int) -> torch.Tensor:
        return self.conv

    def recurrent_state(self, layer_idx: int) -> torch.Tensor:
        return self.state

    def record_conv_input(self, layer_idx: int, xs, halos, width: int) -> None:
        # the piece is longer than the convolution: its last width + 1 inputs are its own tokens
        self.conv.copy_(torch.cat([x[:, x.shape[1] - width - 1:] for x in xs], dim=-1).transpose(1, 2))

    def record_state(self, layer_idx: int, final_state: torch.Tensor) -> None:
        self.state.copy_(final_state)


def prefill_rows(args, tokens: int, group, device) -> list[dict]:
    """The ``prefill`` capture (module docstring): ``--pieces`` pieces of ``tokens`` tokens."""
    layer = make_layer(args, device)
    layer.cp = ContextParallel("state", group)
    C = 2 * args.heads * args.head_dim + layer.num_v_heads * args.head_dim
    cache = StaticPieceCache(group, C, args.conv_size, (layer.num_v_heads, args.head_dim, args.head_dim), device)
    hooks = LayerPrefill(layer.cp, cache, 0)
    gen = torch.Generator(device=device).manual_seed(2)
    prompt = torch.randn(1, tokens * args.pieces, args.hidden, device=device, dtype=torch.bfloat16,
                         generator=gen)
    piece = torch.empty(1, tokens, args.hidden, device=device, dtype=torch.bfloat16)

    @torch.no_grad()
    def one_piece():
        y, final_state = mix_tokens(layer, hooks, piece, cu_seqlens=None, backend="fla",
                                    initial_state=hooks.initial_state(None), output_final_state=True)
        hooks.record_state(final_state)
        return (y,)

    def run_prompt(run):
        cache.conv.zero_(), cache.state.zero_()
        ys = []
        for i in range(args.pieces):
            piece.copy_(prompt[:, i * tokens:(i + 1) * tokens])
            ys.append(run()[0].clone())
        return torch.cat(ys, dim=1), cache.state.clone()

    piece.copy_(prompt[:, :tokens])
    graph, static = capture(one_piece)
    replayed = run_prompt(lambda: (graph.replay(), static)[1])
    eager = run_prompt(one_piece)
    with torch.no_grad():
        whole = layer(prompt, output_final_state=True)
    eager_host, eager_wall = host_and_wall_ms(one_piece, args.iters, device)
    graph_host, graph_wall = host_and_wall_ms(graph.replay, args.iters, device)
    return [dict(capture="prefill", batch=f"{args.pieces} pieces", docs=1, P=1, tokens_per_rank=tokens,
                 eager_host_ms=eager_host, eager_wall_ms=eager_wall, graph_host_ms=graph_host,
                 graph_wall_ms=graph_wall, vs_eager=largest_difference(replayed, eager),
                 vs_one_pass=largest_difference(replayed, whole))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048", help="comma-separated: tokens a rank (step) or a piece (prefill)")
    parser.add_argument("--pieces", type=int, default=8, help="prefill: pieces of the prompt")
    parser.add_argument("--iters", type=int, default=50, help="steps timed back to back")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--conv-size", type=int, default=4)
    parser.add_argument("--captures", default=",".join(CAPTURES), help=f"comma-separated, from {CAPTURES}")
    parser.add_argument("--compiled", action="store_true",
                        help="step: also the layer under torch.compile(mode='reduce-overhead')")
    parser.add_argument("--batches", default=",".join(BATCHES), help=f"step: comma-separated, from {BATCHES}")
    args = parser.parse_args()
    args.captures, args.batches = args.captures.split(","), args.batches.split(",")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    for name, given, allowed in (("--captures", args.captures, CAPTURES), ("--batches", args.batches, BATCHES)):
        if not set(given) <= set(allowed):
            parser.error(f"{name} must be from {allowed}, got {given}")
    if min(args.tokens) <= args.conv_size or args.pieces < 1 or args.iters < 1:
        parser.error(f"--tokens must exceed --conv-size ({args.conv_size}), --pieces and --iters be >= 1")
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA GPU; none is visible")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    try:
        group = new_cp_group()
        P = dist.get_world_size(group)
        if "prefill" in args.captures and P > 1:
            parser.error("the prefill capture runs on one rank")
        rows = []
        for tokens in args.tokens:
            rows += step_rows(args, tokens, group, device) if "step" in args.captures else []
            rows += prefill_rows(args, tokens, group, device) if "prefill" in args.captures else []
        if dist.get_rank() == 0:
            print(f"{torch.cuda.get_device_name()}, KDA layer, hidden {args.hidden}, {args.heads} heads of "
                  f"{args.head_dim}, bf16, P = {P}")
            print("| capture | batch | tokens a rank | eager host ms | graph host ms | eager wall ms | graph wall ms "
                  "| replay vs eager | replay vs one pass | FLA layer host ms | FLA layer wall ms "
                  "| compiled host ms | compiled wall ms | compiled vs eager |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                one_pass = f"{r['vs_one_pass']:.1e}" if "vs_one_pass" in r else ""
                fla = (f"{r['fla_host_ms']:.3f} | {r['fla_wall_ms']:.3f}" if "fla_host_ms" in r else " | ")
                compiled = (f"{r['compiled_host_ms']:.3f} | {r['compiled_wall_ms']:.3f} | {r['compiled_vs_eager']:.1e}"
                            if "compiled_host_ms" in r else " | | ")
                print(f"| {r['capture']} | {r['batch']} ({r['docs']} docs) | {r['tokens_per_rank']} | "
                      f"{r['eager_host_ms']:.3f} | {r['graph_host_ms']:.3f} | {r['eager_wall_ms']:.3f} | "
                      f"{r['graph_wall_ms']:.3f} | {r['vs_eager']:.1e} | {one_pass} | {fla} | {compiled} |")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
