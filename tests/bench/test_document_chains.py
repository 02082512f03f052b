"""``benchmarks/document_chains.py``: gloo ranks exchange the states of documents cut per document, a row per
document count with every strategy's step time."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "document_chains.py"


def test_document_chains_rows():
    # a process of its own: the script spawns its gloo ranks
    run = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--docs", "1,5", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| 2 \| (\d+) \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", run.stdout, re.M)
    # rank 0 holds a piece of each document, its ranges across neighbouring documents merged: docs + 1 positions
    assert [(int(d), int(n)) for d, n, *_ in rows] == [(1, 2), (5, 6)], run.stdout
    assert all(float(ms) > 0 for *_, p2p, gather, scan in rows for ms in (p2p, gather, scan))


def test_document_chains_refuses_one_rank(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "document_chains", "--ranks", "1")
    assert run.returncode == 2 and "--ranks must be at least 2" in run.stderr, run.stderr[-2000:]
