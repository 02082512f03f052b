"""Training curves: a Kimi Linear model of a few hundred million parameters under
``kdacp.parallelize`` on P GPUs against the same model on one GPU, from the same seed.

    python benchmarks/train_curve.py OUT_DIR [--world-sizes 1 2] [--steps 50] [--seq-lens 65536] [--plain]

Runs, one after another: ``kdacp_1_nudged`` (kdacp on one GPU from the initial weights moved by one bf16
ulp in a random two thirds of their entries: the spread that bf16 rounding alone gives a training curve,
the band to judge the others by), then kdacp at each world size (``kdacp.parallelize``, state mode, p2p;
the global batch cut by ``kdacp.shard_batch``, the global token-mean loss, gradients all-reduced), and
with ``--plain`` first transformers' unmodified model on one GPU (FLA's kernels, one document at a time;
it runs out of memory on an H200 at 64K tokens). Every run: bf16 weights, AdamW, gradients clipped at 1,
the same initial weights and the same batches (a fixed random bigram source, so the loss has something to
learn).

Writes ``train_curve.json`` (rows: run, ranks, step, loss, step_s), ``train_curve.png`` (the losses, and
their differences to kdacp on one GPU) and prints a table: parameters, median step time and tokens/s
after the first ``--skip`` steps, and the largest and mean absolute loss difference to kdacp on one GPU.
On CPU (``--device cpu``) it runs a tiny config with gloo ranks (a check of the script, not a result).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from kdacp import precompile
from kdacp.demo import demo_step
from kdacp.cp import new_cp_group
from kdacp.cp import ContextParallel
from kdacp.integrations.transformers import load_kimi_linear, parallelize
from kdacp.workers import WorkerRank, launch

# A few hundred million parameters: Kimi Linear's 3:1 KDA:MLA pattern over 12 layers; KDA with Kimi Linear's
# 32 heads of 128 (the shapes kdacp's shipped H200 kernel configurations were tuned at, so FLA does not
# autotune for minutes), MLA with 8 (P = 2, 4, 8 divide them; 64K-token softmax attention dominates otherwise).
GPU_SIZE = dict(hidden=1024, layers=12, heads=32, attention_heads=8, head_dim=128, vocab=32000, intermediate=2816)
CPU_SIZE = dict(hidden=64, layers=4, heads=4, attention_heads=2, head_dim=16, vocab=256, intermediate=128)
SUCCESSORS = 4  # each token's possible next tokens in the bigram source: the loss can fall to log(4)


def build_model(size: dict, seed: int, device, dtype: torch.dtype):
    """transformers' ``KimiLinearForCausalLM`` of ``size`` (layers: KDA, KDA, KDA, MLA, repeated; dense MLPs;
    ``heads`` KDA heads and ``attention_heads`` MLA heads, all of ``head_dim``)."""
    kl = load_kimi_linear()
    d, H, K, L = size["hidden"], size["heads"], size["head_dim"], size["layers"]
    HA = size["attention_heads"]
    types = [("full_attention" if i % 4 == 3 else "linear_attention") for i in range(L)]
    config = kl.KimiLinearConfig(
        vocab_size=size["vocab"], hidden_size=d, intermediate_size=size["intermediate"], num_hidden_layers=L,
        layer_types=types, mlp_layer_types=["dense"] * L, num_attention_heads=HA, num_key_value_heads=HA,
        kv_lora_rank=512 if d >= 512 else K, q_lora_rank=None, qk_nope_head_dim=K, qk_rope_head_dim=K // 2,
        v_head_dim=K, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return kl.KimiLinearForCausalLM(config).to(device=device, dtype=dtype)


def make_batch(step: int, seq_lens: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[1, T]`` from a fixed random bigram source (new documents per step) and ``cu_seqlens``."""
    successors = np.random.default_rng(seed).integers(0, vocab, size=(vocab, SUCCESSORS))
    rng = np.random.default_rng(seed * 100_003 + step)
    T = sum(seq_lens)
    choice = rng.integers(0, SUCCESSORS, size=T)
    ids = np.empty(T, dtype=np.int64)
    start = 0
    for n in seq_lens:
        ids[start] = rng.integers(0, vocab)
        for t in range(start + 1, start + n):
            ids[t] = successors[ids[t - 1], choice[t]]
        start += n
    cu = torch.tensor([0, *np.cumsum(seq_lens).tolist()])
    return torch.from_numpy(ids)[None], cu


def nudge_by_one_ulp(model, seed: int) -> None:
    """Move each bf16 weight to a neighbouring bf16 value (up, down or not at all, uniformly at random)."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            x = p.float()
            ulp = torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)  # bf16: 7 mantissa bits
            p.copy_(x + ulp * torch.randint(-1, 2, x.shape, generator=gen, device=x.device))


def _plain_step(model, ids, cu):
    cu = cu.tolist()
    total = sum(F.cross_entropy(model(input_ids=ids[:, s:e], use_cache=False).logits[0, :-1].float(),
                                ids[0, s + 1:e], reduction="sum") for s, e in zip(cu[:-1], cu[1:]))
    loss = total / (cu[-1] - len(cu) + 1)
    loss.backward()
    return loss.detach()


def train_worker(worker: WorkerRank, run: str, args: dict) -> list[dict]:
    size = GPU_SIZE if worker.device.type == "cuda" else CPU_SIZE
    dtype = torch.bfloat16 if worker.device.type == "cuda" else torch.float32
    model = build_model(size, args["seed"], worker.device, dtype)
    params = sum(p.numel() for p in model.parameters())
    if run.endswith("_nudged"):
        nudge_by_one_ulp(model, args["seed"] + 1)
    group = None
    if run != "plain":
        cp = ContextParallel("state", new_cp_group(), strategy="p2p")
        parallelize(model, cp)
        group = cp.group
    optimizer = torch.optim.AdamW(model.parameters(), lr=args["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    rows = []
    for step in range(args["steps"]):
        ids, cu = make_batch(step, args["seq_lens"], size["vocab"], args["seed"])
        ids, cu = ids.to(worker.device), cu.to(worker.device)
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if run == "plain":
            loss = _plain_step(model, ids, cu)
        else:
            if step == 0:
                precompile(lambda: demo_step(model, ids, cu, group), device=worker.device)
                model.zero_grad(set_to_none=True)
            loss = demo_step(model, ids, cu, group)[1]  # the logits dropped at once (64K x vocab)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.item()
        rows.append(dict(run=run, ranks=worker.world_size, step=step, loss=loss, step_s=time.perf_counter() - start,
                         params=params, tokens=sum(args["seq_lens"])))
        if worker.rank == 0:
            worker.report(f"{run} step {step}: loss {loss:.4f}, {rows[-1]['step_s']:.3f} s")
    return rows


def summarize(rows: list[dict], skip: int) -> list[dict]:
    """Per run: median step time and tokens/s after ``skip`` steps; loss differences to kdacp on one GPU."""
    runs = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    base = {r["step"]: r["loss"] for r in runs.get("kdacp_1", [])}
    out = []
    for name, rs in runs.items():
        t = statistics.median(r["step_s"] for r in rs[skip:]) if len(rs) > skip else float("nan")
        diffs = [abs(r["loss"] - base[r["step"]]) for r in rs if r["step"] in base]
        out.append(dict(run=name, ranks=rs[0]["ranks"], params=rs[0]["params"], first_step_s=rs[0]["step_s"],
                        step_s=t, tokens_per_s=rs[0]["tokens"] / t, final_loss=rs[-1]["loss"],
                        max_abs_diff=max(diffs) if diffs else float("nan"),
                        mean_abs_diff=sum(diffs) / len(diffs) if diffs else float("nan")))
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    runs = {}
    for r in rows:
        runs.setdefault(r["run"], []).append(r)
    base = {r["step"]: r["loss"] for r in runs.get("kdacp_1", [])}
    for name, rs in runs.items():
        top.plot([r["step"] for r in rs], [r["loss"] for r in rs], label=name)
        if base and name != "kdacp_1":
            bottom.plot([r["step"] for r in rs], [r["loss"] - base[r["step"]] for r in rs], label=f"{name} - kdacp_1")
    top.set_ylabel("loss (global token mean)")
    top.set_title(title)
    top.legend()
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss difference")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the step times")
    parser.add_argument("--plain", action="store_true", help="also run the unmodified model on one GPU")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = parser.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    args = dict(steps=a.steps, seq_lens=a.seq_lens, lr=a.lr, seed=a.seed)
    runs = ([("plain", 1)] if a.plain else []) + [("kdacp_1_nudged", 1)] + [(f"kdacp_{p}", p) for p in a.world_sizes]
    rows = []
    for name, p in runs:
        if a.device == "cuda" and p > torch.cuda.device_count():
            print(f"{name}: skipped, {p} GPUs asked for and {torch.cuda.device_count()} visible", flush=True)
            continue
        # transformers' model module loaded in each rank before its process group (kdacp.workers.launch)
        result = launch(train_worker, p, (name, args), device=a.device, timeout_s=3600,
                        on_report=lambda rank, m: print(m, flush=True), prepare=load_kimi_linear)
        rows += result[0]
        with open(os.path.join(a.out, "train_curve.json"), "w") as f:
            json.dump(rows, f, indent=1)
    summary = summarize(rows, a.skip)
    tokens = sum(a.seq_lens)
    plot(rows, os.path.join(a.out, "train_curve.png"),
         f"Kimi Linear {summary[0]['params'] / 1e6:.0f}M, {tokens} tokens/step in {len(a.seq_lens)} document(s)")
    print(f"{'run':>14} {'ranks':>5} {'params':>8} {'first s':>8} {'step s':>7} {'tokens/s':>9} {'final loss':>10} "
          f"{'max |d|':>8} {'mean |d|':>8}")
    for s in summary:
        print(f"{s['run']:>14} {s['ranks']:>5} {s['params'] / 1e6:>7.0f}M {s['first_step_s']:>8.2f} {s['step_s']:>7.3f} "
              f"{s['tokens_per_s']:>9.0f} {s['final_loss']:>10.4f} {s['max_abs_diff']:>8.4f} {s['mean_abs_diff']:>8.4f}")


if __name__ == "__main__":
    main()
