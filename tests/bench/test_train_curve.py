"""benchmarks/train_curve.py on CPU (gloo, its tiny config, float32): its 2-rank curve is the 1-rank
curve over several AdamW steps (packed documents cut across the rank edge), and the one-ulp nudge that
makes its noise band moves the curve."""
import importlib
from pathlib import Path

import pytest

from kdacp.workers import launch


@pytest.fixture(scope="module")
def train_curve():
    """The script as a module, importable by the spawned ranks too (they get this sys.path)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
        yield importlib.import_module("train_curve")


@pytest.mark.slow
def test_two_ranks_follow_one_and_the_nudge_moves_the_curve(train_curve):
    args = dict(steps=3, seq_lens=[200, 120], lr=1e-3, seed=0)  # the first document crosses the edge at 160
    curves = {run: [r["loss"] for r in launch(train_curve.train_worker, p, (run, args), device="cpu",
                                              timeout_s=300, prepare=train_curve.load_kimi_linear)[0]]
              for run, p in (("kdacp_1", 1), ("kdacp_2", 2), ("kdacp_1_nudged", 1))}
    one, two, nudged = curves["kdacp_1"], curves["kdacp_2"], curves["kdacp_1_nudged"]
    assert len(one) == len(two) == 3
    assert max(abs(a - b) / a for a, b in zip(one, two)) < 2e-6, (one, two)
    assert max(abs(a - b) for a, b in zip(one, nudged)) > 1e-5, (one, nudged)


def test_summary_measures_differences_to_one_rank(train_curve):
    rows = [dict(run=run, ranks=p, step=s, loss=loss, step_s=0.5 + s, params=10, tokens=100)
            for run, p, losses in (("kdacp_1", 1, [3.0, 2.0, 1.0]), ("kdacp_2", 2, [3.0, 2.5, 1.0]))
            for s, loss in enumerate(losses)]
    summary = {s["run"]: s for s in train_curve.summarize(rows, skip=1)}
    assert summary["kdacp_2"]["max_abs_diff"] == pytest.approx(0.5)
    assert summary["kdacp_2"]["mean_abs_diff"] == pytest.approx(0.5 / 3)
    assert summary["kdacp_1"]["step_s"] == pytest.approx(2.0) and summary["kdacp_1"]["tokens_per_s"] == pytest.approx(50)


def test_main_loads_the_model_module_before_each_ranks_group(train_curve, monkeypatch, tmp_path):
    """transformers' model module imported after init_process_group aborted 1 in 20 runs at exit; the
    script's launches load it first (``prepare``)."""
    calls = []

    def launch(fn, p, args, **kwargs):
        calls.append(kwargs.get("prepare"))
        return [[dict(run=args[0], ranks=p, step=s, loss=1.0, step_s=0.1, params=10, tokens=100) for s in range(2)]]
    monkeypatch.setattr(train_curve, "launch", launch)
    train_curve.main([str(tmp_path), "--world-sizes", "1", "2", "--steps", "2", "--skip", "0", "--device", "cpu"])
    assert calls == [train_curve.load_kimi_linear] * 3  # kdacp_1_nudged, kdacp_1, kdacp_2
