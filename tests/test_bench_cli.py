"""`kdacp bench` runs a suite through the harness and writes JSON, Markdown and PNG results."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_layer_suite_on_cpu_writes_results(tmp_path):
    """Its batches hold the documents they name at CPU sizes, its rows say ranks (not GPUs), and it times
    the ulysses mode beside state."""
    out = subprocess.run([sys.executable, "-m", "kdacp.cli", "bench", "--suite", "layer", "--device", "cpu",
                          "--backend", "torch", "--world-size", "2", "--hidden", "32", "--heads", "2",
                          "--head-dim", "16", "--seq-lens", "64", "--modes", "state,ulysses", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((tmp_path / "layer.json").read_text())
    assert data["suite"] == "layer" and data["context"]["commit"] and data["complete"] is True
    from kdacp.bench.batches import BATCHES, document_lengths
    runs = {(r["batch"], r["run"], r["ranks"], r["tokens_per_rank"]) for r in data["rows"]}
    assert runs == {(b, run, ranks, 64) for b in BATCHES
                    for run, ranks in (("kdacp_one_rank", 1), ("kdacp_state", 2), ("kdacp_ulysses", 2))}
    docs = {r["batch"]: r["docs"] for r in data["rows"]}
    assert docs == {"one_sequence": 1, "docs7": 7, "lognormal": len(document_lengths("lognormal", 128))}
    assert docs["lognormal"] > 1
    assert all(r["ms"] > 0 for r in data["rows"])
    assert not [k for r in data["rows"] for k in (*r, r["run"]) if "gpu" in k]  # on CPU: ranks
    assert "| run |" in (tmp_path / "layer.md").read_text()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "layer_step.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_needs_a_gpu_for_fla_suites():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "kdacp.cli", "bench", "--suite", "kernels"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "needs a CUDA GPU and none is visible" in out.stderr


def test_harness_skips_line_plots_with_one_x_value(tmp_path):
    pytest.importorskip("matplotlib")
    from kdacp.bench.harness import PlotSpec, write_results
    rows = [dict(world_size=2, T=t, ms=float(t)) for t in (8, 16)]
    plots = {"vs_T": PlotSpec(x="T", y=("ms",)), "vs_ranks": PlotSpec(x="world_size", y=("ms",))}
    context = dict(date="d", device="cpu", gpus=0, torch="t", triton="t", commit="c")
    paths = {p.name for p in write_results("s", rows, tmp_path, plots, context=context)}
    assert paths == {"s.json", "s.md", "vs_T.png"}


def test_git_commit_marks_uncommitted_changes(tmp_path):
    import shutil

    from kdacp.bench.harness import git_commit
    if shutil.which("git") is None:
        pytest.skip("needs git")
    assert git_commit(tmp_path) == "unknown"

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    clean = git_commit(tmp_path)
    assert clean != "unknown" and not clean.endswith("+dirty")
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == clean + "+dirty"


def test_multi_rank_suites_prepare_each_rank_before_its_group(monkeypatch):
    """The soak suite builds transformers' Kimi Linear: its module is loaded before each rank's process group
    (``prepare``), as the demo's is (imported after it, the group's teardown at exit aborted now and then)."""
    import kdacp.bench
    from kdacp.bench import _prepare, soak
    got = {}

    def launch(fn, world_size, args, **kwargs):
        got.update(kwargs)
        return [[]]
    monkeypatch.setattr(kdacp.bench, "launch", launch)
    kdacp.bench.run_suite("soak", {}, device="cpu", world_size=2)
    prepared = []
    monkeypatch.setattr(soak, "prepare", lambda: prepared.append(True))
    got["prepare"]()
    assert prepared == [True]
    _prepare("layer")  # a suite without one: nothing to do
