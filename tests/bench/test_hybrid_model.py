"""The hybrid step model: causal attention work per rank under each layout, and the composed step."""
from __future__ import annotations

import math
import random

import pytest

from kdacp.bench.hybrid_model import (HYBRID_MODELS, SCHEMES, Calibrated, HybridShapes, attention_balance, causal_pairs,
                                      one_gpu_step, predict_hybrid)
from kdacp.cp.cost_model import Link, RoleStages, StageTimes
from kdacp.cp.layout import contiguous_layout, document_zigzag_layout, ranges_layout, zigzag_layout

FREE = Link(0.0, 1e30, 0.0, 1e30)


def _brute_pairs(layout, rank, cu):
    bounds = cu or [0, layout.num_tokens]
    doc_start = {t: s for s, e in zip(bounds[:-1], bounds[1:]) for t in range(s, e)}
    return sum(t - doc_start[t] + 1 for s, e in layout.ranges[rank] for t in range(s, e))


@pytest.mark.parametrize("seed", range(4))
def test_causal_pairs_count_every_key_of_every_query(seed):
    rng = random.Random(seed)
    T, P = rng.randrange(20, 80), rng.randrange(2, 5)
    cuts = sorted(rng.sample(range(1, T), 2 * P))
    pieces = list(zip([0, *cuts], [*cuts, T]))
    owners = list(range(P)) + [rng.randrange(P) for _ in range(len(pieces) - P)]
    layout = ranges_layout([[p for p, o in zip(pieces, owners) if o == r] for r in range(P)], T)
    cu = sorted({0, T, *rng.sample(range(1, T), 3)})
    for docs in (None, cu):
        assert [causal_pairs(layout, r, docs) for r in range(P)] == [_brute_pairs(layout, r, docs) for r in range(P)]
    doc = document_zigzag_layout(cu, P)
    assert [causal_pairs(doc, r, cu) for r in range(P)] == [_brute_pairs(doc, r, cu) for r in range(P)]


@pytest.mark.parametrize("P", [8, 16, 64])
def test_contiguous_rank_r_does_2r_plus_1_over_p_squared(P):
    T = 131072
    layout = contiguous_layout(T, P)
    total = T * (T + 1) // 2
    for r in range(P):
        assert abs(causal_pairs(layout, r) / total - (2 * r + 1) / P ** 2) < 1e-4 / P
    assert abs(attention_balance(layout) - (2 * P - 1) / P) < 1e-4


@pytest.mark.parametrize("P", [8, 16, 64])
def test_zigzag_balances_causal_attention(P):
    T = 131072  # even chunks: T % 2P == 0
    assert attention_balance(zigzag_layout(T, P)) <= 1.02
    # per-document zigzag of a packed batch whose documents split into even chunks, under the document mask
    cu = [0, 32 * P, 32 * P + 64 * P, 32 * P + 64 * P + 1024 * P]
    assert attention_balance(document_zigzag_layout(cu, P), cu) <= 1.02
    assert attention_balance(zigzag_layout(T, P)) < attention_balance(contiguous_layout(T, P)) - 0.5


def _shapes(layer_types, H=8):
    return HybridShapes("test", tuple(layer_types), hidden=64, HV=4, K=16, V=16, H=H, H_kv=H, Dqk=16, Dv=16)


def _cal(mixer_s=0.0, link=FREE, apply_s=0.0, flops=1e12):
    """Every role's ``ready`` = ``mixer_s`` at 1024 tokens, nothing else; the model's heads as calibrated."""
    role = {r: RoleStages(ready=mixer_s) for r in ("first", "through", "last")}
    st = StageTimes(forward=role, backward=role, one_device=(mixer_s, mixer_s), apply_s=apply_s, compose_s=apply_s)
    return Calibrated(st, 1024, 4, 16, 16, link, flops)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_attention_only_step_follows_the_busiest_rank(P):
    """Only attention costs (a free link, no mixer work): the contiguous gather's efficiency is mean/max of the
    ranks' pairs, zigzag's and Ulysses' 1."""
    T, shapes, cal = 256 * P, _shapes(["attention", "linear", "attention"]), _cal()
    got = {s: predict_hybrid(shapes, s, T, P, cal) for s in SCHEMES}
    pairs = [causal_pairs(contiguous_layout(T, P), r) for r in range(P)]
    assert abs(got["contiguous+gather"].efficiency - sum(pairs) / P / max(pairs)) < 1e-9
    for s in ("contiguous+ulysses", "zigzag+gather", "megatron-relayout"):
        assert abs(got[s].efficiency - 1) < 1e-9, s


@pytest.mark.parametrize("P", [2, 4])
def test_zigzag_chain_is_twice_as_long(P):
    """One mixer layer, no local work, only the link's latency: p2p's forward and backward each pay one hop per
    link of the chain between two ranks: ``P - 1`` contiguous, ``2P - 2`` zigzag (rank ``P-1``'s two chunks are
    one range); scan ``ceil(log2)`` of the chain's positions at most."""
    latency = 1e-3
    cal = _cal(link=Link(latency, 1e30, latency, 1e30))
    shapes = _shapes(["linear"])
    for strategy, hops in (("p2p", (P - 1, 2 * P - 2)), ("scan", (math.ceil(math.log2(P)), math.ceil(math.log2(2 * P - 1))))):
        contiguous = predict_hybrid(shapes, "contiguous+gather", 64 * P, P, cal, strategies=(strategy,))
        zigzag = predict_hybrid(shapes, "zigzag+gather", 64 * P, P, cal, strategies=(strategy,))
        assert abs(contiguous.step_s - 2 * hops[0] * latency) < 1e-9, strategy
        assert zigzag.step_s <= 2 * hops[1] * latency + 1e-9, strategy
        if strategy == "p2p":
            assert abs(zigzag.step_s - 2 * hops[1] * latency) < 1e-9


def test_megatron_relayout_pays_its_conversions():
    """Megatron's scheme moves each rank's two chunks of hidden states around every linear layer, forward and
    backward (four conversions a layer): with only the link's bandwidth costing, its step exceeds zigzag's by
    at least those messages."""
    P, T, bandwidth = 4, 1024, 1e9
    cal = _cal(link=Link(0.0, bandwidth, 0.0, 1e30))
    shapes = _shapes(["linear", "linear"])
    zigzag = predict_hybrid(shapes, "zigzag+gather", T, P, cal)
    relayout = predict_hybrid(shapes, "megatron-relayout", T, P, cal)
    chunk = T // (2 * P) * shapes.hidden * 2 / bandwidth
    assert relayout.step_s >= zigzag.step_s + 2 * 4 * chunk - 1e-12


def test_mixer_work_per_rank_is_the_same_under_zigzag():
    """Local mixer work alone (a free link): every layout's ranks do ``T/P`` tokens' work, so the step is the
    one-GPU step over ``P`` for contiguous and zigzag alike."""
    P, T = 4, 8192
    shapes, cal = _shapes(["linear"] * 3), _cal(mixer_s=1e-3)
    for scheme in ("contiguous+gather", "zigzag+gather"):
        p = predict_hybrid(shapes, scheme, T, P, cal)
        assert abs(p.efficiency - 1) < 1e-9, scheme
    assert abs(one_gpu_step(shapes, T, cal) - 3 * 2 * 1e-3 * T / 1024) < 1e-12


def test_bad_arguments_are_named():
    shapes, cal = _shapes(["linear"]), _cal()
    with pytest.raises(ValueError, match="scheme must be one of"):
        predict_hybrid(shapes, "spiral", 64, 2, cal)
    with pytest.raises(ValueError, match="multiple of 2P=8"):
        predict_hybrid(shapes, "zigzag+gather", 36, 4, cal)
    assert predict_hybrid(_shapes(["attention"], H=6), "contiguous+ulysses", 64, 4, cal) is None


def test_shapes_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    for name, config in (("kimi-linear-48b", transformers.KimiLinearConfig()),
                         ("qwen3-next-80b", transformers.Qwen3NextConfig())):
        shapes = HYBRID_MODELS[name]
        assert shapes.layer_types == tuple("linear" if t == "linear_attention" else "attention"
                                           for t in config.layer_types)
        assert (shapes.hidden, shapes.H) == (config.hidden_size, config.num_attention_heads)
    kimi, qwen = transformers.KimiLinearConfig(), transformers.Qwen3NextConfig()
    k = HYBRID_MODELS["kimi-linear-48b"]
    assert (k.HV, k.K, k.Dqk, k.Dv) == (kimi.linear_num_heads, kimi.linear_head_dim,
                                       kimi.qk_nope_head_dim + kimi.qk_rope_head_dim, kimi.v_head_dim)
    q = HYBRID_MODELS["qwen3-next-80b"]
    assert (q.HV, q.K, q.V, q.H_kv, q.Dqk) == (qwen.linear_num_value_heads, qwen.linear_key_head_dim,
                                             qwen.linear_value_head_dim, qwen.num_key_value_heads, qwen.head_dim)


def calibration_json(path):
    """A scaling suite's JSON at ``path`` from made-up stages (each role's total at least one device's) and link;
    returns ``(rows, stages, link)``."""
    import json

    import torch

    from kdacp.bench.calibration import Calibration, calibration_rows
    role = {r: RoleStages(1e-3 * (i + 1), 2e-5, 3e-4) for i, r in enumerate(("first", "through", "last"))}
    st = StageTimes(forward=role, backward=role, one_device=(1.32e-3, 1.32e-3), apply_s=8e-6, compose_s=1.7e-5,
                    copy_s_per_byte=1e-12)
    link = Link(2e-5, 3e11, 2.5e-5, 2e11)
    rows = calibration_rows(Calibration(st, link, "given"), 16384, 32, 128, "fla", torch.bfloat16)
    path.write_text(json.dumps({"rows": rows}))
    return rows, st, link


def test_calibration_rows_round_trip_and_the_suite_reads_them(tmp_path):
    """A scaling suite's recorded calibration read back (:func:`read_calibration`) is what was written, and the
    hybrid suite predicts from it: a row per model, T, P and applicable scheme."""
    import json
    import subprocess
    import sys

    from kdacp.bench.calibration import read_calibration
    path = tmp_path / "scaling.json"
    rows, st, link = calibration_json(path)
    back, setup = read_calibration(rows)
    assert back.stages == st and back.link == link and setup["T_local"] == 16384
    out = subprocess.run([sys.executable, "-m", "kdacp.cli", "bench", "--suite", "hybrid", "--device", "cpu",
                          "--calibration", str(path), "--seq-lens", "4096", "--predict-ranks", "2,4",
                          "--attention-tflops", "300", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "hybrid.json").read_text())["rows"]
    assert got[0]["attention_tflops"] == 300 and got[0]["gather_bandwidth_GBs"] == 200
    model_rows = [r for r in got if r["source"] == "model"]
    assert {(r["model"], r["P"], r["scheme"]) for r in model_rows} == {
        (m, P, s) for m in HYBRID_MODELS for P in (2, 4) for s in SCHEMES}
    assert all(0 < r["efficiency"] <= 1.0 + 1e-9 for r in model_rows)
    assert "zigzag+gather" in (tmp_path / "hybrid.md").read_text()
    with pytest.raises(ValueError, match="missing"):
        read_calibration(rows[1:])
