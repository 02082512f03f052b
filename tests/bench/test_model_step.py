"""``benchmarks/model_step.py --device cpu``: the script's check mode (tiny Kimi Linear, gloo), every variant
built and stepped, the compiled one not compiling again on new documents after its warm-up."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 20 s on 2 cores; tests/models/test_compile_cp.py checks compiled models in the default run
def test_model_step_runs_every_variant_on_cpu():
    # a process of its own: the script starts a gloo process group (and compiles)
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_step.py"), "--device", "cpu",
                          "--steps", "2", "--warmup", "3", "--tokens", "128", "--documents", "lognormal",
                          "--variants", "parallelize,+fsdp2,+fsdp2 kept,+compile", "--compile-backend", "aot_eager"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "128 tokens (graphs compiled after the warm-up: 0)" in run.stdout, run.stdout
    rows = re.findall(r"^  (parallelize|\+fsdp2 kept|\+fsdp2|\+compile) +([0-9.]+) s", run.stdout, re.M)
    assert sorted(name for name, _ in rows) == sorted(["parallelize", "+fsdp2", "+fsdp2 kept", "+compile"]), run.stdout
    assert all(float(t) > 0 for _, t in rows), run.stdout


def test_model_step_refuses_an_unknown_variant(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "model_step", "--device", "cpu", "--variants", "parallelize,+fsdp3")
    assert run.returncode == 2 and "variants must be from" in run.stderr and "+fsdp3" in run.stderr, run.stderr


def test_model_step_times_transformers_own_model_beside_kdacp_on_cpu():
    # a process of its own: the script starts a gloo process group
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_step.py"), "--device", "cpu",
                          "--steps", "1", "--warmup", "0", "--tokens", "64", "--variants", "transformers,parallelize",
                          "--backend", "torch"], capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "kdacp backend torch" in run.stdout, run.stdout
    rows = dict(re.findall(r"^  (transformers|parallelize) +([0-9.]+) s", run.stdout, re.M))
    assert sorted(rows) == ["parallelize", "transformers"] and all(float(t) > 0 for t in rows.values()), run.stdout
    ratio = float(re.search(r"parallelize over transformers' own model: ([0-9.]+)x", run.stdout).group(1))
    assert ratio == pytest.approx(float(rows["parallelize"]) / float(rows["transformers"]), rel=5e-3), run.stdout


def test_model_step_refuses_packed_documents_for_transformers_own_model(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "model_step", "--device", "cpu", "--variants", "transformers",
                     "--documents", "lognormal")
    assert run.returncode == 2 and "--documents must be one_sequence" in run.stderr, run.stderr
