"""``benchmarks/rank_host_time.py``: every role of the overhead suite timed on the host, a row each with the
positions its rank holds; a role to profile must be one of the rows."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "rank_host_time.py"


def test_rank_host_time_rows_name_each_role_and_its_positions():
    # a process of its own: the script sets torch's thread count to 1
    run = subprocess.run([sys.executable, str(SCRIPT), "--t-local", "512", "--ranks", "2,4", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| (\w+) \| (\w+) \| (\d+) \| (\w+) \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$",
                      run.stdout, re.M)
    got = {(layout, batch, int(P), role): int(positions) for layout, batch, P, role, positions, *_ in rows}
    assert len(got) == 6 + 2 * (2 + 3), run.stdout  # contiguous 2 x 3; zigzag layouts: P = 2 two roles, P = 4 three
    assert got[("contiguous", "one_sequence", 3, "through")] == 1
    assert got[("zigzag", "one_sequence", 4, "middle")] == 2
    # per-document zigzag: a position per document piece, more on a middle rank than on the chain's turn
    assert got[("document_zigzag", "lognormal", 4, "middle")] > got[("document_zigzag", "lognormal", 4, "turn")] > 2
    assert all(float(wall) > 0 and float(cpu) >= float(least) >= 0 for *_, cpu, least, wall in rows)


def test_rank_host_time_refuses_an_unknown_role_to_profile(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "rank_host_time", "--t-local", "512", "--ranks", "2", "--profile", "zigzag x")
    assert run.returncode == 2 and "--profile must name a row" in run.stderr, run.stderr[-2000:]
