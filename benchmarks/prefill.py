"""Prefill of one long prompt: ``kdacp.integrations.transformers.prefill`` of the 346M Kimi Linear of
benchmarks/train_curve.py on P GPUs, against transformers' own forward with FLA's kernels on one GPU.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/prefill.py OUT_DIR \\
        [--world-size 1] [--seq-lens 131072 524288 1048576] [--repeats 2] [--no-plain] [--pieces-of TOKENS] [--profile]

Per prompt length, each rank: the time of ``prefill(model, shard_batch(prompt, pad_id=0))`` (without
gradients; the cache of the whole prompt on every rank, the last token's logits) and its peak memory
(``torch.cuda.max_memory_allocated``, the weights included), over ``--repeats`` runs (the first and the best
time). With ``--pieces-of N``, prompts longer than ``N`` tokens are also prefilled in pieces of ``N`` (chunked
prefill: each piece under CP, continuing the cache of the ones before; the run ``kdacp pieces``), which bounds the
activations by one piece's. Then, at ``--world-size 1``, transformers' own model with the same weights (``kdacp.integrations.transformers.own_forwards``:
its own code, FLA's kernels where FLA imports) as ``generate`` prefills: ``model(prompt, use_cache=True,
logits_to_keep=1)`` under ``torch.no_grad``; an out-of-memory error is caught and reported as ``OOM``. Where
both ran, the relative (2-norm) difference of their last-token logits and of every cache tensor (bf16).

Memory at P > 1, a model (printed, not measured): the weights, the per-token activations divided by P, and
what every rank holds whole: the cache (the MLA latents of every token, all-gathered) and, while one MLA
layer runs, its keys and values expanded to heads for every token up to the rank's last.

Writes ``prefill.json`` (one row per run and length) and prints a table. ``--device cpu`` runs the tiny
CPU model on gloo ranks at short lengths: a check of the script, not a result.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from train_curve import CPU_SIZE, GPU_SIZE, build_model

from kdacp import shard_batch
from kdacp.bench.trace import top_ops
from kdacp.cp import new_cp_group
from kdacp.cp import ContextParallel
from kdacp.integrations.transformers import load_kimi_linear, own_forwards, parallelize, prefill
from kdacp.integrations.transformers.prefill import cache_tensors
from kdacp.bench.errors import rel_err
from kdacp.bench.timing import Clock, sync
from kdacp.workers import WorkerRank, launch

GIB = 2.0 ** 30


def _measure(device: torch.device, fn):
    """``(result, seconds, peak GiB)`` of ``fn()`` (no peak on CPU), or ``(None, None, None)`` when it ran out
    of memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock(device)
    sync(device)
    start = clock.stamp()
    try:
        result = fn()
        seconds = clock.seconds(start, clock.stamp())
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # Triton's launches report it as a RuntimeError
        if not isinstance(e, torch.cuda.OutOfMemoryError) and "out of memory" not in str(e):
            raise
        return None, None, None
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return result, seconds, peak


def prefill_worker(worker: WorkerRank, args: dict) -> list[dict]:
    size = GPU_SIZE if worker.device.type == "cuda" else CPU_SIZE
    dtype = torch.bfloat16 if worker.device.type == "cuda" else torch.float32
    model = build_model(size, args["seed"], worker.device, dtype)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    cp = ContextParallel("state", new_cp_group(), strategy="p2p")
    parallelize(model, cp)
    gen = torch.Generator().manual_seed(args["seed"])
    rows = []

    def run_kdacp(prompt):
        return prefill(model, shard_batch(prompt, group=cp.group, pad_id=0), group=cp.group)

    def run_pieces(prompt):
        cache, out = None, None
        for start in range(0, prompt.shape[1], args["pieces_of"]):
            piece = prompt[:, start:start + args["pieces_of"]]
            out = prefill(model, shard_batch(piece, group=cp.group, pad_id=0), cache, group=cp.group)
            cache = out.cache
        return out

    def run_plain(prompt):
        with own_forwards(model), torch.no_grad():
            out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        return out.cache, out.logits[:, -1]

    plain = args["plain"] and worker.world_size == 1
    warm = torch.randint(3, size["vocab"], (1, args["warmup"]), generator=gen).to(worker.device)
    run_kdacp(warm)  # compiles (and, for shapes not shipped, autotunes) the kernels
    if plain:
        run_plain(warm)
    del warm
    if args["profile"] and worker.world_size == 1:  # one pass of each at the first length, before the timed ones
        prompt = torch.randint(3, size["vocab"], (1, args["seq_lens"][0]), generator=gen).to(worker.device)
        for run, fn in [("kdacp", run_kdacp)] + ([("transformers", run_plain)] if plain else []):
            worker.report(f"profile {run} T={prompt.shape[1]}: "
                          + top_ops(lambda p=prompt: fn(p), worker.device.type == "cuda"))
        del prompt
    for T in args["seq_lens"]:
        prompt = torch.randint(3, size["vocab"], (1, T), generator=gen).to(worker.device)
        results = {}
        first = len(rows)  # this prompt's rows start there
        runs = [("kdacp", run_kdacp)]
        if args["pieces_of"] and T > args["pieces_of"]:
            runs.append(("kdacp pieces", run_pieces))
        for run, fn in runs + ([("transformers", run_plain)] if plain else []):
            times, peak, out = [], None, None
            for _ in range(args["repeats"]):
                out = None  # the previous run's cache freed before the next
                out, seconds, peak_run = _measure(worker.device, lambda p=prompt: fn(p))
                if out is None:
                    break
                times.append(seconds)
                peak = peak_run if peak is None or peak_run is None else max(peak, peak_run)
            row = dict(run=run, ranks=worker.world_size, rank=worker.rank, tokens=T, params=params,
                       weights_gib=weights, status="ok" if out is not None else "OOM",
                       first_s=times[0] if times else None, best_s=min(times) if times else None, peak_gib=peak)
            if out is not None:
                cache, logits = out
                tensors = cache_tensors(cache)
                row["cache_gib"] = sum(t.numel() * t.element_size() for t in tensors.values()) / GIB
                results[run] = (tensors, logits)
            rows.append(row)
            worker.report(f"rank {worker.rank} {run} T={T}: {row['status']} {row['best_s']} s, "
                          f"peak {row['peak_gib']} GiB")
        # each kdacp run against transformers' (or, without it, the pieces against the one pass)
        against = "transformers" if "transformers" in results else "kdacp"
        for row in rows[first:]:
            if row["run"] == against or row["run"] not in results or against not in results:
                continue
            (mine, my_logits), (theirs, their_logits) = results[row["run"]], results[against]
            # float32: a 1M-token cache tensor in float64 would take gigabytes more
            diffs = {k: rel_err(mine[k], theirs[k], torch.float32) for k in theirs}
            worst = max(diffs, key=diffs.get)
            row.update(against=against, logits_rel_diff=rel_err(my_logits, their_logits, torch.float32),
                       worst_cache_tensor=worst, worst_cache_rel_diff=diffs[worst])
        del results, prompt
    return rows


def attention_kv_gib(size: dict, T: int) -> float:
    """One MLA layer's keys and values expanded to heads for ``T`` tokens, bf16."""
    K = size["head_dim"]
    return T * size["attention_heads"] * (K + K // 2 + K) * 2 / GIB


def memory_model(row: dict, size: dict, P: int) -> float:
    """Peak GiB per rank at ``P`` ranks from a one-GPU row (see the module docstring)."""
    whole = row["cache_gib"] + attention_kv_gib(size, row["tokens"])
    activations = row["peak_gib"] - row["weights_gib"] - whole
    return row["weights_gib"] + activations / P + whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 524288, 1048576])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=16384, help="tokens of the warm-up prefill")
    parser.add_argument("--no-plain", dest="plain", action="store_false",
                        help="skip transformers' own forward (it runs at --world-size 1 only)")
    parser.add_argument("--pieces-of", type=int, default=0, metavar="TOKENS",
                        help="also prefill prompts longer than this in pieces of it (chunked prefill)")
    parser.add_argument("--profile", action="store_true",
                        help="first profile one pass of each run at the first length (at --world-size 1 only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    args = dict(seq_lens=a.seq_lens, repeats=a.repeats, warmup=a.warmup, plain=a.plain, seed=a.seed,
                pieces_of=a.pieces_of, profile=a.profile)
    per_rank = launch(prefill_worker, a.world_size, (args,), device=a.device, timeout_s=3600,
                      on_report=lambda rank, m: print(m, flush=True), prepare=load_kimi_linear)
    rows = [r for rank_rows in per_rank for r in rank_rows]
    with open(os.path.join(a.out, "prefill.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'run':>12} {'P':>2} {'rank':>4} {'tokens':>8} {'status':>6} {'first s':>8} {'best s':>8} "
          f"{'peak GiB':>8} {'cache GiB':>9} {'against':>12} {'logits d':>8} {'worst cache d':>22}")
    for r in rows:
        def fmt(key, spec):
            return format(r[key], spec) if r.get(key) is not None else "-"
        worst = f"{r['worst_cache_tensor']} {r['worst_cache_rel_diff']:.1e}" if "worst_cache_tensor" in r else "-"
        print(f"{r['run']:>12} {r['ranks']:>2} {r['rank']:>4} {r['tokens']:>8} {r['status']:>6} "
              f"{fmt('first_s', '8.3f'):>8} {fmt('best_s', '8.3f'):>8} {fmt('peak_gib', '8.2f'):>8} "
              f"{fmt('cache_gib', '9.3f'):>9} {r.get('against', '-'):>12} "
              f"{fmt('logits_rel_diff', '8.1e'):>8} {worst:>22}")
    size = GPU_SIZE if a.device == "cuda" else CPU_SIZE
    ones = [r for r in rows if r["run"] == "kdacp" and r["ranks"] == 1 and r["status"] == "ok"]  # one pass
    if ones and a.device == "cuda":
        print("peak GiB per rank at P ranks, a model from the one-GPU rows (weights + activations / P + the cache "
              "and one MLA layer's expanded keys/values, which every rank holds whole):")
        for r in ones:
            print(f"  {r['tokens']:>8} tokens: " + ", ".join(f"P={P} {memory_model(r, size, P):.1f}"
                                                            for P in (1, 2, 4, 8)))


if __name__ == "__main__":
    main()
