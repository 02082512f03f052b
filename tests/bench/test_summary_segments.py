"""``benchmarks/summary_segments.py`` under the Triton interpreter: every tiling runs over a rank's segments (many
short ones per document piece, or one range) and gives the default tiling's results; a bad case is refused."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "summary_segments.py"


def _run(*args: str):
    """A process of its own under TRITON_INTERPRET=1: Triton takes its interpreter or not as kdacp's kernels are
    defined, at their import, which this process may have done without it (where there is a GPU)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_every_tiling_matches_the_default_over_each_cases_segments():
    run = _run("--tilings", "2", "--rounds", "1", "--cases", "document_zigzag 2 ends,zigzag 2 turn")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| (\w+ \d \w+) \| (\d+) \| ([\w/]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.e+-]+) \|$",
                      run.stdout, re.M)
    assert [(case, tiling) for case, _, tiling, *_ in rows] == [
        ("document_zigzag 2 ends", "default"), ("document_zigzag 2 ends", "64/4/1/True"),
        ("zigzag 2 turn", "default"), ("zigzag 2 turn", "64/4/1/True")], run.stdout
    segments = {case: int(n) for case, n, *_ in rows}
    assert segments["document_zigzag 2 ends"] > 2 and segments["zigzag 2 turn"] == 1
    for case, _, tiling, fwd, grad, diff in rows:
        assert float(fwd) > 0 and float(grad) > 0
        assert float(diff) == 0 if tiling == "default" else float(diff) < 1e-4, (case, tiling, diff)


def test_a_case_of_no_such_role_is_refused(monkeypatch, capsys):
    run = run_script(monkeypatch, capsys, "summary_segments", "--device", "cpu", "--cases", "zigzag 2 middle")
    assert run.returncode == 2 and "--cases: role 'middle' is not one of ['ends', 'turn'] at P = 2" in run.stderr, \
        run.stderr[-2000:]
