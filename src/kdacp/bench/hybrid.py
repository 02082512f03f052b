"""Hybrid models' training step under context parallelism, per token layout and attention exchange: the
predictions of :mod:`kdacp.bench.hybrid_model` (read its docstring) for Kimi Linear and Qwen3-Next shapes.

Inputs: the linear-attention stage times of each rank role, measured here as the scaling suite does
(:func:`~kdacp.bench.calibration.measure_stages`) or read from a scaling suite's JSON (``calibration``); the
link (measured figures in that JSON, or given); the achieved causal-attention throughput (``attention_tflops``,
the ``balance`` suite's ``step_tflops``, given or read from its JSON (``balance``), default
:data:`~kdacp.bench.hybrid_model.ATTENTION_FLOPS`).

Rows: ``setup`` (what the predictions come from), then per model, ``T`` and ``P`` one row per scheme: the
predicted step, one GPU's step on the same tokens, the parallel efficiency, the best mixer exchange and the
ranks' attention work max over mean.

    kdacp bench --suite hybrid [--calibration scaling.json] [--attention-tflops 400 | --balance balance.json]
                               [--seq-lens 131072,524288,1048576]
                               [--predict-ranks 8,16,64]
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from kdacp.cp.cost_model import DEFAULT_LINK, Link

from .calibration import measure_stages, read_calibration
from .harness import PlotSpec, markdown_table
from .hybrid_model import ATTENTION_FLOPS, HYBRID_MODELS, SCHEMES, Calibrated, predict_hybrid

__all__ = ["PLOTS", "markdown", "run"]

TOKENS = (131072, 524288, 1048576)
WORLD_SIZES = (8, 16, 64)
PLOTS = {"hybrid": PlotSpec(x="P", y="efficiency", series="scheme", panel="case", where=("source", "model"),
                            title="hybrid step: one GPU's step over P x the CP step", ylabel="parallel efficiency")}


def run(calibration: str | None = None, tokens=TOKENS, world_sizes=WORLD_SIZES, models=tuple(HYBRID_MODELS),
        attention_tflops: float | None = None, balance: str | None = None, link: dict | None = None, t_local: int | None = None,
        heads: int | None = None, head_dim: int | None = None, backend: str | None = None, iters: int = 7,
        device: str = "cuda", report=None) -> list[dict]:
    """Predict every scheme's step (module docstring).

    Args:
        calibration: a scaling suite's JSON whose setup and stage rows are used (no measurement here); None:
            measure the stages on ``device`` at ``t_local`` tokens, ``heads`` heads of ``head_dim`` with
            ``backend`` (defaults as the scaling suite's: 16384, 32, 128, fla on CUDA; 256, 2, 32, torch on CPU).
        tokens, world_sizes: the sequence lengths ``T`` and rank counts ``P`` (``T`` a multiple of ``2P``).
        models: names among :data:`~kdacp.bench.hybrid_model.HYBRID_MODELS`.
        attention_tflops: achieved causal-attention throughput, TFLOP/s.
        balance: a ``balance`` suite's JSON: the median ``step_tflops`` of its balance rows is the throughput
            (not together with ``attention_tflops``).
        link: figures replacing the calibration's (any of ``Link``'s fields, seconds and bytes/s).

    Raises:
        ValueError: an unknown model or link field, a ``T`` that is not a multiple of ``2P``, or both
            ``attention_tflops`` and ``balance``.
    """
    if attention_tflops is not None and balance is not None:
        raise ValueError("give attention_tflops or balance (a balance suite's JSON), not both")
    unknown = set(models) - set(HYBRID_MODELS)
    if unknown:
        raise ValueError(f"models must be among {tuple(HYBRID_MODELS)}, got {sorted(unknown)}")
    bad_link = set(link or {}) - set(Link.__dataclass_fields__)
    if bad_link:
        raise ValueError(f"link fields must be among {tuple(Link.__dataclass_fields__)}, got {sorted(bad_link)}")
    for T in tokens:
        for P in world_sizes:
            if isinstance(P, bool) or not isinstance(P, int) or P < 2 or T % (2 * P):
                raise ValueError(f"every T of tokens must be a multiple of 2P for every P >= 2 of world_sizes, got "
                                 f"T={T}, P={P!r}")
    if calibration is not None:
        cal, setup = read_calibration(json.loads(Path(calibration).read_text())["rows"])
        stages, base_link, source = cal.stages, cal.link, f"{calibration} ({setup['link']})"
        t_cal, h_cal, d_cal = setup["T_local"], setup["heads"], setup["head_dim"]
    else:
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        t_cal, h_cal, d_cal = t_local or (16384 if cuda else 256), heads or (32 if cuda else 2), head_dim or (
            128 if cuda else 32)
        dtype = torch.bfloat16 if cuda else torch.float32
        stages = measure_stages(t_cal, h_cal, d_cal, backend or ("fla" if cuda else "torch"), dtype, dev, iters)
        base_link, source = DEFAULT_LINK, f"measured here on {device}; link cost_model.DEFAULT_LINK"
    the_link = Link(**{**asdict(base_link), **(link or {})})
    if balance is not None:
        measured = [r["step_tflops"] for r in json.loads(Path(balance).read_text())["rows"] if r["source"] == "balance"]
        attention_tflops = statistics.median(measured)
    flops = (attention_tflops or ATTENTION_FLOPS / 1e12) * 1e12
    cal = Calibrated(stages, t_cal, h_cal, d_cal, d_cal, the_link, flops)
    rows = [dict(source="setup", calibration=source, attention=balance or ("given" if attention_tflops else "default"),
                 T_cal=t_cal, heads_cal=h_cal, head_dim_cal=d_cal,
                 attention_tflops=flops / 1e12, latency_us=the_link.latency_s * 1e6,
                 bandwidth_GBs=the_link.bandwidth / 1e9, gather_latency_us=the_link.gather_latency_s * 1e6,
                 gather_bandwidth_GBs=the_link.gather_bandwidth / 1e9)]
    for name in models:
        shapes = HYBRID_MODELS[name]
        for T in tokens:
            for P in world_sizes:
                for scheme in SCHEMES:
                    pred = predict_hybrid(shapes, scheme, T, P, cal)
                    if pred is None:
                        continue
                    rows.append(dict(source="model", model=name, case=f"{name} T={T}", T=T, P=P, scheme=scheme,
                                     strategy=pred.strategy, step_ms=pred.step_s * 1e3, one_gpu_ms=pred.one_gpu_s * 1e3,
                                     efficiency=pred.efficiency, attention_max_over_mean=pred.attention_imbalance))
                    if report is not None:
                        report(rows[-1])
    return rows


def markdown(rows: list[dict]) -> str:
    """The setup, then per model a table of efficiencies: a row per ``(T, P)``, a column per scheme (with its
    mixer exchange)."""
    parts = [f"### setup\n\n{markdown_table([{k: v for k, v in r.items() if k != 'source'} for r in rows if r['source'] == 'setup'])}"]
    for name in dict.fromkeys(r["model"] for r in rows if r["source"] == "model"):
        table = {}
        for r in rows:
            if r["source"] == "model" and r["model"] == name:
                table.setdefault((r["T"], r["P"]), dict(T=r["T"], P=r["P"]))[r["scheme"]] = (
                    f"{r['efficiency']:.3f} ({r['strategy']})")
        parts.append(f"### {name}: parallel efficiency (mixer exchange)\n\n{markdown_table(list(table.values()))}")
    return "\n\n".join(parts)
