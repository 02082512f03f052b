"""``benchmarks/layer_profile.py``: a row per family and usable backend whose matmul share is part of the total and
whose floor is the projections' FLOPs at the peak; a backend not usable here is skipped by name."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from kdacp.bench.kernels import PEAK_FLOPS
from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import layer_profile  # noqa: E402


def test_rows_split_the_step_and_state_the_floor(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "layer_profile", "--device", "cpu", "--backends", "torch,fla", "--top", "3",
                     "--steps", "1", "--warmup", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "backend 'fla' is not usable on cpu; skipped" in run.stderr
    rows = re.findall(r"^\| (kda|gdn) \| torch \| 64 \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.e-]+) \|$",
                      run.stdout, re.M)
    assert [r[0] for r in rows] == ["kda", "gdn"], run.stdout
    for family, total, matmul, rest, floor in rows:
        assert 0 < float(matmul) < float(total) and abs(float(matmul) + float(rest) - float(total)) < 2e-3
        layer = layer_profile.LAYERS[family](64, 2, 16, "torch", torch.device("meta"), torch.float32)
        assert float(floor) == round(6 * 64 * layer_profile.linear_weights(layer) / PEAK_FLOPS * 1e3, 5)


def test_linear_weights_count_every_projection():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3, bias=False))
    assert layer_profile.linear_weights(layer) == 4 * 8 + 8 * 3


def test_matmul_kernels_are_told_apart():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert layer_profile.is_matmul("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", cuda)
    assert layer_profile.is_matmul("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", cuda)
    assert not layer_profile.is_matmul("chunk_kda_fwd_kernel_o", cuda)
    assert not layer_profile.is_matmul("cutlass_dsl_chunk_kda_bwd_intra_fm1_kernel_cutlass__chunk_kda_bwd_intra_hmma", cuda)
    assert layer_profile.is_matmul("aten::addmm", cpu) and not layer_profile.is_matmul("aten::mul", cpu)
