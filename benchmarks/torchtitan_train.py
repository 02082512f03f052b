"""torchtitan's Qwen3.5 trained through torchtitan's own trainer with kdacp's spec (``kdacp.integrations.torchtitan``).

Each run writes what torchtitan's text pipeline reads into ``--workdir`` (a word-level ``tokenizer.json`` and a
local ``{"text": ...}`` dataset of documents of random lengths: nothing is downloaded) and runs
``torchrun -m torchtitan.train --module kdacp.integrations.torchtitan --config ...``.

Each rank runs ``torchtitan.train.main()`` (``--rank-entry``) after two changes: torchtitan 0.3.0 calls
``torch.distributed.set_timeout``, which torch 2.13 does not have under that name (:func:`bridge_torch`), and,
without a GPU, it picks the accelerator at import and falls back to ``"cuda"`` (``tools/utils.py``), so each
rank first makes torch report the CPU as the device (:func:`cpu_as_device`).

``cpu``: a few steps of the debug model with context parallelism over ``--nproc`` CPU ranks (gloo), ending with a
checkpoint; prints each step's loss and PASS.

``compare``: one GPU, torchtitan's own Qwen3.5 0.8B spec (``qwen35_titan_0_8b``) against kdacp's at CP degree 1
(``qwen35_kdacp_0_8b``), same data and seed, at each ``--seq-lens``; prints the median step time after the
warm-up steps, their ratio and the largest loss difference, and writes ``torchtitan_compare.json``.

Needs ``pip install -e '.[torchtitan]'``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

WORDS = 500  # the tokenizer's vocabulary, far below the model's: ids only need to be in range


def write_assets(workdir: Path, documents: int, seed: int) -> tuple[Path, Path]:
    """A word-level tokenizer (``w0 ... w499`` and BOS/EOS) and ``documents`` documents of 20-300 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    assets, data = workdir / "assets", workdir / "data"
    assets.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    vocab = {"<|bos|>": 0, "<|eos|>": 1, "<|unk|>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>",
                                                              "add_bos_token": True, "add_eos_token": True}))
    rng = random.Random(seed)
    with open(data / "train.json", "w") as f:
        for _ in range(documents):
            words = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(20, 300)))
            f.write(json.dumps({"text": words}) + "\n")
    return assets, data


def cpu_as_device() -> None:
    """Make torch report the CPU as the available device, with the device-module calls torchtitan's
    trainer makes (name, capacity, memory statistics) answered for the CPU; before torchtitan is imported."""
    import torch
    import torch._utils
    torch._utils._get_available_device_type = lambda: "cpu"
    capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    answers = {"get_device_name": lambda device=None: "cpu",
               "get_device_properties": lambda device=None: SimpleNamespace(total_memory=capacity),
               "memory_stats": lambda device=None: {}, "reset_peak_memory_stats": lambda device=None: None,
               "empty_cache": lambda: None}
    for name, answer in answers.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, answer)
    torch.cpu.current_device = lambda: 0  # torchtitan hands it to barrier(device_ids=[...]), which takes ints


def bridge_torch() -> None:
    """torchtitan 0.3.0 calls ``torch.distributed.set_timeout`` after the first step; torch 2.13 (and older)
    has it only as ``distributed_c10d._set_pg_timeout`` (same arguments)."""
    import torch.distributed as dist
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def rank_entry(args: list[str]) -> None:
    """One rank: torchtitan's trainer entry point, on CPU when there is no GPU (see the module docstring)."""
    import torch
    if not torch.cuda.is_available():
        cpu_as_device()
    bridge_torch()
    from torchtitan.train import main as torchtitan_main
    sys.argv = ["torchtitan.train", *args]
    torchtitan_main()


STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def train(workdir: Path, config: str, *, nproc: int, cp: int, steps: int, seq_len: int, cpu: bool,
          checkpoint: bool, log: Path) -> list[tuple[int, float, float]]:
    """One torchtitan run of ``config`` (a ``kdacp.integrations.torchtitan`` config) on ``nproc`` ranks with
    context parallelism ``cp``; returns ``(step, loss, tokens per second per device)`` of each step.
    Raises ``RuntimeError`` (with the log's tail) if the run fails."""
    assets, data = write_assets(workdir, documents=max(200, steps * seq_len // 100), seed=0)
    dump = workdir / "outputs" / f"{config}-{seq_len}"
    entry = [__file__, "--rank-entry"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *entry,
               "--module", "kdacp.integrations.torchtitan", "--config", config,
               "--parallelism.context_parallel_degree", str(cp),
               "--training.steps", str(steps), "--training.seq_len", str(seq_len),
               "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(data), "--dump_folder", str(dump)]
    if cpu:  # no CUDA graphs, and float32 (bf16 matrix products are slow on CPUs)
        command += ["--training.disable_cuda_graphs", "--training.mixed_precision_param", "float32"]
    if checkpoint:
        command += ["--checkpoint.enable", "--checkpoint.interval", str(steps)]
    print(" ".join(command), flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    text = ANSI.sub("", log.read_text())
    if rc:
        raise RuntimeError(f"{config} at {seq_len} tokens failed (rc {rc}); log {log}:\n" + text[-3000:])
    rows = {}
    for step, loss, tps in STEP_LINE.findall(text):
        rows[int(step)] = (int(step), float(loss), float(tps.replace(",", "")))  # every rank logs the same line
    if checkpoint and not any((dump / "checkpoint" / f"step-{steps}").glob("*")):
        raise RuntimeError(f"no checkpoint at {dump / 'checkpoint' / f'step-{steps}'}")
    return [rows[k] for k in sorted(rows)]


def cpu_run(args) -> int:
    rows = train(args.workdir, "qwen35_kdacp_debugmodel", nproc=args.nproc, cp=args.nproc, steps=args.steps,
                 seq_len=args.seq_len, cpu=True, checkpoint=True, log=args.workdir / "cpu_train.log")
    for step, loss, _ in rows:
        print(f"step {step}: loss {loss:.5f}")
    ok = len(rows) == args.steps and all(math.isfinite(loss) for _, loss, _ in rows)
    print(f"{'PASS' if ok else 'FAIL'}: {len(rows)} of {args.steps} steps on {args.nproc} CPU ranks (cp={args.nproc}), "
          f"checkpoint of step {args.steps} written under {args.workdir / 'outputs'}")
    return 0 if ok else 1


def gpu_compare(args) -> int:
    """torchtitan's own Qwen3.5 0.8B spec against kdacp's (CP degree 1) on one GPU, same data and seed."""
    results = {}
    for seq_len in args.seq_lens:
        for config in ("qwen35_titan_0_8b", "qwen35_kdacp_0_8b"):
            results[config, seq_len] = train(args.workdir, config, nproc=1, cp=1, steps=args.steps, seq_len=seq_len,
                                             cpu=False, checkpoint=False,
                                             log=args.workdir / f"{config}-{seq_len}.log")
    summary = []
    print("| tokens | torchtitan step (s) | kdacp step (s) | ratio | max loss difference | last losses (titan/kdacp) |")
    print("|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        titan, ours = results["qwen35_titan_0_8b", seq_len], results["qwen35_kdacp_0_8b", seq_len]
        skip = args.warmup  # the first steps compile and autotune
        step_time = [statistics.median(seq_len / tps for _, _, tps in rows[skip:]) for rows in (titan, ours)]
        diff = max(abs(a[1] - b[1]) for a, b in zip(titan, ours))
        print(f"| {seq_len} | {step_time[0]:.4f} | {step_time[1]:.4f} | {step_time[1] / step_time[0]:.3f}x | "
              f"{diff:.4f} | {titan[-1][1]:.4f} / {ours[-1][1]:.4f} |")
        summary.append({"seq_len": seq_len, "titan": titan, "kdacp": ours, "step_s": step_time})
    (args.workdir / "torchtitan_compare.json").write_text(json.dumps(summary, indent=1))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-entry"]:
        rank_entry(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    cpu = sub.add_parser("cpu", help="a few steps of the debug model with CP on CPU ranks, ending with a checkpoint")
    cpu.add_argument("--nproc", type=int, default=2, help="ranks, all on the cp axis")
    cpu.add_argument("--steps", type=int, default=2)
    cpu.add_argument("--seq-len", type=int, default=256)
    gpu = sub.add_parser("compare", help="one GPU: torchtitan's own 0.8B spec against kdacp's (CP 1)")
    gpu.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    gpu.add_argument("--steps", type=int, default=20)
    gpu.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    for p in (cpu, gpu):
        p.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)
    return cpu_run(args) if args.mode == "cpu" else gpu_compare(args)


if __name__ == "__main__":
    sys.exit(main())
