"""A few training steps of torchtitan's Qwen3.5 debug model with kdacp's context parallelism, on CPU,
through torchtitan's own trainer entry point (``torchtitan.train.main``) under ``torchrun``, ending with
a checkpoint.

Writes what torchtitan's text pipeline reads into ``--workdir`` (a word-level ``tokenizer.json`` and a
local ``{"text": ...}`` dataset of documents of random lengths, so nothing is downloaded), runs::

    torchrun --nproc-per-node 2 benchmarks/torchtitan_cpu_train.py --rank-entry \\
        --module kdacp.integrations.torchtitan --config qwen35_kdacp_debugmodel \\
        --parallelism.context_parallel_degree 2 ...

and checks that the checkpoint of the last step was written. ``--rank-entry`` calls
``torchtitan.train.main()`` with those arguments after one change: torchtitan 0.3.0 picks the
accelerator at import and falls back to ``"cuda"`` when there is none (``tools/utils.py``), so on a
CPU-only machine each rank first makes torch report ``"cpu"`` as the available device
(:func:`cpu_as_device`). On GPUs run
``torchrun ... -m torchtitan.train`` with the same arguments. Needs ``pip install -e '.[torchtitan]'``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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


def rank_entry(args: list[str]) -> None:
    """One rank: torchtitan's trainer entry point on CPU (see the module docstring)."""
    cpu_as_device()
    from torchtitan.train import main as torchtitan_main
    sys.argv = ["torchtitan.train", *args]
    torchtitan_main()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-entry"]:
        rank_entry(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, all on the cp axis")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    assets, data = write_assets(args.workdir, documents=200, seed=0)
    dump = args.workdir / "outputs"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               __file__, "--rank-entry", "--module", "kdacp.integrations.torchtitan",
               "--config", "qwen35_kdacp_debugmodel",
               "--parallelism.context_parallel_degree", str(args.nproc),
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
               "--training.disable_cuda_graphs", "--training.mixed_precision_param", "float32",
               "--checkpoint.enable", "--checkpoint.interval", str(args.steps),
               "--hf_assets_path", str(assets), "--dataloader.dataset_path", str(data),
               "--dump_folder", str(dump)]
    print(" ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc = subprocess.run(command, env=env).returncode
    if rc:
        return rc
    checkpoint = dump / "checkpoint" / f"step-{args.steps}"
    if not checkpoint.is_dir() or not any(checkpoint.iterdir()):
        print(f"FAIL: no checkpoint at {checkpoint}")
        return 1
    print(f"PASS: {args.steps} steps on {args.nproc} ranks (cp={args.nproc}), checkpoint at {checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
